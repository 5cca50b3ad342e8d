"""Triton body of `kernels/push.py` (imported lazily; needs triton)."""

import torch
import triton
import triton.language as tl

from ..sizing import next_pow2


@triton.jit(do_not_specialize=["rank", "num_rows", "cap"])
def _push_rows_kernel(
    local_ptr, delta16_ptr, area_off_words, rec_words,
    data_ptr, data_stride_words, data_words,
    small_ptr, small_stride_words, small_words, small_off_words,
    src_ptr, num_rows, cap, rank,
    BLOCK: tl.constexpr, SMALL_BLOCK: tl.constexpr,
):
    """Persistent: program p moves send rows p, p + P, ...; each row's record goes to its destination's area.

    Worked example: see kernels/push.py (cap 2, sender rank 1, src_X = [0, -1, 2, 1]).
    """
    for x in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        src = tl.load(src_ptr + x)
        if src >= 0:
            dest = x // cap
            row = (rank * cap + x % cap).to(tl.int64)
            # The peer's region is `delta16 * 16` bytes from ours; stating it in 16-byte units keeps the address
            # provably 16-byte aligned, so the stores below are 16-byte vector stores.
            dst = local_ptr + tl.load(delta16_ptr + dest) * 4 + area_off_words + row * rec_words
            src_row = data_ptr + src * data_stride_words
            for w in range(0, data_words, BLOCK):
                offs = w + tl.arange(0, BLOCK)
                mask = offs < data_words
                tl.store(dst + offs, tl.load(src_row + offs, mask=mask), mask=mask)
            offs = tl.arange(0, SMALL_BLOCK)
            mask = offs < small_words
            small = tl.load(small_ptr + src * small_stride_words + offs, mask=mask)
            tl.store(dst + small_off_words + offs, small, mask=mask)


def launch(local, delta16, area_offset, rec_bytes, data, small, data_bytes, src_X, cap, rank, num_programs,
           block: int = 1024, num_warps: int = 4):
    data_w = data.view(torch.int32)
    small_w = small.view(torch.int32) if small.shape[1] else small.new_zeros(small.shape[0], 4).view(torch.int32)
    small_words = small.shape[1] // 4
    num_rows = src_X.shape[0]
    grid = (min(num_programs, num_rows),)
    _push_rows_kernel[grid](
        local.view(torch.int32), delta16, area_offset // 4, rec_bytes // 4,
        data_w, data_w.stride(0), data_w.shape[1],
        small_w, small_w.stride(0), small_words, data_bytes // 4,
        src_X, num_rows, cap, rank,
        BLOCK=block, SMALL_BLOCK=next_pow2(max(small_words, 1)),
        num_warps=num_warps,
    )
