"""Weight buckets from a trainer rank to an engine on the same host through shared memory, not HTTP bodies.

The CPU counterpart of SGLang's colocated `update_weights_from_tensor` (where a trainer hands CUDA-IPC
handles to the engine on its own GPU): the trainer copies a bucket of HF-named tensors into a segment in
/dev/shm (tmpfs: memory, not disk) and posts a JSON descriptor — segment name, and per tensor its name,
dtype, shape and byte offset — to `/update_weights_from_tensor` with `load_format: "kimi_shm"`. The engine
maps the segment read-only and copies the tensors into its weights. Nothing is pickled, the request body is
a few hundred bytes per bucket, and the bytes are copied twice (into the segment, into the engine) instead
of being serialized, base64-encoded, sent and parsed.

Hand-written: torch's shared-memory tensors travel by pickle and `multiprocessing.shared_memory` unlinks
segments from a reader's resource tracker (fixed in Python 3.13); a tmpfs file + mmap has neither problem.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import tempfile
import threading
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kimi_pipeline.errors import PermanentError

LOAD_FORMAT = "kimi_shm"
PREFIX = "kimi-weights-"
_NAME = re.compile(rf"{PREFIX}(\d+)-[0-9a-f]{{32}}")  # kimi-weights-<owner pid>-<uuid>
_ALIGN = 64
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                        torch.int8, torch.uint8, torch.int32, torch.int64,
                                                        torch.float8_e4m3fn)}


class SharedMemoryError(PermanentError):
    """A descriptor that does not describe a segment we wrote (bad name, dtype, or bytes out of range)."""


def shm_dir() -> Path:
    """tmpfs where the OS has one (Linux /dev/shm); else the temp dir (page cache, still no HTTP body)."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())


def remove_stale_segments() -> list[str]:
    """Remove segments whose owner process is gone (a trainer killed with SIGKILL cannot remove its own; tmpfs
    would keep its pages until reboot). Called whenever a segment is created; returns the names removed."""
    gone = []
    for path in shm_dir().glob(PREFIX + "*"):
        m = _NAME.fullmatch(path.name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            gone.append(path.name)
        except PermissionError:  # alive, another user's
            pass
    return gone


class SharedBucket:
    """One reusable segment a trainer rank stages buckets in (grows to the largest bucket; removed on close).
    Keep it for the run: a fresh segment pays a page fault and a zeroed page per 4 KiB on every sync."""

    def __init__(self) -> None:
        remove_stale_segments()
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        self.path = shm_dir() / self.name
        self._file = open(self.path, "w+b")  # noqa: SIM115 - kept open for the channel's lifetime
        os.chmod(self.path, 0o600)  # only this user's engine may read the weights
        self._size = 0
        self._map: mmap.mmap | None = None

    def _ensure(self, nbytes: int) -> None:
        if nbytes <= self._size:
            return
        if self._map is not None:
            self._map.close()
        self._file.truncate(nbytes)
        self._size = nbytes
        # pages are allocated (and zeroed) once, up front; the segment is reused for every later bucket and sync
        self._map = mmap.mmap(self._file.fileno(), nbytes, flags=mmap.MAP_SHARED | _POPULATE)

    def write_bucket(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Copy a bucket into the segment; returns its JSON descriptor (what the engine is sent)."""
        layout, offset = [], 0
        for name, t in tensors.items():
            layout.append((name, t, offset))
            offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        self._ensure(max(offset, 1))
        entries = []
        for name, t, off in layout:
            src = t.detach().contiguous()
            if src.device.type != "cpu":
                src = src.cpu()
            nbytes = src.numel() * src.element_size()
            dst = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=off)
            dst.copy_(src.view(-1).view(torch.uint8))
            entries.append([name, str(src.dtype).removeprefix("torch."), list(src.shape), off])
        return {"segment": self.name, "tensors": entries}

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        self._file.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> SharedBucket:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Mappings:
    """The engine's read-only mappings of recent segments, kept between buckets and syncs: mapping (and
    pre-faulting) 1 GB costs ~0.1 s, so it is done when a segment is new or has grown, not per bucket."""

    def __init__(self, keep: int = 8) -> None:
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._keep = keep
        self.lock = threading.Lock()

    def get(self, name: str) -> mmap.mmap:
        path = shm_dir() / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise SharedMemoryError(f"{path}: no such segment; is the engine on the trainer's host? (shared-memory "
                                    "weight sync needs a colocated engine)") from None
        buf = self._maps.get(name)
        if buf is None or len(buf) != size:
            if buf is not None:
                buf.close()
            with open(path, "rb") as f:  # read-only, pre-faulted in one call instead of a fault per page
                buf = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
            self._maps[name] = buf
        self._maps.move_to_end(name)
        while len(self._maps) > self._keep:  # the trainer removed old segments; drop our pages of them
            self._maps.popitem(last=False)[1].close()
        return buf


_MAPPINGS = _Mappings()


@contextmanager
def open_bucket(descriptor: Mapping[str, Any]) -> Iterator[dict[str, torch.Tensor]]:
    """The engine side: HF-named tensors viewing the segment, valid inside the `with` (copy them out)."""
    name = str(descriptor.get("segment", ""))
    if not _NAME.fullmatch(name):
        raise SharedMemoryError(f"shared-memory segment {name!r} is not one of ours ({PREFIX}<pid>-<32 hex>)")
    with _MAPPINGS.lock:
        buf = _MAPPINGS.get(name)
        views: dict[str, torch.Tensor] = {}
        try:
            for tname, dtype, shape, off in descriptor.get("tensors", []):
                if dtype not in DTYPES:
                    raise SharedMemoryError(f"{tname}: dtype {dtype!r} is not a weight dtype")
                dt = DTYPES[dtype]
                nbytes = math.prod(int(d) for d in shape) * torch.empty((), dtype=dt).element_size()
                if int(off) < 0 or int(off) + nbytes > len(buf):
                    raise SharedMemoryError(f"{tname}: bytes {off}..{int(off) + nbytes} outside the "
                                            f"{len(buf)}-byte segment")
                with warnings.catch_warnings():  # read-only buffer: the views are only ever copied from
                    warnings.simplefilter("ignore", UserWarning)
                    raw = (torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=int(off)) if nbytes
                           else torch.empty(0, dtype=torch.uint8))
                views[tname] = raw.view(dt).view(*shape)
            yield views
        finally:
            views.clear()
