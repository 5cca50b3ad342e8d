"""The fused sync-free path on the nvlink transport: decode-sized `dispatch(do_cpu_sync=False)` in 3 kernels (4 with
expand), and
the combine and cached dispatch on its handle with one send kernel each.

The generic sync-free path (pipeline.py) computes the layouts with ~100 small torch kernels, about 500 us per call
in a CUDA graph at 128 tokens (2x H200), whatever the transport. At decode sizes this module does the same call
as:

    barrier -> dispatch_send (layout + records into peers + counts) -> barrier -> dispatch_plan_rows
            (-> dispatch_plan_experts with expand; without, the plan kernel's last program writes its totals)
            -> dispatch_place

with the kernels of `kernels/_syncfree_triton.py`. Outputs, handle and plan are the generic path's, value for value:
the receive area holds the same records in the same blocked layout, and the kernels write every tensor of the
handle and its plan, so the generic combine and cached dispatch accept the handle. At the same sizes those two run
fused as well: the combine (not per pair) sends with `combine_send` between the same two barriers instead of pack +
copy-engine writes, then reduces as the generic path; a cached dispatch is `cached_send` between the barriers, then
`dispatch_place` with the weights. tests/kernels/syncfree_sim.py checks every field under the interpreter; the GPU tests
compare both paths bitwise.

`EPBuffer.dispatch` / `combine` pick these kernels on nvlink for a sync-free dispatch, and for a combine (not per
pair) or cached dispatch on a sync-free handle (from either path), when
`num_ranks * num_max_tokens_per_rank <= EPCOMM_FUSED_SYNC_FREE_ROWS` (default 4096).
On 2x H200 the fused dispatch takes 0.05-0.5x the generic time up to 4096 rows and loses BF16 non-expand at 8192:
the send kernel's prefix count grows as T^2 and the plan with the worst-case rows
(benchmarks/results/decode-syncfree_2xH200-NV18_2026-11-30.md).

Shape legend (docs/shapes.md): T tokens, H hidden, K top-k, R ranks, L local experts, N num_max_tokens_per_rank,
M = R * N received rows, S expanded rows, P scale packs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import envs, epilogue, layout, pipeline
from .sizing import ceil_div, next_pow2
from .debug import phase
from .recv_plan import WORDS_PER_PROGRAM, as_bits, outputs, place, plan_rows, ptr_or

_TOKEN_CHUNK = 64  # tokens per step when a send program counts the tokens before its own


@dataclass(frozen=True)
class Areas:
    """Where the kernels find the regions: `local` ([bytes] uint8, this rank's region), `delta16` ([R] int64, every
    region's base relative to it in 16-byte units), the receive area (`rows_off`) and the count headers
    (`hdr_off`, R rows of `hdr_cols` int64; the sender writes its count of rows for the receiver in column 0 of its
    row), and the plan kernel's counter of finished programs (`done`, `SymmetricRegion.programs_done("totals")`)."""

    local: Tensor
    delta16: Tensor
    rows_off: int
    hdr_off: int
    hdr_cols: int
    done: Tensor


def _fits(buf, n: int, x: Tensor) -> bool:
    """nvlink, `R * n` rows within `EPCOMM_FUSED_SYNC_FREE_ROWS`, and rows of `x` that are whole 4-byte words."""
    return (getattr(buf.transport, "name", None) == "nvlink" and buf.num_ranks * n <= envs.fused_sync_free_rows()
            and (x.shape[1] * x.element_size()) % 4 == 0)


def _sync_free_handle(handle) -> bool:
    """A handle of a sync-free dispatch (blocked rows, no exact route), whichever path made it."""
    return handle._plan.blocked and handle._plan.route is None


def applies(buf, call: pipeline.DispatchCall) -> bool:
    """Whether `dispatch` takes the fused path for this (resolved, valid, non-cached) call."""
    return not call.do_cpu_sync and call.handle is None and _fits(buf, call.n, call.x.data)


def _spec(call: pipeline.DispatchCall, with_routing: bool = True):
    """The generic path's dispatch record (cached dispatch: without the routing fields)."""
    wdt = None if call.topk_weights is None else call.topk_weights.dtype
    return pipeline.dispatch_record_spec(call.x, call.topk_idx.shape[1], wdt, with_routing=with_routing)


def _words(t: Tensor) -> Tensor:
    """[T, H] of any 1/2/4-byte dtype as [T, H * size / 4] int32 (rows must be whole words; a fresh copy if the
    start or the row stride is not: `contiguous()` would keep a misaligned start, or a one-row tensor's odd
    stride, and the view would raise)."""
    if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 4 or t.data_ptr() % 4:
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8).view(torch.int32) if t.element_size() == 1 else t.view(torch.int32)


def _send_inputs(call: pipeline.DispatchCall) -> tuple:
    """(data words [T, X], sf or None, sf bits, weights or None, weight bits): what the send kernels read."""
    data = _words(call.x.data)
    sf = call.x.sf if call.x.is_fp8 else None
    w = call.topk_weights
    return (data, sf, None if sf is None else as_bits(sf), w,
            None if w is None else as_bits(w if w.stride(1) == 1 else w.contiguous()))


def send(areas: Areas, call: pipeline.DispatchCall, rank: int, num_ranks: int, spec) -> dict:
    """Launch `dispatch_send`: every token's record (layout `spec`, `_spec(call)`) into the receive areas of the ranks
    it goes to, and the sender-side layout. Returns the tensors `finish` needs."""
    from .kernels import _syncfree_triton as k

    topk = call.topk_idx
    num_tokens, num_topk = topk.shape
    n, device = call.n, areas.local.device
    data, sf, sf_arg, w, w_arg = _send_inputs(call)
    topk_arg = topk if topk.stride(1) == 1 else topk.contiguous()
    token_slot_TR = torch.empty(num_tokens, num_ranks, dtype=torch.int64, device=device)
    last_pos_TR = torch.empty_like(token_slot_TR)
    send_row_TR = torch.empty_like(token_slot_TR)
    send_src_X = torch.empty(num_ranks * n, dtype=torch.int64, device=device)
    dst_slot_TK = torch.empty(num_tokens, num_topk, dtype=torch.int32, device=device)
    counts_R = torch.empty(num_ranks, dtype=torch.int64, device=device)
    num_packs = sf.shape[1] if sf is not None else 1
    k.dispatch_send[(n, ceil_div(data.shape[1], WORDS_PER_PROGRAM))](
        data, sf_arg if sf is not None else data, topk_arg, w_arg if w is not None else data, areas.local,
        areas.delta16, token_slot_TR, last_pos_TR, send_row_TR, send_src_X, dst_slot_TK, counts_R,
        num_tokens, data.stride(0), sf.stride(0) if sf is not None else 0, sf.stride(1) if sf is not None else 0,
        topk_arg.stride(0), w_arg.stride(0) if w is not None else 0, rank,
        areas.rows_off, areas.hdr_off, spec.nbytes, spec.offsets.get("sf", 0), spec.offsets["topk"],
        spec.offsets["g"], spec.offsets.get("w", 0),
        N=n, X_WORDS=data.shape[1], P=num_packs, K=num_topk, R=num_ranks, L=call.num_experts // num_ranks,
        HDR_COLS=areas.hdr_cols, HAS_SF=sf is not None, HAS_W=w is not None,
        K_POW2=next_pow2(num_topk), R_POW2=next_pow2(num_ranks),
        P_POW2=next_pow2(num_packs), TC=_TOKEN_CHUNK, BLOCK_W=WORDS_PER_PROGRAM,
        USE_TRAP=device.type == "cuda", num_warps=4)
    send_layout = layout.SendLayout(num_tokens_per_rank_R=counts_R, token_slot_TR=token_slot_TR,
                                    last_pos_TR=last_pos_TR)
    return dict(send=send_layout, send_row_TR=send_row_TR, send_src_X=send_src_X, dst_slot_TK=dst_slot_TK,
                spec=spec, fused=True)


def finish(buf, areas: Areas, call: pipeline.DispatchCall, launched: dict) -> tuple:
    """After the barrier: launch the plan kernels (`recv_plan.plan_rows`) and `dispatch_place`; returns dispatch's
    `(recv_x, recv_topk_idx, recv_topk_weights, handle)` (`pipeline.dispatch_finish`'s values)."""
    num_ranks, n = buf.num_ranks, call.n
    num_topk, num_local = call.topk_idx.shape[1], call.num_experts // num_ranks
    spec = launched["spec"]
    s = layout.worst_case_expanded_rows(num_ranks, n, num_topk, num_local, call.expert_alignment) \
        if call.do_expand else 0
    base, rec = areas.rows_off, spec.nbytes
    p = plan_rows(call, buf.rank, num_ranks, num_rows=num_ranks * n, num_expanded=s, blocked=True,
                  counts=(areas.local, areas.hdr_off, areas.hdr_cols),
                  routing=(areas.local, base, rec, spec.offsets["topk"], spec.offsets["g"]),
                  weights=(areas.local, base + spec.offsets.get("w", 0), rec), done=areas.done)
    plan = pipeline.Plan(exact=False, blocked=True, send_splits=None, recv_splits=None,
                         send_row_TR=launched["send_row_TR"], send_src_X=launched["send_src_X"],
                         out_src_M=p["out_src_M"], buf_out_X=p["buf_out_X"], src_rank_M=p["src_rank_M"],
                         valid_M=p["valid_M"], recv=p["recv"], send=launched["send"], pair_S=p["pair_S"])
    with phase("place"):
        recv_x, _ = _place(areas, call, spec, plan)
    return outputs(buf, call, plan, p, recv_x, [], launched["dst_slot_TK"])


def _place(areas: Areas, call: pipeline.DispatchCall, spec, plan: pipeline.Plan, with_weights: bool = False):
    """(recv_x, recv_topk_weights or None) from the receive area's records (`place`)."""
    base, rec = areas.rows_off, spec.nbytes
    sources = dict(x=(areas.local, base, rec), sf=(areas.local, base + spec.offsets.get("sf", 0), rec),
                   w=(areas.local, base + spec.offsets.get("w", 0), rec))
    return place(call, plan, sources, with_weights)


def combine_applies(buf, call: pipeline.CombineCall) -> bool:
    """Whether `combine` sends with `combine_send`: a sync-free handle, not per pair, at decode sizes."""
    return (not call.per_pair and _sync_free_handle(call.handle)
            and _fits(buf, call.handle.num_max_tokens_per_rank, call.x))


def combine_send(areas: Areas, call: pipeline.CombineCall, rank: int, num_ranks: int, spec) -> None:
    """Launch `combine_send`: every received row (expand: the canonical sum of its expanded rows first) back into
    its origin's receive area, with its weights, as records of layout `spec` (`pipeline.combine_record_spec`)."""
    from .kernels import _syncfree_triton as k

    h, plan = call.handle, call.handle._plan
    n, num_topk = h.num_max_tokens_per_rank, h.num_topk
    y = epilogue.expert_partials(call.x, plan.recv.row_ptr_MK) if h.do_expand else call.x
    y_words = _words(y)
    w = call.topk_weights
    w_arg = as_bits(w.contiguous()) if w is not None else y_words
    if num_ranks * n:
        k.combine_send[(num_ranks * n, ceil_div(y_words.shape[1], WORDS_PER_PROGRAM))](
            y_words, w_arg, ptr_or(plan.recv.row_ptr_MK, plan.buf_out_X), plan.recv.local_idx_MK, plan.buf_out_X,
            areas.local, areas.delta16, y_words.stride(0), rank, areas.rows_off, spec.nbytes, spec.offsets.get("w", 0),
            N=n, K=num_topk, Y_WORDS=y_words.shape[1], EXPAND=h.do_expand, HAS_W=w is not None,
            K_POW2=next_pow2(num_topk), BLOCK_W=WORDS_PER_PROGRAM, num_warps=4)


def cached_applies(buf, call: pipeline.DispatchCall) -> bool:
    """Whether a cached dispatch runs `cached_send` + `dispatch_place`: a sync-free handle at decode sizes."""
    return _sync_free_handle(call.handle) and _fits(buf, call.n, call.x.data)


def cached_send(areas: Areas, call: pipeline.DispatchCall, rank: int, num_ranks: int, spec) -> None:
    """Launch `cached_send`: the handle's send rows (`plan.send_src_X`) of the new data, scales and weights into
    the destinations' receive areas, as records of layout `spec` (`_spec(call, with_routing=False)`, as
    `pipeline.cached_launch`'s)."""
    from .kernels import _syncfree_triton as k

    n, num_topk = call.n, call.topk_idx.shape[1]
    data, sf, sf_arg, w, w_arg = _send_inputs(call)
    num_packs = sf.shape[1] if sf is not None else 1
    if num_ranks * n:
        k.cached_send[(num_ranks * n, ceil_div(data.shape[1], WORDS_PER_PROGRAM))](
            data, sf_arg if sf is not None else data, w_arg if w is not None else data, call.handle._plan.send_src_X,
            areas.local, areas.delta16, data.stride(0), sf.stride(0) if sf is not None else 0,
            sf.stride(1) if sf is not None else 0, w_arg.stride(0) if w is not None else 0, rank, areas.rows_off,
            spec.nbytes, spec.offsets.get("sf", 0), spec.offsets.get("w", 0), N=n, X_WORDS=data.shape[1], P=num_packs,
            K=num_topk, HAS_SF=sf is not None, HAS_W=w is not None, K_POW2=next_pow2(num_topk),
            P_POW2=next_pow2(num_packs), BLOCK_W=WORDS_PER_PROGRAM, num_warps=4)


def cached_finish(areas: Areas, call: pipeline.DispatchCall, spec) -> tuple:
    """After the barrier: `dispatch_place` with the weights; returns the cached dispatch's
    `(recv_x, recv_topk_idx, recv_topk_weights, handle)` (`pipeline.cached_finish`'s values)."""
    plan = call.handle._plan
    recv_x, recv_w = _place(areas, call, spec, plan, with_weights=True)
    recv_topk_idx = None if call.do_expand else plan.recv.local_idx_MK.to(call.topk_idx.dtype, copy=True)
    return recv_x, recv_topk_idx, recv_w, call.handle


# -- on a buffer ---------------------------------------------------------------------------------------------------
def _areas(tr) -> Areas:
    return Areas(local=tr.region.local, delta16=tr.region.delta16, rows_off=tr.rows_off, hdr_off=tr.headers_off,
                 hdr_cols=tr.header_cols, done=tr.region.programs_done("totals"))


def _between_barriers(buf, num_rows: int, spec, send_kernel, call):
    """Check that `num_rows` records of `spec` fit the receive area (before any data moves; every rank computes the
    same sizes), then barrier (peers have read their previous rows), `send_kernel`, barrier (every record has
    landed).

    Raises:
        ValueError: the receive area cannot hold the records.
    """
    tr = buf.transport
    tr.check_rows_fit(num_rows, spec.nbytes)
    tr.barrier()
    with phase("send_kernel"):
        launched = send_kernel(_areas(tr), call, buf.rank, buf.num_ranks, spec)
    tr.barrier()
    return launched


def dispatch_launch(buf, call: pipeline.DispatchCall, call_id: int) -> dict:
    """`dispatch_send` between the two barriers; returns what `dispatch_finish` needs.

    Raises:
        ValueError: the receive area cannot hold R x N records of this call.
    """
    return _between_barriers(buf, buf.num_ranks * call.n, _spec(call), send, call)


def dispatch_finish(buf, call: pipeline.DispatchCall, launched: dict) -> tuple:
    return finish(buf, _areas(buf.transport), call, launched)


def combine_launch(buf, call: pipeline.CombineCall, call_id: int) -> dict:
    """`combine_send` between the two barriers; returns what `pipeline.combine_finish` reads (the records in place).

    Raises:
        ValueError: the receive area cannot hold R x N records of this call.
    """
    rows = buf.num_ranks * call.handle.num_max_tokens_per_rank
    spec = pipeline.combine_record_spec(call.x, call.topk_weights, call.handle.num_topk)
    _between_barriers(buf, rows, spec, combine_send, call)
    tr = buf.transport
    return dict(spec=spec, recv_XB=tr.region.peer(buf.rank, tr.rows_off, (rows * spec.nbytes,), torch.uint8).view(
        rows, spec.nbytes))


def dispatch_cached_launch(buf, call: pipeline.DispatchCall, call_id: int) -> dict:
    """`cached_send` between the two barriers; returns what `dispatch_cached_finish` needs.

    Raises:
        ValueError: the receive area cannot hold R x N records of this call.
    """
    spec = _spec(call, with_routing=False)
    _between_barriers(buf, buf.num_ranks * call.n, spec, cached_send, call)
    return dict(spec=spec, fused=True)


def dispatch_cached_finish(buf, call: pipeline.DispatchCall, launched: dict) -> tuple:
    return cached_finish(_areas(buf.transport), call, launched["spec"])
