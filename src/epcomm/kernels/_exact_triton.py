"""Triton bodies of the fused CPU-synced dispatch on NVLink (imported lazily by `exact_nvlink.py`).

* `send_plan` (program: a chunk of TC tokens): the sender-side layout of layout.py and pipeline.send_rows in one
  launch (rank dedup; the slot of a token among the tokens sent to a rank = the tokens before it that go there;
  packed send rows `offset[r] + slot`), `dst_buffer_slot_idx`, the routing field every receiver needs (top-k ids,
  token key and the weights, so that the pull moves one narrow field rather than two), and the row this rank
  publishes to each peer: the call header, its count of rows for every rank, the count of its (token, expert)
  pairs for each of the peer's local experts, and two flags for bad values (an id outside [-1, num_experts), an
  expert twice in a token), which the host turns into the generic path's errors;
* `publish_rows` (one program): a barrier, row p of that table into row `me` of rank p's header area, a barrier,
  then the rows every rank published here into pinned host memory: the host reads them without a copy of its own.
  `send_plan` with `PUBLISH` runs the same steps in its last program to finish, one launch instead of two (eager
  calls on the H200 hosts are bound by launch cost); `publish_rows` alone serves a call without tokens.

Each program counts the tokens of the chunks before its own (a two-level scan in one launch: no host round trip),
so the work grows as T^2 / TC, a few us at 4096 tokens.
"""

import triton
import triton.language as tl

from ._signal_triton import _last_to_finish, _region, group_barrier
from ._syncfree_triton import tokens_sent


@triton.jit(do_not_specialize=["num_tokens", "stride_topk", "stride_w", "me", "call_id", "timeout_ns", "flags_off",
                               "hdr_off"])
def send_plan(
    topk_ptr, w_ptr, token_slot_ptr, last_pos_ptr, send_row_ptr, send_src_ptr, dst_slot_ptr, rt_ptr, ex_ptr, hdr_ptr,
    counts_ptr, num_tokens, stride_topk, stride_w, me, call_id,
    done_ptr, host_ptr, local_ptr, delta16_ptr, status_ptr, timeout_ns, flags_off, hdr_off,
    N: tl.constexpr, K: tl.constexpr, R: tl.constexpr, L: tl.constexpr, EX_STRIDE: tl.constexpr,
    CNT_COL: tl.constexpr, RT_COLS: tl.constexpr, HAS_W: tl.constexpr, K_POW2: tl.constexpr, R_POW2: tl.constexpr,
    H_POW2: tl.constexpr, TC: tl.constexpr, TL: tl.constexpr,
    PUBLISH: tl.constexpr, EX_COLS: tl.constexpr, C_POW2: tl.constexpr, STAGES: tl.constexpr, USE_TIMER: tl.constexpr,
):
    """Program g: tokens g*TC .. ; it first counts every rank's tokens, TL at a time (those before its chunk, and the
    totals). `ex` is [R, EX_STRIDE] int64, zero (the previous call's publish left it so): program 0 writes
    the header (`hdr`, CNT_COL int64, with `call_id` in column 1) and the counts `ex[:, CNT_COL + r]` (and into
    `counts` [R]); every program adds its pairs to `ex[d, CNT_COL + R + l]` (expert l of rank d) and raises the
    flags `ex[:, CNT_COL + R + L]` (bad id) and `ex[:, CNT_COL + R + L + 1]` (an expert twice). The routing field
    `rt` ([T, RT_COLS] int64) gets each token's top-k ids, its key and, with `HAS_W`, its weights' bits (`w`, the
    int32 or int64 view of fp32 or fp64 weights) from column K + 1.

    `PUBLISH`: then the last program to finish (`done_ptr`: an int64 counter at zero) runs `publish_rows`'s steps
    on the complete table (its arguments from `host_ptr` on, `EX_COLS` .. `USE_TIMER`; the table's row stride is
    `EX_STRIDE`). Without it they are not read."""
    g_id = tl.program_id(0)
    kk = tl.arange(0, K_POW2)
    rr = tl.arange(0, R_POW2)
    first = g_id * TC

    # Tokens sent to each rank before this chunk, and in all.
    before_r, count_r = tokens_sent(topk_ptr, num_tokens, stride_topk, first, K, L, K_POW2, R_POW2, TL)
    off_r = tl.cumsum(count_r, axis=0) - count_r  # packed send rows: grouped by destination, ascending

    tt = first + tl.arange(0, TC)
    in_t = tt < num_tokens
    in_tk = in_t[:, None] & (kk[None, :] < K)
    ids = tl.load(topk_ptr + tt[:, None].to(tl.int64) * stride_topk + kk[None, :], mask=in_tk, other=-1)
    dest = tl.where(ids >= 0, ids // L, -1).to(tl.int32)
    hit = dest[:, :, None] == rr[None, None, :]  # [TC, K_POW2, R_POW2]
    sent = tl.max(hit.to(tl.int32), axis=1)  # [TC, R_POW2]
    slot = tl.where(sent > 0, before_r[None, :] + tl.cumsum(sent, axis=0) - 1, -1)
    last = tl.max(tl.where(hit, kk[None, :, None], -1), axis=1)
    row = tl.where(sent > 0, off_r[None, :] + slot, -1)
    tr_idx = tt[:, None] * R + rr[None, :]
    in_tr = in_t[:, None] & (rr[None, :] < R)
    tl.store(token_slot_ptr + tr_idx, slot.to(tl.int64), mask=in_tr)
    tl.store(last_pos_ptr + tr_idx, last.to(tl.int64), mask=in_tr)
    tl.store(send_row_ptr + tr_idx, row.to(tl.int64), mask=in_tr)
    tl.store(send_src_ptr + row, tt[:, None].to(tl.int64) + tl.zeros([TC, R_POW2], tl.int64),
             mask=in_tr & (sent > 0))
    # dst_buffer_slot_idx: dest * N + slot at the largest position of each destination, else -1.
    last_k = tl.sum(tl.where(hit, last[:, None, :], 0), axis=2)
    slot_k = tl.sum(tl.where(hit, slot[:, None, :], 0), axis=2)
    dst = tl.where((dest >= 0) & (dest < R) & (last_k == kk[None, :]), dest * N + slot_k, -1)
    tl.store(dst_slot_ptr + tt[:, None] * K + kk[None, :], dst.to(tl.int32), mask=in_tk)
    # The routing field: top-k ids (int64), the token key g = me * N + t, the weights' bits.
    rt_row = rt_ptr + tt.to(tl.int64) * RT_COLS
    tl.store(rt_row[:, None] + kk[None, :], ids.to(tl.int64), mask=in_tk)
    tl.store(rt_row + K, (me * N + tt).to(tl.int64), mask=in_t)
    if HAS_W:
        w = tl.load(w_ptr + tt[:, None].to(tl.int64) * stride_w + kk[None, :], mask=in_tk)
        tl.store((rt_row + K + 1).to(w_ptr.dtype)[:, None] + kk[None, :], w, mask=in_tk)

    if g_id == 0:
        hh = tl.arange(0, H_POW2)
        head = tl.load(hdr_ptr + hh, mask=hh < CNT_COL)
        head = tl.where(hh == 1, call_id, head)
        tl.store(ex_ptr + rr[:, None] * EX_STRIDE + hh[None, :], head[None, :] + tl.zeros([R_POW2, H_POW2], tl.int64),
                 mask=(rr[:, None] < R) & (hh[None, :] < CNT_COL))
        tl.store(ex_ptr + rr[:, None] * EX_STRIDE + CNT_COL + rr[None, :], count_r[None, :].to(tl.int64)
                 + tl.zeros([R_POW2, R_POW2], tl.int64), mask=(rr[:, None] < R) & (rr[None, :] < R))
        tl.store(counts_ptr + rr, count_r.to(tl.int64), mask=rr < R)
    ok = in_tk & (ids >= 0) & (ids < R * L)
    safe = tl.where(ok, ids, 0)
    tl.atomic_add(ex_ptr + (safe // L) * EX_STRIDE + CNT_COL + R + safe % L, tl.full([TC, K_POW2], 1, tl.int64),
                  mask=ok)
    bad = tl.sum(tl.sum((in_tk & ((ids < -1) | (ids >= R * L))).to(tl.int32), axis=1), axis=0)
    twice = (ids[:, :, None] == ids[:, None, :]) & (kk[None, :, None] < kk[None, None, :]) & ok[:, :, None]
    dup = tl.sum(tl.sum(tl.sum(twice.to(tl.int32), axis=2), axis=1), axis=0)
    flag_col = CNT_COL + R + L
    if bad > 0:
        tl.atomic_max(ex_ptr + rr * EX_STRIDE + flag_col, tl.full([R_POW2], 1, tl.int64), mask=rr < R)
    if dup > 0:
        tl.atomic_max(ex_ptr + rr * EX_STRIDE + flag_col + 1, tl.full([R_POW2], 1, tl.int64), mask=rr < R)
    if PUBLISH:
        if _last_to_finish(done_ptr, tl.num_programs(0)):  # every program's counts and flags are in the table
            _publish(ex_ptr, host_ptr, local_ptr, delta16_ptr, status_ptr, me, timeout_ns, flags_off, hdr_off, R,
                     R_POW2, EX_COLS, EX_STRIDE, C_POW2, STAGES, USE_TIMER)


@triton.jit(do_not_specialize=["me", "timeout_ns", "flags_off", "hdr_off"])
def publish_rows(ex_ptr, host_ptr, local_ptr, delta16_ptr, status_ptr, me, timeout_ns, flags_off, hdr_off,
                 R: tl.constexpr, R_POW2: tl.constexpr, EX_COLS: tl.constexpr, HDR_COLS: tl.constexpr,
                 C_POW2: tl.constexpr, STAGES: tl.constexpr, USE_TIMER: tl.constexpr):
    """One program: `_publish`."""
    _publish(ex_ptr, host_ptr, local_ptr, delta16_ptr, status_ptr, me, timeout_ns, flags_off, hdr_off, R, R_POW2,
             EX_COLS, HDR_COLS, C_POW2, STAGES, USE_TIMER)


@triton.jit
def _publish(ex_ptr, host_ptr, local_ptr, delta16_ptr, status_ptr, me, timeout_ns, flags_off, hdr_off,
             R: tl.constexpr, R_POW2: tl.constexpr, EX_COLS: tl.constexpr, HDR_COLS: tl.constexpr,
             C_POW2: tl.constexpr, STAGES: tl.constexpr, USE_TIMER: tl.constexpr):
    """In one program, between two barriers of the region: row p of `ex` ([R, HDR_COLS] int64, EX_COLS used) into
    row `me` of rank p's header area (R rows of HDR_COLS int64 at byte `hdr_off` of every region), then `ex`'s rows
    back to zero for the next call's `send_plan`; after the second barrier, this rank's [R, EX_COLS] headers (row s
    from rank s) into `host_ptr` (pinned host memory, rows of EX_COLS), which the host reads once the kernel is done.

    `STAGES` (bits) splits the kernel where a rank waits for the others, for the CPU simulation of several ranks
    (the interpreter runs one rank at a time): 1 = arrive at the first barrier; 2 = wait for it, publish, arrive at
    the second; 4 = wait for it, copy the headers out. On GPU all three (7)."""
    cc = tl.arange(0, C_POW2)
    in_c = cc < EX_COLS
    if STAGES & 1:  # every peer has read the previous call's headers once all have arrived
        group_barrier(local_ptr, delta16_ptr, status_ptr, me, timeout_ns, flags_off, R, R_POW2, True, False,
                      USE_TIMER)
    if STAGES & 2:
        group_barrier(local_ptr, delta16_ptr, status_ptr, me, timeout_ns, flags_off, R, R_POW2, False, True,
                      USE_TIMER)
        for p in tl.static_range(R):
            v = tl.load(ex_ptr + p * HDR_COLS + cc, mask=in_c)
            dst = (_region(local_ptr, delta16_ptr, p) + hdr_off).to(tl.pointer_type(tl.int64)) + me * HDR_COLS
            tl.store(dst + cc, v, mask=in_c)
            tl.store(ex_ptr + p * HDR_COLS + cc, tl.zeros([C_POW2], tl.int64), mask=in_c)
        tl.debug_barrier()  # every thread's rows are written before the release adds of the barrier
        group_barrier(local_ptr, delta16_ptr, status_ptr, me, timeout_ns, flags_off, R, R_POW2, True, False,
                      USE_TIMER)
    if STAGES & 4:
        group_barrier(local_ptr, delta16_ptr, status_ptr, me, timeout_ns, flags_off, R, R_POW2, False, True,
                      USE_TIMER)
        mine = (local_ptr + hdr_off).to(tl.pointer_type(tl.int64))
        host = host_ptr.to(tl.int64).to(tl.pointer_type(tl.int64))
        for s in tl.static_range(R):
            tl.store(host + s * EX_COLS + cc, tl.load(mine + s * HDR_COLS + cc, mask=in_c), mask=in_c)
