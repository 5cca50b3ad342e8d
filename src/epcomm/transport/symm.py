"""A small shim over torch's private symmetric-memory API (torch 2.11 and newer, CUDA backend).

The API (`torch.distributed._symmetric_memory`) moves between releases; everything epcomm uses goes through
these functions: allocate a region every rank of a group can address, views of a peer's region, the device
pointer table Triton kernels cast to pointers. The device barrier is epcomm's own kernel (it names a rank that
does not arrive); torch's is used once, at construction. NVLink multicast (NVLS) stays off.
"""

from __future__ import annotations

import importlib
import math
import os
from typing import Optional

import torch
import torch.distributed as dist

from ..kernels.launch import Compiled
from ..kernels.push import region_deltas
from ..sizing import align, contiguous_strides


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


# The kinds of kernels that count their finished programs (`SymmetricRegion.programs_done`): the gather that runs
# the barrier (`barrier_in_kernel`), the send plan that publishes the fused dispatch's rows, the plan kernel that
# writes the per-expert totals.
_DONE_COUNTERS = ("barrier", "publish", "totals")


class SymmetricRegion:
    """`nbytes` of device memory on every rank of `group`, addressable by every peer over NVLink, with a device
    barrier that names a rank that does not arrive.

    Collective: every rank of the group constructs it with the same `nbytes`.

    Args:
        timeout_s: bound of every device barrier of the region (`num_gpu_timeout_secs`), in seconds.

    Fields:
        local: [nbytes] uint8 -- this rank's region.
        ptrs: [R] int64 (device) -- base address of every rank's region (the pointer table for kernels).
        delta16: [R] int64 (device) -- every rank's base relative to this rank's, in 16-byte units
            (`kernels.push.region_deltas`), which is how the Triton kernels address peers.
        status: [1] int64 (pinned host memory the GPU writes) -- 0, or 1 + the rank a barrier timed out on.

    The barrier's flags follow the caller's bytes (one arrival counter per rank, then this rank's barrier count, in
    device memory so that CUDA graphs replay barriers correctly). The count is read and advanced by each barrier,
    so the barriers of one region must run in one order: issue them on one stream (or order the streams).
    """

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device, timeout_s: float = 100.0):
        # NVLink multicast can take a host's GPUs out of service; epcomm never needs it.
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        from ..kernels._signal_triton import barrier

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
        num_ranks = group.size()
        self._flags_off = align(nbytes, 128)
        self._storage = symm_mem.empty(self._flags_off + align((num_ranks + 1) * 8, 128), dtype=torch.uint8,
                                       device=device)
        self._storage[self._flags_off:].zero_()
        self.local = self._storage[:nbytes]
        self.nbytes = nbytes
        self._bytes = None  # per-rank [nbytes] uint8 views, made at first use
        self._typed: dict = {}  # (rank, dtype) -> the whole region as dtype (`peer`)
        self.timeout_ns = max(1, int(timeout_s * 1e9))
        self.status = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._status_np = self.status.numpy()  # read on every barrier: a numpy view costs no torch dispatch
        self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        # Compile the barrier kernel before the rendezvous lines the ranks up, so that no rank's first barrier
        # times out while a peer is still compiling (the arguments' values do not matter to the compiled kernel).
        with torch.cuda.device(device):
            compiled = barrier.warmup(self._storage, torch.empty(num_ranks, dtype=torch.int64, device=device),
                                      self.status.data_ptr(), 0, self.timeout_ns, self._flags_off, R=num_ranks,
                                      R_POW2=1 << (num_ranks - 1).bit_length(), SIGNAL=True, WAIT=True,
                                      USE_TIMER=True, num_warps=1, grid=(1,))
            self._launch = Compiled(compiled)  # the compiled kernel, launched directly (kernels/launch.py)

        self.handle = symm_mem.rendezvous(self._storage, group_name)
        self.rank, self.num_ranks = self.handle.rank, self.handle.world_size
        self.ptrs = torch.tensor(list(self.handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.delta16 = region_deltas(self.ptrs, self.rank)
        # The barrier kernel's arguments (`_signal_triton.barrier`), pointers as ints; constexprs last.
        self._args = (self._storage.data_ptr(), self.delta16.data_ptr(), self.status.data_ptr(), self.rank,
                      self.timeout_ns, self._flags_off, self.num_ranks, 1 << (self.num_ranks - 1).bit_length(),
                      True, True, True)  # R, R_POW2, SIGNAL, WAIT, USE_TIMER
        # Kernels on this region whose last program does more count their finished programs in a counter of their
        # own (`programs_done`); the last one sets it back to zero (`_signal_triton._last_to_finish`).
        counters = torch.zeros(len(_DONE_COUNTERS), dtype=torch.int64, device=device)
        self._done = {name: counters[i: i + 1] for i, name in enumerate(_DONE_COUNTERS)}
        # A kernel that runs the barrier inside itself (`barrier_in_kernel`): the same flags, and its counter.
        self._in_kernel = dict(done_ptr=self._done["barrier"], local_ptr=self.local,
                               delta16_ptr=self.delta16, status_ptr=self.status.data_ptr(), me=self.rank,
                               timeout_ns=self.timeout_ns, flags_off=self._flags_off, R=self.num_ranks,
                               R_POW2=1 << (self.num_ranks - 1).bit_length(), SIGNAL=True, WAIT=True, USE_TIMER=True)
        # Every rank's flags are zero before anyone adds to them: torch's barrier, once.
        self.handle.barrier(channel=0, timeout_ms=max(1, math.ceil(timeout_s * 1000)))
        self.barrier()

    @property
    def flags_off(self) -> int:
        """Byte offset of the barrier's flags from `local`'s start (`_signal_triton.group_barrier`'s `flags_off`)."""
        return self._flags_off

    def peer(self, rank: int, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous view of `rank`'s region at byte `offset` (a multiple of dtype's size): one `as_strided` of a
        typed view of the whole region made once per rank and dtype, since asking torch for a new peer tensor (or
        three views) on every call costs host time on every call."""
        numel = 1
        for s in shape:
            numel *= s
        assert offset % dtype.itemsize == 0 and offset + numel * dtype.itemsize <= self.nbytes
        typed = self._typed.get((rank, dtype))
        if typed is None:
            if self._bytes is None:
                self._bytes = [self.handle.get_buffer(r, [self.nbytes], torch.uint8, 0) for r in range(self.num_ranks)]
            whole = self._bytes[rank]
            typed = self._typed[(rank, dtype)] = whole[:self.nbytes - self.nbytes % dtype.itemsize].view(dtype)
        return typed.as_strided(tuple(shape), contiguous_strides(tuple(shape)), offset // dtype.itemsize)

    def barrier(self) -> None:
        """Device-side barrier over the group on the current stream: a one-program Triton kernel
        (`kernels/_signal_triton.barrier`) that adds to every rank's arrival counter and waits for theirs.
        Capturable in a CUDA graph.

        A rank that does not arrive within `timeout_s` makes the kernel print "timed out waiting for rank r",
        record r in `status` and abort: the process must restart (docs/decisions.md, "Errors and timeouts"). If
        the process survives, the region's next barrier raises `TimeoutError` naming r.

        Raises:
            TimeoutError: an earlier barrier of this region timed out (`check_status`).
        """
        self.check_status()
        # The compiled kernel directly, pointers as ints: Triton's JIT dispatch and tensor arguments cost ~20 us
        # of host time per barrier, which an eager call with four barriers would pay four times.
        self._launch((1, 1, 1), self._args, None, torch._C._cuda_getCurrentRawStream(self._device_index))

    def programs_done(self, kind: str) -> torch.Tensor:
        """[1] int64 on the device, zero between launches: the counter of finished programs of the kernels of `kind`
        (`_DONE_COUNTERS`) on this region, one per kind, so that kernels of different kinds (which may run on
        different streams: a deferred epilogue runs on the caller's) never share one."""
        return self._done[kind]

    def barrier_in_kernel(self) -> dict:
        """The arguments of a kernel that runs this region's barrier inside itself once its own programs are done
        (`_gather_triton.gather_fields` with `BARRIER`): the barrier's flags, this rank's counter of finished
        programs, and `R`, `R_POW2`, `SIGNAL`, `WAIT`, `USE_TIMER`. The barrier's rules hold (one stream order for
        the region's barriers; a timeout records the missing rank and traps); the dict is shared, not to be changed.

        Raises:
            TimeoutError: an earlier barrier of this region timed out (`check_status`).
        """
        self.check_status()
        return self._in_kernel

    def check_status(self) -> None:
        """Raises: TimeoutError -- a device barrier of this region timed out waiting for a rank (named)."""
        missing = int(self._status_np[0])
        if missing:
            raise TimeoutError(f"rank {self.rank}: a device barrier timed out after {self.timeout_ns / 1e9:g} s "
                               f"(num_gpu_timeout_secs) waiting for rank {missing - 1}; the CUDA context is "
                               "unusable, restart the process group")


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
