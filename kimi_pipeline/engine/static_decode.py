"""Static-shape decode steps for the rollout engine, captured in CUDA graphs where the device allows.

One code path: `StaticDecoder.step` runs `EngineModel.decode_static` on fixed-size views of persistent buffers
(token ids [b], positions [b], the latent KV cache [layers, b, L, latent], logits [b, V] fp32, routed experts
[b, moe_layers, topk] int16). On CPU (and wherever graphs are off) it runs eagerly, which is how the tests prove
it; with graphs on it is captured once per (batch bucket b, cache-length bucket L) with torch.cuda.CUDAGraph and
replayed. Sampling stays outside, eager, on the logits of the live rows, so a seed draws the same tokens either way.

- Batch buckets follow SGLang's default CUDA-graph batch sizes, [1, 2, 4, 8] + range(16, max, 8)
  (sglang/srt/model_executor/cuda_graph_runner.py, get_batch_sizes_to_capture); graphs are captured up to
  `graph_max_rows` (256, the largest size SGLang captures by default, on its large-memory GPUs); larger batches
  run the same static step eagerly.
- Cache-length bucket: prompt + max_new_tokens rounded up to a multiple of `cache_step` (256), fixed per batch.
- Live rows sit in rows [0, n) of the buffers; rows [n, b) are padding (id 0 at position 0) whose outputs are
  never read and whose cache writes land in their own rows. When rows finish, the sampler's compaction copies the
  live rows into the prefix and the step moves to the smaller bucket that fits: its graph reads the same buffers.
- Buffers grow (and every graph is dropped) when a batch needs more rows or a longer cache than any before;
  otherwise graphs and buffers are kept across generate calls. Weight updates copy into the weights' storage
  (`EngineModel.load_weights`, `_Layer.refresh`), so graphs stay valid; should a tensor ever be rebound,
  `EngineModel.storage_epoch` changes and the graphs are dropped and captured again.
"""

from __future__ import annotations

from collections import Counter

import torch

from kimi_pipeline.model.grouped_experts import grouped_mm_supported

DECODE_MODES = ("dynamic", "static", "graphs")
GRAPH_MAX_ROWS = 256
CACHE_STEP = 256
# torch.cuda.make_graphed_callables' default number of warm-up runs before a capture (torch/cuda/graphs.py:494)
WARMUP_STEPS = 3


def batch_bucket(rows: int) -> int:
    """The padded batch size for `rows` live rows: 1, 2, 4, 8, then multiples of 8 (SGLang's capture sizes)."""
    if rows < 1:
        raise ValueError(f"rows={rows}: must be >= 1")
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 8) * 8


def batch_buckets(max_rows: int = GRAPH_MAX_ROWS) -> list[int]:
    """Every batch bucket up to max_rows (the sizes a CUDA graph may be captured for)."""
    return [b for b in (1, 2, 4, 8) if b <= max_rows] + list(range(16, max_rows + 1, 8))


def cache_bucket(length: int, step: int = CACHE_STEP) -> int:
    """The cache length for sequences of up to `length` tokens: the next multiple of `step`."""
    if length < 1:
        raise ValueError(f"length={length}: must be >= 1")
    return -(-length // step) * step


def graphs_supported(model) -> bool:
    """Whether the model's decode step can be captured in a CUDA graph: decided from its device and dtype alone.

    Capture forbids host syncs. The routed experts need torch's grouped GEMM without its fallback, which copies the
    group offsets to the host: on CUDA that is bf16 on sm90 / sm100 only (aten/src/ATen/native/cuda/GroupedBlas.cpp,
    _grouped_mm_cuda: `use_fast_path = scaled_mm_arch_allowed(sm90_only, sm100_only) && bf16`, else
    _grouped_mm_fallback in GroupedMMUtils.h runs `offs.cpu()`), a subset of `grouped_mm_supported` (bf16, sm80+).
    """
    if model.device.type != "cuda" or model.dtype != torch.bfloat16:
        return False
    c = model.config
    probe = model.embed
    if c.moe_layers and not grouped_mm_supported(probe, 2 * c.moe_intermediate_size, c.hidden_size,
                                                 c.moe_intermediate_size):
        return False
    return torch.cuda.get_device_capability(model.device)[0] in (9, 10)


def default_decode_mode(model) -> str:
    """"graphs" where the model's device and dtype allow them, else "dynamic" (the eager loop, the CPU default)."""
    return "graphs" if graphs_supported(model) else "dynamic"


def resolve_decode_mode(model, mode: str | None) -> str:
    """The decode mode a RolloutEngine runs: `mode`, checked, or the default for the model when None."""
    if mode is None:
        return default_decode_mode(model)
    if mode not in DECODE_MODES:
        raise ValueError(f"decode_mode={mode!r}: one of {', '.join(DECODE_MODES)}")
    if mode == "graphs" and not graphs_supported(model):
        raise ValueError(f"decode_mode='graphs' needs a bf16 model on an sm90/sm100 CUDA device (sync-free grouped "
                         f"GEMM); this model is {str(model.dtype).replace('torch.', '')} on {model.device}: use "
                         "'static' or 'dynamic'")
    return mode


class StaticDecoder:
    """Persistent decode buffers of one engine and, with `graphs`, its captured CUDA graphs (see the module docstring).

    Not thread-safe: the RolloutEngine runs one static batch at a time. Per batch: `start`, then `step` per decode
    step and `compact` whenever the sampler drops finished rows.
    """

    pad_id = 0  # the token id of padding rows (at position 0); their outputs are never read

    def __init__(self, model, graphs: bool = False, cache_step: int = CACHE_STEP,
                 graph_max_rows: int = GRAPH_MAX_ROWS):
        if graphs and not graphs_supported(model):
            raise ValueError("CUDA graphs are not supported for this model's device and dtype (graphs_supported)")
        self.model, self.use_graphs = model, graphs
        self.cache_step, self.graph_max_rows = cache_step, graph_max_rows
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.captures = self.replays = 0
        self.steps: Counter[tuple[int, int]] = Counter()  # decode steps run per (batch bucket, cache length)
        self._pool = None
        self._epoch = model.storage_epoch
        self.cache = self.ids = self.pos = self.logits = self.experts = None
        self.rows_cap = self.len_cap = 0
        self.n = self.b = self.L = 0

    # ------------------------------------------------------------------ buffers
    def _ensure(self, rows: int, length: int) -> None:
        """Buffers of at least `rows` x `length`; growing them drops every graph (they hold the old addresses)."""
        if rows <= self.rows_cap and length <= self.len_cap:
            return
        self.drop_graphs()
        m, c = self.model, self.model.config
        self.rows_cap, self.len_cap = max(rows, self.rows_cap), max(length, self.len_cap)
        self.cache = None  # free the old cache before allocating the new one
        self.cache = m.new_cache(self.rows_cap, self.len_cap)
        self.ids = torch.zeros(self.rows_cap, dtype=torch.long, device=m.device)
        self.pos = torch.zeros(self.rows_cap, dtype=torch.long, device=m.device)
        self.logits = torch.zeros(self.rows_cap, c.vocab_size, dtype=torch.float32, device=m.device)
        self.experts = torch.zeros(self.rows_cap, len(c.moe_layers), c.topk, dtype=torch.int16, device=m.device)

    def drop_graphs(self) -> None:
        self.graphs.clear()
        self._pool = None

    def free(self) -> None:
        """Drop the KV cache and every decode buffer (and the graphs that hold their addresses); the next batch
        allocates them again. The engine's `kv_cache` release."""
        self.drop_graphs()
        self.cache = self.ids = self.pos = self.logits = self.experts = None
        self.rows_cap = self.len_cap = 0

    # ------------------------------------------------------------------ one batch
    @torch.inference_mode()
    def start(self, prefix: torch.Tensor, length: int) -> None:
        """A new batch: prefix [layers, rows, Lp, latent] is the prompts' cache (one row per sample), `length` the
        longest prompt + max_new_tokens. The cache rows of the batch's bucket are zeroed first: masked slots still
        enter q·k before the -inf mask, and stale NaN would survive it."""
        rows, lp = prefix.shape[1], prefix.shape[2]
        self.n, self.b, self.L = rows, batch_bucket(rows), cache_bucket(length, self.cache_step)
        self._ensure(self.b, self.L)
        region = self.cache[:, : self.b, : self.L]
        region.zero_()
        region[:, :rows, :lp] = prefix

    @torch.inference_mode()
    def compact(self, keep: torch.Tensor) -> None:
        """Keep rows `keep` (ascending indices into the live rows) as the new rows [0, len(keep)); move to the
        smallest bucket that holds them."""
        live = self.cache[:, : self.n, : self.L]
        self.cache[:, : keep.shape[0], : self.L] = live.index_select(1, keep)
        self.n = keep.shape[0]
        self.b = batch_bucket(self.n)

    @torch.inference_mode()
    def step(self, tok: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode tokens tok [n] of the live rows at positions [n]; returns views (logits [n, V], experts [n, ...])
        of the output buffers, valid until the next step."""
        n, b, L = self.n, self.b, self.L
        if tok.shape[0] != n:
            raise ValueError(f"{tok.shape[0]} tokens for {n} live rows")
        self.ids[:n].copy_(tok)
        self.pos[:n].copy_(positions)
        if n < b:
            self.ids[n:b].fill_(self.pad_id)
            self.pos[n:b].zero_()
        self.steps[(b, L)] += 1
        if self.use_graphs and b <= self.graph_max_rows:
            if self.model.storage_epoch != self._epoch:  # a weight moved: the graphs read the old storage
                self.drop_graphs()
                self._epoch = self.model.storage_epoch
            graph = self.graphs.get((b, L))
            if graph is None:
                graph = self._capture(b, L)
            graph.replay()
            self.replays += 1
        else:
            self._run(b, L)
        return self.logits[:n], self.experts[:n]

    def _run(self, b: int, L: int) -> None:
        logits, experts = self.model.decode_static(self.ids[:b], self.pos[:b], self.cache[:, :b, :L])
        self.logits[:b].copy_(logits)
        self.experts[:b].copy_(experts)

    def _capture(self, b: int, L: int) -> torch.cuda.CUDAGraph:
        """Capture the (b, L) step. A step is idempotent (it rewrites the same cache slots with the same values), so
        the warm-up runs on the live inputs; the replay that follows produces this step's outputs."""
        with torch.cuda.device(self.model.device):
            # warm-up on a side stream before capturing, as torch.cuda.make_graphed_callables does
            # (torch/cuda/graphs.py:643-647): lazy initialisation (cuBLAS handles, workspaces) stays out of the graph
            main = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    self._run(b, L)
            main.wait_stream(side)
            # one memory pool shared by all of this engine's graphs (torch/cuda/graphs.py:66-74): they replay one at a
            # time on one stream, and each copies its outputs into the buffers above, so no graph's result lives in
            # the pool where another graph's intermediates could overwrite it
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # "thread_local": the server's weight-sync threads may allocate device memory while a capture is under
            # way (update_weights_from_distributed receives into fresh tensors outside the model lock); "global"
            # would fail their cudaMalloc (torch/cuda/graphs.py:378-381)
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._run(b, L)
        self.graphs[(b, L)] = graph
        self.captures += 1
        return graph
