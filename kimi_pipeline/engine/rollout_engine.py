"""Batched sampling on EngineModel: prefill each distinct prompt once, decode all samples together.

Logprobs: each sampled token's logprob under the *unmodified* softmax(logits / temperature) — top-p /
top-k only restrict which tokens can be drawn, they do not renormalize the reported logprob — because
RL compares it with the trainer's logprob of the same token, which never sees any truncation
(temperature 0 reports the plain softmax logprob of the greedy token). The recipes use top-p 1 and no
top-k, where the two coincide.

Routed experts follow SGLang's convention: one row per token that went through the model, i.e.
`len(prompt) + len(output) - 1` rows (the last sampled token is never fed back), each
[moe_layers, topk] expert ids (int16) as the router picked them.

Seeds are per row, as SGLang 0.5.23 takes them (`sampling_seed` of each row's sampling params, honoured with
deterministic inference: `srt/sampling/sampling_batch_info.py:157-170`, `srt/layers/sampler.py:934-958`): a row's
draws depend only on its seed and the token position (a counter-based hash, no generator state), so two rows
with one seed and one prompt sample the same tokens, as in SGLang. A seeded call gives each row its own seed
(`row_seeds`), so the n samples of a prompt differ and a run repeats exactly; an unseeded call draws the rows'
seeds from the engine's own seeded generator.

Decode modes (`decode_mode`, chosen once per engine): "dynamic" runs `EngineModel.decode` on a cache sized for
the batch, attending only as far as the longest row (the CPU default); "static" runs the static-shape step of
static_decode.py eagerly; "graphs" runs that same step captured in CUDA graphs (the default where the model's
device and dtype allow them). All three sample the same rows in the same order from one generator, so a seed draws
the same tokens; they differ only in how the logits are computed (to float rounding).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kimi_pipeline.engine.model import EngineModel
from kimi_pipeline.engine.static_decode import StaticDecoder, resolve_decode_mode
from kimi_pipeline.errors import PermanentError

# what an engine releases and resumes around a colocated train phase (sglang 0.5.23 `srt/constants.py:2-6`)
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
ENGINE_NAME = "kimi-embedded"  # what the embedded engine's /server_info reports; clients tell it from SGLang by it
FINISH_LENGTH, FINISH_STOP, FINISH_ABORT = "length", "stop", "abort"


class EngineUnavailable(RuntimeError):
    """The engine cannot serve now (memory released, weights not yet synced): a state, not a bad request."""


class EngineInputError(PermanentError, ValueError):
    """A request the engine cannot serve as asked (empty prompt, token out of vocab, too long)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: disabled (sent to SGLang as its "off", -1)
    max_new_tokens: int = 16
    # None: the model's eos ids. Through HTTP (SGLang's rule) a non-empty tuple stops at these and the model's
    # eos; () never stops early (SGLang's ignore_eos). RolloutEngine.generate called directly takes the exact set.
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None  # the request's seed, spread over its rows by `row_seeds`; None: the engine's draws

    def __post_init__(self):
        if self.temperature < 0:
            raise EngineInputError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise EngineInputError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise EngineInputError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")

    def batch_key(self) -> tuple:
        """Requests with the same key can share one batch (seeds are per row, so they need not agree)."""
        return (self.temperature, self.top_p, self.top_k, self.max_new_tokens, self.stop_token_ids)


@dataclass
class Completion:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # one per output token, see the module docstring
    finish_reason: str  # "stop" | "length" | "abort"
    matched_stop: int | None = None  # the stop token that ended it
    routed_experts: np.ndarray | None = field(default=None, repr=False)  # int16 [T-1, moe_layers, topk]
    weight_version: str = ""


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seeds(seed: int, count: int) -> list[int]:
    """`count` distinct row seeds of a request seeded `seed` (non-negative int64, SGLang's sampling_seed range,
    `sampling_params.py:302-311`). The client sends them as each row's sampling_seed and RolloutEngine derives the
    same ones for a direct call, so both paths sample alike; hashed, so consecutive request seeds share no row seed."""
    base = _splitmix64(seed & _MASK64)
    return [_splitmix64(base ^ i) >> 1 for i in range(count)]


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding 32-bit values (products wrap; the mask keeps 32 bits)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row from (its seed, its position) only: SGLang's counter-based draw
    (`multinomial_with_seed`, srt/layers/sampler.py:934-958), so rows sharing a seed and a prompt draw alike."""
    lo, hi = seeds & 0xFFFFFFFF, (seeds >> 32) & 0x7FFFFFFF
    h = _fmix32(lo ^ _fmix32(hi ^ _fmix32((positions.to(torch.int64) + 0x9E3779B9) & 0xFFFFFFFF)))
    return h.to(torch.float64) / 4294967296.0


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                  gen: torch.Generator | None = None, *, seeds: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of fp32 logits [B, V]; return (tokens [B], logprobs [B]). The uniform of each row
    comes from `seeds` [B] and `positions` [B] (`seeded_uniform`) when given, else from `gen`."""
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)
    logp = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    allowed = logp
    if 0 < top_k < logits.shape[-1]:
        kth = logp.topk(top_k, dim=-1)[0][:, -1:]
        allowed = allowed.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = allowed.sort(dim=-1, descending=True)
        cum = sorted_lp.softmax(dim=-1).cumsum(dim=-1)
        drop = (cum - sorted_lp.softmax(dim=-1)) >= top_p  # keep the smallest prefix reaching top_p
        allowed = allowed.scatter(1, order, sorted_lp.masked_fill(drop, float("-inf")))
    # inverse-CDF draw: one uniform per row (the per-element exponential race costs ~20x more on CPU);
    # u < total and right=True never land on a zero-probability token; no host sync (GPU friendly)
    cdf = (logp.exp() if allowed is logp else torch.softmax(allowed, dim=-1)).cumsum(dim=-1)
    if seeds is not None:
        unit = seeded_uniform(seeds, positions).clamp_(max=1.0 - 2.0**-24)[:, None].to(cdf.dtype)
    else:
        unit = torch.rand(cdf.shape[0], 1, device=cdf.device, generator=gen)
    u = unit * cdf[:, -1:]
    tok = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)


def memory_tags(tags) -> set[str]:
    """SGLang's memory tags, checked; none given means all of them (as SGLang reads an empty list)."""
    tags = set(tags or MEMORY_TAGS)
    if unknown := tags - set(MEMORY_TAGS):
        raise EngineInputError(f"memory tags {sorted(unknown)}: known tags are {list(MEMORY_TAGS)}")
    return tags


class RolloutEngine:
    """Thread-safe batched generation; `model_lock` also guards weight updates between decode steps.

    decode_mode: "dynamic", "static" or "graphs" (see the module docstring); None picks "graphs" where
    static_decode.graphs_supported(model) holds, else "dynamic". The static modes keep one set of decode buffers
    (and graphs), so their batches run one at a time.
    """

    def __init__(self, model: EngineModel, seed: int = 0, max_batch_rows: int = 1024, weight_version: str = "0",
                 decode_mode: str | None = None):
        self.model = model
        self.max_batch_rows = max_batch_rows
        self.weight_version = weight_version
        self.model_lock = threading.RLock()
        self._seeds = torch.Generator().manual_seed(seed)
        self.decode_mode = resolve_decode_mode(model, decode_mode)
        self.static = None if self.decode_mode == "dynamic" else StaticDecoder(model, self.decode_mode == "graphs")
        self._static_lock = threading.Lock()
        self.released: set[str] = set()  # memory tags released (release_memory) and not resumed

    @property
    def config(self):
        return self.model.config

    # ------------------------------------------------------------------ memory handoff (colocated)
    def release_memory(self, tags) -> None:
        """Free the memory of these kinds while the colocated trainer trains (SGLang's tags: weights, kv_cache,
        cuda_graph). kv_cache: the static modes' persistent KV cache and decode buffers (the dynamic loop holds a
        cache only while a batch runs); cuda_graph: the captured graphs; weights: `EngineModel.release_weights`.
        The caller makes sure no batch runs (the server refuses unless idle)."""
        tags = memory_tags(tags)
        with self.model_lock, self._static_lock:
            if self.static is not None and "kv_cache" in tags:
                self.static.free()
            if self.static is not None and "cuda_graph" in tags:
                self.static.drop_graphs()
            if "weights" in tags:
                self.model.release_weights()
            self.released |= tags

    def resume_memory(self, tags) -> None:
        """Take the memory back: weights resume empty (the next sync fills them), the KV cache and graphs are
        rebuilt by the next batch."""
        tags = memory_tags(tags)
        with self.model_lock:
            if "weights" in tags:
                self.model.resume_weights()
            self.released -= tags

    def unready_reason(self) -> str | None:
        if self.released:
            return (f"its memory is released ({', '.join(sorted(self.released))}): "
                    "resume_memory_occupation first")
        return self.model.unready_reason()

    def generate(self, prompts: list[list[int]], n: int = 1, params: SamplingParams | None = None,
                 return_routed_experts: bool = True,
                 step_hook: Callable[[], bool] | None = None, seeds: list[int] | None = None) -> list[Completion]:
        """n samples of every prompt, prompt-major (prompts[0]'s n samples first).

        step_hook runs between decode steps (outside the model lock); returning True aborts the batch
        (unfinished rows end with finish_reason "abort"). The server uses it for pause/abort.
        `seeds`: one per row (SGLang's per-row sampling_seed), else `row_seeds(params.seed)`, else drawn.
        """
        params = params or SamplingParams()
        if why := self.unready_reason():
            raise EngineUnavailable(f"the engine cannot generate: {why}")
        if n < 1:
            raise EngineInputError(f"n={n}: must be >= 1")
        self._validate(prompts, params)
        rows = [list(p) for p in prompts for _ in range(n)]
        if seeds is None:
            seeds = row_seeds(params.seed, len(rows)) if params.seed is not None else self.draw_seeds(len(rows))
        if len(seeds) != len(rows):
            raise EngineInputError(f"{len(seeds)} row seeds for {len(rows)} rows")
        out: list[Completion] = []
        # the static modes' buffers serve one batch at a time (weight updates still interleave between steps)
        with self._static_lock if self.static is not None else contextlib.nullcontext():
            for start in range(0, len(rows), self.max_batch_rows):
                stop = start + self.max_batch_rows
                seeds_t = torch.tensor(seeds[start:stop], dtype=torch.int64, device=self.model.device)
                out += self._generate_rows(rows[start:stop], params, seeds_t, return_routed_experts, step_hook)
        return out

    def draw_seeds(self, count: int) -> list[int]:
        """Row seeds for unseeded rows, from the engine's own seeded generator."""
        return torch.randint(0, 2**62, (count,), generator=self._seeds).tolist()

    def _validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        c = self.config
        if not prompts:
            raise EngineInputError("no prompts: send at least one list of token ids")
        for i, p in enumerate(prompts):
            if not p:
                raise EngineInputError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= c.vocab_size:
                raise EngineInputError(f"prompt {i}: token ids must be in [0, {c.vocab_size})")
            if len(p) + params.max_new_tokens > c.max_position_embeddings:
                raise EngineInputError(
                    f"prompt {i}: {len(p)} tokens + max_new_tokens {params.max_new_tokens} exceed the model's "
                    f"{c.max_position_embeddings} positions; shorten it or lower max_new_tokens"
                )

    def _generate_rows(self, rows: list[list[int]], params: SamplingParams, seeds: torch.Tensor,
                       want_experts: bool, step_hook) -> list[Completion]:
        m, dev = self.model, self.model.device
        B, max_new = len(rows), params.max_new_tokens
        # prefill each distinct prompt once; samples of one prompt copy its cache rows
        uniq: dict[tuple[int, ...], int] = {}
        row_map = [uniq.setdefault(tuple(r), len(uniq)) for r in rows]
        prompts_u = list(uniq)
        lens_u = [len(p) for p in prompts_u]
        Lp = max(lens_u)
        ids_u = torch.zeros(len(prompts_u), Lp, dtype=torch.long)
        for i, p in enumerate(prompts_u):
            ids_u[i, : len(p)] = torch.tensor(p)
        ids_u, lens_t = ids_u.to(dev), torch.tensor(lens_u, device=dev)
        row_map_t = torch.tensor(row_map, device=dev)
        stop_ids = params.stop_token_ids if params.stop_token_ids is not None else self.config.eos_token_ids
        stop_t = torch.tensor(list(stop_ids) or [-1], device=dev)

        static = self.static
        with self.model_lock:
            logits_u, cache_u, experts_u = m.prefill(ids_u, lengths=lens_t)
            if static is None:
                cache = m.new_cache(B, Lp + max_new)
                cache[:, :, :Lp] = cache_u.index_select(1, row_map_t)
            else:  # the prompts' cache goes into the persistent buffers' rows [0, B)
                static.start(cache_u.index_select(1, row_map_t), Lp + max_new)
        logits = logits_u.index_select(0, row_map_t)
        del cache_u

        out_tok = torch.zeros(B, max_new, dtype=torch.long, device=dev)
        out_lp = torch.zeros(B, max_new, dtype=torch.float32, device=dev)
        out_exp = torch.zeros(B, max(max_new - 1, 1), len(self.config.moe_layers), self.config.topk,
                              dtype=torch.int16, device=dev) if want_experts else None
        resp_len = torch.full((B,), max_new, dtype=torch.long, device=dev)
        reason = torch.zeros(B, dtype=torch.int8, device=dev)  # 0 length, 1 stop, 2 abort
        active = torch.arange(B, device=dev)  # original row of each batch row
        plens = lens_t.index_select(0, row_map_t)  # prompt length of each batch row
        host_plens = [lens_u[u] for u in row_map]
        alive = torch.ones(B, dtype=torch.bool, device=dev)
        for t in range(max_new):
            tok, lp = sample_tokens(logits, params.temperature, params.top_p, params.top_k,
                                    seeds=seeds.index_select(0, active), positions=plens + t)
            out_tok[active, t] = tok
            out_lp[active, t] = lp
            stopped = alive & torch.isin(tok, stop_t)
            if bool(stopped.any()):
                done_rows = active[stopped]
                resp_len[done_rows] = t + 1
                reason[done_rows] = 1
                alive &= ~stopped
            if t + 1 == max_new:
                break
            if step_hook is not None and step_hook():
                reason[active[alive]] = 2
                resp_len[active[alive]] = t + 1
                break
            n_alive = int(alive.sum())
            if n_alive == 0:
                break
            if len(active) - n_alive >= max(1, len(active) // 4):  # compact once a quarter of rows finished
                keep = alive.nonzero().squeeze(1)
                host_plens = [host_plens[i] for i in keep.tolist()]
                active, plens, tok, alive = active[keep], plens[keep], tok[keep], alive[keep]
                if static is None:
                    cache = cache.index_select(1, keep)
                else:  # live rows into the buffers' prefix; a smaller batch bucket when they fit one
                    static.compact(keep)
            with self.model_lock:
                if static is None:
                    logits, experts = m.decode(tok, plens + t, cache, max(host_plens) + t + 1)
                else:
                    logits, experts = static.step(tok, plens + t)
            if out_exp is not None:
                out_exp[active, t] = experts
        return self._assemble(rows, row_map, lens_u, out_tok, out_lp, resp_len, reason, experts_u, out_exp)

    def _assemble(self, rows, row_map, lens_u, out_tok, out_lp, resp_len, reason, experts_u,
                  out_exp) -> list[Completion]:
        toks, lps = out_tok.tolist(), out_lp.tolist()
        lens, reasons = resp_len.tolist(), reason.tolist()
        ex_u = experts_u.cpu().numpy() if out_exp is not None else None
        ex_r = out_exp.cpu().numpy() if out_exp is not None else None
        names = (FINISH_LENGTH, FINISH_STOP, FINISH_ABORT)
        out = []
        for b, prompt in enumerate(rows):
            n = lens[b]
            experts = None
            if ex_u is not None:
                u = row_map[b]
                experts = np.concatenate([ex_u[u, : lens_u[u]], ex_r[b, : n - 1]], axis=0)
            out.append(Completion(
                prompt_ids=prompt,
                output_ids=toks[b][:n],
                logprobs=lps[b][:n],
                finish_reason=names[reasons[b]],
                matched_stop=toks[b][n - 1] if reasons[b] == 1 else None,
                routed_experts=experts,
                weight_version=self.weight_version,
            ))
        return out
