"""`BucketBuffer`: a storage region registered with up to 8 groups, for batched all-gather / reduce-scatter /
all-reduce over buckets that live in it (DeepEP V2.5 behaviour, §14).

epcomm runs each bucket as one `torch.distributed` collective on the bucket's own bytes, in place, so results
equal `all_gather_into_tensor` / `reduce_scatter_tensor` / `all_reduce` by construction; nothing needs NVLink
multicast. Placement rules (what each result is a view of) follow the reference; docs/collectives.md has the
table. Inside `with buffer.session() as s:` the same calls accept tensors outside the storage (staged in it).
Shape legend (docs/shapes.md): R ranks of the bucket's group.

This module holds the buffer: construction and group registration, the SM-count model, barrier and lifecycle, and
the public collectives with their contracts. The placement and launch behind the collectives are in
bucket_placement.py (with `BucketEvent`), the session in bucket_session.py (with `SessionOutOfStorage`); all
three public names are re-exported here.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import agreement, sizing
from .allocator import BufferAllocator
from .bucket_placement import BucketEvent, gather_call, reduce_call
from .bucket_session import BucketSession, SessionOutOfStorage
from .comm import ContextLifecycle, CommContext, group_device, new_comm_stream
from .compile_guard import eager_under_compile
from .validate import Checker, construction_timeout

__all__ = ["BucketBuffer", "BucketEvent", "BucketSession", "SessionOutOfStorage"]

MAX_GROUPS = 8  # bucket contexts per buffer (reference §1)
# NOTE: a 400 Gb/s NIC per GPU at 0.9 of nominal, the reference's NIC class; only the SM-count hint uses it.
DEFAULT_RDMA_GBS = 0.9 * 50.0


def _theoretical_num_sms(op: str, nvl: int, rdma: int, nvl_gbs: float, rdma_gbs: float) -> int:
    """Reference §14.2 SM model; nvl = ranks per host, rdma = hosts."""
    def al(x: float) -> int:
        return sizing.align(max(1, math.ceil(x)), 2)
    if op == "all_gather":
        return 0
    if op == "reduce_scatter":
        if rdma == 1:
            g = nvl_gbs / nvl
            return al(max(6, max(g / 180, g / 45)))
        a = rdma_gbs * rdma / (rdma - 1)
        if nvl == 1:
            return al(max(6, max(a / 180, a / rdma / 45)))
        g = min(nvl_gbs / nvl, a)
        return al(max(8, 1.2 * max(2 * g / 180, 2 * g / 45)))
    if rdma == 1:  # all_reduce
        g = nvl_gbs / nvl
        return al(max(4, max(g / 180, g / 45)))
    if nvl == 1:
        r = rdma_gbs * rdma / (rdma - 1)
        return al(max(6, max(r / 2 / 180, r / 2 / 45)))
    g = min(nvl_gbs / nvl, rdma_gbs * rdma / (2 * (rdma - 1)))
    return al(max(6, max(3 * g / 180, 3 * g / 45)))


def _plan_digest(plan: Optional[BufferAllocator]) -> int:
    """A plan's layout (each tensor's offset, shape and dtype, in order) as a 62-bit digest; 0 for no plan."""
    if plan is None:
        return 0
    return agreement.digest([[p.offset, str(p.tensor.dtype), *p.tensor.shape] for p in plan.allocations]) or 1


class BucketBuffer(ContextLifecycle):
    """A storage region registered with up to 8 groups, for batched collectives (collective construction).

    Args:
        group_or_groups: a `ProcessGroup` or a list of up to 8; every rank lists its groups in the same order
            (checked per group): every member of a group holds as many groups, with that group at one index. So
            overlapping subgroups with different members (ranks 0-1 and 1-2 of 3) need one BucketBuffer each.
            None = the default group.
        allocation_plan_or_num_bytes: int -- storage bytes, a positive multiple of 2 MiB; or an
            `epcomm.BufferAllocator` plan, not yet materialized and not empty: the storage has `plan.num_bytes`
            bytes and the plan's tensors become views of it (reference §6, §14.1). Every rank of every group
            passes a plan of the same layout (shapes, dtypes, order), or every rank a byte count.
        sl_idx: RDMA service level; accepted, no effect (no RDMA layer).
        num_gpu_timeout_secs: accepted; device waits are bounded by the groups' NCCL timeout. Default 100.
        explicitly_destroy: warn at garbage collection when `destroy()` was not called.
        num_cpu_timeout_secs: bound on every host wait (epcomm keyword). Default 300.

    Fields:
        num_bytes: int; groups: list of groups; contexts: one `CommContext` per group; storage: [num_bytes]
        uint8 on the buffer's device (zeroed at construction); allocation_plan: the `BufferAllocator` passed, its
        tensors views of `storage` (a construction that fails leaves the plan as it was passed, so that the
        same plans can be passed again), or None; nccl_comm_handles: None per group (epcomm uses each group's own communicator).

    Raises:
        TypeError: a group that is not a `ProcessGroup` of this rank; `allocation_plan_or_num_bytes` neither an
            int nor a `BufferAllocator`.
        ValueError: bad sizes, an empty or already materialized plan, ranks whose plans differ, more than 8
            groups, a group listed twice, ranks listing groups in other orders or other numbers of groups (on the
            ranks of the group where it shows, and on the ranks they share a later group with, in the order of the
            groups' ranks; where overlapping groups also disagree on the number of groups, a rank may raise it only
            after `num_cpu_timeout_secs`).
        TimeoutError: a peer did not construct within `num_cpu_timeout_secs`.
    """

    def __init__(self, group_or_groups, allocation_plan_or_num_bytes: Union[int, BufferAllocator],
                 sl_idx: Optional[int] = None, num_gpu_timeout_secs: float = 100, explicitly_destroy: bool = False, *,
                 num_cpu_timeout_secs: float = 300):
        self.explicitly_destroy = explicitly_destroy
        self._destroyed = False
        groups = [dist.group.WORLD] if group_or_groups is None else group_or_groups
        groups = list(groups) if isinstance(groups, (list, tuple)) else [groups]
        rank = groups[0].rank() if groups and isinstance(groups[0], dist.ProcessGroup) else dist.get_rank()
        name = "BucketBuffer"
        if not 1 <= len(groups) <= MAX_GROUPS:
            raise ValueError(f"{name}: rank {rank}: group_or_groups must hold 1 to {MAX_GROUPS} groups, got "
                             f"{len(groups)}")
        for i, g in enumerate(groups):
            if not isinstance(g, dist.ProcessGroup):
                raise TypeError(f"{name}: rank {rank}: groups[{i}] must be a ProcessGroup this rank belongs to, got "
                                f"{type(g).__name__}")
        if len({id(g) for g in groups}) != len(groups):
            raise ValueError(f"{name}: rank {rank}: group_or_groups lists a group twice; list each group once")
        num_bytes, plan = allocation_plan_or_num_bytes, None
        err = None  # a bad size still joins the construction exchange, so that every rank raises
        if isinstance(num_bytes, BufferAllocator):
            plan, num_bytes = num_bytes, num_bytes.num_bytes
            if plan.materialized:
                err = ValueError(f"{name}: rank {rank}: allocation_plan_or_num_bytes: the BufferAllocator is already "
                                 "materialized (a plan serves one buffer); make a new plan")
            elif not plan.num_bytes:
                err = ValueError(f"{name}: rank {rank}: allocation_plan_or_num_bytes: the BufferAllocator plans no "
                                 "bytes (num_bytes 0); allocate non-empty tensors in it or pass a byte count")
        elif isinstance(num_bytes, bool) or not isinstance(num_bytes, int):
            err = TypeError(f"{name}: rank {rank}: allocation_plan_or_num_bytes must be an int byte count or an "
                            f"epcomm.BufferAllocator, got {type(num_bytes).__name__}")
        elif num_bytes <= 0 or num_bytes % sizing.ALLOCATION_ALIGNMENT:
            err = ValueError(f"{name}: rank {rank}: allocation_plan_or_num_bytes must be a positive multiple of 2 MiB "
                             f"({sizing.ALLOCATION_ALIGNMENT}), got {num_bytes}")
        try:
            Checker(name, rank, torch.device("cpu")).timeouts(num_cpu_timeout_secs, num_gpu_timeout_secs)
        except (TypeError, ValueError) as e:
            err = err or e
        storage, materialized_here = None, False
        if err is None:  # before the exchange, so that a failure here makes every rank raise
            try:
                storage = torch.zeros(num_bytes, dtype=torch.uint8, device=group_device(groups[0]))
                if plan is not None:
                    plan.materialize(storage)  # the plan's tensors become views of the storage (same objects)
                    materialized_here = True
            except (RuntimeError, ValueError) as e:  # out of memory; a placeholder that cannot be swapped
                err = type(e)(f"{name}: rank {rank}: allocation_plan_or_num_bytes ({num_bytes} bytes): {e}")
        num_cpu_timeout_secs = construction_timeout(num_cpu_timeout_secs, err)
        self.num_bytes = num_bytes
        self.groups = groups
        self.sl_idx, self.num_gpu_timeout_secs, self.num_cpu_timeout_secs = sl_idx, num_gpu_timeout_secs, \
            num_cpu_timeout_secs
        try:
            self._register(groups, name, num_cpu_timeout_secs, plan, err)
        except BaseException:
            if materialized_here:  # back to planned, as the plan is on every rank that failed earlier
                plan.release()
            raise
        self.device = self.contexts[0].device
        self.storage, self.allocation_plan = storage, plan
        self.nccl_comm_handles = [None] * len(groups)
        self._session: Optional[BucketSession] = None
        self._sessions_opened = 0  # sessions entered so far (a call's carved staging is valid until the next one)
        self._warned: set = set()

    def _register(self, groups: list, name: str, num_cpu_timeout_secs: float, plan: Optional[BufferAllocator],
                  err: Optional[BaseException]) -> None:
        """Build `self.contexts`, one `CommContext` per group; raise this rank's `err` or what the exchanges raised."""
        # Each group's construction exchange, in one order on every rank (its ranks, then its name), whatever the
        # order of the list: ranks that list the groups in other orders then meet in every exchange and raise there
        # (the index agrees), and groups that overlap cannot wait on each other in a cycle.
        # A rank whose construction failed in one group still joins the exchanges of its later groups, failing them
        # too, so that the ranks it shares only those with raise as well (they waited there until the timeout);
        # unless that group's ranks hold different numbers of groups: some would not come to the later exchanges.
        self.contexts: list = [None] * len(groups)
        stream = None  # one communication stream for every group
        for i in sorted(range(len(groups)), key=lambda i: (dist.get_process_group_ranks(groups[i]),
                                                           getattr(groups[i], "group_name", ""))):
            try:
                ctx = CommContext(groups[i], owner=name, num_cpu_timeout_secs=num_cpu_timeout_secs,
                                  agree={"the group's index in group_or_groups": i, "the number of groups": len(groups),
                                         "the allocation plan (its layout's digest; 0: a byte count)":
                                             _plan_digest(plan)},
                                  error=err)
            except (TypeError, ValueError) as e:
                if "the number of groups" in getattr(e, "disagreed", ()):
                    self._destroyed = True
                    raise
                err = err or e
                continue
            except TimeoutError as e:
                self._destroyed = True
                if err is not None:  # a peer of this later group stopped at an error of its own: ours is the cause
                    raise err from e
                raise
            if stream is None:
                stream = new_comm_stream(ctx.device)
            ctx.comm_stream, self.contexts[i] = stream, ctx
        if err is not None:
            self._destroyed = True
            raise err

    # -- helpers -------------------------------------------------------------------------------------
    def get_context_idx(self, group: Optional[dist.ProcessGroup] = None) -> int:
        """Index of `group` in `groups`; `group` may be None only when one group is registered.

        Raises:
            ValueError: `group` is None with several groups, or not one of this buffer's groups.
        """
        rank = self.contexts[0].rank if self.contexts else dist.get_rank()
        if not self.contexts:
            raise ValueError(f"BucketBuffer: rank {rank}: the BucketBuffer was destroyed; create a new one")
        if group is None:
            if len(self.groups) != 1:
                raise ValueError(f"BucketBuffer: rank {rank}: group=None is ambiguous with {len(self.groups)} groups "
                                 "registered; pass the group")
            return 0
        for i, g in enumerate(self.groups):
            if g is group:
                return i
        raise ValueError(f"BucketBuffer: rank {rank}: the group is not registered with this buffer (it has "
                         f"{len(self.groups)}); pass one of buffer.groups")

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The buffer's high-priority communication stream; None on CPU."""
        return self.contexts[0].comm_stream if self.contexts else None

    def get_theoretical_num_sms(self, op: str, group: Optional[dist.ProcessGroup] = None) -> int:
        """SM count of the reference's model for `op` on `group` (reference §14.2); a hint, allocates nothing.

        Args:
            op: "all_gather" (0), "reduce_scatter" or "all_reduce".
            group: one of `groups`; None when one group is registered.

        Returns:
            int -- an even SM count (0 for all_gather). Assumes H200 NVLink on CPU and a 400 Gb/s NIC.

        Raises:
            ValueError: unknown `op` (the reference raises NotImplementedError), unknown group.
        """
        ctx = self.contexts[self.get_context_idx(group)]
        if op not in ("all_gather", "reduce_scatter", "all_reduce"):
            raise ValueError(f"BucketBuffer.get_theoretical_num_sms: rank {ctx.rank}: op must be 'all_gather', "
                             f"'reduce_scatter' or 'all_reduce', got {op!r}")
        nvl_gbs = sizing.default_nvlink_gbs(self.device) or 0.9 * 18 * 26.5625
        return _theoretical_num_sms(op, ctx.num_nvlink_ranks, ctx.num_rdma_ranks, nvl_gbs, DEFAULT_RDMA_GBS)

    @eager_under_compile
    def barrier(self, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True,
                group: Optional[dist.ProcessGroup] = None) -> None:
        """Barrier over `group` on the current stream (collective over it; reference §17.1).

        Args:
            wait_comm_stream, with_cpu_sync, sequential: as `epcomm.comm.barrier`.
            group: one of `groups`; None when one group is registered.

        Raises:
            ValueError: unknown group, destroyed buffer. TimeoutError: a peer did not arrive.
        """
        call = "BucketBuffer.barrier"
        try:
            idx = self.get_context_idx(group)
        except ValueError as e:  # name the call, as the data calls do
            raise ValueError(str(e).replace("BucketBuffer:", f"{call}:", 1)) from None
        self.contexts[idx].barrier(wait_comm_stream, with_cpu_sync, sequential, call=call)

    def session(self) -> "BucketSession":
        """A `BucketSession` to use as `with buffer.session() as s:` (reference §14.3)."""
        return BucketSession(self)

    # -- lifecycle -----------------------------------------------------------------------------------
    @eager_under_compile
    def destroy(self) -> None:
        """Release the buffer (collective over every group: a barrier each, skipped on a group that a timeout or a
        mid-call failure broke). A second call is a no-op."""
        if self._destroyed:
            return
        for ctx in self.contexts:
            if ctx.can_meet_peers():
                ctx.barrier(call="BucketBuffer.destroy", same_buffer=False)
            ctx.destroyed = True
        self._destroyed = True
        self.contexts, self.storage, self.nccl_comm_handles = [], None, []

    # -- collectives ---------------------------------------------------------------------------------
    @eager_under_compile
    def all_gather(self, srcs: Union[Tensor, list], dsts: Union[None, Tensor, list] = None,
                   group: Optional[dist.ProcessGroup] = None, num_sms: Optional[int] = None) -> BucketEvent:
        """Gather every rank's shard of each bucket, in place in the storage (collective over `group`).

        Asynchronous on the communication stream; the first `wait()` of the returned event returns the results.
        Equals `dist.all_gather_into_tensor(dst, src)` bitwise; bytes are copied (any dtype).

        Args:
            srcs: one tensor or a list; each contiguous, non-empty, any dtype -- this rank's shard. Without
                `dsts` it must lie in `storage` as the `rank`-th shard of the gathered region.
            dsts: None, or one tensor / a list like `srcs`; each contiguous, in `storage`, with
                `dst.nbytes == R * src.nbytes`. A `src` that overlaps its `dst` must be exactly the local shard.
            group: one of `groups`; None when one group is registered.
            num_sms: None or 0 (all_gather uses no SMs).

        Returns:
            `BucketEvent`; `wait()` gives one tensor or a list: the 1-D gathered view `[R * src.numel()]` of
            `src.dtype` (without dsts) or the `dst`.

        Raises:
            TypeError: srcs/dsts not tensors. ValueError: tensors outside the storage, sizes, contiguity,
            device, num_sms, destroyed buffer. TimeoutError: a peer did not arrive (CPU).
        """
        return gather_call(self, srcs, dsts, group, num_sms, None)

    @eager_under_compile
    def reduce_scatter(self, srcs: Union[Tensor, list], comm_precision: str = "fp32", scale: float = 1.0,
                       group: Optional[dist.ProcessGroup] = None, num_sms: Optional[int] = None) -> BucketEvent:
        """Sum each fp32 bucket over the ranks and keep this rank's shard, in place (collective over `group`).

        Naive equivalent: `dist.reduce_scatter_tensor(src.view(-1)[rank*n:(rank+1)*n], src.view(-1)); shard *= scale`
        with `n = src.numel() // R`. Asynchronous on the communication stream; `wait()` returns the results.

        Args:
            srcs: one tensor or a list; each fp32, contiguous, non-empty, in `storage`, `nbytes % (R*32) == 0`,
                start 32-byte aligned.
            comm_precision: "fp32" (the only one epcomm runs; the reference's "bf16" needs a pure-RDMA group).
            scale: float -- multiplies the sum (after summing). Default 1.0.
            group: one of `groups`; None when one group is registered.
            num_sms: > 0, or None for `get_theoretical_num_sms("reduce_scatter")`; no effect on CPU.

        Returns:
            `BucketEvent`; `wait()` gives `[src.numel() // R]` fp32 views into each `src` (one tensor or a list).

        Raises:
            TypeError: not fp32 / not tensors. ValueError: outside the storage, alignment, sizes, a one-rank
            group, comm_precision, num_sms. TimeoutError: a peer did not arrive (CPU).
        """
        return reduce_call(self, "reduce_scatter", srcs, None, comm_precision, scale, group, num_sms, None)

    @eager_under_compile
    def all_reduce(self, srcs: Union[Tensor, list], scale: float = 1.0, group: Optional[dist.ProcessGroup] = None,
                   num_sms: Optional[int] = None) -> BucketEvent:
        """Sum each fp32 bucket over the ranks, in place over the whole tensor (collective over `group`).

        Naive equivalent: `dist.all_reduce(src); src *= scale`. Works without NVLink multicast.

        Args:
            srcs: one tensor or a list; each fp32, contiguous, non-empty, in `storage`, `nbytes % (R*32) == 0`,
                start 32-byte aligned.
            scale: float -- multiplies the sum. Default 1.0.
            group: one of `groups`; None when one group is registered.
            num_sms: > 0, or None for `get_theoretical_num_sms("all_reduce")`; no effect on CPU.

        Returns:
            `BucketEvent`; `wait()` gives each `src` itself (one tensor or a list).

        Raises:
            As `reduce_scatter`.
        """
        return reduce_call(self, "all_reduce", srcs, None, "fp32", scale, group, num_sms, None)

    # -- lookups for placement and the session -------------------------------------------------------
    def _begin(self, call: str, group):
        try:
            idx = self.get_context_idx(group)
        except ValueError as e:
            raise ValueError(str(e).replace("BucketBuffer:", f"{call}:", 1)) from None
        ctx = self.contexts[idx]
        c = ctx.checker(call)
        # A failure on one of the buffer's groups leaves the ranks' calls out of step on all of them (a later call
        # on another group would pair with a peer's stale header): the whole buffer is unusable, as documented.
        other = next((x.broken for x in self.contexts if x.broken is not None), None)
        if other is not None:
            c.fail(ValueError, f"the BucketBuffer is unusable after an earlier failure on another of its groups "
                               f"({other}); destroy it and restart the process group")
        return ctx, c

    def offset_of(self, t: Tensor) -> Optional[int]:
        """Byte offset of `t` in `storage` when all of its bytes lie there, else None (partly inside: None)."""
        if self.storage is None or t.device != self.storage.device or t.numel() == 0:
            return None
        start = t.data_ptr() - self.storage.data_ptr()
        return start if 0 <= start and start + t.nbytes <= self.num_bytes else None
