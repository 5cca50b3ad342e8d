"""A small shim over torch's private symmetric-memory API (torch 2.11 and newer, CUDA backend).

The API (`torch.distributed._symmetric_memory`) moves between releases; everything epcomm uses goes through
these functions: allocate a region every rank of a group can address, views of a peer's region, the device
pointer table Triton kernels cast to pointers. The device barrier is epcomm's own kernel (it names a rank that
does not arrive); torch's is used once, at construction. NVLink multicast (NVLS) stays off.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional

import torch
import torch.distributed as dist

from ..sizing import align


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

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device, timeout_ms: int = 100_000):
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
        # The barrier's flags follow the caller's bytes: one arrival counter per rank, then this rank's count.
        self._flags_off = align(nbytes, 256)
        self._storage = symm_mem.empty(self._flags_off + 256, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self._storage, group_name)
        self.rank, self.num_ranks = self.handle.rank, self.handle.world_size
        self.local = self._storage[:nbytes]
        self.ptrs = torch.tensor(list(self.handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.nbytes = nbytes
        self._bytes = None  # per-rank [nbytes] uint8 views, made at first use
        self.timeout_ms = int(timeout_ms)  # bound of every device barrier (`num_gpu_timeout_secs`)
        self._launch = None  # the barrier kernel once compiled: launched directly
        assert (self.num_ranks + 1) * 8 <= 256, "the barrier's flag area holds at most 31 ranks"
        self._storage[self._flags_off:].zero_()
        self._delta16 = torch.div(self.ptrs - self.ptrs[self.rank], 16, rounding_mode="floor")
        pinned = torch.cuda.is_available()
        self.status = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)  # 1 + the rank a barrier timed out on
        self._status_np = self.status.numpy()  # read on every barrier: a numpy view costs no torch dispatch
        self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        # The barrier kernel's arguments (`_signal_triton.barrier`), pointers as ints: R, SIGNAL, WAIT, USE_TIMER last.
        self._args = (self._storage.data_ptr(), self._delta16.data_ptr(), self.status.data_ptr(), self.rank,
                      self.timeout_ms * 1_000_000, self._flags_off, self.num_ranks, True, True, True)
        self.handle.barrier(channel=0)  # every rank's flags are zero before anyone adds to them
        self.barrier()  # compiles the barrier kernel now, not in the middle of a call or a graph capture
        self.barrier()  # and checks the direct launch of the compiled kernel

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

    def barrier(self) -> None:
        """Device-side barrier over the group on the current stream: a one-program Triton kernel
        (`kernels/_signal_triton.barrier`) that adds to every rank's arrival counter and waits for theirs.
        Capturable in a CUDA graph (the barrier count lives in device memory).

        A rank that does not arrive within `timeout_ms` makes the kernel print "timed out waiting for rank r"
        and abort (the process must restart; DESIGN.md's error table); `check_status` then names r on the host.

        Raises:
            TimeoutError: an earlier barrier of this region timed out (`check_status`).
        """
        self.check_status()
        if self._launch is not None:
            # The compiled kernel directly, pointers as ints: Triton's JIT dispatch and tensor arguments cost
            # ~20 us of host time per barrier, which an eager call with four barriers would pay four times.
            self._launch(*self._args, stream=torch._C._cuda_getCurrentRawStream(self._device_index))
            return
        from ..kernels._signal_triton import barrier

        launched = barrier[(1,)](self._storage, self._delta16, *self._args[2:6], R=self.num_ranks, SIGNAL=True,
                                 WAIT=True, USE_TIMER=True, num_warps=1)
        if callable(getattr(launched, "__getitem__", None)):  # a CompiledKernel (Triton 3.x): reuse it
            self._launch = launched[(1, 1, 1)]

    def check_status(self) -> None:
        """Raises: TimeoutError -- a device barrier of this region timed out waiting for a rank (named)."""
        missing = int(self._status_np[0])
        if missing:
            raise TimeoutError(f"rank {self.rank}: a device barrier timed out (num_gpu_timeout_secs) waiting for "
                               f"rank {missing - 1}; the CUDA context is unusable, restart the process group")


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
