"""The colocated CUDA-IPC weight-sync payload (kimi_pipeline/weight_sync/cuda_ipc.py) checked on the CPU: the request
body, the bucket's layout, the device-UUID rewrite, and — strongest — SGLang 0.5.23's own receive code
(`Base64Bytes`, `normalize_serialized_named_tensor_payloads`, `TpModelWorker.deserialize_own_rank` with its
`SafeUnpickler`, `WeightUpdater._update_weights_from_flattened_bucket`) loading our CPU-tensor payload in another
process (`make sglang-parser` installs that sglang under .cache/sglang-parser; CPU tensors stand in for CUDA ones,
whose IPC handles need a GPU: tests/gpu/test_gpu_cuda_ipc.py).

What a CPU tensor becomes under ForkingPickler (checked below): its storage moves to shared memory and travels as
a file descriptor (`rebuild_storage_fd` + `multiprocessing.resource_sharer.DupFd`), fetched from this process's
resource-sharer thread by a process that holds this process's authkey, once per pickled storage."""

from __future__ import annotations

import ast
import base64
import inspect
import io
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kimi_pipeline.weight_sync import cuda_ipc
from kimi_pipeline.engine.sglang import PARSER_PATH_VAR

SRT = ("sglang", "srt")


def _bucket(shift: int = 0) -> list[tuple[str, torch.Tensor]]:
    """A Kimi-like bucket: a 3-byte fp8 scale first (so the next tensor needs alignment), a non-contiguous bf16
    weight, int32-packed int4 weights, a 0-dim tensor and an empty one."""
    g = torch.Generator().manual_seed(7 + shift)
    return [
        ("model.layers.0.mlp.experts.0.w1.weight_scale", (torch.rand(3, generator=g) + shift).to(torch.float8_e4m3fn)),
        ("model.layers.0.self_attn.o_proj.weight", (torch.randn(6, 4, generator=g) + shift).to(torch.bfloat16).t()),
        ("model.layers.0.mlp.experts.0.w1.weight_packed",
         torch.randint(-(2**31), 2**31 - 1, (3, 5), generator=g, dtype=torch.int32) + shift),
        ("model.norm.eps_like", torch.tensor(2.5 + shift)),
        ("model.layers.0.empty", torch.empty(0, 3)),
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


class _Recorder(pickle.Unpickler):
    """pickle.Unpickler that records every global the payload names (what SGLang's SafeUnpickler is asked for)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.globals: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str):
        self.globals.add((module, name))
        return super().find_class(module, name)


def _load(entry: str) -> tuple[dict, set[tuple[str, str]]]:
    rec = _Recorder(base64.b64decode(entry, validate=True))
    return rec.load(), rec.globals


def test_request_body_is_sglangs_update_weights_from_tensor_input():
    body = cuda_ipc.build_update_request(["YQ==", "Yg=="], weight_version="7", tp_size=2)
    assert body == {"serialized_named_tensors": ["YQ==", "Yg=="], "load_format": "flattened_bucket",
                    "flush_cache": False, "weight_version": "7"}
    assert json.loads(json.dumps(body)) == body
    assert cuda_ipc.build_update_request(["YQ=="], flush_cache=True)["flush_cache"] is True
    assert cuda_ipc.build_update_request(["YQ=="])["weight_version"] is None
    with pytest.raises(ValueError, match="one per SGLang TP rank"):
        cuda_ipc.build_update_request([])
    with pytest.raises(ValueError, match="tp_size 2"):
        cuda_ipc.build_update_request(["YQ=="], tp_size=2)
    with pytest.raises(TypeError, match="weight_version"):
        cuda_ipc.build_update_request(["YQ=="], weight_version=7)
    with pytest.raises(TypeError, match="base64 strings"):
        cuda_ipc.build_update_request([b"YQ=="])


def test_cpu_bucket_round_trips_through_base64_and_forking_pickle_in_order():
    named = _bucket()
    entry = cuda_ipc.serialize_bucket(named)
    assert isinstance(entry, str) and base64.b64encode(base64.b64decode(entry, validate=True)).decode() == entry
    obj, names = _load(entry)
    assert set(obj) == {"flattened_tensor", "metadata"}
    flat = obj["flattened_tensor"]
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert [m.name for m in obj["metadata"]] == [n for n, _ in named]
    for (name, t), m in zip(named, obj["metadata"]):
        assert vars(m).keys() == {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}
        assert (m.shape, m.dtype) == (t.shape, t.dtype) and isinstance(m.shape, torch.Size)
        assert m.numel == m.end_idx - m.start_idx == t.numel() * t.element_size()
        assert m.start_idx % 16 == 0, name  # so `.view(dtype)` of the slice is legal for every dtype
        got = flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)  # SGLang's reader (tensor_bucket.py:127)
        assert _same(got, t), name
    starts = [m.start_idx for m in obj["metadata"]]
    assert starts == sorted(starts) and obj["metadata"][-1].end_idx <= flat.numel()
    # A CPU tensor's bytes travel as a file descriptor of shared memory, not inside the pickle:
    assert ("torch.multiprocessing.reductions", "rebuild_storage_fd") in names
    assert ("multiprocessing.resource_sharer", "DupFd") in names
    assert len(base64.b64decode(entry)) < 2048
    # No SGLang class in the payload: the metadata are SimpleNamespaces (see the module doc).
    assert ("types", "SimpleNamespace") in names and not any(m.startswith("sglang") for m, _ in names)


def test_flatten_refuses_what_one_flattened_bucket_cannot_hold():
    with pytest.raises(ValueError, match="empty bucket"):
        cuda_ipc.serialize_bucket([])
    with pytest.raises(ValueError, match="one bucket is one device"):
        cuda_ipc.flatten_bucket([("a", torch.zeros(2)), ("b", torch.zeros(2, device="meta"))])
    with pytest.raises(TypeError, match=r"\(str, Tensor\)"):
        cuda_ipc.flatten_bucket([("a", [1.0])])


def test_cuda_device_index_becomes_the_device_uuid_and_nothing_else_changes():
    from torch.multiprocessing import reductions

    params = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert params[cuda_ipc._DEVICE_ARG] == "storage_device"  # torch's layout, the position SGLang rewrites too
    args = tuple(range(15))
    out = cuda_ipc._uuid_device_args(reductions.rebuild_cuda_tensor, args, uuid_of=lambda i: f"uuid-of-{i}")
    assert out == (*args[:6], "uuid-of-6", *args[7:])
    # Already a UUID (a process where SGLang's global patch ran): unchanged, not rewritten twice.
    assert cuda_ipc._uuid_device_args(reductions.rebuild_cuda_tensor, out, uuid_of=lambda i: "x") == out
    # A CPU tensor's reduction (3 arguments, where SGLang's global patch would raise IndexError) is left alone.
    rebuild, cpu_args = reductions.reduce_tensor(torch.zeros(2))
    assert cuda_ipc._uuid_device_args(rebuild, cpu_args, uuid_of=lambda i: "x") == cpu_args


def test_the_uuid_reducer_is_this_pickler_instances_alone():
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    before = (reductions.reduce_tensor, reductions.rebuild_cuda_tensor, dict(ForkingPickler._extra_reducers))
    cuda_ipc.serialize_bucket([("w", torch.ones(3))])
    assert (reductions.reduce_tensor, reductions.rebuild_cuda_tensor, dict(ForkingPickler._extra_reducers)) == before
    assert ForkingPickler._extra_reducers[torch.Tensor] is reductions.reduce_tensor
    pickler = cuda_ipc._UuidPickler(io.BytesIO())
    assert pickler.dispatch_table[torch.Tensor] is cuda_ipc._reduce_tensor_by_uuid
    assert ForkingPickler(io.BytesIO()).dispatch_table[torch.Tensor] is reductions.reduce_tensor


# --- against the pinned SGLang's own source and code (`make sglang-parser`) ---


@pytest.fixture(scope="module")
def parser_dir() -> Path:
    d = Path(os.environ[PARSER_PATH_VAR])
    assert (d / "sglang").is_dir(), f"no sglang in {d}: run `make sglang-parser` (make test does)"
    return d


def _source(parser_dir: Path, *rel: str) -> ast.Module:
    return ast.parse(parser_dir.joinpath(*SRT, *rel).read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def test_payload_names_only_globals_on_sglangs_safe_unpickler_allow_list(parser_dir):
    cls = _class(_source(parser_dir, "utils", "common.py"), "SafeUnpickler")
    allowed = next(ast.literal_eval(n.value) for n in cls.body
                   if isinstance(n, ast.Assign) and n.targets[0].id == "ALLOWED_GLOBALS")
    _, names = _load(cuda_ipc.serialize_bucket(_bucket()))
    assert names <= allowed, names - allowed
    # CUDA tensors add `rebuild_cuda_tensor` (the name the receiver's patch rebinds) and torch.storage.TypedStorage.
    assert {("torch.multiprocessing.reductions", "rebuild_cuda_tensor"), ("torch.storage", "TypedStorage")} <= allowed
    # SGLang's device-argument position is ours.
    patch = _source(parser_dir, "utils", "patch_torch.py")
    index = next(n.value.value for n in patch.body if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", "") == "_REDUCE_TENSOR_ARG_DEVICE_INDEX")
    assert index == cuda_ipc._DEVICE_ARG


def test_request_keys_are_fields_of_sglangs_request_struct(parser_dir):
    cls = _class(_source(parser_dir, "managers", "io_struct.py"), "UpdateWeightsFromTensorReqInput")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    assert set(cuda_ipc.build_update_request(["YQ=="])) <= fields, fields


# The receiving process: SGLang's own functions, importable on the CPU (utils.common, utils.msgspec_utils,
# utils.patch_torch, weight_sync.tensor_bucket), plus the two methods on the path whose modules need GPU-only
# packages to import, compiled from SGLang's source as they stand and run with stand-ins for `self`.
_RECEIVER = r'''
import __future__, ast, json, multiprocessing, os, sys, textwrap, types
from pathlib import Path

import torch

multiprocessing.current_process().authkey = bytes.fromhex(os.environ["KIMI_TEST_AUTHKEY"])  # to fetch the fds

import sglang
from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads
from sglang.srt.utils.msgspec_utils import Base64Bytes
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

SRT = Path(sglang.__file__).parent / "srt"


def method(rel, cls, name, **env):
    path = SRT / rel
    src = path.read_text()
    node = next(f for c in ast.walk(ast.parse(src)) if isinstance(c, ast.ClassDef) and c.name == cls
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == name)
    code = textwrap.dedent(ast.get_source_segment(src, node, padded=True))
    ns = dict(env)
    exec(compile(code, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)
    return ns[name]


rank = types.SimpleNamespace(tp_rank=None)
deserialize_own_rank = method("managers/tp_worker.py", "BaseTpWorker", "deserialize_own_rank",
                              monkey_patch_torch_reductions=monkey_patch_torch_reductions,
                              MultiprocessingSerializer=MultiprocessingSerializer, get_parallel=lambda: rank)
load_flattened = method("model_executor/model_runner_components/weight_updater.py", "WeightUpdater",
                        "_update_weights_from_flattened_bucket", FlattenedTensorBucket=FlattenedTensorBucket,
                        FlattenedTensorMetadata=FlattenedTensorMetadata)

request = json.load(sys.stdin)
body = request["body"]
assert body["load_format"] == "flattened_bucket"
payloads = normalize_serialized_named_tensor_payloads(Base64Bytes._decode_value(body["serialized_named_tensors"]))
loaded = {}
for tp_rank in range(len(payloads)):  # one scheduler per TP rank, each reading its own entry, once
    rank.tp_rank = tp_rank
    received = []
    model = types.SimpleNamespace(load_weights=lambda named: received.extend((n, t.clone()) for n, t in named))
    ok, message = load_flattened(types.SimpleNamespace(get_model=lambda: model), deserialize_own_rank(None, payloads))
    assert ok, message
    loaded[tp_rank] = received
torch.save(loaded, request["out"])
'''


def test_sglangs_own_receive_path_loads_each_ranks_entry(parser_dir, tmp_path):
    buckets = [_bucket(shift=r) for r in range(2)]  # the two TP ranks' entries differ, to see who read which
    body = cuda_ipc.build_update_request([cuda_ipc.serialize_bucket(b) for b in buckets], weight_version="3",
                                         tp_size=2)
    out = tmp_path / "loaded.pt"
    env = {**os.environ, "KIMI_TEST_AUTHKEY": bytes(multiprocessing.current_process().authkey).hex(),
           "PYTHONPATH": os.pathsep.join(p for p in (str(parser_dir), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", _RECEIVER], input=json.dumps({"body": body, "out": str(out)}),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    loaded = torch.load(out, weights_only=True)
    assert sorted(loaded) == [0, 1]
    for tp_rank, bucket in enumerate(buckets):
        assert [n for n, _ in loaded[tp_rank]] == [n for n, _ in bucket]
        for (name, want), (_, got) in zip(bucket, loaded[tp_rank]):
            assert _same(got, want), (tp_rank, name)
