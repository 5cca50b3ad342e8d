"""The dispatch and combine data paths, top to bottom, over any transport.

dispatch: layout -> exchange counts (+ call header) -> (CPU sync) -> pack records -> move rows
          -> epilogue (compact, unpack, place) -> outputs + handle
combine:  per-rank partials / rows back -> move rows -> canonical reduce (+ bias) at the origin

Each path is split into `*_launch` (everything up to the row exchange; on the comm stream, or on the current
stream for a synchronous call: streams.CallOrder) and `*_finish` (the epilogue, which a deferred call runs at wait
time on the current stream). DeepEP V2.5 EPBuffer behaviour,
§9 and §11; orders and layouts as docs/decisions.md decision 4.

Shape legend (docs/shapes.md): T tokens, H hidden, K top-k, R ranks, L local experts, N capacity per rank,
M received rows, S expanded rows, X rows of a transfer buffer, B record bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from . import agreement, epilogue, layout, streams
from .debug import phase
from .kernels import canonical_reduce
from .kernels.launch import launch
from .kernels.reduce import canonical_reduce_chunks
from .moves import Route, return_weights, row_bytes
from .records import Field, RecordSpec, scatter_index
from .sizing import ceil_div, next_pow2
from .validate import XSpec


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a dispatch decided, replayed by cached dispatch and combine (kept in `EPHandle._plan`).

    Fields:
        exact: CPU-synced (exact output sizes) or sync-free (worst-case sizes).
        blocked: rows travel in per-rank blocks of `N` rows (sync-free, or a transport that writes rows straight
            into peers' receive areas); else packed back to back with exact splits.
        send_splits, recv_splits: host lists of rows to / from each rank (packed layout), else None.
        send_row_TR: [T, R] int64 -- row of the send (and combine-return) buffer for (token, rank), -1.
        send_src_X: [X] int64 -- token packed into each send row, -1 for holes.
        out_src_M: [M] int64 -- receive-buffer row of each output row, -1 past the valid extent.
        buf_out_X: [X'] int64 -- output row of each receive-buffer row, -1 for holes.
        src_rank_M: [M] int64 -- source rank of each output row, -1 past the valid extent.
        valid_M: [M] bool -- rows inside the valid extent.
        recv: the receiver-side `RecvLayout`.
        send: the sender-side `SendLayout`.
        pair_S: [S] int64 -- flat (row, position) placed at each expanded row, -1 (expand only).
        route: the packed layout's `Route` (fields move straight into their outputs), or None (records).
    """

    exact: bool
    blocked: bool
    send_splits: Optional[list]
    recv_splits: Optional[list]
    send_row_TR: Tensor
    send_src_X: Tensor
    out_src_M: Tensor
    buf_out_X: Tensor
    src_rank_M: Tensor
    valid_M: Tensor
    recv: layout.RecvLayout
    send: layout.SendLayout
    pair_S: Optional[Tensor]
    route: Optional[Route] = None
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # per-handle index tensors (_memo)


def _memo(plan: Plan, key, make):
    """`make()` once per handle: index tensors derived from the routing alone (topk_idx is version-guarded); not
    kept when made under CUDA-graph capture (`streams.memo`)."""
    return streams.memo(plan.cache, key, make)


@dataclass
class DispatchCall:
    """Resolved arguments of one dispatch (see `EPBuffer.dispatch` for their meaning)."""

    x: XSpec
    topk_idx: Tensor
    topk_weights: Optional[Tensor]
    stats: Optional[Tensor]
    num_experts: int
    n: int
    expert_alignment: int
    do_cpu_sync: bool
    do_expand: bool
    do_zero_padding: bool
    emit_expert_ids: bool
    col_major_sf: bool
    num_sms: int
    handle: Optional[object] = None
    call_id: int = 0  # this call's id (`EPBuffer._next_call_id`): a new handle keeps it (`EPHandle._dispatch_id`)

    def signature(self, op: int) -> dict:
        return dict(
            op=op, hidden=self.x.hidden, num_topk=self.topk_idx.shape[1], dtype=agreement.dtype_code(self.x.data.dtype),
            num_experts=self.num_experts, do_expand=self.do_expand, expert_alignment=self.expert_alignment,
            fp8=self.x.is_fp8, num_sf_packs=self.x.sf.shape[1] if self.x.is_fp8 else 0,
            sf_dtype=agreement.dtype_code(self.x.sf.dtype) if self.x.is_fp8 else 0,  # fp32 or packed UE8M0 int32
            num_max_tokens_per_rank=self.n, has_topk_weights=self.topk_weights is not None,
            do_cpu_sync=self.do_cpu_sync, handle=0 if self.handle is None else self.handle._dispatch_id,
        )


def _exclusive_cumsum(v: Tensor) -> Tensor:
    return v.cumsum(0) - v


def dispatch_record_spec(x: XSpec, num_topk: int, weights_dtype: Optional[torch.dtype], with_routing: bool):
    """Record of a dispatch row: data, scales, (routing: topk row, key), weights."""
    fields = [Field("x", x.data.dtype, (x.hidden,))]
    if x.is_fp8:
        fields.append(Field("sf", x.sf.dtype, (x.sf.shape[1],)))
    if with_routing:
        fields += [Field("topk", torch.int64, (num_topk,)), Field("g", torch.int64, ())]
    if weights_dtype is not None:
        fields.append(Field("w", weights_dtype, (num_topk,)))
    return RecordSpec(fields)


def _record_tensors(x: XSpec, weights: Optional[Tensor]) -> dict:
    return {"x": x.data, "sf": x.sf, "w": weights}


def _move_fields(tr, tensors: dict, route: Route, call_id: int, beside: tuple = ()) -> dict:
    """Packed layout: every given field lands in a fresh [route.num_recv, ...] tensor (moves.py). `beside`: local
    copies `(src, dst)` the transport may run while rows travel (`Transport.move_fields`)."""
    outs, moves = {}, []
    for name, t in tensors.items():
        if t is None:
            continue
        t = t.contiguous()
        outs[name] = torch.empty((route.num_recv,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        moves.append((t, outs[name]))
    with phase("move_rows"):
        tr.move_fields(moves, route, call_id=call_id, beside=beside)
    return outs


def _return_fields(tr, tensors: dict, route: Route, call_id: int, skip_own: bool) -> dict:
    """The combine direction of `_move_fields` (`Transport.return_fields`): `fields` may be views of the
    transport's memory, read by the combine's reduction before the next call; `ready` is None or one event per
    chunk of rows; `own` is None or `(row, {name: rows})`: rows `row ..` of each field are these rows of its
    source, left in place."""
    names = [name for name, t in tensors.items() if t is not None]
    srcs = [tensors[name].contiguous() for name in names]
    with phase("move_rows"):
        outs, ready, own = tr.return_fields(srcs, route, call_id=call_id, skip_own=skip_own)
    if own is not None:
        row, count, src_row = own
        own = (row, {name: src[src_row: src_row + count] for name, src in zip(names, srcs)})
    return dict(fields=dict(zip(names, outs)), ready=ready, own=own)


def _field(launched: dict, name: str, idx: Optional[Tensor] = None, holes: bool = False) -> Tensor:
    """Field `name` of the received rows `idx` (all when None; -1 gives zeros with `holes`), from the moved
    fields or the records."""
    fields = launched.get("fields")
    if fields is None:
        return launched["spec"].unpack(launched["recv_XB"], name, idx, holes)
    t = fields[name]
    return t if idx is None else epilogue.gather_rows(t, idx)


def _has(launched: dict, name: str) -> bool:
    fields = launched.get("fields")
    return name in fields if fields is not None else launched["spec"].has(name)


def _row_index(plan: "Plan", rows_Y: Tensor) -> Tensor:
    """Receive-buffer row of output rows `rows_Y` (-1 stays -1)."""
    if not plan.blocked:
        return rows_Y
    return (plan.out_src_M[rows_Y.clamp(min=0)]).masked_fill(rows_Y < 0, -1)


# ------------------------------------------------------------------------------------------------------------
# dispatch
# ------------------------------------------------------------------------------------------------------------
def dispatch_launch(buf, call: DispatchCall, call_id: int, local_error: Optional[BaseException]) -> dict:
    """Count exchange (all ranks raise together on bad input), then pack and move the records."""
    tr, num_ranks, device = buf.transport, buf.num_ranks, buf.device
    with phase("layout"):
        send = None if local_error else layout.send_layout(call.topk_idx, num_ranks, call.num_experts // num_ranks)
    signature = {} if local_error else call.signature(1)
    head = agreement.header(agreement.status_of(local_error), call_id, signature, buf.uid)
    send_RC = agreement.pack(head, None if send is None else send.num_tokens_per_rank_R, num_ranks, device)
    check_on_host = call is None or call.do_cpu_sync or device.type == "cpu"
    with phase("exchange_counts"):
        recv_RC = tr.exchange_counts(send_RC, wait=check_on_host, call_id=call_id, label="EPBuffer.dispatch")
        host_RC = recv_RC.tolist() if check_on_host else None
        if check_on_host:
            buf.agree("EPBuffer.dispatch", host_RC, local_error)
    if local_error is not None:  # sync-free on GPU: peers are left to their timeout (docs/decisions.md)
        raise local_error
    recv_counts_R = recv_RC[:, agreement.HEADER_LEN + buf.rank]
    send_counts_R = send.num_tokens_per_rank_R
    n = call.n
    blocked = tr.writes_blocks or not call.do_cpu_sync
    send_splits = recv_splits = None
    if not blocked:
        matrix = [row[agreement.HEADER_LEN:] for row in host_RC]  # [src][dst] rows, from the count exchange
        send_splits, recv_splits = list(matrix[buf.rank]), [row[buf.rank] for row in matrix]
        send_off_R = _exclusive_cumsum(send_counts_R)
        num_send, num_recv = sum(send_splits), sum(recv_splits)
    else:
        send_off_R = torch.arange(num_ranks, device=device) * n
        num_send = num_ranks * n
        num_recv = int(recv_counts_R.sum()) if call.do_cpu_sync else num_ranks * n
    send_row_TR, send_src_X = send_rows(send, send_off_R, num_send)
    tokens = torch.arange(call.x.num_tokens, device=device)
    tensors = _record_tensors(call.x, call.topk_weights)
    tensors.update(topk=call.topk_idx.long(), g=buf.rank * n + tokens)
    launched = dict(recv_counts_R=recv_counts_R, send=send, send_row_TR=send_row_TR, send_src_X=send_src_X,
                    send_splits=send_splits, recv_splits=recv_splits, num_recv=num_recv, blocked=blocked, route=None)
    if not blocked:
        launched["route"] = route = Route(send_splits, recv_splits, send_src_X, matrix)
        launched["fields"] = _move_fields(tr, tensors, route, call_id)
        return launched
    wdt = None if call.topk_weights is None else call.topk_weights.dtype
    spec = dispatch_record_spec(call.x, call.topk_idx.shape[1], wdt, with_routing=True)
    with phase("move_rows"):
        recv_XB = _push(tr, spec, tensors, send_src_X, n, call_id)
    return dict(launched, spec=spec, recv_XB=recv_XB)


def send_rows(send: layout.SendLayout, send_off_R: Tensor, num_send: int) -> tuple:
    """`(send_row_TR, send_src_X)`: the send row of each (token, rank), -1; the token of each send row, -1."""
    num_ranks = send_off_R.shape[0]
    send_row_TR = (send_off_R + send.token_slot_TR).masked_fill(send.token_slot_TR < 0, -1)
    send_src_X = scatter_index(send_row_TR.reshape(-1), num_send)
    send_src_X = (torch.div(send_src_X, num_ranks, rounding_mode="floor")).masked_fill(send_src_X < 0, -1)
    return send_row_TR, send_src_X


def _push(tr, spec: RecordSpec, tensors: dict, src_X: Tensor, cap: int, call_id: int) -> Tensor:
    """Blocked layout (sync-free calls): records in blocks of `cap` rows per rank (the transport may write them
    straight into peers). CPU-synced calls move fields instead (`_move_fields`)."""
    return tr.push_rows(spec, tensors, src_X, cap, call_id=call_id)


def _compaction(recv_counts_R: Tensor, blocked: bool, num_ranks: int, n: int, num_recv: int) -> tuple:
    """Map the receive buffer to `num_recv` output rows: (out_src_M, buf_out_X, src_rank_M, valid_M)."""
    device = recv_counts_R.device
    out_off_R = _exclusive_cumsum(recv_counts_R)
    if not blocked:
        rows = torch.arange(num_recv, device=device)
        src_rank = torch.repeat_interleave(torch.arange(num_ranks, device=device), recv_counts_R, output_size=num_recv)
        return rows, rows, src_rank, torch.ones(num_recv, dtype=torch.bool, device=device)
    b = torch.arange(num_ranks * n, device=device)
    s, k = torch.div(b, n, rounding_mode="floor"), b % n
    buf_out_X = (out_off_R[s] + k).masked_fill(k >= recv_counts_R[s], -1)
    out_src_M = scatter_index(buf_out_X, num_recv)
    valid_M = out_src_M >= 0
    src_rank_M = (torch.div(out_src_M, n, rounding_mode="floor")).masked_fill(~valid_M, -1)
    return out_src_M, buf_out_X, src_rank_M, valid_M


def dispatch_finish(buf, call: DispatchCall, launched: dict):
    """Epilogue of a non-cached dispatch: outputs and a new handle."""
    num_ranks, n, num_topk = buf.num_ranks, call.n, call.topk_idx.shape[1]
    num_local = call.num_experts // num_ranks
    exact, blocked = call.do_cpu_sync, launched["blocked"]
    out_src_M, buf_out_X, src_rank_M, valid_M = _compaction(
        launched["recv_counts_R"], blocked, num_ranks, n, launched["num_recv"])
    idx, holes = (out_src_M, not exact) if blocked else (None, False)
    topk_MK = _field(launched, "topk", idx, holes).masked_fill(~(valid_M.unsqueeze(1)), -1)
    g_M = _field(launched, "g", idx, holes)
    worst_s = None if exact else layout.worst_case_expanded_rows(num_ranks, n, num_topk, num_local,
                                                                 call.expert_alignment)
    with phase("recv_layout"):
        recv = layout.recv_layout(topk_MK, valid_M, buf.rank, num_local, call.expert_alignment, call.do_expand,
                                  worst_s)
        pair_S = epilogue.expanded_sources(recv.row_ptr_MK, recv.num_expanded_rows) if call.do_expand else None
    plan = Plan(exact=exact, blocked=blocked, send_splits=launched["send_splits"], recv_splits=launched["recv_splits"],
                send_row_TR=launched["send_row_TR"], send_src_X=launched["send_src_X"], out_src_M=out_src_M,
                buf_out_X=buf_out_X, src_rank_M=src_rank_M, valid_M=valid_M, recv=recv, send=launched["send"],
                pair_S=pair_S, route=launched["route"])
    with phase("place"):
        recv_x, recv_w = _place(call, launched, plan)
    # A fresh tensor: the plan keeps its own local ids.
    recv_topk_idx = None if call.do_expand else recv.local_idx_MK.to(call.topk_idx.dtype, copy=True)
    if call.stats is not None:
        call.stats += recv.num_unaligned_L.to(call.stats.dtype)
    with phase("handle"):
        handle = _make_handle(buf, call, plan, g_M, recv_counts_R=launched["recv_counts_R"])
    return recv_x, recv_topk_idx, recv_w, handle


def _place(call: DispatchCall, launched: dict, plan: Plan) -> tuple:
    """Data, scales and weights in the final layout: the moved fields themselves (packed non-expand), or one
    gather each from the receive buffer."""
    local_MK, num_rows = plan.recv.local_idx_MK, plan.out_src_M.shape[0]
    if call.do_expand and not plan.blocked and _places_in_one_launch(call, launched):
        from .recv_plan import field_sources, place  # one launch writes every expanded row once, zeros included

        fields = launched["fields"]
        return place(call, plan, field_sources(fields), with_weights="w" in fields)
    if call.do_expand:
        num_topk = local_MK.shape[1]
        src_S = (torch.div(plan.pair_S, num_topk, rounding_mode="floor")).masked_fill(plan.pair_S < 0, -1)
        idx, holes = _row_index(plan, src_S), True
    else:
        idx, holes = (plan.out_src_M, not plan.exact) if plan.blocked else (None, False)
    x = _field(launched, "x", idx, holes)
    sf = _field(launched, "sf", idx, holes) if _has(launched, "sf") else None
    w = None
    if _has(launched, "w"):  # docs/decisions.md: non-local columns hold 0
        w_MK = _field(launched, "w", plan.out_src_M if plan.blocked else None, not plan.exact)
        w = w_MK.masked_fill(_memo(plan, "nonlocal_MK", lambda: local_MK < 0), 0)
        if call.do_expand:
            w = epilogue.expand_weights(w, plan.pair_S)
    assert call.do_expand or x.shape[0] == num_rows
    recv_x = x if sf is None else (x, epilogue.place_sf(sf, call.col_major_sf))
    return recv_x, w


def _places_in_one_launch(call: DispatchCall, launched: dict) -> bool:
    """Expand layout from moved fields on a GPU, rows of whole 4-byte words: `recv_plan.place` (one kernel)
    rather than a gather and a fill per field over the expanded rows."""
    fields = launched.get("fields")
    return (fields is not None and fields["x"].is_cuda and fields["x"].shape[0] > 0
            and all(row_bytes(t) % 4 == 0 for t in fields.values()))


def _make_handle(buf, call: DispatchCall, plan: Plan, g_M: Tensor, recv_counts_R: Tensor):
    recv, alignment = plan.recv, call.expert_alignment
    aligned_L = torch.div(recv.num_unaligned_L + alignment - 1, alignment, rounding_mode="floor") * alignment
    if call.do_expand:
        psum_expert = recv.aligned_start_L + recv.num_unaligned_L
    else:
        psum_expert = aligned_L.cumsum(0)
    expert_ids = None
    if call.emit_expert_ids:
        flat_local = recv.local_idx_MK.reshape(-1)
        expert_ids = torch.where(plan.pair_S >= 0, flat_local[plan.pair_S.clamp(min=0)] if flat_local.numel()
                                 else plan.pair_S, -1).to(torch.int32)
    num_local = call.num_experts // buf.num_ranks
    return new_handle(
        buf, call, plan, num_recv_tokens_per_expert_list=aligned_L.tolist() if plan.exact else [],
        psum_rank=recv_counts_R.cumsum(0).to(torch.int32), psum_expert=psum_expert.to(torch.int32),
        unaligned=recv.num_unaligned_L.to(torch.int32),
        recv_src_metadata=epilogue.src_metadata(g_M, plan.src_rank_M, recv.local_idx_MK, recv.row_ptr_MK,
                                                plan.valid_M),
        dst_buffer_slot_idx=layout.dst_buffer_slot_idx(plan.send, call.topk_idx, num_local, call.n),
        recv_expert_ids=expert_ids)


def new_handle(buf, call: DispatchCall, plan: Plan, *, num_recv_tokens_per_expert_list: list, psum_rank: Tensor,
               psum_expert: Tensor, unaligned: Tensor, recv_src_metadata: Tensor, dst_buffer_slot_idx: Tensor,
               recv_expert_ids: Optional[Tensor]):
    """The `EPHandle` of a non-cached dispatch from its plan and the handle's own tensors (see `EPHandle`)."""
    from .handle import EPHandle

    return EPHandle(
        do_expand=call.do_expand, num_experts=call.num_experts, expert_alignment=call.expert_alignment,
        num_max_tokens_per_rank=call.n, num_sms=call.num_sms, num_recv_tokens=plan.out_src_M.shape[0],
        num_expanded_tokens=plan.recv.num_expanded_rows,
        num_recv_tokens_per_expert_list=num_recv_tokens_per_expert_list,
        psum_num_recv_tokens_per_scaleup_rank=psum_rank, psum_num_recv_tokens_per_expert=psum_expert,
        num_unaligned_recv_tokens_per_expert=unaligned, recv_src_metadata=recv_src_metadata,
        dst_buffer_slot_idx=dst_buffer_slot_idx, recv_expert_ids=recv_expert_ids,
        _topk_idx=call.topk_idx, _topk_idx_version=EPHandle.capture_version(call.topk_idx), _plan=plan,
        _buffer_uid=buf.uid, _dispatch_id=call.call_id,
    )


def cached_launch(buf, call: DispatchCall, call_id: int) -> dict:
    """Replay a handle's routing: pack data (+ weights) with the stored send order and move it."""
    plan: Plan = call.handle._plan
    if plan.route is not None:
        # The fresh recv_topk_idx is copied while the rows travel (nvlink in a graph: ~2 us less than after them).
        idx = None if call.do_expand else torch.empty_like(plan.recv.local_idx_MK, dtype=call.topk_idx.dtype)
        beside = () if idx is None else ((plan.recv.local_idx_MK, idx),)
        return dict(fields=_move_fields(buf.transport, _record_tensors(call.x, call.topk_weights), plan.route,
                                        call_id, beside), recv_topk_idx=idx)
    wdt = None if call.topk_weights is None else call.topk_weights.dtype
    spec = dispatch_record_spec(call.x, call.topk_idx.shape[1], wdt, with_routing=False)
    recv_XB = _push(buf.transport, spec, _record_tensors(call.x, call.topk_weights), plan.send_src_X, call.n,
                    call_id)
    return dict(spec=spec, recv_XB=recv_XB)


def cached_finish(buf, call: DispatchCall, launched: dict):
    plan: Plan = call.handle._plan
    recv_x, recv_w = _place(call, launched, plan)
    if "recv_topk_idx" in launched:  # copied while the rows travelled
        recv_topk_idx = launched["recv_topk_idx"]
    else:  # a fresh tensor: the plan keeps its own local ids
        recv_topk_idx = None if call.do_expand else plan.recv.local_idx_MK.to(call.topk_idx.dtype, copy=True)
    return recv_x, recv_topk_idx, recv_w, call.handle


# ------------------------------------------------------------------------------------------------------------
# combine
# ------------------------------------------------------------------------------------------------------------
@dataclass
class CombineCall:
    x: Tensor
    handle: object
    topk_weights: Optional[Tensor]
    bias_0: Optional[Tensor]
    bias_1: Optional[Tensor]
    per_pair: bool  # expand without multiple reduction: every (token, expert) row goes back on its own
    num_sms: int = 0  # SMs the reduction kernel may occupy (its grid); 0 = no cap

    def signature(self) -> dict:
        h = self.handle
        return dict(op=3, hidden=self.x.shape[1], num_topk=h.num_topk, dtype=agreement.dtype_code(self.x.dtype),
                    num_experts=h.num_experts, do_expand=h.do_expand, expert_alignment=h.expert_alignment,
                    num_max_tokens_per_rank=h.num_max_tokens_per_rank,
                    has_topk_weights=self.topk_weights is not None, do_cpu_sync=h._plan.exact,
                    handle=h._dispatch_id)


def combine_record_spec(x: Tensor, weights: Optional[Tensor], num_topk: int) -> RecordSpec:
    """Record of a row going back in combine: the row, then the weights of its top-k positions."""
    fields = [Field("x", x.dtype, (x.shape[1],))]
    if weights is not None:
        fields.append(Field("w", weights.dtype, (num_topk,)))
    return RecordSpec(fields)


def combine_launch(buf, call: CombineCall, call_id: int, defer: bool = False) -> dict:
    """Expert side: build the rows going back (partials or pairs) and move them to their origins. Unless the
    epilogue is deferred (`defer`: it may run after the caller has reused `x`), a transport may leave this rank's
    rows for itself in place, and the reduction reads them from `x` (or the partials)."""
    h, plan = call.handle, call.handle._plan
    num_topk, n, num_ranks = h.num_topk, h.num_max_tokens_per_rank, buf.num_ranks
    local_MK = plan.recv.local_idx_MK
    spec = combine_record_spec(call.x, call.topk_weights, num_topk)
    if call.per_pair:
        cap = None if plan.exact else n * min(num_topk, plan.recv.aligned_start_L.shape[0])
        send_src_X, counts_R = epilogue.pair_rows_by_source(plan.recv.row_ptr_MK, plan.src_rank_M, num_ranks, cap)
        send_XB = spec.pack({"x": call.x}, send_src_X, holes=not plan.exact)
        send_splits = counts_R.tolist() if plan.exact else None
        recv_splits = _pair_counts_at_origin(h, num_ranks).tolist() if plan.exact else None
    else:
        if h.do_expand:
            y_MH = epilogue.expert_partials(call.x, plan.recv.row_ptr_MK)
            w_MK = None
            if call.topk_weights is not None:
                w_MK = epilogue.gather_rows(call.topk_weights, plan.recv.row_ptr_MK.reshape(-1)).view_as(local_MK)
        else:
            y_MH = call.x
            w_MK = call.topk_weights
        # Weights travel back as given (rows of whole, contiguous columns): the origin reads only each owner's
        # columns (combine_finish, reference §11.4).
        if w_MK is not None:
            w_MK = w_MK.contiguous()
        if plan.route is not None:
            back = _memo(plan, "route_back", plan.route.back)
            return _return_fields(buf.transport, {"x": y_MH, "w": w_MK}, back, call_id, skip_own=not defer)
        with phase("move_rows"):
            recv_XB = _push(buf.transport, spec, {"x": y_MH, "w": w_MK}, plan.buf_out_X, n, call_id)
        return dict(spec=spec, recv_XB=recv_XB)
    with phase("move_rows"):
        recv_XB = buf.transport.combine_rows(send_XB, send_splits, recv_splits, call_id=call_id)
    return dict(spec=spec, recv_XB=recv_XB)


def _pair_counts_at_origin(h, num_ranks: int) -> Tensor:
    return layout.pair_slots(h._topk_idx, num_ranks, h.num_experts // num_ranks)[0]


def returned_item_rows(buf, h, per_pair: bool) -> Tensor:
    """[T, K] int64: the row of the combine-return buffer holding the item at each top-k position, -1 for none.

    Per pair: every (token, expert) row at its own position; else one row per (token, destination rank) at the
    largest top-k position on that rank (reference §11.2).
    """
    plan = h._plan
    topk_TK = h._topk_idx.long()
    num_tokens, num_topk = topk_TK.shape
    num_ranks, num_local = buf.num_ranks, h.num_experts // buf.num_ranks
    if per_pair:
        dest_TK = layout.dest_rank_of(topk_TK, num_local)
        counts_R, slot_TK = layout.pair_slots(topk_TK, num_ranks, num_local)
        if plan.exact:
            off_R = _exclusive_cumsum(counts_R)
        else:
            off_R = torch.arange(num_ranks, device=buf.device) * (h.num_max_tokens_per_rank * min(num_topk, num_local))
        return (off_R[dest_TK.clamp(min=0)] + slot_TK).masked_fill(slot_TK < 0, -1)
    last_TR, row_TR = plan.send.last_pos_TR, plan.send_row_TR
    item_TK = torch.full((num_tokens, num_topk + 1), -1, dtype=torch.int64, device=buf.device)
    item_TK.scatter_(1, torch.where(last_TR >= 0, last_TR, num_topk), row_TR)
    return item_TK[:, :num_topk]


def _left_packed(item_TK: Tensor, width: int) -> Tensor:
    """[T, width]: each row's items (not -1) moved to the front in their order, the rest -1. The reduction adds
    the same items in the same order, and reads `width` columns instead of K (one item per rank at most)."""
    if width >= item_TK.shape[1]:
        return item_TK
    order = torch.sort((item_TK < 0).to(torch.int8), dim=1, stable=True).indices
    return item_TK.gather(1, order)[:, :width].contiguous()


def _token_chunks(item_TP: Tensor, rows_R: Tensor, weights: tuple) -> tuple:
    """Tokens grouped by the chunk in which the last of their returned rows arrives (two Triton launches:
    `kernels/_token_chunks_triton.py`; this runs inside a CUDA graph on every replay).

    Returned rows come grouped by source rank, `rows_R[r]` from rank r, and chunk c of a source's n rows is
    `moves.chunk_bounds(n, weights)[c: c + 2]`, where `weights` are `moves.return_weights(C)`. A token is ready
    when its latest item is (chunk 0 without items).

    Args:
        item_TP: [T, P] int64 -- returned row of each of a token's items, -1 for none (rows with unit stride).
        rows_R: [R] int64 (device) -- rows returned by each rank: the tokens this rank sent it.
        weights: `moves.return_weights(C)`, `(E, .., E, 1)`.

    Returns:
        `(tokens_T [T] int64, bounds_C [C + 1] int64)`: chunk c's tokens are `tokens_T[bounds_C[c]:bounds_C[c+1]]`,
        ascending.
    """
    from .kernels import _token_chunks_triton as k

    chunks, num_tokens = len(weights), item_TP.shape[0]
    earlier = weights[0] if chunks > 1 else 1
    assert tuple(weights) == (earlier,) * (chunks - 1) + (1,), f"not a return push's chunk weights: {weights}"
    assert item_TP.shape[1] == 0 or item_TP.stride(1) == 1
    device = item_TP.device
    chunk_T = torch.empty(num_tokens, dtype=torch.int64, device=device)
    tokens_T = torch.empty(num_tokens, dtype=torch.int64, device=device)
    bounds_C = torch.empty(chunks + 1, dtype=torch.int64, device=device)
    block_t = 128
    launch(k.token_chunk, (max(1, ceil_div(num_tokens, block_t)),), item_TP, rows_R, chunk_T, num_tokens,
           item_TP.stride(0), item_TP.shape[1], rows_R.shape[0], chunks, earlier, BLOCK_T=block_t,
           P_POW2=next_pow2(max(item_TP.shape[1], 1)), num_warps=4)
    c_pow2 = next_pow2(chunks)
    launch(k.group_by_chunk, (1,), chunk_T, tokens_T, bounds_C, num_tokens, chunks,
           BLOCK=max(16, min(1024, 4096 // c_pow2)), C_POW2=c_pow2, num_warps=4)
    return tokens_T, bounds_C


def combine_finish(buf, call: CombineCall, launched: dict) -> tuple:
    """Origin side: the canonical reduction (bias first, then ascending position) and the weights back."""
    h, plan = call.handle, call.handle._plan
    fields = launched.get("fields")
    y_XH = fields["x"] if fields is not None else launched["spec"].view(launched["recv_XB"], "x")  # read in place
    num_tokens, num_topk = h._topk_idx.shape
    dest_TK = _memo(plan, "dest_TK", lambda: layout.dest_rank_of(h._topk_idx.long(), h.num_experts // buf.num_ranks))
    item_TK = _memo(plan, ("item_TK", call.per_pair), lambda: _left_packed(
        returned_item_rows(buf, h, call.per_pair), num_topk if call.per_pair else min(num_topk, buf.num_ranks)))
    ready, own = launched.get("ready"), launched.get("own")
    own_x = None if own is None else (own[1]["x"], own[0])  # my rows for myself, read where they are
    if ready is not None and y_XH.shape[0] and num_tokens:  # rows arrive in chunks: reduce each as it lands
        weights = return_weights(len(ready))  # the return push's chunks (transport/push_back.py)
        tokens_T, bounds_C = _memo(plan, ("token_chunks", weights), lambda: _token_chunks(
            item_TK, plan.send.num_tokens_per_rank_R, weights))  # rows back from rank r: tokens sent to r
        combined_x = canonical_reduce_chunks(y_XH, item_TK, call.bias_0, call.bias_1, call.x.dtype,
                                             tokens_T=tokens_T, bounds_C=bounds_C, ready=ready, num_sms=call.num_sms,
                                             own=own_x)
    else:
        for event in ready or ():
            torch.cuda.current_stream(buf.device).wait_event(event)
        combined_x = canonical_reduce(y_XH, item_TK, call.bias_0, call.bias_1, out_dtype=call.x.dtype,
                                      num_sms=call.num_sms, own=own_x)
    combined_w = None
    if call.topk_weights is not None:
        w_XK = fields["w"] if fields is not None else launched["spec"].view(launched["recv_XB"], "w")
        if own is not None:  # a few bytes per row: fill my rows in (my part of the area is mine alone)
            w_XK[own[0]: own[0] + own[1]["w"].shape[0]].copy_(own[1]["w"])
        if w_XK.shape[0]:
            # Flat index of (row of the token's rank, position) in the returned weights: the owner's column only;
            # -1 positions read 0.
            flat_TK = _memo(plan, ("w_flat", num_topk), lambda: (
                plan.send_row_TR.gather(1, dest_TK.clamp(min=0)).clamp(min=0) * num_topk
                + torch.arange(num_topk, device=buf.device)))
            combined_w = w_XK.reshape(-1)[flat_TK].masked_fill(_memo(plan, "unrouted_TK", lambda: dest_TK < 0), 0)
        else:
            combined_w = torch.zeros(num_tokens, num_topk, dtype=w_XK.dtype, device=buf.device)
    return combined_x, combined_w
