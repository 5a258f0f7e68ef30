"""A trainer's device memory handed over to a colocated rollout engine and taken back (colocated runs only).

The trainer sleeps while the engines generate: every storage behind its parameters, gradient buffers and
optimizer state that lives on its device is copied to the host and resized to zero, so the device memory goes
back to the allocator (and, on a GPU, to the engine on the same GPU); waking resizes each storage to its old
size and copies the host copy back. Views stay valid because a storage keeps its identity when resized: megatron's
own RL offload does the same to its DDP buffers (megatron/core/distributed/param_and_grad_buffer.py:964-994,
`storage().resize_(0)` / `resize_(size)`), which we cannot call as is: it pins host memory, which a torch without
an accelerator refuses, and it leaves the optimizer state alone. Gradient buffers are zeroed at the start of every
step (`zero_grad_buffer`), so they are freed and come back zeroed instead of being copied.

Written by hand (torch_memory_saver, the seeds' choice, needs an LD_PRELOAD allocator hook and CUDA); the same
code runs on CPU, where it frees and restores host storages, which is how the tests prove the round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

PARTS = ("weights", "grads", "optimizer")
KEEP_VALUES = {"weights": True, "grads": False, "optimizer": True}  # grads are zeroed at every step's start


def empty_device_cache(device: torch.device) -> None:
    """Give freed cached blocks back to the device (a caching allocator keeps them otherwise); CPU has no cache."""
    empty = getattr(torch.get_device_module(device.type), "empty_cache", None)
    if empty is not None:
        empty()


def _storages(tensors: Iterable[torch.Tensor], device: torch.device, taken: set[int]) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages of `tensors` on `device` not already in `taken` (a storage named by two
    parts belongs to the first). Host-resident state, e.g. the hybrid optimizer's CPU shard, stays where it is."""
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device != device:
            continue
        st = t.untyped_storage()
        if st.nbytes() and st._cdata not in taken:  # _cdata: the storage itself, whatever wrapper returned it
            taken.add(st._cdata)
            out.append(st)
    return out


class Offloaded:
    """Parts of a trainer's device state (`PARTS`) moved to the host and back. `state()` lists, by part, the
    tensors whose storages make up each part (`megatron_train.state_tensors`); grads come back zero instead of
    being copied (`KEEP_VALUES`)."""

    def __init__(self, device: torch.device, state: Callable[[], Mapping[str, Iterable[torch.Tensor]]],
                 pin_memory: bool = False) -> None:
        self.device, self.state, self.pin_memory = device, state, pin_memory
        self._held: dict[str, list[tuple[torch.UntypedStorage, int, torch.UntypedStorage | None]]] = {}

    @property
    def asleep(self) -> tuple[str, ...]:
        return tuple(p for p in PARTS if p in self._held)

    def _sync(self) -> None:
        if self.pin_memory:  # asynchronous copies to / from page-locked memory must land first
            torch.get_device_module(self.device.type).synchronize()

    @torch.no_grad()
    def offload(self, parts: Iterable[str]) -> int:
        """Free these parts' device storages (their bytes copied to the host where kept); returns the bytes freed.
        A part already asleep is left as it is."""
        by_part, taken, todo = self.state(), set(), set(parts)
        for held in self._held.values():
            taken.update(st._cdata for st, _, _ in held)
        freed = 0
        for part in PARTS:  # in PARTS order, so a shared storage goes to the first part that names it
            storages = _storages(by_part.get(part, ()), self.device, taken)
            if part not in todo or part in self._held:
                continue
            held = []
            for st in storages:
                host = None
                if KEEP_VALUES[part]:
                    host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=self.pin_memory).untyped_storage()
                    host.copy_(st, non_blocking=self.pin_memory)
                held.append((st, st.nbytes(), host))
            self._sync()
            for st, n, _ in held:
                st.resize_(0)
                freed += n
            self._held[part] = held
        empty_device_cache(self.device)
        return freed

    @torch.no_grad()
    def reload(self, parts: Iterable[str]) -> None:
        """Give the parts their device storages back: values copied back, or zeros where none were kept."""
        for part in parts:
            for st, n, host in self._held.pop(part, []):
                st.resize_(n)
                if host is not None:
                    st.copy_(host, non_blocking=self.pin_memory)
                else:
                    torch.empty(0, dtype=torch.uint8, device=self.device).set_(st, 0, (n,)).zero_()
        self._sync()
