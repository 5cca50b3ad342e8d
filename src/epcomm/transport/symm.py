"""A small shim over torch's private symmetric-memory API (torch 2.11 and newer, CUDA backend).

The API (`torch.distributed._symmetric_memory`) moves between releases; everything epcomm uses goes through
these functions: allocate a region every rank of a group can address, views of a peer's region, the device
pointer table Triton kernels cast to pointers, and the device barrier. NVLink multicast (NVLS) stays off.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional

import torch
import torch.distributed as dist


def available() -> Optional[str]:
    """None when symmetric memory can be used here, else the reason it cannot."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except Exception as e:  # pragma: no cover - depends on the torch build
        return f"torch.distributed._symmetric_memory cannot be imported ({e})"
    try:
        importlib.import_module("triton")
    except Exception as e:  # pragma: no cover
        return f"triton cannot be imported ({e})"
    return None


class SymmetricRegion:
    """`nbytes` of device memory on every rank of `group`, addressable by every peer over NVLink.

    Collective: every rank of the group constructs it with the same `nbytes`.

    Fields:
        local: [nbytes] uint8 -- this rank's region.
        ptrs: [R] int64 (device) -- base address of every rank's region (the pointer table for kernels).
    """

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device):
        # NVLink multicast can take a host's GPUs out of service; epcomm never needs it.
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "set_backend"):
            try:
                symm_mem.set_backend("CUDA")
            except Exception:  # already chosen for this process
                pass
        group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group") and not hasattr(symm_mem, "set_backend"):
            try:
                symm_mem.enable_symm_mem_for_group(group_name)
            except Exception:
                pass
        self.local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.local, group_name)
        self.rank, self.num_ranks = self.handle.rank, self.handle.world_size
        self.ptrs = torch.tensor(list(self.handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.nbytes = nbytes
        self._bytes = None  # per-rank [nbytes] uint8 views, made at first use

    def peer(self, rank: int, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A view of `rank`'s region at byte `offset` (a multiple of dtype's size): a slice of a byte view made once
        per rank, since asking torch for a new peer tensor on every call costs host time on every call."""
        numel = 1
        for s in shape:
            numel *= s
        assert offset % dtype.itemsize == 0 and offset + numel * dtype.itemsize <= self.nbytes
        if self._bytes is None:
            self._bytes = [self.handle.get_buffer(r, [self.nbytes], torch.uint8, 0) for r in range(self.num_ranks)]
        return self._bytes[rank][offset: offset + numel * dtype.itemsize].view(dtype).view(shape)

    def barrier(self, channel: int = 0, timeout_ms: int = 100_000) -> None:
        """Device-side barrier over the group on the current stream (bounded by `timeout_ms`)."""
        self.handle.barrier(channel=channel, timeout_ms=timeout_ms)


def nvlink_unavailable(device: torch.device) -> Optional[str]:
    """None when this rank can use the nvlink path (CUDA, symmetric memory, peer access to every other local
    GPU), else the reason it cannot."""
    if device.type != "cuda":
        return f"the buffer lives on {device.type} (gloo); nvlink needs one CUDA GPU per rank (NCCL)"
    reason = available()
    if reason is not None:
        return f"no symmetric memory ({reason})"
    blocked = [d for d in range(torch.cuda.device_count())
               if d != device.index and not torch.cuda.can_device_access_peer(device.index, d)]
    return f"cuda:{device.index} has no peer access to cuda:{blocked}" if blocked else None
