"""Colocated weight sync over CUDA IPC (kimi_pipeline/weight_sync/cuda_ipc.py) on one GPU: a bucket of CUDA tensors
(an odd-sized fp8 scale, a non-contiguous bf16 weight, int32-packed int4 weights) serialized by `serialize_bucket`
is read by another process the way SGLang 0.5.23's scheduler reads its TP rank's entry, and that process sees the
same bits on its own GPU. The GPU twin of tests/unit/test_cuda_ipc_payload.py.

The reader is a fresh interpreter (`subprocess`, as unrelated to the trainer as an SGLang server is: no inherited
state, CUDA context or authkey). Where it can import sglang (the trainer's environment, or the CPU parser copy
that `make sglang-parser` puts under $KIMI_SGLANG_PARSER_PATH) it uses SGLang's own `monkey_patch_torch_reductions`,
`MultiprocessingSerializer.deserialize` (its SafeUnpickler) and `FlattenedTensorBucket`; otherwise it mirrors them
(utils/patch_torch.py:80-99: device UUID -> index; utils/common.py:3084-3099: base64 + unpickle, here without the
allow-list, which the CPU test checks against SGLang's source) and says so in the test's output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

_READER = r'''
import base64, gc, importlib.util, json, os, pickle, sys

parser = os.environ.get("KIMI_SGLANG_PARSER_PATH", "")
if parser and os.path.isdir(os.path.join(parser, "sglang")):
    sys.path.append(parser)  # after this environment's own packages (its CUDA torch, its triton)

import torch
from torch.multiprocessing import reductions

request = json.load(sys.stdin)
how = "mirror: no sglang importable"
named = None
if importlib.util.find_spec("sglang") is not None:
    try:
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
    except ImportError as e:
        how = f"mirror: sglang found but not importable ({e})"
    else:
        monkey_patch_torch_reductions()  # managers/tp_worker.py:198
        obj = MultiprocessingSerializer.deserialize(request["entry"])  # tp_worker.py:199-201, TP rank 0's entry
        meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                        end_idx=m.end_idx, numel=m.numel) for m in obj["metadata"]]
        named = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=meta).reconstruct_tensors()
        how = "sglang " + getattr(importlib.import_module("sglang"), "__version__", "?")
if named is None:
    original = reductions.rebuild_cuda_tensor

    def rebuild_by_uuid(*args):  # SGLang's _rebuild_cuda_tensor_modified / _device_from_maybe_uuid
        device = args[6]
        if isinstance(device, str):
            device = next(i for i in range(torch.cuda.device_count())
                          if str(torch.cuda.get_device_properties(i).uuid) == device)
        return original(*args[:6], device, *args[7:])

    reductions.rebuild_cuda_tensor = rebuild_by_uuid  # what find_class("torch.multiprocessing.reductions", ...) returns
    obj = pickle.loads(base64.b64decode(request["entry"], validate=True))
    named = [(m.name, obj["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
             for m in obj["metadata"]]

if request.get("save"):  # hand what arrived back to the test, as CPU copies
    torch.save([(n, t.cpu()) for n, t in named], request["save"])
    torch.cuda.synchronize()
    del named, obj
    gc.collect()
    print(json.dumps({"how": how}))
    sys.exit(0)
want = torch.load(request["want"], weights_only=True)
bits = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
report = {
    "how": how,
    "names": [n for n, _ in named],
    "devices": sorted({str(t.device) for _, t in named}),
    "uuids": sorted({str(torch.cuda.get_device_properties(t.device).uuid) for _, t in named}),
    "equal": [t.dtype == w.dtype and t.shape == w.shape and torch.equal(bits(t), bits(w))
              for (_, t), (_, w) in zip(named, want)],
}
torch.cuda.synchronize()
del named, obj
gc.collect()  # release the IPC views now, so the producer's reference count drops before we exit
print(json.dumps(report))
'''


def test_a_cuda_bucket_reaches_another_process_on_the_same_gpu(cuda, tmp_path):
    import base64

    import torch

    from kimi_pipeline.weight_sync.cuda_ipc import build_update_request, serialize_bucket

    g = torch.Generator(device=cuda).manual_seed(3)
    named = [
        ("model.layers.1.mlp.experts.5.w2.weight_scale",
         torch.rand(3, device=cuda, generator=g).to(torch.float8_e4m3fn)),  # 3 bytes: the next start needs aligning
        ("model.layers.1.self_attn.o_proj.weight",
         torch.randn(384, 256, device=cuda, generator=g).to(torch.bfloat16).t()),  # non-contiguous
        ("model.layers.1.mlp.experts.5.w2.weight_packed",
         torch.randint(-(2**31), 2**31 - 1, (256, 64), device=cuda, generator=g, dtype=torch.int32)),
        ("model.layers.1.mlp.experts.5.w2.weight_shape", torch.tensor([7168, 2048], device=cuda, dtype=torch.int32)),
    ]
    want = tmp_path / "want.pt"
    torch.save([(n, t.cpu()) for n, t in named], want)
    uuid = str(torch.cuda.get_device_properties(cuda).uuid)

    torch.cuda.synchronize(cuda)
    before = torch.cuda.memory_allocated(cuda)
    entry = serialize_bucket(named)
    body = build_update_request([entry], weight_version="1", tp_size=1)
    assert body["load_format"] == "flattened_bucket"
    assert uuid.encode() in base64.b64decode(entry)  # the device travels as its UUID (utils/patch_torch.py:85-99)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    # The shared buffer is gone from Python but parked in torch's IPC limbo until the reader releases it: a new
    # allocation of the same size must not get (and overwrite) its memory.
    assert torch.cuda.memory_allocated(cuda) >= before + nbytes
    junk = torch.full((nbytes + 64,), 0xA5, dtype=torch.uint8, device=cuda)

    proc = subprocess.run([sys.executable, "-c", _READER],  # $KIMI_SGLANG_PARSER_PATH: set by tests/conftest.py
                          input=json.dumps({"entry": body["serialized_named_tensors"][0], "want": str(want)}),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print("reader:", report["how"])
    assert report["names"] == [n for n, _ in named]
    assert report["uuids"] == [uuid] and len(report["devices"]) == 1  # on the producer's GPU, by the reader's index
    assert report["equal"] == [True] * len(named), report

    # The reader has released its views: collecting the limbo gives the buffer back.
    del junk
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated(cuda) < before + nbytes // 2


class _EngineOnThisGpu:
    """The SGLang side of one colocated engine of TP 1, as far as one GPU without SGLang can have it: each
    `/update_weights_from_tensor` body is read, before the call returns (SGLang loads a bucket before it answers),
    by a fresh process running SGLang's own deserializer (`_READER`); every other call of the sync is recorded."""

    url = "http://engine-on-this-gpu"

    def __init__(self, tmp_path) -> None:
        self.tmp, self.calls, self.received, self.how = tmp_path, [], {}, set()

    def post_tensor_request(self, body: dict) -> None:
        import torch

        assert body["load_format"] == "flattened_bucket" and len(body["serialized_named_tensors"]) == 1
        out = self.tmp / f"bucket{len(self.calls)}.pt"
        proc = subprocess.run([sys.executable, "-c", _READER], capture_output=True, text=True, timeout=300,
                              input=json.dumps({"entry": body["serialized_named_tensors"][0], "save": str(out)}))
        assert proc.returncode == 0, proc.stderr[-4000:]
        self.how.add(json.loads(proc.stdout.strip().splitlines()[-1])["how"])
        self.received.update(torch.load(out, weights_only=True))
        self.calls.append("update_weights_from_tensor")

    def __getattr__(self, name):  # pause, resume, begin/end_weight_update, flush_cache, update_weight_version, close
        return lambda *a, **k: self.calls.append(name)


def test_the_colocated_sync_hands_every_bucket_to_the_engine_rank_on_its_gpu(cuda, one_gpu_rank, tmp_path):
    """`weight_sync.updaters.GroupBuckets` with `CudaIpcHandoff` on one GPU rank (the path every colocated K2 step
    takes): every bucket reaches the engine's process as a CUDA-IPC handle on this GPU, bit for bit the trainer's
    HF tensors (exported by the conversion's own path), inside one weight-update session, flushed and versioned
    once after the last bucket, and the buckets' memory is given back."""
    from types import SimpleNamespace

    import torch

    from kimi_pipeline.hf.names import HFLayout
    from kimi_pipeline.model.hf_bridge import export_hf_tensors
    from kimi_pipeline.model.megatron_model import build_model
    from kimi_pipeline.recipes import load_recipe
    from kimi_pipeline.weight_sync.updaters import CudaIpcHandoff, GroupBuckets, SyncSections, choose_weight_sync

    spec = load_recipe("tiny").model
    model = build_model(spec, one_gpu_rank, device=cuda)
    target = SyncSections(engine="sglang", weight_format="model", weight_sync="auto", buffer_bytes=1 << 20,
                        group_size=32, gpus_per_engine=1, colocate=True)
    trainer = SimpleNamespace(target=target, spec=spec, model=[model], layout=one_gpu_rank, rank=0, world_size=1,
                              qat=[], device=cuda, hf_layout=HFLayout(), sync_dir=lambda: tmp_path)
    engine = _EngineOnThisGpu(tmp_path)
    router = SimpleNamespace(clients=[engine], urls=[engine.url], close=lambda: None)
    for name in ("pause", "resume", "begin_weight_update", "end_weight_update", "flush_cache", "update_weight_version"):
        setattr(router, name, getattr(engine, name))
    sync = choose_weight_sync(trainer, router)
    assert isinstance(sync, GroupBuckets) and isinstance(sync.handoff, CudaIpcHandoff)
    torch.cuda.synchronize(cuda)
    before = torch.cuda.memory_allocated(cuda)
    metrics = sync.update("7")
    sync.close()
    print("reader:", engine.how)
    buckets = int(metrics["sync_chunks"])
    assert buckets == len(sync.schedule.buckets) > 1
    assert engine.calls == (["pause", "begin_weight_update"] + ["update_weights_from_tensor"] * buckets
                            + ["flush_cache", "update_weight_version", "end_weight_update", "resume"])
    want = {n: t.cpu() for n, t in export_hf_tensors([model], spec, one_gpu_rank)}
    assert sorted(engine.received) == sorted(want)
    for name, t in want.items():
        assert torch.equal(engine.received[name], t), name
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated(cuda) < before + (1 << 20)  # no bucket left behind
