"""The fused CPU-synced dispatch on the nvlink transport: `dispatch(do_cpu_sync=True)` with its layouts made by a
few kernels and one host read.

The generic CPU-synced path (pipeline.py) builds the layouts with ~130 small torch kernels and reads the device
three times (the value checks of `topk_idx`, the count exchange, the per-expert counts): 2.7-2.9 ms per call at
dsv3 4096 tokens on 2x H200 (eager), where a cached dispatch on its handle takes ~0.45 ms; this path takes ~1.2 ms
(benchmarks/results/dsv3-s8_2xH200-NV18_2026-11-30.md). This module does the same
call as:

    send_plan (layout, routing field, counts, value flags; its last program publishes: barrier, rows into the
        peers, barrier, the received rows into pinned host memory) -> host read -> pull of the data, scales and
        routing fields (transport/pull.py, as the generic path; its gather runs the barrier) -> dispatch_plan_rows
        (its last program writes the per-expert totals without expand) (-> dispatch_plan_experts ->
        dispatch_place with expand)

with the kernels of `kernels/_exact_triton.py` and the receive-side plan kernels the fused sync-free path uses
(`kernels/_syncfree_triton.py`, here on rows packed by source). The row each rank publishes to a peer carries the
call header, its counts to every rank, its (token, expert) pairs for each of the peer's local experts and two
value flags; the routing field carries each token's top-k ids, key and weights. The table the rows are published
from stays on the device between calls (the transport's `exact_table`, zeroed by the publish kernel), the header
comes from a device copy made once per signature, and the plan kernels read the counts where the peers wrote them,
so that the host makes no copy of its own (eager calls on the H200 hosts are bound by host time). So the one host
read gives every size (rows from each rank, per-expert counts, expanded rows) and
every error: a bad `topk_idx` value raises the generic path's ValueError on the rank that holds it, and the
peers' calls raise naming it, before any row moves. Outputs, handle and plan are the generic path's, value for
value; tests/kernels/exact_sim.py checks every field under the interpreter and the GPU tests compare both paths.

`EPBuffer.dispatch` takes it on nvlink for a CPU-synced dispatch with rows of whole 4-byte words and at most 1024
local experts, unless `EPCOMM_FUSED_EXACT=0`.

Shape legend (docs/shapes.md): T tokens, K top-k, R ranks, L local experts, N num_max_tokens_per_rank, M received
rows, S expanded rows.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from . import agreement, envs, epilogue, pipeline, recv_plan
from .debug import phase
from .kernels.launch import launch
from .layout import SendLayout
from .moves import Route
from .sizing import ceil_div, next_pow2
from .validate import Checker, check_topk_values

_TOKEN_ELEMS = 4096  # [tokens, top-k, max(top-k, ranks)] elements of a send_plan program's own chunk
_COUNT_ELEMS = 16384  # [tokens, top-k, ranks] elements per step of its count of the tokens before the chunk
_NUM_FLAGS = 2  # an id outside [-1, num_experts); an expert twice in a token
MAX_LOCAL_EXPERTS = 1024  # a published row holds a count per local expert (transport/nvlink.py: 1088 columns)


def enabled(buf) -> bool:
    """nvlink with `EPCOMM_FUSED_EXACT` on: `resolve` leaves the value checks of `topk_idx` to the device (the
    caller runs them on the host for a call that then takes the generic path)."""
    return getattr(buf.transport, "name", None) == "nvlink" and envs.fused_exact()


def _cols(num_ranks: int, num_local: int) -> int:
    """Columns of a published row: header, counts to every rank, per-expert pairs, flags."""
    return agreement.HEADER_LEN + num_ranks + num_local + _NUM_FLAGS


def applies(buf, call: pipeline.DispatchCall) -> bool:
    """Whether `dispatch` takes this path for a (resolved, valid, non-cached) call."""
    x = call.x.data
    return (call.do_cpu_sync and call.handle is None and enabled(buf)
            and (x.shape[1] * x.element_size()) % 4 == 0
            and rows_fit(buf.num_ranks, call.num_experts // buf.num_ranks, buf.transport.header_cols))


def rows_fit(num_ranks: int, num_local: int, header_cols: int) -> bool:
    """At most MAX_LOCAL_EXPERTS local experts, and a published row within the transport's `header_cols`."""
    return 0 < num_local <= MAX_LOCAL_EXPERTS and _cols(num_ranks, num_local) <= header_cols


def call_header(call: pipeline.DispatchCall, call_id: int, buffer_uid: int) -> list:
    """The agreement header of this path's call: `fused_exact` in the signature, so that a peer on the generic path
    (another EPCOMM_FUSED_EXACT) fails the agreement rather than leaving stale columns where this path reads
    per-expert counts."""
    return agreement.header(agreement.STATUS_OK, call_id, call.signature(1) | {"fused_exact": 1}, buffer_uid)


_HEADS: dict = {}  # (device index, header) -> the header on that device (header_row)


def header_row(call: pipeline.DispatchCall, buffer_uid: int, device: torch.device) -> Tensor:
    """[HEADER_LEN] int64 on `device`: `call_header` with call id 0 (send_plan writes the call's id), copied to the
    device once per signature rather than once per call."""
    head = call_header(call, 0, buffer_uid)
    key = (device.index, tuple(head))
    row = _HEADS.get(key)
    if row is None:
        if len(_HEADS) >= 256:  # a bound for programs that try many shapes
            _HEADS.clear()
        row = _HEADS[key] = torch.tensor(head, dtype=torch.int64, device=device)
    return row


def routing_cols(num_topk: int, weights: Optional[Tensor]) -> int:
    """int64 columns of a routing row: top-k ids, token key, then the weights' bits (fp32 pairs or fp64)."""
    return num_topk + 1 + (0 if weights is None else ceil_div(num_topk * weights.element_size(), 8))


def send_plan(call: pipeline.DispatchCall, rank: int, num_ranks: int, call_id: int, head: Tensor,
              ex: Tensor, publish: Optional[dict] = None) -> dict:
    """Launch `send_plan`: the sender-side layout, the routing field, and the rows to publish in `ex` ([R, C'] int64,
    zero, C' >= `_cols`), headed by `head` (`header_row`) with `call_id`; with `publish` (the transport's
    `publish_args`) the kernel publishes them too, unless there are no tokens (then nothing is launched):
    `published` in the result says whether it did."""
    from .kernels import _exact_triton as k

    topk = call.topk_idx if call.topk_idx.stride(1) == 1 else call.topk_idx.contiguous()
    w = call.topk_weights
    if w is not None and w.stride(1) != 1:
        w = w.contiguous()
    num_tokens, num_topk = topk.shape
    num_local, device = call.num_experts // num_ranks, topk.device
    # send_src: the first `sum(counts)` rows are the send rows; routing: top-k ids, token key and weights.
    token_slot_TR, last_pos_TR, send_row_TR, send_src, routing, counts_R = recv_plan.carve(
        torch.int64, device, (num_tokens, num_ranks), (num_tokens, num_ranks), (num_tokens, num_ranks),
        (num_tokens * num_ranks,), (num_tokens, routing_cols(num_topk, w)), (num_ranks,))
    dst_slot_TK = torch.empty(num_tokens, num_topk, dtype=torch.int32, device=device)
    k_pow2, r_pow2 = next_pow2(num_topk), next_pow2(num_ranks)
    tc = max(16, min(128, _TOKEN_ELEMS // (k_pow2 * max(k_pow2, r_pow2))))  # powers of 2 throughout
    tl_ = max(tc, min(1024, _COUNT_ELEMS // (k_pow2 * r_pow2)))  # tokens per step of the count loop
    if num_tokens:
        launch(k.send_plan, (ceil_div(num_tokens, tc),),
            topk, topk if w is None else recv_plan.as_bits(w), token_slot_TR, last_pos_TR, send_row_TR, send_src,
            dst_slot_TK, routing, ex, head, counts_R, num_tokens, topk.stride(0), 0 if w is None else w.stride(0),
            rank, call_id, N=call.n, K=num_topk, R=num_ranks, L=num_local, EX_STRIDE=ex.shape[1],
            CNT_COL=agreement.HEADER_LEN, RT_COLS=routing.shape[1], HAS_W=w is not None, K_POW2=k_pow2, R_POW2=r_pow2,
            H_POW2=next_pow2(agreement.HEADER_LEN), TC=tc, TL=tl_, PUBLISH=publish is not None,
            **(publish if publish is not None else _NO_PUBLISH), num_warps=4)
    else:  # no tokens: the header, and zero counts and pairs (`ex` is zero)
        ex[:, :agreement.HEADER_LEN] = head
        ex[:, 1] = call_id
        counts_R.zero_()
    send = SendLayout(num_tokens_per_rank_R=counts_R, token_slot_TR=token_slot_TR, last_pos_TR=last_pos_TR)
    return dict(send=send, send_row_TR=send_row_TR, send_src=send_src, dst_slot_TK=dst_slot_TK, routing=routing,
                published=bool(num_tokens) and publish is not None)


# `send_plan` without the publish: its publish arguments are not read (the pointers are any int).
_NO_PUBLISH = dict(done_ptr=0, host_ptr=0, local_ptr=0, delta16_ptr=0, status_ptr=0, timeout_ns=0, flags_off=0,
                   hdr_off=0, EX_COLS=1, C_POW2=1, STAGES=0, USE_TIMER=False)
_FUSED_PUBLISH = True  # send_plan publishes the rows (False: publish_rows launches on its own; for A/B runs)


def read_rows(buf, call: pipeline.DispatchCall, host_RC: np.ndarray) -> dict:
    """The published rows ([R, C] int64, row s from rank s) to sizes, raising on every rank as the generic path
    would: bad `topk_idx` values (the flags; the rank that holds them re-runs the host check for its message), a
    failed or disagreeing rank (`agreement.check`).

    Returns:
        `{send_splits, recv_splits, matrix, num_unaligned (host list, L)}`.
    """
    num_ranks, rank = buf.num_ranks, buf.rank
    num_local = call.num_experts // num_ranks
    cnt = agreement.HEADER_LEN
    flag = cnt + num_ranks + num_local
    rows = host_RC[:, :cnt + num_ranks].tolist()
    local_error = None
    # Flags count only when every row is of this call and path (else the columns may be stale), a rule every rank
    # applies to the same rows: all ranks then gather the messages together, or none does.
    if (host_RC[:, 1:cnt] == host_RC[0, 1:cnt]).all():
        for s in np.flatnonzero(host_RC[:, flag: flag + _NUM_FLAGS].any(axis=1)).tolist():
            if rows[s][0] == agreement.STATUS_OK:
                rows[s][0] = agreement.STATUS_VALUE
    if rows[rank][0] != agreement.STATUS_OK:
        try:
            check_topk_values(Checker("EPBuffer.dispatch", rank, buf.device), call.topk_idx, call.num_experts)
            local_error = ValueError(f"EPBuffer.dispatch: rank {rank}: topk_idx failed the device value check")
        except ValueError as e:
            local_error = e
    buf.agree("EPBuffer.dispatch", rows, local_error)
    matrix = [row[cnt:] for row in rows]  # [src][dst] rows
    per_expert = cnt + num_ranks  # each rank's (token, expert) pairs for my local experts
    return dict(matrix=matrix, send_splits=list(matrix[rank]), recv_splits=[row[rank] for row in matrix],
                num_unaligned=host_RC[:, per_expert: per_expert + num_local].sum(axis=0).tolist())


def dispatch_launch(buf, call: pipeline.DispatchCall, call_id: int) -> dict:
    """send_plan, the exchange (one host read; errors raise here, on every rank), then the pull of the fields.

    Raises:
        ValueError: bad `topk_idx` values on any rank, ranks that disagree, or rows that exceed the staging area.
        TimeoutError: a peer did not arrive.
    """
    tr, num_ranks = buf.transport, buf.num_ranks
    cols = _cols(num_ranks, call.num_experts // num_ranks)
    with phase("layout"):
        launched = send_plan(call, buf.rank, num_ranks, call_id, header_row(call, buf.uid, buf.device),
                             tr.exact_table(), tr.publish_args(cols) if _FUSED_PUBLISH else None)
    with phase("exchange_counts"):
        host_RC = tr.publish_rows(cols, call_id=call_id, published=launched.pop("published"))
        sizes = read_rows(buf, call, host_RC)
    num_send = sum(sizes["send_splits"])
    route = Route(sizes["send_splits"], sizes["recv_splits"], launched.pop("send_src")[:num_send], sizes["matrix"])
    tensors = dict(x=call.x.data, sf=call.x.sf, routing=launched["routing"])
    fields = pipeline._move_fields(tr, tensors, route, call_id)
    return dict(launched, counts=tr.received_headers(), done=tr.region.programs_done("totals"), route=route, fields=fields,
                num_unaligned=sizes["num_unaligned"], send_splits=route.send_splits, recv_splits=route.recv_splits,
                fused=True)


def dispatch_finish(buf, call: pipeline.DispatchCall, launched: dict) -> tuple:
    """The plan kernels on the received fields, then the outputs; `pipeline.dispatch_finish`'s values."""
    num_ranks, rank, num_topk = buf.num_ranks, buf.rank, call.topk_idx.shape[1]
    route, fields = launched["route"], launched["fields"]
    a = call.expert_alignment
    aligned = [(n + a - 1) // a * a for n in launched["num_unaligned"]]  # sizing.align, inline: L calls per call
    routing = fields["routing"]
    row_bytes, routing = routing.shape[1] * 8, routing.view(torch.uint8)
    headers, header_cols = launched["counts"]
    p = recv_plan.plan_rows(
        call, rank, num_ranks, num_rows=route.num_recv, num_expanded=sum(aligned) if call.do_expand else 0,
        blocked=False, counts=(headers, (agreement.HEADER_LEN + rank) * 8, header_cols),
        routing=(routing, 0, row_bytes, 0, num_topk * 8),
        weights=(routing, 0, 0) if call.topk_weights is None else (routing, (num_topk + 1) * 8, row_bytes),
        done=launched["done"])
    plan = pipeline.Plan(exact=True, blocked=False, send_splits=route.send_splits, recv_splits=route.recv_splits,
                         send_row_TR=launched["send_row_TR"], send_src_X=route.src_X, out_src_M=p["out_src_M"],
                         buf_out_X=p["buf_out_X"], src_rank_M=p["src_rank_M"], valid_M=p["valid_M"], recv=p["recv"],
                         send=launched["send"], pair_S=p["pair_S"], route=route)
    x, sf = fields["x"], fields.get("sf")
    with phase("place"):
        if call.do_expand:  # the weights came from the plan kernels
            recv_x, _ = recv_plan.place(call, plan, recv_plan.field_sources(fields))
        else:  # the moved rows are the output rows
            recv_x = x if sf is None else (x, epilogue.place_sf(sf, call.col_major_sf))
    return recv_plan.outputs(buf, call, plan, p, recv_x, aligned, launched["dst_slot_TK"])
