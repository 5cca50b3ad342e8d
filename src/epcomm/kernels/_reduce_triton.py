"""Triton body of the canonical reduction (imported lazily by `kernels/reduce.py`; needs triton)."""

import triton
import triton.language as tl

from ..sizing import ceil_div, next_pow2

from .launch import launch as launch_direct


# Per-call integers: one compiled variant for all their values (Triton would specialise chunk 1 or an own range
# starting at 0 or at a multiple of 16 into variants of their own).
@triton.jit(do_not_specialize=["chunk", "own_lo", "own_n"])
def _canonical_reduce_kernel(
    rows_ptr, item_ptr, bias0_ptr, bias1_ptr, out_ptr, tokens_ptr, bounds_ptr, own_ptr,
    num_tokens, hidden, stride_rows, stride_item, stride_bias0, stride_bias1, stride_out, chunk, own_lo, own_n,
    stride_own,
    NUM_POS: tl.constexpr, HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, ACC_FP64: tl.constexpr,
    DOWNCAST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, TOKEN_LIST: tl.constexpr,
    HAS_OWN: tl.constexpr,
):
    """out[t] = round(0 + bias0[t] + bias1[t] + sum_p rows[item[t, p]] (p ascending, item >= 0)).

    Every token, or with `TOKEN_LIST` only tokens `tokens[bounds[chunk]:bounds[chunk + 1]]` (a combine reducing
    the tokens whose rows have arrived while later rows still travel). With `HAS_OWN`, rows `own_lo ..
    own_lo + own_n - 1` are read from `own` instead (a rank's rows for itself, never copied into `rows`).

    Worked example (fp32, no bias): rows = [[1.], [2.], [4.]], item = [[2, -1, 0], [-1, -1, -1]]
    -> out = [[5.], [0.]].
    """
    # Persistent: program i handles tiles i, i + P, ... (a tile = BLOCK_T tokens x BLOCK_H channels), so the grid
    # size bounds the SMs the reduction occupies (`num_sms`).
    first = 0
    if TOKEN_LIST:  # the chunk's token count is known on the device only
        first = tl.load(bounds_ptr + chunk)
        num_tokens = tl.load(bounds_ptr + chunk + 1) - first
    num_h_tiles = tl.cdiv(hidden, BLOCK_H)
    num_tiles = tl.cdiv(num_tokens, BLOCK_T) * num_h_tiles
    acc_dtype = tl.float64 if ACC_FP64 else tl.float32
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        i = tile // num_h_tiles * BLOCK_T + tl.arange(0, BLOCK_T)
        offs = (tile % num_h_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
        t_ok = i < num_tokens
        if TOKEN_LIST:
            t = tl.load(tokens_ptr + first + i, mask=t_ok, other=0).to(tl.int64)
        else:
            t = i.to(tl.int64)
        inside = t_ok[:, None] & (offs < hidden)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=acc_dtype)
        if HAS_BIAS0:
            acc += tl.load(bias0_ptr + t[:, None] * stride_bias0 + offs[None, :], mask=inside, other=0.0).to(acc_dtype)
        if HAS_BIAS1:
            acc += tl.load(bias1_ptr + t[:, None] * stride_bias1 + offs[None, :], mask=inside, other=0.0).to(acc_dtype)
        for p in tl.static_range(NUM_POS):
            # Branch-free, so the unrolled loads of every position can be in flight together; `where` (not a
            # masked add of 0) keeps the sum bitwise that of skipping the position.
            row = tl.load(item_ptr + t * stride_item + p, mask=t_ok, other=-1).to(tl.int64)
            limit = tl.where(row >= 0, hidden, 0)  # no channel of an absent item is read
            src = rows_ptr + tl.maximum(row, 0)[:, None] * stride_rows + offs[None, :]
            if HAS_OWN:
                mine = (row >= own_lo) & (row < own_lo + own_n)
                src = tl.where(mine[:, None], own_ptr + (row - own_lo)[:, None] * stride_own + offs[None, :], src)
            val = tl.load(src, mask=offs[None, :] < limit[:, None], other=0.0)
            acc = tl.where((row >= 0)[:, None], acc + val.to(acc_dtype), acc)
        if DOWNCAST:  # one rounding, to nearest even (as torch)
            out = acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        else:
            out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t[:, None] * stride_out + offs[None, :], out, mask=inside)


def launch(rows, item, bias0, bias1, out, num_programs: int = 0, block_t: int = 4, block_h: int = 1024,
           num_warps: int = 8, tokens=None, bounds=None, chunk: int = 0, num_chunks: int = 1, own=None,
           own_lo: int = 0):
    """`num_programs` > 0 caps the grid (at most that many SMs busy); 0 = one program per tile. `own` ([n, H],
    rows' dtype, unit channel stride): rows `own_lo .. own_lo + n - 1` are read from it.

    With `tokens` ([T] int32/int64, a permutation of the tokens) and `bounds` ([num_chunks + 1] int64 on the
    device), only chunk `chunk`'s tokens are reduced; the uncapped grid is then sized for an even share of the
    tokens, and its programs loop over the rest."""
    num_tokens, num_pos = item.shape
    hidden = rows.shape[1]
    block_h = min(block_h, next_pow2(max(hidden, 16)))
    tiles = ceil_div(ceil_div(num_tokens, num_chunks), block_t) * ceil_div(hidden, block_h)
    grid = (min(tiles, num_programs) if num_programs > 0 else tiles,)
    launch_direct(_canonical_reduce_kernel, grid,
        rows, item, bias0 if bias0 is not None else out, bias1 if bias1 is not None else out, out,
        tokens if tokens is not None else item, bounds if bounds is not None else item,
        own if own is not None else rows,
        num_tokens, hidden, rows.stride(0), item.stride(0),
        bias0.stride(0) if bias0 is not None else 0, bias1.stride(0) if bias1 is not None else 0, out.stride(0),
        chunk, own_lo, own.shape[0] if own is not None else 0, own.stride(0) if own is not None else 0,
        NUM_POS=num_pos, HAS_BIAS0=bias0 is not None, HAS_BIAS1=bias1 is not None,
        ACC_FP64=rows.dtype.itemsize == 8, DOWNCAST=out.dtype.itemsize < max(4, rows.dtype.itemsize),
        BLOCK_T=block_t, BLOCK_H=block_h, TOKEN_LIST=tokens is not None, HAS_OWN=own is not None,
        num_warps=num_warps,
    )
    return out
