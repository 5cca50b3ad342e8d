"""Triton body of the pull's one-launch gather (transport/pull.py): the rows a rank sends, of up to four fields, into
its staging area or, for its own rows, straight into its outputs. An eager call on a host where a launch costs tens
of microseconds pays one launch here instead of two `index_select`s per field. In a CUDA graph, where launches are
cheap, `index_select` gathers faster (2x H200); there `copy_words` reads the narrow fields (scales, weights: at
most 512 bytes a row) out of the peers' staging areas with the SMs.

Every field is moved as int32 words, whatever its dtype (callers check that rows are whole words and that every
tensor starts on 4 bytes); all tensors are row-contiguous.

With `BARRIER` the last program to finish runs the region's device barrier (`_signal_triton.group_barrier`), which
an eager pull needs right after its staging: one launch less per eager dispatch, on hosts where a launch costs
tens of microseconds.
"""

import triton
import triton.language as tl

from ._signal_triton import _last_to_finish, group_barrier


@triton.jit
def _copy_row(src_ptr, stage_ptr, out_ptr, t, row, own, out_lo, ww, W: tl.constexpr):
    words = tl.pointer_type(tl.int32)
    v = tl.load(src_ptr.to(words) + t * W + ww, mask=ww < W)
    tl.store(out_ptr.to(words) + (out_lo + row) * W + ww, v, mask=ww < tl.where(own != 0, W, 0))
    tl.store(stage_ptr.to(words) + row * W + ww, v, mask=ww < tl.where(own != 0, 0, W))


@triton.jit(do_not_specialize=["own_lo", "own_hi", "out_lo", "me", "timeout_ns", "flags_off"])
def gather_fields(
    idx_ptr, own_lo, own_hi, out_lo,
    src0, stage0, out0, src1, stage1, out1, src2, stage2, out2, src3, stage3, out3,
    done_ptr, local_ptr, delta16_ptr, status_ptr, me, timeout_ns, flags_off,
    W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
    P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr, BLOCK: tl.constexpr,
    BARRIER: tl.constexpr, R: tl.constexpr, R_POW2: tl.constexpr, SIGNAL: tl.constexpr, WAIT: tl.constexpr,
    USE_TIMER: tl.constexpr,
):
    """Program (x, c): send row x, which is row `idx[x]` of every source. Block c of field 0's words (W0 words a row);
    c = 0 also fields 1-3 (W = 0: no field; P: the next power of 2 of W). Send rows own_lo .. own_hi - 1 are this
    rank's rows for itself and go to `out[out_lo + x - own_lo]`; the others to `stage[x]` (x < own_lo) or
    `stage[x - own rows]`.

    `BARRIER`: then the last program to finish (`done_ptr`: an int64 counter at zero) runs the region's barrier
    (`group_barrier`'s arguments from `local_ptr` on; `SIGNAL` / `WAIT` split it for the CPU simulation of several
    ranks, both set on GPU), so that every rank's staging is complete when the barrier ends. Without it the
    barrier's arguments are not read."""
    x = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(idx_ptr + x)
    own = ((x >= own_lo) & (x < own_hi)).to(tl.int32)
    row = tl.where(own != 0, x - own_lo, tl.where(x < own_lo, x, x - (own_hi - own_lo)))
    _copy_row(src0, stage0, out0, t, row, own, out_lo, c * BLOCK + tl.arange(0, BLOCK), W0)
    if c == 0:
        if W1 > 0:
            _copy_row(src1, stage1, out1, t, row, own, out_lo, tl.arange(0, P1), W1)
        if W2 > 0:
            _copy_row(src2, stage2, out2, t, row, own, out_lo, tl.arange(0, P2), W2)
        if W3 > 0:
            _copy_row(src3, stage3, out3, t, row, own, out_lo, tl.arange(0, P3), W3)
    if BARRIER:
        if _last_to_finish(done_ptr, tl.num_programs(0) * tl.num_programs(1)):
            group_barrier(local_ptr, delta16_ptr, status_ptr, me, timeout_ns, flags_off, R, R_POW2, SIGNAL, WAIT,
                          USE_TIMER)


@triton.jit
def copy_words(src_ptr, dst_ptr, num_words, BLOCK: tl.constexpr):
    """Program i: words i * BLOCK .. (i + 1) * BLOCK - 1 of `num_words` contiguous 4-byte words from `src` (a peer's
    staging area, read over NVLink) to `dst`."""
    w = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    words = tl.pointer_type(tl.int32)
    tl.store(dst_ptr.to(words) + w, tl.load(src_ptr.to(words) + w, mask=w < num_words), mask=w < num_words)
