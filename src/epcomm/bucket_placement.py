"""Placement and launch of bucket collectives, shared by `BucketBuffer` and `BucketSession` (DeepEP V2.5
behaviour, §14).

* `gather_call` / `reduce_call`: check every bucket of a call before any data moves, then decide what each
  collective runs on and what each result is a view of (the placement rules; docs/collectives.md has the table).
  Outside a session (`session=None`) inputs live in the buffer's storage and are used in place; inside one, a
  source outside the storage is staged into its in-storage `dst` (all-reduce; an all-gather gathers into it) or
  into an area the session carves.
* `_launch`: one `torch.distributed` collective per bucket on the bucket's own bytes, in place, on the buffer's
  communication stream (CUDA) or now (CPU); results equal `all_gather_into_tensor` / `reduce_scatter_tensor` /
  `all_reduce` by construction. The returned `BucketEvent`'s first `wait()` gives the results.

Shape legend (docs/shapes.md): R ranks of the bucket's group.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .agreement import STATUS_OK, STATUS_TYPE, digest, gather_messages, rejected, status_of
from .comm import CommContext
from .events import EventHandle, EventOverlap
from .validate import warn_caller

if TYPE_CHECKING:
    from .bucket import BucketBuffer
    from .bucket_session import BucketSession

__all__ = ["BucketEvent", "gather_call", "reduce_call"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
    carved: bool = False  # session: `out` is an area the session carved (reused by the next session)


def _open_call(buf: BucketBuffer, session: Optional[BucketSession], call: str, group) -> tuple:
    """`(ctx, checker, err)` of a call. A lookup that fails on this rank (a group that is not the buffer's, a closed
    session, a group other than the session's) comes back as `err` with the buffer's only group, so that the call
    still meets its peers' header and every rank raises; with several groups the peers' group is unknown, and the
    rank raises alone."""
    try:
        ctx, c = session._context(call, group) if session else buf._begin(call, group)
        return ctx, c, None
    except ValueError as e:
        if len(buf.contexts) != 1:
            raise
        return buf.contexts[0], buf.contexts[0].checker(call), e


def _check_disjoint(c, buf: BucketBuffer, buckets: list, names: list) -> None:
    """The storage bytes each bucket's collective reads or writes, and the `dsts` its result is copied into at
    `wait()` (in the storage or outside it), must be its own: the collectives of one call run concurrently (the same
    bucket twice, or overlapping buckets, would race), and a copy into bytes of another bucket's result would
    overwrite it."""
    spans, outside = [], []  # (start, end, bucket index, name): storage offsets; addresses of dsts outside it
    for i, b in enumerate(buckets):
        dst_name = names[i].replace("srcs", "dsts")
        # A staged src's collective runs in its staging: a carved area, or its dst's bytes (an in-storage dst).
        inp_name = names[i] if b.stage_to is None else (f"{names[i]}'s staging" if b.carved
                                                         else f"{dst_name} (the staging of {names[i]})")
        for name, t in ((inp_name, b.inp), (inp_name, b.out), (dst_name, b.copy_to)):
            off = None if t is None else buf.offset_of(t)
            if off is not None:
                spans.append((off, off + t.nbytes, i, name))
            elif t is not None and t is b.copy_to:
                outside.append((t.data_ptr(), t.data_ptr() + t.nbytes, i, name))
    clash = _first_overlap(spans)
    if clash is not None:
        (a0, e0, i0, n0), (a1, e1, i1, n1) = clash
        carved = [names[i] for i in (i0, i1) if buckets[i].carved]
        staged = (f"; {carved[0]} is staged in an area the session carved from the start of the storage, "
                  "which must hold no bucket of the call") if carved else ""
        c.fail(ValueError, f"{n0} and {n1} overlap in the storage (bytes [{a0}, {e0}) and [{a1}, {e1})); the "
                           "buckets of one call run at once, so each needs bytes of its own: pass a bucket once, "
                           f"or make the calls one after the other{staged}")
    clash = _first_overlap(outside)
    if clash is not None:
        (_, _, _, n0), (_, _, _, n1) = clash
        c.fail(ValueError, f"{n0} and {n1} share memory; each bucket's result is copied into its own dst at wait(), "
                           "so one would overwrite the other: pass a tensor of its own to each")


def _first_overlap(spans: list) -> Optional[tuple]:
    """The first two `(start, end, bucket, name)` spans of different buckets whose byte ranges overlap, or None."""
    spans = sorted(spans)
    for k, (a0, e0, i0, n0) in enumerate(spans):
        for a1, e1, i1, n1 in spans[k + 1:]:
            if a1 >= e0:
                break
            if i1 != i0:
                return (a0, e0, i0, n0), (a1, e1, i1, n1)
    return None


def gather_call(buf: BucketBuffer, srcs, dsts, group, num_sms, session: Optional[BucketSession]) -> BucketEvent:
    """`all_gather` of `buf` (session None) or of `session`: check every bucket, place it, launch."""
    call = "BucketBuffer.all_gather"
    ctx, c, err = _open_call(buf, session, call, group)
    try:
        if err is not None:
            raise err
        srcs_l, single = _as_list(c, "srcs", srcs)
        dsts_l = [None] * len(srcs_l) if dsts is None else _like(c, srcs_l, single, dsts)
        if num_sms:
            c.fail(ValueError, f"num_sms must be None or 0 for all_gather (copy-engine driven), got {num_sms}")
        names = ["srcs" if single else f"srcs[{i}]" for i in range(len(srcs_l))]
        buckets = [_gather_bucket(buf, c, ctx, name, s, d, session) for name, s, d in zip(names, srcs_l, dsts_l)]
        _check_disjoint(c, buf, buckets, names)
    except (Exception, KeyboardInterrupt) as e:  # a bad argument, out of memory, ...: it travels in the header
        err = e
    _header(ctx, call, "all_gather", err, None if err is not None else [b.inp.nbytes for b in buckets])
    return _launch(buf, ctx, call, "all_gather", buckets, 1.0, 0, single)


def _gather_bucket(buf: BucketBuffer, c, ctx, name: str, src, dst, session) -> _Bucket:
    r, R = ctx.rank, ctx.num_ranks
    dname = name.replace("srcs", "dsts")
    src = _check_tensor(buf, c, name, src)
    if dst is not None:
        dst = _check_tensor(buf, c, dname, dst)
        _check_contiguous(c, dname, dst)
        if session is not None and dst.dtype != src.dtype:
            c.fail(TypeError, f"{dname} must have the src's dtype {src.dtype} in a session, got {dst.dtype}")
        if dst.nbytes != R * src.nbytes:
            c.fail(ValueError, f"{dname} must have {R} x {name}.nbytes = {R * src.nbytes} bytes, got "
                               f"{dst.nbytes}")
    src_off, dst_off = buf.offset_of(src), None if dst is None else buf.offset_of(dst)
    if dst_off is not None:  # gather straight into dst; src may be anywhere
        out = buf.storage[dst_off:dst_off + dst.nbytes]
        sptr, dptr = src.data_ptr(), dst.data_ptr()
        if src_off is not None and sptr < dptr + dst.nbytes and dptr < sptr + src.nbytes \
                and sptr != dptr + r * src.nbytes:
            c.fail(ValueError, f"{name} overlaps {dname} but is not its rank-th (rank {r}) shard (byte offset "
                               f"{sptr - dptr}, expected {r * src.nbytes}); use the local shard or another tensor")
        if session is None or src.is_contiguous():
            _check_contiguous(c, name, src)
            return _Bucket(inp=_bytes(src), out=out, result=dst)
        shard = out[r * src.nbytes:(r + 1) * src.nbytes]
        return _Bucket(inp=shard, out=out, result=dst, stage_from=src,
                       stage_to=shard.view(src.dtype).view(src.shape))
    if dst is not None and session is None:
        _in_storage(buf, c, dname, dst)  # raises: dsts live in the storage outside a session
    if src_off is not None and dst is None:  # in place: src is the rank-th shard of the gathered region (with a
        # dst outside the storage, a session carves instead: gathering around src would write the bytes next to it)
        _check_contiguous(c, name, src)
        start, end = src_off - r * src.nbytes, src_off + (R - r) * src.nbytes
        if start < 0 or end > buf.num_bytes:
            c.fail(ValueError, f"{name} must be the rank-th (rank {r}) shard of a gathered tensor inside the "
                               f"storage: the gathered bytes would span [{start}, {end}) but the storage has "
                               f"{buf.num_bytes}; move the bucket or pass dsts")
        out = buf.storage[start:end]
        return _Bucket(inp=_bytes(src), out=out, result=out.view(src.dtype), copy_to=dst)
    if session is None:
        _in_storage(buf, c, name, src)  # raises
    out = session._carve(c, R * src.nbytes)
    shard = out[r * src.nbytes:(r + 1) * src.nbytes]
    return _Bucket(inp=shard, out=out, result=out.view(src.dtype), stage_from=src,
                   stage_to=shard.view(src.dtype).view(src.shape), copy_to=dst, carved=True)


def reduce_call(buf: BucketBuffer, op: str, srcs, dsts, comm_precision, scale, group, num_sms,
                session: Optional[BucketSession]) -> BucketEvent:
    """`reduce_scatter` / `all_reduce` (`op`) of `buf` (session None) or of `session`: check, place, launch."""
    call = f"BucketBuffer.{op}"
    ctx, c, err = _open_call(buf, session, call, group)
    try:
        if err is not None:
            raise err
        buckets, single, sms = _reduce_buckets(buf, c, ctx, op, srcs, dsts, comm_precision, scale, num_sms, session)
    except (Exception, KeyboardInterrupt) as e:  # as all_gather
        err = e
    _header(ctx, call, op, err, None if err is not None else [b.inp.nbytes for b in buckets],
            scale if err is None else 1.0)
    return _launch(buf, ctx, call, op, buckets, float(scale), sms, single)


def _reduce_buckets(buf: BucketBuffer, c, ctx, op: str, srcs, dsts, comm_precision, scale, num_sms,
                    session: Optional[BucketSession]) -> tuple:
    """`reduce_call`'s checks and placement: `(buckets, single, num_sms)`."""
    srcs_l, single = _as_list(c, "srcs", srcs)
    dsts_l = [None] * len(srcs_l) if dsts is None else _like(c, srcs_l, single, dsts)
    sms = _reduction_options(buf, c, ctx, op, comm_precision, scale, num_sms)
    r, R = ctx.rank, ctx.num_ranks
    shards_out = R if op == "reduce_scatter" else 1
    buckets, names = [], ["srcs" if single else f"srcs[{i}]" for i in range(len(srcs_l))]
    for name, src, dst in zip(names, srcs_l, dsts_l):
        dname = name.replace("srcs", "dsts")
        src = _check_tensor(buf, c, name, src)
        if src.dtype != torch.float32:
            c.fail(TypeError, f"{name} must be torch.float32, got {src.dtype}")
        if src.nbytes % (R * 32):
            c.fail(ValueError, f"{name} has {src.nbytes} bytes; it must be a multiple of R x 32 = {R * 32} "
                               "(R ranks, 32-byte shards)")
        if dst is not None:
            dst = _check_tensor(buf, c, dname, dst)
            if dst.dtype != torch.float32:
                c.fail(TypeError, f"{dname} must have the src's dtype torch.float32, got {dst.dtype}")
            _check_contiguous(c, dname, dst)
            if dst.nbytes * shards_out != src.nbytes:
                c.fail(ValueError, f"{dname} must have {src.nbytes // shards_out} bytes, got {dst.nbytes}")
        n = src.numel() // shards_out
        stage = None
        if session is None or buf.offset_of(src) is not None:  # in place
            _check_contiguous(c, name, src)
            off = _in_storage(buf, c, name, src)
            if off % 32:
                c.fail(ValueError, f"{name} starts at storage byte {off}; it must start on a 32-byte boundary")
            flat = src.view(-1)
        else:  # stage: an all-reduce's in-storage dst (as large as src), else carved (a reduce-scatter's dst holds
            # only its shard: staging around it would write the bytes next to it)
            flat, dst_off = None, None if dst is None or op != "all_reduce" else buf.offset_of(dst)
            if dst_off is not None and dst_off % 32 == 0:
                flat = buf.storage[dst_off:dst_off + src.nbytes].view(torch.float32)
            carved = flat is None
            flat = session._carve(c, src.nbytes).view(torch.float32) if carved else flat
            stage = flat.view(src.shape)
        out = flat[r * n:(r + 1) * n] if op == "reduce_scatter" else flat
        result = out if op == "reduce_scatter" else src if stage is None else stage
        same = dst is not None and dst.data_ptr() == out.data_ptr()
        # wait() copies `result` into dst: onto itself, shifted, if they overlap. A staged src (outside the
        # storage) may be its own dst (`dsts=src`): its bytes were copied into the staging at the call.
        if dst is not None and not same and dst.data_ptr() < result.data_ptr() + result.nbytes and \
                result.data_ptr() < dst.data_ptr() + dst.nbytes:
            c.fail(ValueError, f"{dname} overlaps {name} but is not its in-place result (the {op} result of "
                               f"{name} is {'its rank-th shard' if op == 'reduce_scatter' else name + ' itself'}); "
                               "pass that view or a tensor of its own")
        buckets.append(_Bucket(inp=flat, out=out, result=dst if same else result, stage_to=stage,
                               stage_from=None if stage is None else src,
                               copy_to=dst if dst is not None and not same else None,
                               carved=stage is not None and carved))
    _check_disjoint(c, buf, buckets, names)
    return buckets, single, sms


_OPS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3}


def _header(ctx: CommContext, call: str, op: str, err: Optional[BaseException], sizes: Optional[list],
            scale: float = 1.0) -> None:
    """`_agree`, then raise `err` (this rank's own error before the header, which every rank saw there) if any. An
    error of this rank's own while it waits in the exchange (an interrupt, ...) breaks the buffer and its group
    and reaches the peers (`CommContext.fail_mid_call`): they may be in the exchange without it."""
    try:
        _agree(ctx, call, op, err, sizes or [], scale)
    except (Exception, KeyboardInterrupt) as e:  # `err` is raised once every rank saw it (on GPU: at once, locally)
        ctx.after_agreement(call, e, err=err, every_rank=(TypeError, ValueError))


def _agree(ctx: CommContext, call: str, op: str, err: Optional[BaseException], sizes: list,
           scale: float = 1.0) -> None:
    """On CPU, a header before any data moves (status, operation, bucket sizes, the buffer's id, a reduction's
    `scale`: applied after the sum, so ranks that differ would get different results of one all-reduce), so that a
    rank's failed check or ranks passing different calls, sizes, scales or buffers raise on every rank instead of
    breaking the collective or returning results that differ. On GPU the checks stay local, as for EPBuffer's calls
    without a count exchange (docs/decisions.md)."""
    if ctx.device.type != "cpu":
        if err is not None:
            raise err
        return
    scale_bits = struct.unpack("<q", struct.pack("<d", float(scale)))[0]
    row = [status_of(err), _OPS[op], len(sizes), sum(sizes), digest(sizes), ctx.uid, scale_bits]
    rows = ctx.exchange(torch.tensor([row] * ctx.num_ranks, dtype=torch.int64), f"{call} header",
                        kind="BucketBuffer header", label=call).tolist()
    failed = [r for r, got in enumerate(rows) if got[0] != STATUS_OK]
    if failed:
        messages = gather_messages(lambda t: ctx.exchange(t, f"{call} messages", kind="error messages", label=call),
                                   str(err) if err is not None else "",
                                   ctx.num_ranks, torch.device("cpu"))
        if err is not None:
            raise err
        exc = TypeError if rows[failed[0]][0] == STATUS_TYPE else ValueError
        raise exc(rejected(call, ctx.rank, failed, messages, group=ctx.group))
    if len({got[5] for got in rows}) > 1:  # two BucketBuffers (or contexts) on one group: the calls paired
        ctx.take_back_call_id()
        same = [r for r, got in enumerate(rows) if got[5] == ctx.uid]
        raise ValueError(f"{call}: rank {ctx.rank}: ranks are in calls of different BucketBuffers on this group "
                         f"(group ranks {same} in this one); every rank must call the same buffer in the same order")
    names = {v: k for k, v in _OPS.items()}
    for i, what in ((1, "operation"), (2, "number of buckets"), (3, "total bytes"), (4, "bucket sizes")):
        values = [got[i] for got in rows]
        if len(set(values)) > 1:
            shown = [names.get(v, "?") for v in values] if i == 1 else values
            desc = ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown))
            raise ValueError(f"{call}: rank {ctx.rank}: ranks disagree on the {what} ({desc}); every rank of the "
                             "group must make the same call with buckets of the same sizes")
    if len({got[6] for got in rows}) > 1:  # by bits: -0.0 and 0.0 give results that differ in the sign of zero
        scales = [struct.unpack("<d", struct.pack("<q", got[6]))[0] for got in rows]
        desc = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(scales))
        raise ValueError(f"{call}: rank {ctx.rank}: ranks disagree on scale ({desc}); the sum is scaled after the "
                         "reduction, so every rank must pass the same scale")


def _reduction_options(buf: BucketBuffer, c, ctx, op: str, comm_precision: str, scale, num_sms) -> int:
    if ctx.num_ranks == 1:
        c.fail(ValueError, f"{op} needs a group of at least 2 ranks (reductions on one-rank groups are not "
                           "supported, as in the reference)")
    if comm_precision != "fp32":
        c.fail(ValueError, f"comm_precision must be 'fp32', got {comm_precision!r} (the reference's 'bf16' needs "
                           "a pure-RDMA group; epcomm's collective path reduces in fp32)")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        c.fail(TypeError, f"scale must be a float, got {type(scale).__name__}")
    try:
        finite = math.isfinite(scale)
    except OverflowError:  # an int past the float range
        finite = False
    if not finite:
        c.fail(ValueError, f"scale must be finite, got {scale}")
    if num_sms is None:
        return buf.get_theoretical_num_sms(op, ctx.group)
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms <= 0:
        c.fail(ValueError, f"num_sms must be > 0 or None (the model's value) for {op}, got {num_sms}")
    if buf.device.type == "cpu" and "num_sms" not in buf._warned:
        buf._warned.add("num_sms")
        warn_caller("epcomm: num_sms has no effect on CPU; it is ignored")
    return num_sms


def _in_storage(buf: BucketBuffer, c, name: str, t: Tensor) -> int:
    off = buf.offset_of(t)
    if off is None:
        c.fail(ValueError, f"{name} must belong to this BucketBuffer (a view of buffer.storage, {buf.num_bytes} "
                           "bytes); use tensors carved from buffer.storage or open buffer.session()")
    return off


def _check_tensor(buf: BucketBuffer, c, name: str, t) -> Tensor:
    if not isinstance(t, Tensor):
        c.fail(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:  # sparse, mkldnn, ...: buckets are strided memory
        c.fail(TypeError, f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.device.type != buf.device.type or (buf.device.index is not None and t.device != buf.device):
        c.fail(ValueError, f"{name} is on {t.device} but the buffer lives on {buf.device}; move it there")
    if t.numel() == 0:
        c.fail(ValueError, f"{name} is empty; buckets must hold at least one element")
    if t.is_conj() or t.is_neg():  # its bytes are not its values: byte moves would drop the lazy operation
        c.fail(ValueError, f"{name} is a lazily conjugated or negated view; call .resolve_conj() / .resolve_neg()")
    return t


def _check_contiguous(c, name: str, t: Tensor) -> None:
    if not t.is_contiguous():
        c.fail(ValueError, f"{name} must be contiguous (got strides {tuple(t.stride())})")


def _launch(buf: BucketBuffer, ctx: CommContext, call: str, op: str, buckets: list, scale: float, num_sms: int,
            single: bool) -> BucketEvent:
    """Run the buckets' collectives on the comm stream (CUDA) or now (CPU); the event returns the results. An error
    of this rank's own on the way (out of memory, ...) breaks the buffer and its group and reaches the peers' waits
    (`CommContext.fail_mid_call`); a timeout has already broken them."""
    try:
        return _move(buf, ctx, call, op, buckets, scale, num_sms, single)
    except (Exception, KeyboardInterrupt) as e:
        ctx.after_agreement(call, e)


def _move(buf: BucketBuffer, ctx: CommContext, call: str, op: str, buckets: list, scale: float, num_sms: int,
          single: bool) -> BucketEvent:
    cuda = buf.device.type == "cuda"
    stream = ctx.comm_stream
    if cuda:
        stream.wait_stream(torch.cuda.current_stream(buf.device))
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
    event = EventHandle(stream=stream) if cuda else EventHandle.completed()
    # Carved staging belongs to its session: the next session carves the same bytes again.
    session_number = buf._sessions_opened if any(b.carved for b in buckets) else None

    def results():
        if session_number is not None and buf._sessions_opened != session_number:
            raise ValueError(f"{call}: rank {ctx.rank}: the first wait() of this call came after a later session "
                             "reused the staging area its results were in; wait for a session's events before the "
                             "next session opens (or give it dsts inside the storage)")
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
