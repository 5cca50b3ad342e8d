"""Triton bodies of the low-latency (decode) path on NVLink (imported lazily by `lowlatency_nvlink.py`).

The region the kernels share is laid out by `lowlatency_nvlink.Layout`. The work of a call comes in items:

* dispatch send (token slot, block of channels): cast the token to FP8 (or keep BF16) and write it once to every
  rank that holds one of its experts (rank dedup), with its local expert ids and its position among this rank's
  rows for each expert;
* dispatch receive (source rank, token slot, block of channels): expand the row into the expert-major output
  (row = rows of lower source ranks + position: ascending token key) and record where each (token, top-k) item
  went, for the combine;
* combine send (destination rank, token slot, KP top-k positions): each expert output row back to its token's
  rank, at slot (token, top-k position), then one release add to that slot's arrival count there;
* combine receive (token, block of channels): once the token's arrivals are in, `sum_k w_k * y_k` in fp32,
  ascending k, one rounding to bf16.

A call runs as one fused kernel (`*_fused`: a persistent grid does the send items, signals, waits, does the
receive items) or, with `return_recv_hook=True`, as a send kernel now and a receive kernel when the hook is called.
Dispatch: every program, as soon as its sends are done, adds the number of send items it did for rank r to rank r's
`ready` count, and the receives wait for every rank's count. Combine: every send item adds 1 to its token slot's
arrival count from this rank (`_arrivals`), and a receive waits only for its own token, so in the fused kernel the
tokens whose rows have landed are summed while later rows still travel. The last program to finish the receives
(writes the counts and) adds 1 to `freed` in every rank.

Flags are counters that only grow (fire-and-forget adds), so there is no cleaning pass. Two areas alternate by
call parity. A call does the same number of send items for each peer (dispatch), and for each token slot (combine),
every time (`send_items`, fixed per area by the host), so dispatch call `e` waits for
`ready >= (e // 2 + 1) * send_items` and a combine receive for `arrivals >= (e // 2 + 1) * KB`; the senders
first wait for `freed >= e // 2` (the call two before has been read), so no peer overwrites rows still being read,
and no send item of a later call can count towards call e. The host reads no expert ids (that would synchronise):
a token's first send item checks them and stops the kernel on one outside [-1, num_experts) (`_stop_on_bad_ids`).
Every wait is bounded (`_signal_triton._wait`): on
timeout the kernel prints the missing rank, records it in `status` and (on GPU) traps (docs/decisions.md, "Errors
and timeouts").
"""

import triton
import triton.language as tl

from ._signal_triton import _last_to_finish, _region, _stop_on_bad_ids, _wait, _wait_all, _wait_all_timed

# Integer arguments that change between calls or ranks: one compiled variant for all their values (the fused
# kernels' grids come from the variant's occupancy, so a variant must not change under a new token count).
_RUNTIME_INTS = ["num_tokens", "me", "timeout_ns", "stride_x", "stride_topk", "stride_w", "stride_out",
                 "send_programs"]

# Flag slots: ((kind * 2 + what) * 2 + parity) * R + rank, int64 each.
DISPATCH = tl.constexpr(0)
COMBINE = tl.constexpr(1)
READY = tl.constexpr(0)
FREED = tl.constexpr(1)


@triton.jit
def _flag(base, kind, what, parity, rank, R: tl.constexpr):
    """Pointer to one int64 flag of the region starting at `base` (uint8 pointer)."""
    return base.to(tl.pointer_type(tl.int64)) + ((kind * 2 + what) * 2 + parity) * R + rank


@triton.jit
def _to_bf16(v):
    """fp32 -> bf16 rounded to nearest even, by integer arithmetic (the interpreter's conversion truncates)."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e4m3_bits(v, HW: tl.constexpr):
    """float8_e4m3fn bits of fp32 `v` (|v| <= 448), rounded to nearest even: torch's bits.

    `HW` (an NVIDIA GPU of compute capability 8.9 or more): the hardware conversion (`cvt.rn.satfinite`). Else by
    integer arithmetic, spelled out because the interpreter's conversion mis-rounds values that carry into the
    exponent (and older GPUs have no FP8 type); NaN gives 0x7F, as torch. The GPU tests compare the hardware
    path with torch's cast bitwise; the integer path costs ~30 dependent ops per element, about 2 us per send item
    on a GPU (2x H200, phase stamps).
    """
    if HW:
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    # Normal results (|v| >= 2**-6): keep 3 mantissa bits; a carry out of them rounds into the exponent.
    keep = mant >> 20
    rest = mant & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & ((keep & 1) == 1))
    normal = ((exp - 120) << 3 | keep) + up.to(tl.int32)
    # Subnormal results: round(|v| * 2**9) = (1.mant) >> shift, to nearest even.
    shift = tl.minimum(141 - exp, 31)
    full = mant | 0x800000
    q = full >> shift
    rest_s = full & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up_s = (rest_s > half) | ((rest_s == half) & ((q & 1) == 1))
    sub = q + up_s.to(tl.int32)
    code = tl.where(exp >= 121, tl.minimum(normal, 0x7E), tl.where(exp == 0, 0, sub))
    code = tl.where((exp == 0xFF) & (mant != 0), 0x7F, code)  # NaN
    return (code | sign).to(tl.uint8)


@triton.jit
def _signal_all(local_ptr, delta16_ptr, kind, what, parity, me, amount, R: tl.constexpr, R_POW2: tl.constexpr):
    """Add `amount[r]` ([R_POW2] int64; 0 skips) to flag (kind, what, parity, me) in rank r's region, for every r at
    once: R threads each issue one release add (system scope) after the program's barrier, so the R fences run in
    parallel rather than one after another."""
    tl.debug_barrier()  # every thread's writes happen before the adds below
    r = tl.arange(0, R_POW2)
    base = local_ptr + tl.load(delta16_ptr + r, mask=r < R, other=0) * 16
    flags = base.to(tl.pointer_type(tl.int64)) + ((kind * 2 + what) * 2 + parity) * R + me
    tl.atomic_add(flags, amount, mask=(r < R) & (amount > 0), sem="release", scope="sys")


@triton.jit
def _as_tensor(i):
    """A loop index as an int32 scalar tensor (the interpreter hands plain ints to `range` loop bodies)."""
    return i + tl.zeros([], dtype=tl.int32)


# -- dispatch ------------------------------------------------------------------------------------------------------
@triton.jit
def _dispatch_send_item(
    t, c, epoch, x_ptr, topk_ptr, local_ptr, delta16_ptr, status_ptr,
    num_tokens, stride_x, stride_topk, me, timeout_ns, hdr_off, rows_off, row_bytes, scale_off, meta_off,
    N: tl.constexpr, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
    USE_FP8: tl.constexpr, POW2_SCALES: tl.constexpr, USE_TIMER: tl.constexpr,
    K_POW2: tl.constexpr, NBC: tl.constexpr, CHUNK: tl.constexpr, R_POW2: tl.constexpr, HW_FP8: tl.constexpr,
):
    """Token slot t, channel blocks c*NBC ..: cast and write to every rank that holds one of its experts."""
    t = _as_tensor(t)
    c = _as_tensor(c)
    parity = epoch % 2
    kk = tl.arange(0, K_POW2)
    live = t < num_tokens
    expert_k = tl.load(topk_ptr + t * stride_topk + kk, mask=kk < tl.where(live, K, 0), other=-1).to(tl.int32)
    if c == 0:  # the kernels trap on GPU, where USE_TIMER is set
        _stop_on_bad_ids(expert_k, t, R * L, "epcomm low-latency dispatch: topk_idx has an expert id outside "
                         "[-1, num_experts) in token", USE_TIMER)
    dest_k = tl.where(expert_k >= 0, expert_k // L, -1)
    # Every rank's region, read once up front (one load per rank inside the loops below cost a round trip each).
    rr = tl.arange(0, R_POW2)
    delta_r = tl.load(delta16_ptr + rr, mask=rr < R, other=0)

    # This item's part of the token row, cast once: [NBC blocks, 128 channels].
    blk = c * NBC + tl.arange(0, NBC)
    ch = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
    inside = ch < H
    row = tl.load(x_ptr + t.to(tl.int64) * stride_x + ch, mask=ch < tl.where(live, H, 0), other=0.0)
    if USE_FP8:
        xf = row.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-4)
        scale = tl.math.div_rn(amax, tl.full([NBC], 448.0, tl.float32))
        if POW2_SCALES:  # round up to a power of two, exactly (fp8.py's _round_up_pow2)
            bits = scale.to(tl.int32, bitcast=True)
            exp = (bits >> 23) & 0xFF
            exp = tl.minimum(exp + ((bits & 0x7FFFFF) != 0).to(tl.int32), 255)
            scale = (exp << 23).to(tl.float32, bitcast=True)
        payload = _e4m3_bits(tl.math.div_rn(xf, scale[:, None]), HW_FP8)
    else:
        payload = row

    # Every rank must have finished reading the call two before (same area): one wait for all of them. Then the
    # row goes out first, and the metadata (which needs the count below) follows while the row travels.
    _wait_all(_flag(local_ptr, DISPATCH, FREED, parity, 0, R), epoch // 2, timeout_ns, status_ptr, R, R_POW2,
              USE_TIMER)
    for r in tl.static_range(R):
        if tl.sum((dest_k == r).to(tl.int32), axis=0) > 0:
            slot = _send_slot(local_ptr, delta_r, rr, r, rows_off, row_bytes, parity, me, t, N, R)
            if USE_FP8:
                tl.store(slot + ch, payload, mask=inside)
                tl.store((slot + scale_off).to(tl.pointer_type(tl.float32)) + blk, scale, mask=blk * 128 < H)
            else:
                tl.store(slot.to(tl.pointer_type(tl.bfloat16)) + ch, payload, mask=inside)

    if c == 0:  # the token's metadata, once (by its first block of channels), to every rank
        # Position of each item among this rank's items for the same expert, in (token, k) order, and whether a
        # later item has the same expert (the last one writes the count).
        mine = t * K + kk
        before_k = tl.zeros([K_POW2], dtype=tl.int32)
        after_k = tl.zeros([K_POW2], dtype=tl.int32)
        num_items = tl.where(live, num_tokens * K, 0)
        for start in range(0, num_items, CHUNK):
            f = start + tl.arange(0, CHUNK)
            ids = tl.load(topk_ptr + (f // K) * stride_topk + f % K, mask=f < num_items, other=-1).to(tl.int32)
            same = (ids[None, :] == expert_k[:, None]) & (expert_k[:, None] >= 0)
            before_k += tl.sum((same & (f[None, :] < mine[:, None])).to(tl.int32), axis=1)
            after_k += tl.sum((same & (f[None, :] > mine[:, None])).to(tl.int32), axis=1)
        for r in tl.static_range(R):
            slot = _send_slot(local_ptr, delta_r, rr, r, rows_off, row_bytes, parity, me, t, N, R)
            local_k = tl.where(dest_k == r, expert_k - r * L, -1)
            meta = (slot + meta_off).to(tl.pointer_type(tl.int32))
            tl.store(meta + kk, local_k, mask=kk < K)
            tl.store(meta + K + kk, before_k, mask=kk < K)
            hdr = (_send_region(local_ptr, delta_r, rr, r) + hdr_off).to(tl.pointer_type(tl.int32)) + \
                (parity * R + me) * L
            tl.store(hdr + tl.maximum(local_k, 0), before_k + 1, mask=(local_k >= 0) & (after_k == 0) & (kk < K))


@triton.jit
def _send_region(local_ptr, delta_r, rr, r):
    """`_region(.., r)` from every rank's distance, loaded once (`delta_r`, [R_POW2] in 16-byte units)."""
    return local_ptr + tl.sum(tl.where(rr == r, delta_r, 0), axis=0) * 16


@triton.jit
def _send_slot(local_ptr, delta_r, rr, r, rows_off, row_bytes, parity, me, t, N: tl.constexpr, R: tl.constexpr):
    """This rank's row slot t in rank r's dispatch area of this parity."""
    return _send_region(local_ptr, delta_r, rr, r) + rows_off + ((parity * R + me) * N + t).to(tl.int64) * row_bytes


@triton.jit
def _dispatch_recv_item(
    src, t, c, epoch, local_ptr, out_ptr, scales_ptr, item_ptr, hdr_off, rows_off, row_bytes, scale_off, meta_off,
    N: tl.constexpr, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
    USE_FP8: tl.constexpr, UE8M0: tl.constexpr, NB: tl.constexpr, NBC: tl.constexpr, SCALE_COLS: tl.constexpr,
    K_POW2: tl.constexpr,
):
    """Row t of source rank src, channel blocks c*NBC ..: copy it to each of its local experts' rows."""
    src = _as_tensor(src)
    t = _as_tensor(t)
    c = _as_tensor(c)
    parity = epoch % 2
    slot = local_ptr + rows_off + ((parity * R + src) * N + t).to(tl.int64) * row_bytes
    meta = (slot + meta_off).to(tl.pointer_type(tl.int32))
    hdr = (local_ptr + hdr_off).to(tl.pointer_type(tl.int32)) + parity * R * L
    rows = R * N  # rows per expert in the output
    kk = tl.arange(0, K_POW2)
    items = item_ptr + (src * N + t) * K
    expert_k = tl.load(meta + kk, mask=kk < K, other=-1)
    if tl.max(expert_k, axis=0) < 0:  # no expert of this token lives here
        if c == 0:
            tl.store(items + kk, tl.full([K_POW2], -1, tl.int32), mask=kk < K)
    else:
        # Output row of every top-k position at once (a scalar loop over k paid a round trip per position).
        live_k = expert_k >= 0
        offset_k = tl.load(meta + K + kk, mask=live_k, other=0)
        for s in range(src):  # rows of lower source ranks come first (ascending token key)
            offset_k += tl.load(hdr + s * L + expert_k, mask=live_k, other=0)
        item_k = tl.where(live_k, expert_k * rows + offset_k, -1)
        blk = c * NBC + tl.arange(0, NBC)
        ch = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
        inside = ch < H
        if USE_FP8:
            payload = tl.load(slot + ch, mask=inside, other=0)
            scale = tl.load((slot + scale_off).to(tl.pointer_type(tl.float32)) + blk, mask=blk < NB, other=0.0)
            if UE8M0:  # four exponent bytes per int32, block 4i+j in byte j (fp8.pack_ue8m0)
                exps = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
                packs = tl.sum(tl.reshape(exps, [NBC // 4, 4]) << (tl.arange(0, 4) * 8)[None, :], axis=1)
        else:
            payload = tl.load(slot.to(tl.pointer_type(tl.bfloat16)) + ch, mask=inside, other=0.0)
        # [K_POW2, NBC, 128]: the row block to each position's output row.
        dst = out_ptr + item_k.to(tl.int64)[:, None, None] * H + ch[None, :, :]
        tl.store(dst, tl.broadcast_to(payload[None, :, :], [K_POW2, NBC, 128]),
                 mask=live_k[:, None, None] & inside[None, :, :])
        if USE_FP8:  # scales token-contiguous per expert: [L, SCALE_COLS, rows]
            col_k = expert_k.to(tl.int64) * SCALE_COLS * rows + offset_k
            if UE8M0:
                p = c * (NBC // 4) + tl.arange(0, NBC // 4)
                tl.store(scales_ptr + col_k[:, None] + p[None, :] * rows,
                         tl.broadcast_to(packs[None, :], [K_POW2, NBC // 4]),
                         mask=live_k[:, None] & (p < SCALE_COLS)[None, :])
            else:
                tl.store(scales_ptr + col_k[:, None] + blk[None, :] * rows,
                         tl.broadcast_to(scale[None, :], [K_POW2, NBC]), mask=live_k[:, None] & (blk < NB)[None, :])
        if c == 0:
            tl.store(items + kk, item_k, mask=kk < K)


@triton.jit
def _sent(kind, epoch, num_programs, local_ptr, delta16_ptr, state_ptr, me, amount, R: tl.constexpr,
          R_POW2: tl.constexpr, ADVANCE: tl.constexpr):
    """After a program's sends: add the number of send items it did for rank r (`amount[r]`) to r's `ready` count
    (no program waits for the others here). A split send kernel (`ADVANCE`) then lets its last program advance the
    kind's call counter (`state[kind]`); a fused kernel leaves that to the last program to finish its receives
    (`_advance`), off the critical path. Finish counters: `state[2 + 2 * kind]` (split send kernels),
    `state[3 + 2 * kind]` (receives, split or fused)."""
    _signal_all(local_ptr, delta16_ptr, kind, READY, epoch % 2, me, amount, R, R_POW2)
    if ADVANCE:
        if _last_to_finish(state_ptr + 2 + 2 * kind, num_programs):
            _advance(kind, epoch, state_ptr)


@triton.jit
def _issue_ticket(kind, state_ptr, ticket_ptr):
    """A split send kernel's call index: read from the call counter, and kept in `ticket` (written by the first
    program) for the receive kernel the hook launches later, when the counter may have moved on."""
    epoch = tl.load(state_ptr + kind)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(ticket_ptr, epoch)
    return epoch


@triton.jit
def _advance(kind, epoch, state_ptr):
    """The call counter of `kind` moves to the next call (every program of this call has read it)."""
    tl.atomic_xchg(state_ptr + kind, epoch + 1, sem="relaxed", scope="gpu")


@triton.jit
def _wait_ready(kind, epoch, items, local_ptr, status_ptr, timeout_ns, cost_ptr, R: tl.constexpr,
                R_POW2: tl.constexpr, USE_TIMER: tl.constexpr, HAS_COST: tl.constexpr):
    """Wait until every rank has done its `items` send items of this call for us (the count of ready items of this
    parity grows by `items` per call); with `HAS_COST`, add the wait for each rank to `cost_ptr` (ns)."""
    flags = _flag(local_ptr, kind, READY, epoch % 2, 0, R)
    if HAS_COST:
        _wait_all_timed(flags, (epoch // 2 + 1) * items, timeout_ns, status_ptr, cost_ptr, R, R_POW2, USE_TIMER)
    else:
        _wait_all(flags, (epoch // 2 + 1) * items, timeout_ns, status_ptr, R, R_POW2, USE_TIMER)


@triton.jit
def _dispatch_received(epoch, num_programs, local_ptr, delta16_ptr, state_ptr, count_ptr, stats_ptr, hdr_off, me,
                       R: tl.constexpr, L: tl.constexpr, HAS_STATS: tl.constexpr, L_POW2: tl.constexpr,
                       R_POW2: tl.constexpr, ADVANCE: tl.constexpr):
    """After a program's receives: the last one writes the counts (and stats), clears them, frees the area (and,
    in a fused kernel, `ADVANCE`s the call counter)."""
    if _last_to_finish(state_ptr + 3 + 2 * DISPATCH, num_programs):
        if ADVANCE:
            _advance(DISPATCH, epoch, state_ptr)
        hdr = (local_ptr + hdr_off).to(tl.pointer_type(tl.int32)) + (epoch % 2) * R * L
        e = tl.arange(0, L_POW2)
        total = tl.zeros([L_POW2], dtype=tl.int32)
        for s in tl.static_range(R):
            total += tl.load(hdr + s * L + e, mask=e < L, other=0)
            tl.store(hdr + s * L + e, tl.zeros([L_POW2], dtype=tl.int32), mask=e < L)  # counts start at 0
        tl.store(count_ptr + e, total, mask=e < L)
        if HAS_STATS:
            tl.store(stats_ptr + e, tl.load(stats_ptr + e, mask=e < L) + total, mask=e < L)
        _signal_all(local_ptr, delta16_ptr, DISPATCH, FREED, epoch % 2, me, tl.full([R_POW2], 1, tl.int64), R,
                    R_POW2)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def dispatch_send(
    x_ptr, topk_ptr, local_ptr, delta16_ptr, state_ptr, ticket_ptr, status_ptr,
    num_tokens, stride_x, stride_topk, me, timeout_ns, hdr_off, rows_off, row_bytes, scale_off, meta_off,
    N: tl.constexpr, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
    USE_FP8: tl.constexpr, POW2_SCALES: tl.constexpr, USE_TIMER: tl.constexpr,
    K_POW2: tl.constexpr, NBC: tl.constexpr, CHUNK: tl.constexpr, R_POW2: tl.constexpr, HW_FP8: tl.constexpr,
):
    """Grid (N, channel chunks); the receive kernel runs later (`return_recv_hook=True`)."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    epoch = _issue_ticket(DISPATCH, state_ptr, ticket_ptr)
    _dispatch_send_item(t, c, epoch, x_ptr, topk_ptr, local_ptr, delta16_ptr, status_ptr, num_tokens, stride_x,
                        stride_topk, me, timeout_ns, hdr_off, rows_off, row_bytes, scale_off, meta_off,
                        N, H, K, R, L, USE_FP8, POW2_SCALES, USE_TIMER, K_POW2, NBC, CHUNK, R_POW2,
                        HW_FP8)
    _sent(DISPATCH, epoch, tl.num_programs(0) * tl.num_programs(1), local_ptr, delta16_ptr, state_ptr, me,
          tl.full([R_POW2], 1, tl.int64), R, R_POW2, True)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def dispatch_recv(
    local_ptr, delta16_ptr, state_ptr, ticket_ptr, status_ptr, out_ptr, scales_ptr, count_ptr, stats_ptr, item_ptr,
    cost_ptr, me, timeout_ns, hdr_off, rows_off, row_bytes, scale_off, meta_off,
    N: tl.constexpr, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
    USE_FP8: tl.constexpr, UE8M0: tl.constexpr, HAS_STATS: tl.constexpr, HAS_COST: tl.constexpr,
    USE_TIMER: tl.constexpr,
    NB: tl.constexpr, NBC: tl.constexpr, L_POW2: tl.constexpr, SCALE_COLS: tl.constexpr,
    K_POW2: tl.constexpr, R_POW2: tl.constexpr,
):
    """Grid (R * N, channel chunks): the send kernel's chunks, so a sender does N * chunks send items."""
    pid = tl.program_id(0)
    epoch = tl.load(ticket_ptr)
    _wait_ready(DISPATCH, epoch, N * tl.num_programs(1), local_ptr, status_ptr, timeout_ns, cost_ptr, R, R_POW2,
                USE_TIMER, HAS_COST)
    _dispatch_recv_item(pid // N, pid % N, tl.program_id(1), epoch, local_ptr, out_ptr, scales_ptr, item_ptr, hdr_off,
                        rows_off, row_bytes, scale_off, meta_off, N, H, K, R, L, USE_FP8, UE8M0, NB, NBC,
                        SCALE_COLS, K_POW2)
    _dispatch_received(epoch, tl.num_programs(0) * tl.num_programs(1), local_ptr, delta16_ptr, state_ptr, count_ptr,
                       stats_ptr, hdr_off, me, R, L, HAS_STATS, L_POW2, R_POW2, False)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def dispatch_fused(
    x_ptr, topk_ptr, local_ptr, delta16_ptr, state_ptr, status_ptr, out_ptr, scales_ptr, count_ptr, stats_ptr,
    item_ptr, cost_ptr, num_tokens, stride_x, stride_topk, me, timeout_ns, hdr_off, rows_off, row_bytes, scale_off,
    meta_off, N: tl.constexpr, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
    USE_FP8: tl.constexpr, POW2_SCALES: tl.constexpr, UE8M0: tl.constexpr, HAS_STATS: tl.constexpr,
    HAS_COST: tl.constexpr, USE_TIMER: tl.constexpr, NB: tl.constexpr, NBC: tl.constexpr, C: tl.constexpr, L_POW2: tl.constexpr,
    SCALE_COLS: tl.constexpr, K_POW2: tl.constexpr, CHUNK: tl.constexpr, R_POW2: tl.constexpr, HW_FP8: tl.constexpr,
):
    """Send and receive in one launch: a persistent grid no larger than the GPU holds at once (every program must be
    resident, since each waits for all programs' sends), striding over the send items, then the receive items."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    epoch = tl.load(state_ptr + DISPATCH)
    for item in range(pid, N * C, grid):
        _dispatch_send_item(item // C, item % C, epoch, x_ptr, topk_ptr, local_ptr, delta16_ptr, status_ptr,
                            num_tokens, stride_x, stride_topk, me, timeout_ns, hdr_off, rows_off, row_bytes,
                            scale_off, meta_off, N, H, K, R, L, USE_FP8, POW2_SCALES, USE_TIMER, K_POW2, NBC, CHUNK,
                            R_POW2, HW_FP8)
    done = tl.cdiv(tl.maximum(N * C - pid, 0), grid)  # send items this program did, each for every rank
    _sent(DISPATCH, epoch, grid, local_ptr, delta16_ptr, state_ptr, me, tl.full([R_POW2], 1, tl.int64) * done, R,
          R_POW2, False)
    _wait_ready(DISPATCH, epoch, N * C, local_ptr, status_ptr, timeout_ns, cost_ptr, R, R_POW2, USE_TIMER, HAS_COST)
    for item in range(pid, R * N * C, grid):
        _dispatch_recv_item(item // (N * C), (item // C) % N, item % C, epoch, local_ptr, out_ptr, scales_ptr,
                            item_ptr, hdr_off, rows_off, row_bytes, scale_off, meta_off, N, H, K, R, L, USE_FP8,
                            UE8M0, NB, NBC, SCALE_COLS, K_POW2)
    _dispatch_received(epoch, grid, local_ptr, delta16_ptr, state_ptr, count_ptr, stats_ptr, hdr_off, me, R, L,
                       HAS_STATS, L_POW2, R_POW2, True)


# -- combine -------------------------------------------------------------------------------------------------------
@triton.jit
def _combine_send_item(
    dst_rank, t, kb, epoch, x_ptr, item_ptr, local_ptr, delta16_ptr, status_ptr, me, timeout_ns, comb_off, arr_off,
    crow_bytes, N: tl.constexpr, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
    NUM_CH: tl.constexpr, KP: tl.constexpr, USE_TIMER: tl.constexpr,
):
    """Top-k positions kb*KP .. of token t of rank dst_rank: each expert output row back to slot (t, k) there, then
    one release add to that token's arrival count there (`_arrivals`, this rank's column)."""
    dst_rank = _as_tensor(dst_rank)
    t = _as_tensor(t)
    kb = _as_tensor(kb)
    parity = epoch % 2
    _wait(_flag(local_ptr, COMBINE, FREED, parity, dst_rank, R), epoch // 2, dst_rank, timeout_ns, status_ptr,
          USE_TIMER)
    region = _region(local_ptr, delta16_ptr, dst_rank)
    area = region + comb_off + (parity * N * K).to(tl.int64) * crow_bytes
    offs = tl.arange(0, NUM_CH)[:, None] * BLOCK_H + tl.arange(0, BLOCK_H)[None, :]
    for j in tl.static_range(KP):
        kj = kb * KP + j
        item = tl.load(item_ptr + (dst_rank * N + t) * K + kj, mask=kj < K, other=-1)
        if item >= 0:
            # The whole row in one load, then one store: every load is in flight before the first store.
            out = (area + (t * K + kj).to(tl.int64) * crow_bytes).to(tl.pointer_type(tl.bfloat16))
            tl.store(out + offs, tl.load(x_ptr + item.to(tl.int64) * H + offs, mask=offs < H), mask=offs < H)
    tl.debug_barrier()  # every thread's stores happen before the add below
    arrivals = _arrivals(region, arr_off, parity, t, N, R) + me
    if dst_rank == me:  # read on this GPU: a GPU-scope release does not wait for this SM's NVLink stores
        tl.atomic_add(arrivals, 1, sem="release", scope="gpu")
    else:
        tl.atomic_add(arrivals, 1, sem="release", scope="sys")


@triton.jit
def _arrivals(region, arr_off, parity, t, N: tl.constexpr, R: tl.constexpr):
    """Pointer to token slot t's R arrival counts (one per source rank, int64) in `region` for this parity: each
    send item for the slot adds 1, so a call of parity p finds (calls of parity p so far) x KB from every source."""
    return (region + arr_off).to(tl.pointer_type(tl.int64)) + (parity * N + t) * R


@triton.jit
def _combine_recv_item(
    t, hc, epoch, topk_ptr, weights_ptr, out_ptr, local_ptr, status_ptr, cost_ptr, stride_topk, stride_w, stride_out,
    timeout_ns, comb_off, arr_off, crow_bytes, N: tl.constexpr, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr,
    KB: tl.constexpr, BLOCK_H: tl.constexpr, USE_TIMER: tl.constexpr, R_POW2: tl.constexpr, HAS_COST: tl.constexpr,
):
    """Channels hc*BLOCK_H .. of token t, once every rank's send items for the token have arrived:
    sum_k w_k * y_k in fp32, ascending k, one rounding to bf16. With `HAS_COST`, the wait for each rank is added to
    `cost_ptr` (ns)."""
    t = _as_tensor(t)
    arrivals = _arrivals(local_ptr, arr_off, epoch % 2, t, N, R)
    if HAS_COST:
        _wait_all_timed(arrivals, (epoch // 2 + 1) * KB, timeout_ns, status_ptr, cost_ptr, R, R_POW2, USE_TIMER)
    else:
        _wait_all(arrivals, (epoch // 2 + 1) * KB, timeout_ns, status_ptr, R, R_POW2, USE_TIMER)
    offs = hc * BLOCK_H + tl.arange(0, BLOCK_H)
    area = local_ptr + comb_off + ((epoch % 2) * N * K).to(tl.int64) * crow_bytes
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):
        expert = tl.load(topk_ptr + t * stride_topk + k)
        w = tl.load(weights_ptr + t * stride_w + k)
        y_ptr = (area + (t * K + k).to(tl.int64) * crow_bytes).to(tl.pointer_type(tl.bfloat16))
        y = tl.load(y_ptr + offs, mask=offs < tl.where(expert >= 0, H, 0), other=0.0).to(tl.float32)
        # One fp32 product and one fp32 sum per position (the launch turns off FMA contraction).
        acc = tl.where(expert >= 0, acc + w * y, acc)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + offs, _to_bf16(acc), mask=offs < H)


@triton.jit
def _combine_received(epoch, num_programs, local_ptr, delta16_ptr, state_ptr, me, R: tl.constexpr,
                      R_POW2: tl.constexpr, ADVANCE: tl.constexpr):
    if _last_to_finish(state_ptr + 3 + 2 * COMBINE, num_programs):
        if ADVANCE:
            _advance(COMBINE, epoch, state_ptr)
        _signal_all(local_ptr, delta16_ptr, COMBINE, FREED, epoch % 2, me, tl.full([R_POW2], 1, tl.int64), R,
                    R_POW2)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def combine_send(
    x_ptr, item_ptr, local_ptr, delta16_ptr, state_ptr, ticket_ptr, status_ptr, me, timeout_ns, comb_off, arr_off,
    crow_bytes, N: tl.constexpr, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
    NUM_CH: tl.constexpr, KP: tl.constexpr, USE_TIMER: tl.constexpr, R_POW2: tl.constexpr,
):
    """Grid (R * N, ceil(K / KP)); the receive kernel runs later (`return_recv_hook=True`)."""
    pid = tl.program_id(0)
    epoch = _issue_ticket(COMBINE, state_ptr, ticket_ptr)
    _combine_send_item(pid // N, pid % N, tl.program_id(1), epoch, x_ptr, item_ptr, local_ptr, delta16_ptr,
                       status_ptr, me, timeout_ns, comb_off, arr_off, crow_bytes, N, H, K, R, BLOCK_H, NUM_CH, KP,
                       USE_TIMER)
    if _last_to_finish(state_ptr + 2 + 2 * COMBINE, tl.num_programs(0) * tl.num_programs(1)):
        _advance(COMBINE, epoch, state_ptr)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def combine_recv(
    topk_ptr, weights_ptr, out_ptr, local_ptr, delta16_ptr, state_ptr, ticket_ptr, status_ptr, cost_ptr,
    num_tokens, stride_topk, stride_w, stride_out, me, timeout_ns, comb_off, arr_off, crow_bytes,
    N: tl.constexpr, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_TIMER: tl.constexpr, KB: tl.constexpr, R_POW2: tl.constexpr, HAS_COST: tl.constexpr,
):
    """Grid (max(T, 1), channel blocks): each program waits for its token's arrivals only."""
    t = tl.program_id(0)
    epoch = tl.load(ticket_ptr)
    if t < num_tokens:
        _combine_recv_item(t, tl.program_id(1), epoch, topk_ptr, weights_ptr, out_ptr, local_ptr, status_ptr,
                           cost_ptr, stride_topk, stride_w, stride_out, timeout_ns, comb_off, arr_off, crow_bytes, N,
                           H, K, R, KB, BLOCK_H, USE_TIMER, R_POW2, HAS_COST)
    _combine_received(epoch, tl.num_programs(0) * tl.num_programs(1), local_ptr, delta16_ptr, state_ptr, me, R,
                      R_POW2, False)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def combine_fused(
    x_ptr, item_ptr, topk_ptr, weights_ptr, out_ptr, local_ptr, delta16_ptr, state_ptr, status_ptr, cost_ptr,
    num_tokens, stride_topk, stride_w, stride_out, me, timeout_ns, send_programs, comb_off, arr_off, crow_bytes,
    N: tl.constexpr, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, SEND_BLOCK_H: tl.constexpr,
    NUM_CH: tl.constexpr, KP: tl.constexpr, KB: tl.constexpr, BLOCK_H: tl.constexpr, HC: tl.constexpr,
    USE_TIMER: tl.constexpr, R_POW2: tl.constexpr, HAS_COST: tl.constexpr,
):
    """Send and receive in one launch (persistent grid, every program resident; see `dispatch_fused`).

    The first `send_programs` programs send the rows for other ranks, token slot by token slot (the link is the
    bottleneck, so a few senders per SM keep it busy: `lowlatency_nvlink._COMBINE_SENDERS_PER_SM`; at a variant's
    first launch, one program per SM, every program sends). Then every program copies rows for this rank and
    receives tokens, the programs that send nothing first: a token is summed as soon as its own arrivals are in,
    while the rows of other tokens still travel."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    epoch = tl.load(state_ptr + COMBINE)
    per_slot = (R - 1) * KB  # send items per token slot for other ranks
    senders = tl.minimum(send_programs, grid)
    if pid < senders:
        for i in range(pid, N * per_slot, senders):
            j = i % per_slot
            _combine_send_item((me + 1 + j // KB) % R, i // per_slot, j % KB, epoch, x_ptr, item_ptr, local_ptr,
                               delta16_ptr, status_ptr, me, timeout_ns, comb_off, arr_off, crow_bytes, N, H, K, R,
                               SEND_BLOCK_H, NUM_CH, KP, USE_TIMER)
    # Rows for this rank and the receives, from the last program down (the programs that send nothing first).
    for i in range(grid - 1 - pid, N * KB, grid):
        _combine_send_item(me, i // KB, i % KB, epoch, x_ptr, item_ptr, local_ptr, delta16_ptr, status_ptr, me,
                           timeout_ns, comb_off, arr_off, crow_bytes, N, H, K, R, SEND_BLOCK_H, NUM_CH, KP, USE_TIMER)
    for i in range(grid - 1 - pid, num_tokens * HC, grid):
        _combine_recv_item(i // HC, i % HC, epoch, topk_ptr, weights_ptr, out_ptr, local_ptr, status_ptr, cost_ptr,
                           stride_topk, stride_w, stride_out, timeout_ns, comb_off, arr_off, crow_bytes, N, H, K, R,
                           KB, BLOCK_H, USE_TIMER, R_POW2, HAS_COST)
    _combine_received(epoch, grid, local_ptr, delta16_ptr, state_ptr, me, R, R_POW2, True)
