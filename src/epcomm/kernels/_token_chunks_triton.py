"""Triton bodies of the chunked combine's schedule (`pipeline._token_chunks`): which chunk of the return push
brings the last returned row of each token, and the tokens grouped by that chunk.

In a CUDA graph the combine reduces each chunk's tokens as soon as the chunk lands (transport/push_back.py). This
schedule is derived inside the graph on every replay (index tensors made under capture are not kept); as ~35 torch
ops it held the first reduction back by ~90 us on 2x H200, as two launches it costs a few.

Chunk c of a source's n returned rows is rows `n * c * E // W .. n * (c + 1) * E // W - 1` for c < C - 1 and the
rest for the last, with W = (C - 1) * E + 1: `moves.chunk_bounds(n, moves.return_weights(C))` with
`RETURN_EARLIER` = E.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_tokens", "item_stride", "width", "num_ranks", "chunks", "earlier"])
def token_chunk(item_ptr, rows_ptr, chunk_ptr, num_tokens, item_stride, width, num_ranks, chunks, earlier,
                BLOCK_T: tl.constexpr, P_POW2: tl.constexpr):
    """Program i: tokens i * BLOCK_T ..: `chunk[t]` = the largest chunk among the rows `item[t, :width]` (-1: none;
    0 without rows). Returned rows come by source rank, `rows[r]` from rank r, ranks in order."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    p = tl.arange(0, P_POW2)
    valid = (t[:, None] < num_tokens) & (p[None, :] < width)
    x = tl.load(item_ptr + t[:, None] * item_stride + p[None, :], mask=valid, other=-1)
    total = (chunks - 1) * earlier + 1
    chunk = tl.zeros([BLOCK_T, P_POW2], dtype=tl.int64)
    first = tl.zeros([1, 1], dtype=tl.int64)  # the first row of source r
    for r in range(num_ranks):
        n = tl.load(rows_ptr + r + first * 0)  # [1, 1]
        j = x - first
        c_of = tl.zeros([BLOCK_T, P_POW2], dtype=tl.int64)
        for c in range(1, chunks):
            c_of += (j >= n * (c * earlier) // total).to(tl.int64)
        chunk = tl.where((j >= 0) & (j < n), c_of, chunk)
        first += n
    last = tl.max(tl.where(x >= 0, chunk, 0), axis=1)
    tl.store(chunk_ptr + t, last, mask=t < num_tokens)


@triton.jit(do_not_specialize=["num_tokens", "chunks"])
def group_by_chunk(chunk_ptr, tokens_ptr, bounds_ptr, num_tokens, chunks, BLOCK: tl.constexpr,
                   C_POW2: tl.constexpr):
    """One program: `tokens` = every token once, grouped by `chunk[t]` in ascending order, ascending within a chunk;
    `bounds[c] .. bounds[c + 1] - 1` are chunk c's (C + 1 entries). Two passes: count, then place."""
    cs = tl.arange(0, C_POW2)
    counts = tl.zeros([C_POW2], dtype=tl.int64)
    for start in range(0, num_tokens, BLOCK):
        t = start + tl.arange(0, BLOCK)
        ch = tl.load(chunk_ptr + t, mask=t < num_tokens, other=C_POW2)  # past the end: no chunk's column
        counts += tl.sum((ch[:, None] == cs[None, :]).to(tl.int64), axis=0)
    through = tl.cumsum(counts, axis=0)
    tl.store(bounds_ptr + cs + 1, through, mask=cs < chunks)
    tl.store(bounds_ptr + cs, tl.zeros([C_POW2], dtype=tl.int64), mask=cs == 0)
    placed = through - counts  # next free slot of each chunk
    for start in range(0, num_tokens, BLOCK):
        t = start + tl.arange(0, BLOCK)
        ch = tl.load(chunk_ptr + t, mask=t < num_tokens, other=C_POW2)
        hit = (ch[:, None] == cs[None, :]).to(tl.int64)
        before = tl.cumsum(hit, axis=0) - hit  # tokens of the same chunk earlier in this block
        slot = tl.sum(tl.where(hit != 0, placed[None, :] + before, 0), axis=1)
        tl.store(tokens_ptr + slot, t.to(tl.int64), mask=t < num_tokens)
        placed += tl.sum(hit, axis=0)
