"""`BucketBuffer` and `BucketSession`: batched all-gather / reduce-scatter / all-reduce over buckets that live in
one storage region (DeepEP V2.5 behaviour, §14).

epcomm runs each bucket as one `torch.distributed` collective on the bucket's own bytes, in place, so results
equal `all_gather_into_tensor` / `reduce_scatter_tensor` / `all_reduce` by construction; nothing needs NVLink
multicast. Placement rules (what each result is a view of) follow the reference; docs/collectives.md has the
table. Inside `with buffer.session() as s:` the same calls accept tensors outside the storage (staged in it).
Shape legend (docs/shapes.md): R ranks of the bucket's group.

NOTE: about 650 lines, over the ~500 soft cap: the buffer and its session share the placement code
(`_gather_call`, `_reduce_call`); the natural split is the session into its own module.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import sizing
from .comm import ContextLifecycle, CommContext, new_comm_stream
from .events import EventHandle, EventOverlap

__all__ = ["BucketBuffer", "BucketEvent", "BucketSession", "SessionOutOfStorage"]

MAX_GROUPS = 8  # bucket contexts per buffer (reference §1)
STAGING_ALIGNMENT = 64  # session allocation granularity: the reference's RDMA alignment (§1)
# NOTE: a 400 Gb/s NIC per GPU at 0.9 of nominal, the reference's NIC class; only the SM-count hint uses it.
DEFAULT_RDMA_GBS = 0.9 * 50.0
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class SessionOutOfStorage(ValueError, RuntimeError):
    """A session's staging does not fit in the storage (a `ValueError`; a `RuntimeError` as in the reference)."""


class BucketEvent(EventOverlap):
    """The event of a bucket collective: the first `wait()` returns the results (one tensor or a list).

    Fields:
        num_sms: int -- the SM count the call ran with (`get_theoretical_num_sms` when `num_sms=None`; 0 for
            all_gather); a hint on CPU.
    """

    def __init__(self, event: EventHandle, hook, num_sms: int):
        super().__init__(event, hook_after_wait=hook)
        self.num_sms = num_sms


@dataclass
class _Bucket:
    """One bucket of a call: the collective's tensors and what the user gets back."""

    inp: Tensor  # collective input (flat)
    out: Tensor  # collective output (flat; may alias inp)
    result: Tensor  # what wait() returns (a view of `out`, or the user's dst)
    stage_from: Optional[Tensor] = None  # session: user tensor copied into `stage_to` before the collective
    stage_to: Optional[Tensor] = None
    copy_to: Optional[Tensor] = None  # session: user dst that receives `result` at wait()


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


class BucketBuffer(ContextLifecycle):
    """A storage region registered with up to 8 groups, for batched collectives (collective construction).

    Args:
        group_or_groups: a `ProcessGroup` or a list of up to 8; every rank lists its groups in the same order
            (checked per group). None = the default group.
        allocation_plan_or_num_bytes: int -- storage bytes, a positive multiple of 2 MiB (allocation plans are
            not supported yet).
        sl_idx: RDMA service level; accepted, no effect (no RDMA layer).
        num_gpu_timeout_secs: accepted; device waits are bounded by the groups' NCCL timeout. Default 100.
        explicitly_destroy: warn at garbage collection when `destroy()` was not called.
        num_cpu_timeout_secs: bound on every host wait (epcomm keyword). Default 300.

    Fields:
        num_bytes: int; groups: list of groups; contexts: one `CommContext` per group; storage: [num_bytes]
        uint8 on the buffer's device (zeroed at construction); nccl_comm_handles: None per group (epcomm uses
        each group's own communicator).

    Raises:
        TypeError: a group that is not a `ProcessGroup` of this rank; an allocation plan.
        ValueError: bad sizes, more than 8 groups, a group listed twice, ranks listing groups in other orders.
        TimeoutError: a peer did not construct within `num_cpu_timeout_secs`.
    """

    def __init__(self, group_or_groups, allocation_plan_or_num_bytes: int, sl_idx: Optional[int] = None,
                 num_gpu_timeout_secs: float = 100, explicitly_destroy: bool = False, *,
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
        num_bytes = allocation_plan_or_num_bytes
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int):
            raise TypeError(f"{name}: rank {rank}: allocation_plan_or_num_bytes: allocation plans are not supported "
                            f"yet; pass a byte count (got {type(num_bytes).__name__})")
        if num_bytes <= 0 or num_bytes % sizing.ALLOCATION_ALIGNMENT:
            raise ValueError(f"{name}: rank {rank}: allocation_plan_or_num_bytes must be a positive multiple of 2 MiB "
                             f"({sizing.ALLOCATION_ALIGNMENT}), got {num_bytes}")
        self.num_bytes = num_bytes
        self.groups = groups
        self.sl_idx, self.num_gpu_timeout_secs, self.num_cpu_timeout_secs = sl_idx, num_gpu_timeout_secs, \
            num_cpu_timeout_secs
        self.contexts: list = []
        for i, g in enumerate(groups):
            ctx = CommContext(g, owner=name, num_cpu_timeout_secs=num_cpu_timeout_secs,
                              agree={"the group's index in group_or_groups": i, "the number of groups": len(groups)})
            ctx.comm_stream = self.contexts[0].comm_stream if self.contexts else new_comm_stream(ctx.device)
            self.contexts.append(ctx)
        self.device = self.contexts[0].device
        self.storage = torch.zeros(num_bytes, dtype=torch.uint8, device=self.device)
        self.nccl_comm_handles = [None] * len(groups)
        self._session: Optional[BucketSession] = None
        self._warned: set = set()

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

    def barrier(self, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True,
                group: Optional[dist.ProcessGroup] = None) -> None:
        """Barrier over `group` on the current stream (collective over it; reference §17.1).

        Args:
            wait_comm_stream, with_cpu_sync, sequential: as `epcomm.comm.barrier`.
            group: one of `groups`; None when one group is registered.

        Raises:
            ValueError: unknown group, destroyed buffer. TimeoutError: a peer did not arrive.
        """
        self.contexts[self.get_context_idx(group)].barrier(wait_comm_stream, with_cpu_sync, sequential,
                                                           call="BucketBuffer.barrier")

    def session(self) -> "BucketSession":
        """A `BucketSession` to use as `with buffer.session() as s:` (reference §14.3)."""
        return BucketSession(self)

    # -- lifecycle -----------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release the buffer (collective over every group: a barrier each). A second call is a no-op."""
        if self._destroyed:
            return
        for ctx in self.contexts:
            if ctx.broken is None:
                ctx.barrier(call="BucketBuffer.destroy")
            ctx.destroyed = True
        self._destroyed = True
        self.contexts, self.storage, self.nccl_comm_handles = [], None, []

    # -- collectives ---------------------------------------------------------------------------------
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
        return self._gather_call(srcs, dsts, group, num_sms, None)

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
        return self._reduce_call("reduce_scatter", srcs, None, comm_precision, scale, group, num_sms, None)

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
        return self._reduce_call("all_reduce", srcs, None, "fp32", scale, group, num_sms, None)

    # -- checks and placement ------------------------------------------------------------------------
    def _begin(self, call: str, group):
        try:
            idx = self.get_context_idx(group)
        except ValueError as e:
            raise ValueError(str(e).replace("BucketBuffer:", f"{call}:", 1)) from None
        ctx = self.contexts[idx]
        return ctx, ctx.checker(call)

    def offset_of(self, t: Tensor) -> Optional[int]:
        """Byte offset of `t` in `storage` when all of its bytes lie there, else None (partly inside: None)."""
        if self.storage is None or t.device != self.storage.device or t.numel() == 0:
            return None
        start = t.data_ptr() - self.storage.data_ptr()
        return start if 0 <= start and start + t.nbytes <= self.num_bytes else None

    def _in_storage(self, c, name: str, t: Tensor) -> int:
        off = self.offset_of(t)
        if off is None:
            c.fail(ValueError, f"{name} must belong to this BucketBuffer (a view of buffer.storage, {self.num_bytes} "
                               "bytes); use tensors carved from buffer.storage or open buffer.session()")
        return off

    def _check_tensor(self, c, name: str, t) -> Tensor:
        if not isinstance(t, Tensor):
            c.fail(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != self.device.type or (self.device.index is not None and t.device != self.device):
            c.fail(ValueError, f"{name} is on {t.device} but the buffer lives on {self.device}; move it there")
        if t.numel() == 0:
            c.fail(ValueError, f"{name} is empty; buckets must hold at least one element")
        return t

    def _check_contiguous(self, c, name: str, t: Tensor) -> None:
        if not t.is_contiguous():
            c.fail(ValueError, f"{name} must be contiguous (got strides {tuple(t.stride())})")

    def _gather_call(self, srcs, dsts, group, num_sms, session: Optional["BucketSession"]) -> BucketEvent:
        call = "BucketBuffer.all_gather"
        ctx, c = session._context(call, group) if session else self._begin(call, group)
        srcs_l, single = _as_list(c, "srcs", srcs)
        dsts_l = [None] * len(srcs_l) if dsts is None else _like(c, srcs_l, single, dsts)
        if num_sms:
            c.fail(ValueError, f"num_sms must be None or 0 for all_gather (copy-engine driven), got {num_sms}")
        buckets = [self._gather_bucket(c, ctx, "srcs" if single else f"srcs[{i}]", s, d, session)
                   for i, (s, d) in enumerate(zip(srcs_l, dsts_l))]
        return self._launch(ctx, call, "all_gather", buckets, 1.0, 0, single)

    def _gather_bucket(self, c, ctx, name: str, src, dst, session) -> _Bucket:
        r, R = ctx.rank, ctx.num_ranks
        dname = name.replace("srcs", "dsts")
        src = self._check_tensor(c, name, src)
        if dst is not None:
            dst = self._check_tensor(c, dname, dst)
            self._check_contiguous(c, dname, dst)
            if session is not None and dst.dtype != src.dtype:
                c.fail(TypeError, f"{dname} must have the src's dtype {src.dtype} in a session, got {dst.dtype}")
            if dst.nbytes != R * src.nbytes:
                c.fail(ValueError, f"{dname} must have {R} x {name}.nbytes = {R * src.nbytes} bytes, got "
                                   f"{dst.nbytes}")
        src_off, dst_off = self.offset_of(src), None if dst is None else self.offset_of(dst)
        if dst_off is not None:  # gather straight into dst; src may be anywhere
            out = self.storage[dst_off:dst_off + dst.nbytes]
            sptr, dptr = src.data_ptr(), dst.data_ptr()
            if src_off is not None and sptr < dptr + dst.nbytes and dptr < sptr + src.nbytes \
                    and sptr != dptr + r * src.nbytes:
                c.fail(ValueError, f"{name} overlaps {dname} but is not its rank-th (rank {r}) shard (byte offset "
                                   f"{sptr - dptr}, expected {r * src.nbytes}); use the local shard or another tensor")
            if session is None or src.is_contiguous():
                self._check_contiguous(c, name, src)
                return _Bucket(inp=_bytes(src), out=out, result=dst)
            shard = out[r * src.nbytes:(r + 1) * src.nbytes]
            return _Bucket(inp=shard, out=out, result=dst, stage_from=src,
                           stage_to=shard.view(src.dtype).view(src.shape))
        if dst is not None and session is None:
            self._in_storage(c, dname, dst)  # raises: dsts live in the storage outside a session
        if src_off is not None:  # in place: src is the rank-th shard of the gathered region
            self._check_contiguous(c, name, src)
            start, end = src_off - r * src.nbytes, src_off + (R - r) * src.nbytes
            if start < 0 or end > self.num_bytes:
                c.fail(ValueError, f"{name} must be the rank-th (rank {r}) shard of a gathered tensor inside the "
                                   f"storage: the gathered bytes would span [{start}, {end}) but the storage has "
                                   f"{self.num_bytes}; move the bucket or pass dsts")
            out = self.storage[start:end]
            return _Bucket(inp=_bytes(src), out=out, result=out.view(src.dtype), copy_to=dst)
        if session is None:
            self._in_storage(c, name, src)  # raises
        out = session._carve(c, R * src.nbytes)
        shard = out[r * src.nbytes:(r + 1) * src.nbytes]
        return _Bucket(inp=shard, out=out, result=out.view(src.dtype), stage_from=src,
                       stage_to=shard.view(src.dtype).view(src.shape), copy_to=dst)

    def _reduce_call(self, op: str, srcs, dsts, comm_precision, scale, group, num_sms,
                     session: Optional["BucketSession"]) -> BucketEvent:
        call = f"BucketBuffer.{op}"
        ctx, c = session._context(call, group) if session else self._begin(call, group)
        srcs_l, single = _as_list(c, "srcs", srcs)
        dsts_l = [None] * len(srcs_l) if dsts is None else _like(c, srcs_l, single, dsts)
        sms = self._reduction_options(c, ctx, op, comm_precision, scale, num_sms)
        r, R = ctx.rank, ctx.num_ranks
        shards_out = R if op == "reduce_scatter" else 1
        buckets = []
        for i, (src, dst) in enumerate(zip(srcs_l, dsts_l)):
            name = "srcs" if single else f"srcs[{i}]"
            dname = name.replace("srcs", "dsts")
            src = self._check_tensor(c, name, src)
            if src.dtype != torch.float32:
                c.fail(TypeError, f"{name} must be torch.float32, got {src.dtype}")
            if src.nbytes % (R * 32):
                c.fail(ValueError, f"{name} has {src.nbytes} bytes; it must be a multiple of R x 32 = {R * 32} "
                                   "(R ranks, 32-byte shards)")
            if dst is not None:
                dst = self._check_tensor(c, dname, dst)
                if dst.dtype != torch.float32:
                    c.fail(TypeError, f"{dname} must have the src's dtype torch.float32, got {dst.dtype}")
                self._check_contiguous(c, dname, dst)
                if dst.nbytes * shards_out != src.nbytes:
                    c.fail(ValueError, f"{dname} must have {src.nbytes // shards_out} bytes, got {dst.nbytes}")
            n = src.numel() // shards_out
            stage = None
            if session is None or self.offset_of(src) is not None:  # in place
                self._check_contiguous(c, name, src)
                off = self._in_storage(c, name, src)
                if off % 32:
                    c.fail(ValueError, f"{name} starts at storage byte {off}; it must start on a 32-byte boundary")
                flat = src.view(-1)
            else:  # stage: derived from an in-storage dst (dst is the rank-th shard), else carved
                flat, dst_off = None, None if dst is None else self.offset_of(dst)
                if dst_off is not None:
                    start = dst_off - (r * dst.nbytes if op == "reduce_scatter" else 0)
                    if start >= 0 and start + src.nbytes <= self.num_bytes and start % 32 == 0:
                        flat = self.storage[start:start + src.nbytes].view(torch.float32)
                flat = session._carve(c, src.nbytes).view(torch.float32) if flat is None else flat
                stage = flat.view(src.shape)
            out = flat[r * n:(r + 1) * n] if op == "reduce_scatter" else flat
            result = out if op == "reduce_scatter" else src if stage is None else stage
            same = dst is not None and dst.data_ptr() == out.data_ptr()
            buckets.append(_Bucket(inp=flat, out=out, result=dst if same else result, stage_to=stage,
                                   stage_from=None if stage is None else src,
                                   copy_to=dst if dst is not None and not same else None))
        return self._launch(ctx, call, op, buckets, float(scale), sms, single)

    def _reduction_options(self, c, ctx, op: str, comm_precision: str, scale, num_sms) -> int:
        if ctx.num_ranks == 1:
            c.fail(ValueError, f"{op} needs a group of at least 2 ranks (reductions on one-rank groups are not "
                               "supported, as in the reference)")
        if comm_precision != "fp32":
            c.fail(ValueError, f"comm_precision must be 'fp32', got {comm_precision!r} (the reference's 'bf16' needs "
                               "a pure-RDMA group; epcomm's collective path reduces in fp32)")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            c.fail(TypeError, f"scale must be a float, got {type(scale).__name__}")
        if num_sms is None:
            return self.get_theoretical_num_sms(op, ctx.group)
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms <= 0:
            c.fail(ValueError, f"num_sms must be > 0 or None (the model's value) for {op}, got {num_sms}")
        if self.device.type == "cpu" and "num_sms" not in self._warned:
            self._warned.add("num_sms")
            warnings.warn("epcomm: num_sms has no effect on CPU; it is ignored", stacklevel=3)
        return num_sms

    # -- launch --------------------------------------------------------------------------------------
    def _launch(self, ctx: CommContext, call: str, op: str, buckets: list, scale: float, num_sms: int,
                single: bool) -> BucketEvent:
        """Run the buckets' collectives on the comm stream (CUDA) or now (CPU); the event returns the results."""
        cuda = self.device.type == "cuda"
        stream = ctx.comm_stream
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for b in buckets:
                if b.stage_from is not None:
                    b.stage_to.copy_(b.stage_from)
            works, parts = [], []
            for b in buckets:
                if op == "all_gather":
                    works.append(_all_gather(b.out, b.inp, group=ctx.group, async_op=True))
                elif op == "reduce_scatter" and cuda:
                    works.append(_reduce_scatter(b.out, b.inp, group=ctx.group, async_op=True))
                elif op == "reduce_scatter":
                    # NOTE: gloo's reduce-scatter work never reports completion (torch 2.13), so a bounded wait
                    # cannot poll it: on CPU move the shards with all_to_all_single and sum in rank order.
                    parts.append(torch.empty_like(b.inp).view(ctx.num_ranks, -1))
                    works.append(dist.all_to_all_single(parts[-1], b.inp, group=ctx.group, async_op=True))
                else:
                    works.append(dist.all_reduce(b.inp, group=ctx.group, async_op=True))
            for w in works:
                ctx.complete(w, call)
            for b, part in zip(buckets, parts):
                b.out.copy_(part[0])
                for k in range(1, ctx.num_ranks):
                    b.out.add_(part[k])
            if scale != 1.0:
                for b in buckets:
                    b.out.mul_(scale)
        for b in buckets:  # user tensors read or written on the comm stream
            for t in (b.stage_from, b.copy_to):
                if cuda and t is not None:
                    t.record_stream(stream)
        event = EventHandle(stream=stream) if cuda else EventHandle()

        def results():
            out = []
            for b in buckets:
                if b.copy_to is not None:
                    if b.copy_to.data_ptr() != b.result.data_ptr():
                        b.copy_to.view(-1).copy_(b.result.reshape(-1))
                    out.append(b.copy_to)
                else:
                    out.append(b.result)
            return out[0] if single else out
        return BucketEvent(event, results, num_sms)


def _bytes(t: Tensor) -> Tensor:
    return t.view(-1).view(torch.uint8)


def _as_list(c, name: str, xs) -> tuple:
    """`(list, single)`: one tensor becomes a one-element list."""
    if isinstance(xs, Tensor):
        return [xs], True
    if isinstance(xs, (list, tuple)):
        if not xs:
            c.fail(ValueError, f"{name} is an empty list; pass at least one bucket")
        return list(xs), False
    c.fail(TypeError, f"{name} must be a tensor or a list of tensors, got {type(xs).__name__}")


def _like(c, srcs: list, single: bool, dsts) -> list:
    """dsts must have the form of srcs: one tensor for one tensor, a list of the same length for a list."""
    if single:
        if not isinstance(dsts, Tensor):
            c.fail(TypeError, f"dsts must be a tensor when srcs is one tensor, got {type(dsts).__name__}")
        return [dsts]
    if not isinstance(dsts, (list, tuple)) or len(dsts) != len(srcs):
        got = f"a list of {len(dsts)}" if isinstance(dsts, (list, tuple)) else type(dsts).__name__
        c.fail(ValueError, f"dsts must be a list of {len(srcs)} tensors (one per src), got {got}")
    return list(dsts)

class BucketSession:
    """`with buffer.session() as s:` -- bucket collectives on tensors outside the storage (reference §14.3).

    Entering resets a bump allocator at the start of `storage` (the caller makes sure that region is free) and
    shadows `buffer.all_gather / reduce_scatter / all_reduce` with this session's methods; exiting restores
    them. Sessions do not nest, and every collective of one session uses the same group. Per input: a `src` in
    the storage is used in place (the buffer's rules); else, when its `dst` is in the storage, the staging area
    is derived from the `dst`; else a staging area is carved (64-byte granularity). Sources outside the storage
    are copied into their staging area. At `wait()`, results are copied into `dsts` that differ from the
    staging views; without `dsts` the staging views are returned (use them before the storage is reused).
    """

    def __init__(self, buffer: BucketBuffer):
        self.buffer = buffer
        self._offset = 0
        self._ctx: Optional[CommContext] = None
        self._open = False

    def __enter__(self) -> "BucketSession":
        b = self.buffer
        _, c = b._begin("BucketBuffer.session", b.groups[0] if b.groups else None)
        if b._session is not None:
            c.fail(ValueError, "a session is already open on this buffer; sessions do not nest")
        b._session, self._open, self._offset, self._ctx = self, True, 0, None
        b.all_gather, b.reduce_scatter, b.all_reduce = self.all_gather, self.reduce_scatter, self.all_reduce
        return self

    def __exit__(self, *exc) -> None:
        for name in ("all_gather", "reduce_scatter", "all_reduce"):
            self.buffer.__dict__.pop(name, None)
        self.buffer._session, self._open = None, False

    def _context(self, call: str, group):
        ctx, c = self.buffer._begin(call, group)
        if not self._open:
            c.fail(ValueError, "the session is closed; open one with `with buffer.session() as s:`")
        if self._ctx is None:
            self._ctx = ctx
        elif self._ctx is not ctx:
            c.fail(ValueError, f"all collectives of one session must use the same group: the session uses group "
                               f"#{self.buffer.contexts.index(self._ctx)}, this call group "
                               f"#{self.buffer.contexts.index(ctx)}")
        return ctx, c

    def _carve(self, c, nbytes: int) -> Tensor:
        start = sizing.align(self._offset, STAGING_ALIGNMENT)
        if start + nbytes > self.buffer.num_bytes:
            raise SessionOutOfStorage(
                f"{c.call}: rank {c.rank}: session out of storage: staging needs {nbytes} bytes at offset {start} "
                f"but the storage has {self.buffer.num_bytes}; use a larger BucketBuffer or fewer buckets per session")
        self._offset = start + nbytes
        return self.buffer.storage[start:start + nbytes]

    def allocate(self, shapes, dtype: torch.dtype = torch.float32, group: Optional[dist.ProcessGroup] = None):
        """Carve tensors from the session's storage (usable as in-storage inputs).

        Args:
            shapes: one shape (an int, tuple or `torch.Size`) or a list of shapes.
            dtype: element type. Default fp32.
            group: the session's group (sets it when it is the first use).

        Returns:
            One tensor for one shape, a tuple for a list; views into `storage` (64-byte aligned), not zeroed.

        Raises:
            TypeError: bad shapes. SessionOutOfStorage (a ValueError and a RuntimeError): they do not fit.
        """
        _, c = self._context("BucketSession.allocate", group)
        one = isinstance(shapes, int) or (isinstance(shapes, (tuple, list, torch.Size))
                                           and all(isinstance(d, int) for d in shapes))
        items = [shapes] if one else shapes
        if not isinstance(items, (list, tuple)):
            c.fail(TypeError, f"shapes must be a shape or a list of shapes, got {type(shapes).__name__}")
        out = []
        for shape in items:
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                c.fail(TypeError, f"shapes must hold non-negative ints, got {shape}")
            numel = math.prod(shape)
            out.append(self._carve(c, numel * dtype.itemsize).view(dtype).view(shape))
        return out[0] if one else tuple(out)

    def all_gather(self, srcs, dsts=None, group: Optional[dist.ProcessGroup] = None,
                   num_sms: Optional[int] = None) -> BucketEvent:
        """`BucketBuffer.all_gather` accepting tensors outside the storage; `dsts` must have `src.dtype`."""
        return self.buffer._gather_call(srcs, dsts, group, num_sms, self)

    def reduce_scatter(self, srcs, comm_precision: str = "fp32", scale: float = 1.0,
                       group: Optional[dist.ProcessGroup] = None, num_sms: Optional[int] = None, *,
                       dsts=None) -> BucketEvent:
        """`BucketBuffer.reduce_scatter` accepting tensors outside the storage; fp32 `dsts` of `src.nbytes / R`."""
        return self.buffer._reduce_call("reduce_scatter", srcs, dsts, comm_precision, scale, group, num_sms, self)

    def all_reduce(self, srcs, scale: float = 1.0, group: Optional[dist.ProcessGroup] = None,
                   num_sms: Optional[int] = None, *, dsts=None) -> BucketEvent:
        """`BucketBuffer.all_reduce` accepting tensors outside the storage; fp32 `dsts` of `src.nbytes`."""
        return self.buffer._reduce_call("all_reduce", srcs, dsts, "fp32", scale, group, num_sms, self)
