"""Triton bodies of the fused sync-free dispatch and combine send on NVLink (imported lazily by `syncfree_nvlink.py`).

Three dispatch kernels (four with expand) replace the ~100 small kernels of the generic sync-free path
(pipeline.py) at decode sizes:

* `dispatch_send` (program (token slot t, block c of the row)): the sender-side layout of layout.py (rank dedup;
  the slot of a token among the tokens sent to a rank = the tokens before it that go there), block c of the token's
  record written straight into every destination's receive area at row `me * N + slot` (the generic path's blocked
  layout); c = 0 also the rest of the record, the handle's sender-side tensors and the counts in the destinations'
  headers;
* `dispatch_plan_rows` (program: a chunk of MC received rows): after the barrier, pipeline._compaction and the
  row-wise part of layout.recv_layout from the counts and the records' top-k rows (compaction, local expert ids,
  metadata, non-expand weights) and the chunk's count of rows per local expert; without expand its last program to
  finish also writes the per-expert totals (`_expert_totals`);
* `dispatch_plan_experts` (with expand, one program per chunk; without, one program when the totals are not in the
  plan kernel): per-expert counts and aligned starts from the chunk counts; with expand, each chunk's expanded-row
  pointers (prefix sums in token-key order, no sort), pairs, expert ids and weights;
* `dispatch_place` (program (output row, block)): the data row (and scales; for a cached dispatch, the weights) from
  the receive area into the output layout, zeros for rows that hold no token.

`combine_send` (program (send row, block)) sends a sync-free handle's rows back for `pipeline.combine_finish`;
`cached_send` (program (send row, block)) sends a cached dispatch's rows, which `dispatch_place` (with weights) places.

Every value is defined as the generic path defines it (tests/kernels/syncfree_sim.py compares them field by
field). Rows are copied as int32 words, weights and scales as integers of their width: callers check that rows are
whole words.
"""

import triton
import triton.language as tl

from ._signal_triton import _last_to_finish, _region, _stop_on_bad_ids

_RUNTIME_INTS = ["num_tokens", "stride_x", "stride_sf_t", "stride_sf_p", "stride_topk", "stride_w", "me",
                 "num_rows", "num_expanded", "alignment", "num_chunks", "chunk_rows"]


@triton.jit
def tokens_sent(topk_ptr, num_tokens, stride_topk, first, K: tl.constexpr, L: tl.constexpr, K_POW2: tl.constexpr,
                R_POW2: tl.constexpr, STEP: tl.constexpr):
    """([R_POW2] tokens before token `first` sent to each rank, [R_POW2] tokens sent to each rank in all), STEP tokens
    at a time (rank dedup: a token counts once per rank)."""
    kk = tl.arange(0, K_POW2)
    rr = tl.arange(0, R_POW2)
    before_r = tl.zeros([R_POW2], dtype=tl.int32)
    count_r = tl.zeros([R_POW2], dtype=tl.int32)
    for start in range(0, num_tokens, STEP):
        tt = start + tl.arange(0, STEP)
        ids = tl.load(topk_ptr + tt[:, None].to(tl.int64) * stride_topk + kk[None, :],
                      mask=(tt[:, None] < num_tokens) & (kk[None, :] < K), other=-1)
        dest = tl.where(ids >= 0, ids // L, -1).to(tl.int32)
        sent = tl.max((dest[:, :, None] == rr[None, None, :]).to(tl.int32), axis=1)  # [STEP, R_POW2]
        count_r += tl.sum(sent, axis=0)
        before_r += tl.sum(sent * (tt[:, None] < first).to(tl.int32), axis=0)
    return before_r, count_r


@triton.jit
def _dest_ranks(topk_ptr, t, stride_topk, K: tl.constexpr, L: tl.constexpr, K_POW2: tl.constexpr):
    """([K_POW2] int32, [K_POW2] ids): the rank owning each selected expert of token t (-1: no selection)."""
    kk = tl.arange(0, K_POW2)
    ids = tl.load(topk_ptr + t.to(tl.int64) * stride_topk + kk, mask=kk < K, other=-1)
    return tl.where(ids >= 0, ids // L, -1).to(tl.int32), ids


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def dispatch_send(
    x_ptr, sf_ptr, topk_ptr, w_ptr, local_ptr, delta16_ptr,
    token_slot_ptr, last_pos_ptr, send_row_ptr, send_src_ptr, dst_slot_ptr, counts_ptr,
    num_tokens, stride_x, stride_sf_t, stride_sf_p, stride_topk, stride_w, me,
    rows_off, hdr_off, rec_bytes, sf_off, topk_off, g_off, w_off,
    N: tl.constexpr, X_WORDS: tl.constexpr, P: tl.constexpr, K: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
    HDR_COLS: tl.constexpr, HAS_SF: tl.constexpr, HAS_W: tl.constexpr,
    K_POW2: tl.constexpr, R_POW2: tl.constexpr, P_POW2: tl.constexpr, TC: tl.constexpr, BLOCK_W: tl.constexpr,
    USE_TRAP: tl.constexpr,
):
    """Program (t, c): block c of token t's data row to every destination; c = 0 also the rest of the record, token t's
    sender-side layout and the holes of send rows t, N + t, ..."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    kk = tl.arange(0, K_POW2)
    rr = tl.arange(0, R_POW2)

    before_r, count_r = tokens_sent(topk_ptr, num_tokens, stride_topk, t, K, L, K_POW2, R_POW2, TC)

    # Send rows past a rank's count are holes (-1); the rows below it are written by their tokens' programs.
    holes_r = tl.where(c == 0, R, 0)
    tl.store(send_src_ptr + rr * N + t, tl.full([R_POW2], -1, tl.int64), mask=(rr < holes_r) & (t >= count_r))
    if (t == 0) & (c == 0):
        tl.store(counts_ptr + rr, count_r.to(tl.int64), mask=rr < R)
        # Row `me` of every destination's header: how many rows this rank sent it.
        hdr = local_ptr + tl.load(delta16_ptr + rr, mask=rr < R, other=0) * 16 + hdr_off
        tl.store(hdr.to(tl.pointer_type(tl.int64)) + me * HDR_COLS, count_r.to(tl.int64), mask=rr < R)
    if t < num_tokens:
        dest_k, ids_k = _dest_ranks(topk_ptr, t, stride_topk, K, L, K_POW2)
        if c == 0:
            _stop_on_bad_ids(ids_k, t, R * L, "epcomm sync-free dispatch: topk_idx has an expert id outside "
                             "[-1, num_experts) in token", USE_TRAP)
        hit = dest_k[:, None] == rr[None, :]  # [K_POW2, R_POW2]
        sent_r = tl.max(hit.to(tl.int32), axis=0) > 0
        last_r = tl.max(tl.where(hit, kk[:, None], -1), axis=0)
        slot_r = tl.where(sent_r, before_r, -1)
        row_r = tl.where(sent_r, rr * N + before_r, -1)
        # The record: data row | scales | top-k row (int64) | key g | weights, at row me * N + slot of each rank.
        ww = c * BLOCK_W + tl.arange(0, BLOCK_W)
        v = tl.load(x_ptr + t.to(tl.int64) * stride_x + ww, mask=ww < X_WORDS)
        for r in tl.static_range(R):
            slot = tl.sum(tl.where(rr == r, slot_r, 0), axis=0)
            if slot >= 0:
                rec = _region(local_ptr, delta16_ptr, r) + rows_off + (me * N + slot).to(tl.int64) * rec_bytes
                tl.store(rec.to(tl.pointer_type(tl.int32)) + ww, v, mask=ww < X_WORDS)
        if c == 0:
            _send_rest(t, slot_r, last_r, row_r, sent_r, hit, dest_k, ids_k, sf_ptr, w_ptr, local_ptr, delta16_ptr,
                       token_slot_ptr, last_pos_ptr, send_row_ptr, send_src_ptr, dst_slot_ptr, stride_sf_t,
                       stride_sf_p, stride_w, me, rows_off, rec_bytes, sf_off, topk_off, g_off, w_off,
                       N, P, K, R, HAS_SF, HAS_W, K_POW2, R_POW2, P_POW2)


@triton.jit
def _send_rest(t, slot_r, last_r, row_r, sent_r, hit, dest_k, ids_k, sf_ptr, w_ptr, local_ptr, delta16_ptr,
               token_slot_ptr, last_pos_ptr, send_row_ptr, send_src_ptr, dst_slot_ptr, stride_sf_t, stride_sf_p,
               stride_w, me, rows_off, rec_bytes, sf_off, topk_off, g_off, w_off,
               N: tl.constexpr, P: tl.constexpr, K: tl.constexpr, R: tl.constexpr, HAS_SF: tl.constexpr,
               HAS_W: tl.constexpr, K_POW2: tl.constexpr, R_POW2: tl.constexpr, P_POW2: tl.constexpr):
    """Token t's sender-side layout and the small fields of its record (scales, top-k row, key, weights)."""
    kk = tl.arange(0, K_POW2)
    rr = tl.arange(0, R_POW2)
    tl.store(token_slot_ptr + t * R + rr, slot_r.to(tl.int64), mask=rr < R)
    tl.store(last_pos_ptr + t * R + rr, last_r.to(tl.int64), mask=rr < R)
    tl.store(send_row_ptr + t * R + rr, row_r.to(tl.int64), mask=rr < R)
    tl.store(send_src_ptr + row_r, t.to(tl.int64) + tl.zeros([R_POW2], tl.int64), mask=(rr < R) & sent_r)
    # dst_buffer_slot_idx: dest * N + slot at the largest position of each destination, else -1.
    is_last_k = tl.sum(tl.where(hit & (kk[:, None] == last_r[None, :]), 1, 0), axis=1) > 0
    slot_k = tl.sum(tl.where(hit, row_r[None, :], 0), axis=1)
    tl.store(dst_slot_ptr + t * K + kk, tl.where(is_last_k & (dest_k >= 0), slot_k, -1).to(tl.int32),
             mask=kk < K)
    pp = tl.arange(0, P_POW2)
    for r in tl.static_range(R):
        slot = tl.sum(tl.where(rr == r, slot_r, 0), axis=0)
        if slot >= 0:
            rec = _region(local_ptr, delta16_ptr, r) + rows_off + (me * N + slot).to(tl.int64) * rec_bytes
            if HAS_SF:
                sf = tl.load(sf_ptr + t.to(tl.int64) * stride_sf_t + pp * stride_sf_p, mask=pp < P)
                tl.store((rec + sf_off).to(tl.pointer_type(tl.int32)) + pp, sf, mask=pp < P)
            tl.store((rec + topk_off).to(tl.pointer_type(tl.int64)) + kk, ids_k.to(tl.int64), mask=kk < K)
            tl.store((rec + g_off).to(tl.pointer_type(tl.int64)), (me * N + t).to(tl.int64))
            if HAS_W:
                w = tl.load(w_ptr + t.to(tl.int64) * stride_w + kk, mask=kk < K)
                tl.store((rec + w_off).to(w_ptr.dtype) + kk, w, mask=kk < K)


@triton.jit
def _local_ids(rec, topk_off, valid, me, K: tl.constexpr, L: tl.constexpr, K_POW2: tl.constexpr):
    """[MC, K_POW2] int32: local expert id of each top-k position of the records `rec` ([MC] uint8 pointers), -1
    where the expert is not on rank `me` or the row is not valid."""
    kk = tl.arange(0, K_POW2)
    ids = tl.load((rec + topk_off).to(tl.pointer_type(tl.int64))[:, None] + kk[None, :],
                  mask=valid[:, None] & (kk[None, :] < K), other=-1)
    return tl.where((ids >= me * L) & (ids < (me + 1) * L), ids - me * L, -1).to(tl.int32)


@triton.jit
def _onehot(local, kk, ll, K: tl.constexpr, MC: tl.constexpr, L_POW2: tl.constexpr):
    """[MC, L_POW2] int32: 1 where the row chose local expert l (an expert appears at most once per row)."""
    onehot = tl.zeros([MC, L_POW2], dtype=tl.int32)
    for j in tl.static_range(K):
        local_j = tl.sum(tl.where(kk[None, :] == j, local, 0), axis=1)
        onehot = tl.maximum(onehot, (local_j[:, None] == ll[None, :]).to(tl.int32))
    return onehot


@triton.jit
def _source_counts(cnt_ptr, cnt_off, R: tl.constexpr, HDR_COLS: tl.constexpr, R_POW2: tl.constexpr):
    """([R_POW2] rows from each source rank, their inclusive prefix sum), from the headers the senders wrote: row s
    of `HDR_COLS` int64 at byte `cnt_off` of `cnt_ptr` holds what rank s sent this rank."""
    rr = tl.arange(0, R_POW2)
    hdr = (cnt_ptr + cnt_off).to(tl.pointer_type(tl.int64))
    count_r = tl.load(hdr + rr * HDR_COLS, mask=rr < R, other=0)
    return count_r, tl.cumsum(count_r, axis=0)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def dispatch_plan_rows(
    cnt_ptr, rt_ptr, wr_ptr, counts_ptr, out_src_ptr, buf_out_ptr, src_rank_ptr, valid_ptr, local_idx_ptr, meta_ptr,
    psum_rank_ptr, chunk_counts_ptr, w_in_ptr, w_out_ptr, pair_ptr, expert_ids_ptr, recv_idx_ptr,
    done_ptr, unaligned_ptr, start_ptr, psum_expert_ptr, unaligned32_ptr, stats_ptr,
    me, num_rows, num_expanded, chunk_rows, alignment, cnt_off, rt_off, rt_stride, topk_off, g_off, wr_off, wr_stride,
    N: tl.constexpr, K: tl.constexpr, R: tl.constexpr, L: tl.constexpr, HDR_COLS: tl.constexpr,
    BLOCKED: tl.constexpr, EXPAND: tl.constexpr, HAS_W: tl.constexpr, EMIT_IDS: tl.constexpr, WRITE_IDX: tl.constexpr,
    K_POW2: tl.constexpr, R_POW2: tl.constexpr, L_POW2: tl.constexpr, MC: tl.constexpr, FILL: tl.constexpr,
    TOTALS: tl.constexpr, HAS_STATS: tl.constexpr, GC: tl.constexpr,
):
    """Program g: the chunk of rows g*chunk_rows .. of the `num_rows` received rows, MC at a time (`chunk_rows` is a
    multiple of MC): compaction, local expert ids, metadata, (non-expand) weights and `recv_topk_idx`
    (`WRITE_IDX`), and the chunk's count of rows per local expert (`chunk_counts[g]`); with `EXPAND`, also
    its share of the expanded rows set to empty (before `dispatch_plan_experts` places the pairs: stream order).
    `TOTALS` (not with `EXPAND`): the last program to finish (`done_ptr`: an int64 counter at zero) also writes the
    per-expert totals (`_expert_totals`), which are then all `dispatch_plan_experts` would do; without it the
    pointers from `done_ptr` on are not read.

    Received row b's routing is at byte `rt_off + b * rt_stride` of `rt_ptr` (top-k ids at `topk_off`, key at
    `g_off`), its weights at `wr_off + b * wr_stride` of `wr_ptr`. `BLOCKED`: the sync-free receive area, R blocks of
    N records (`num_rows` = R * N), output row m holds block row `src * N + k`; else (the CPU-synced fused dispatch)
    rows are packed by source and output row m is received row m."""
    g_id = tl.program_id(0)
    rr = tl.arange(0, R_POW2)
    kk = tl.arange(0, K_POW2)
    ll = tl.arange(0, L_POW2)
    count_r, end_r = _source_counts(cnt_ptr, cnt_off, R, HDR_COLS, R_POW2)
    off_r = end_r - count_r
    total = tl.sum(count_r, axis=0)
    if g_id == 0:
        tl.store(counts_ptr + rr, count_r, mask=rr < R)
        tl.store(psum_rank_ptr + rr, end_r.to(tl.int32), mask=rr < R)
    if EXPAND:  # this program's share of the expanded rows: empty until the pairs are placed
        share = tl.cdiv(num_expanded, tl.num_programs(0))
        for s0 in range(0, share, FILL):
            ss = g_id * share + s0 + tl.arange(0, FILL)
            inside = (ss < num_expanded) & (s0 + tl.arange(0, FILL) < share)
            tl.store(pair_ptr + ss, tl.full([FILL], -1, tl.int64), mask=inside)
            if HAS_W:
                tl.store(w_out_ptr + ss, tl.zeros([FILL], dtype=w_out_ptr.dtype.element_ty), mask=inside)
            if EMIT_IDS:
                tl.store(expert_ids_ptr + ss, tl.full([FILL], -1, tl.int32), mask=inside)

    n_l = tl.zeros([L_POW2], dtype=tl.int32)
    for sub in range(0, chunk_rows, MC):
        mm = g_id * chunk_rows + sub + tl.arange(0, MC)
        in_m = mm < num_rows
        # Output row m holds row k of source s's rows (in ascending token key), if m < total.
        src = tl.sum(((mm[:, None] >= end_r[None, :]) & (rr[None, :] < R)).to(tl.int32), axis=1)
        valid = mm < total
        if BLOCKED:
            k_in = mm - tl.sum(tl.where(rr[None, :] == src[:, None], off_r[None, :], 0), axis=1)
            b = tl.where(valid, src * N + k_in, -1)
            # Buffer row mm (block s = mm // N, row k = mm % N) goes to output row off[s] + k, if k < count[s].
            bs = mm // N
            bk = mm % N
            b_off = tl.sum(tl.where(rr[None, :] == bs[:, None], off_r[None, :], 0), axis=1)
            b_cnt = tl.sum(tl.where(rr[None, :] == bs[:, None], count_r[None, :], 0), axis=1)
            buf_out = tl.where(bk < b_cnt, b_off + bk, -1)
        else:
            b = mm
            buf_out = mm
        tl.store(out_src_ptr + mm, b.to(tl.int64), mask=in_m)
        tl.store(src_rank_ptr + mm, tl.where(valid, src, -1).to(tl.int64), mask=in_m)
        tl.store(valid_ptr + mm, valid, mask=in_m)
        tl.store(buf_out_ptr + mm, buf_out.to(tl.int64), mask=in_m)

        rec = rt_ptr + rt_off + tl.maximum(b, 0).to(tl.int64) * rt_stride
        g = tl.load((rec + g_off).to(tl.pointer_type(tl.int64)), mask=valid, other=-1)
        local = _local_ids(rec, topk_off, valid, me, K, L, K_POW2)  # [MC, K_POW2]
        in_mk = in_m[:, None] & (kk[None, :] < K)
        tl.store(local_idx_ptr + mm[:, None] * K + kk[None, :], local.to(tl.int64), mask=in_mk)
        if WRITE_IDX:  # dispatch's recv_topk_idx (non-expand): the local ids in topk_idx's dtype, a tensor of its own
            tl.store(recv_idx_ptr + mm[:, None] * K + kk[None, :], local.to(recv_idx_ptr.dtype.element_ty),
                     mask=in_mk)
        last = tl.max(tl.where(local >= 0, kk[None, :], -1), axis=1)
        meta = meta_ptr + mm * (K + 2)
        tl.store(meta, tl.where(valid, g, -1).to(tl.int32), mask=in_m)
        tl.store(meta + 1, tl.where(valid, src * K + last, -1).to(tl.int32), mask=in_m)
        if not EXPAND:
            tl.store(meta[:, None] + 2 + kk[None, :], tl.full([MC, K_POW2], -1, tl.int32), mask=in_mk)
            if HAS_W:
                w_rec = wr_ptr + wr_off + tl.maximum(b, 0).to(tl.int64) * wr_stride
                w = tl.load(w_rec.to(w_in_ptr.dtype)[:, None] + kk[None, :], mask=local >= 0, other=0)
                tl.store(w_out_ptr + mm[:, None] * K + kk[None, :], w, mask=in_mk)
        n_l += tl.sum(_onehot(local, kk, ll, K, MC, L_POW2), axis=0)
    tl.store(chunk_counts_ptr + g_id * L_POW2 + ll, n_l)
    if TOTALS:
        if _last_to_finish(done_ptr, tl.num_programs(0)):  # every chunk's counts are stored
            _expert_totals(chunk_counts_ptr, tl.num_programs(0), 0, unaligned_ptr, start_ptr, psum_expert_ptr,
                           unaligned32_ptr, stats_ptr, alignment, L, False, HAS_STATS, L_POW2, GC)


@triton.jit
def _expert_totals(chunk_counts_ptr, num_chunks, g_id, unaligned_ptr, start_ptr, psum_expert_ptr, unaligned32_ptr,
                   stats_ptr, alignment, L: tl.constexpr, EXPAND: tl.constexpr, HAS_STATS: tl.constexpr,
                   L_POW2: tl.constexpr, GC: tl.constexpr):
    """Per-expert rows from every chunk's counts, GC chunks at a time; returns ([L_POW2] aligned starts, [L_POW2]
    rows of the chunks before chunk `g_id`). For chunk 0 it stores the counts, starts and per-expert prefix sums
    (ends of the aligned segments; of the rows without `EXPAND`) and adds the counts to the stats."""
    ll = tl.arange(0, L_POW2)
    n_l = tl.zeros([L_POW2], dtype=tl.int32)
    before_l = tl.zeros([L_POW2], dtype=tl.int32)  # rows of the chunks before this one, per expert
    for c0 in range(0, num_chunks, GC):
        cc = c0 + tl.arange(0, GC)
        counts = tl.load(chunk_counts_ptr + cc[:, None] * L_POW2 + ll[None, :], mask=cc[:, None] < num_chunks,
                         other=0)
        n_l += tl.sum(counts, axis=0)
        before_l += tl.sum(tl.where(cc[:, None] < g_id, counts, 0), axis=0)
    aligned_l = (n_l + alignment - 1) // alignment * alignment
    start_l = tl.cumsum(aligned_l, axis=0) - aligned_l
    if g_id == 0:
        tl.store(unaligned_ptr + ll, n_l.to(tl.int64), mask=ll < L)
        tl.store(unaligned32_ptr + ll, n_l, mask=ll < L)
        tl.store(start_ptr + ll, start_l.to(tl.int64), mask=ll < L)
        if EXPAND:
            psum = start_l + n_l
        else:
            psum = start_l + aligned_l
        tl.store(psum_expert_ptr + ll, psum, mask=ll < L)
        if HAS_STATS:
            stats = tl.load(stats_ptr + ll, mask=ll < L, other=0)
            tl.store(stats_ptr + ll, stats + n_l, mask=ll < L)
    return start_l, before_l


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def dispatch_plan_experts(
    wr_ptr, out_src_ptr, local_idx_ptr, meta_ptr, chunk_counts_ptr, unaligned_ptr, start_ptr, psum_expert_ptr,
    unaligned32_ptr, stats_ptr, w_in_ptr, w_out_ptr, row_ptr_ptr, pair_ptr, expert_ids_ptr,
    num_rows, num_chunks, chunk_rows, alignment, wr_off, wr_stride,
    K: tl.constexpr, L: tl.constexpr,
    EXPAND: tl.constexpr, HAS_W: tl.constexpr, HAS_STATS: tl.constexpr, EMIT_IDS: tl.constexpr,
    K_POW2: tl.constexpr, L_POW2: tl.constexpr, MC: tl.constexpr, GC: tl.constexpr,
):
    """Program g (one program without `EXPAND`): per-expert counts and aligned starts from every chunk's counts;
    program 0 stores them (and adds the stats). With `EXPAND`, program g places the pairs of its chunk's rows
    g*chunk_rows .., MC at a time: (row m, position j) of expert e goes to start[e] + (rows before m that chose e),
    prefix sums in token-key order. Row m's weights are at byte `wr_off + out_src[m] * wr_stride` of `wr_ptr` (`dispatch_plan_rows`)."""
    g_id = tl.program_id(0)
    kk = tl.arange(0, K_POW2)
    ll = tl.arange(0, L_POW2)
    start_l, before_l = _expert_totals(chunk_counts_ptr, num_chunks, g_id, unaligned_ptr, start_ptr, psum_expert_ptr,
                                       unaligned32_ptr, stats_ptr, alignment, L, EXPAND, HAS_STATS, L_POW2, GC)
    if EXPAND:
        base_l = start_l + before_l  # the next expanded row of each expert
        for sub in range(0, chunk_rows, MC):
            mm = g_id * chunk_rows + sub + tl.arange(0, MC)
            in_m = mm < num_rows
            in_mk = in_m[:, None] & (kk[None, :] < K)
            local = tl.load(local_idx_ptr + mm[:, None] * K + kk[None, :], mask=in_mk, other=-1).to(tl.int32)
            if HAS_W:
                b = tl.load(out_src_ptr + mm, mask=in_m, other=-1)
                w_rec = wr_ptr + wr_off + tl.maximum(b, 0).to(tl.int64) * wr_stride
                w = tl.load(w_rec.to(w_in_ptr.dtype)[:, None] + kk[None, :], mask=local >= 0, other=0)
            onehot = _onehot(local, kk, ll, K, MC, L_POW2)
            base = base_l[None, :] + tl.cumsum(onehot, axis=0) - onehot
            row = tl.gather(base, tl.maximum(local, 0), axis=1)  # base[m, local[m, j]]
            row = tl.where(local >= 0, row, -1)
            tl.store(row_ptr_ptr + mm[:, None] * K + kk[None, :], row.to(tl.int64), mask=in_mk)
            tl.store(meta_ptr + mm[:, None] * (K + 2) + 2 + kk[None, :], row, mask=in_mk)
            placed = (row >= 0) & in_mk
            tl.store(pair_ptr + row, (mm[:, None] * K + kk[None, :]).to(tl.int64), mask=placed)
            if EMIT_IDS:
                tl.store(expert_ids_ptr + row, local, mask=placed)
            if HAS_W:
                tl.store(w_out_ptr + row, w, mask=placed)
            base_l += tl.sum(onehot, axis=0)


@triton.jit
def dispatch_place(
    x_src_ptr, sf_src_ptr, w_src_ptr, out_src_ptr, pair_ptr, out_ptr, sf_out_ptr, w_out_ptr, local_idx_ptr,
    x_off, x_stride, sf_off, sf_stride, w_off, w_stride,
    X_WORDS: tl.constexpr, P: tl.constexpr, K: tl.constexpr, EXPAND: tl.constexpr, HAS_SF: tl.constexpr,
    HAS_W: tl.constexpr, K_POW2: tl.constexpr, P_POW2: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Program (y, c): block c of output row y (expanded row y with `EXPAND`) from received row b = `out_src[y]`
    (its data at byte `x_off + b * x_stride` of `x_src_ptr`, its scales and weights likewise), zeros without one;
    c = 0 also the scales and, with `HAS_W` (cached dispatch: the plan kernels do not run), the weights: [M, K]
    with 0 where the expert is not local, or [S] (the weight of the pair placed at the row, 0 for none)."""
    y = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if EXPAND:
        pair = tl.load(pair_ptr + y)
        b = tl.where(pair >= 0, tl.load(out_src_ptr + tl.maximum(pair, 0) // K), -1)
    else:
        b = tl.load(out_src_ptr + y)
    bb = tl.maximum(b, 0)
    src = (x_src_ptr + x_off + bb * x_stride).to(tl.pointer_type(tl.int32))
    ww = c * BLOCK_W + tl.arange(0, BLOCK_W)
    v = tl.load(src + ww, mask=ww < tl.where(b >= 0, X_WORDS, 0), other=0)
    tl.store(out_ptr + y * X_WORDS + ww, v, mask=ww < X_WORDS)
    if HAS_SF:
        pp = tl.arange(0, P_POW2)
        sf_src = (sf_src_ptr + sf_off + bb * sf_stride).to(tl.pointer_type(tl.int32))
        sf = tl.load(sf_src + pp, mask=pp < tl.where(b >= 0, P, 0), other=0)
        tl.store(sf_out_ptr + y * P + pp, sf, mask=pp < tl.where(c == 0, P, 0))
    if HAS_W:
        if c == 0:
            w_in = (w_src_ptr + w_off + bb * w_stride).to(w_out_ptr.dtype)
            if EXPAND:
                w = tl.load(w_in + tl.maximum(pair, 0) % K, mask=b >= 0, other=0)
                tl.store(w_out_ptr + y, w)
            else:
                kk = tl.arange(0, K_POW2)
                local = tl.load(local_idx_ptr + y * K + kk, mask=kk < K, other=-1)
                w = tl.load(w_in + kk, mask=local >= 0, other=0)
                tl.store(w_out_ptr + y * K + kk, w, mask=kk < K)


@triton.jit(do_not_specialize=["stride_x", "stride_sf_t", "stride_sf_p", "stride_w", "me"])
def cached_send(
    x_ptr, sf_ptr, w_ptr, send_src_ptr, local_ptr, delta16_ptr, stride_x, stride_sf_t, stride_sf_p, stride_w, me,
    rows_off, rec_bytes, sf_off, w_off, N: tl.constexpr, X_WORDS: tl.constexpr, P: tl.constexpr, K: tl.constexpr,
    HAS_SF: tl.constexpr, HAS_W: tl.constexpr, K_POW2: tl.constexpr, P_POW2: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Program (b, c): send row b = s * N + k of a cached dispatch (token `send_src[b]`, if any) into rank s's
    receive area at row `me * N + k`: block c of the data row; c = 0 also its scales and weights
    (`pipeline.cached_launch`'s records: data | scales | weights)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(send_src_ptr + b)
    if t >= 0:
        rec = _region(local_ptr, delta16_ptr, b // N) + rows_off + (me * N + b % N).to(tl.int64) * rec_bytes
        ww = c * BLOCK_W + tl.arange(0, BLOCK_W)
        v = tl.load(x_ptr + t * stride_x + ww, mask=ww < X_WORDS)
        tl.store(rec.to(tl.pointer_type(tl.int32)) + ww, v, mask=ww < X_WORDS)
        if c == 0:
            if HAS_SF:
                pp = tl.arange(0, P_POW2)
                sf = tl.load(sf_ptr + t * stride_sf_t + pp * stride_sf_p, mask=pp < P)
                tl.store((rec + sf_off).to(tl.pointer_type(tl.int32)) + pp, sf, mask=pp < P)
            if HAS_W:
                kk = tl.arange(0, K_POW2)
                w = tl.load(w_ptr + t * stride_w + kk, mask=kk < K)
                tl.store((rec + w_off).to(w_ptr.dtype) + kk, w, mask=kk < K)


@triton.jit(do_not_specialize=["stride_y", "me"])
def combine_send(
    y_ptr, w_ptr, row_ptr_ptr, local_idx_ptr, buf_out_ptr, local_ptr, delta16_ptr, stride_y, me, rows_off, rec_bytes,
    w_off, N: tl.constexpr, K: tl.constexpr, Y_WORDS: tl.constexpr, EXPAND: tl.constexpr, HAS_W: tl.constexpr,
    K_POW2: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Program (b, c): send row b = s * N + k of a blocked combine (the row of output row `buf_out[b]`, if any) into
    rank s's receive area at row `me * N + k`: block c of the data row; c = 0 also the weights, 0 where the expert
    is not local (expand: the weight of each position's expanded row). `pipeline.combine_launch`'s records."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    m = tl.load(buf_out_ptr + b)
    if m >= 0:
        s = b // N
        rec = _region(local_ptr, delta16_ptr, s) + rows_off + (me * N + b % N).to(tl.int64) * rec_bytes
        ww = c * BLOCK_W + tl.arange(0, BLOCK_W)
        v = tl.load(y_ptr + m * stride_y + ww, mask=ww < Y_WORDS)
        tl.store(rec.to(tl.pointer_type(tl.int32)) + ww, v, mask=ww < Y_WORDS)
        if HAS_W:
            if c == 0:
                kk = tl.arange(0, K_POW2)
                local = tl.load(local_idx_ptr + m * K + kk, mask=kk < K, other=-1)
                if EXPAND:
                    row = tl.load(row_ptr_ptr + m * K + kk, mask=kk < K, other=-1)
                    w = tl.load(w_ptr + tl.maximum(row, 0), mask=(row >= 0) & (local >= 0), other=0)
                else:
                    w = tl.load(w_ptr + m * K + kk, mask=local >= 0, other=0)
                tl.store((rec + w_off).to(w_ptr.dtype) + kk, w, mask=kk < K)
