"""The nvlink transport's pull: CPU-synced field moves (`Transport.move_fields`) read from peers' staging areas.

Each rank gathers the rows it sends to other ranks, in send order, into its own staging area (symmetric memory);
its rows for itself are gathered straight into its outputs. After a device barrier every rank copies its rows
out of each peer's staging area into its outputs with the copy engines, which reach the link ceiling and use no
SMs. Under CUDA-graph capture the staging goes in `C` chunks, each published by its own barrier, so that the copy
engines pull chunk c while the SMs gather chunk c + 1; the pulls run on a second stream, and the own-rows gather
follows the staging on the first, beside the pulls (eager calls keep one stream: they are bound by launch cost).
Narrow fields (at most 512 bytes a row: FP8 scales, weights; rows of whole 4-byte words) are then read out of the
peers by the SMs, not by copy-engine copies, which cost more to start in a replay than such fields take to move.

Rank s's staging area holds, per field, `staged_rows[s]` rows; my rows in it start at `first_row_at[s]` (rows s
sends to ranks before me, other than itself); its chunk c is rows
`moves.chunk_bounds(n, moves.pull_weights(C))[c: c + 2]` (a small first chunk, since its staging holds back the
first pull). Every rank derives all of it from the split matrix, so every rank agrees on C and on the number of
barriers.

Worked example (2 ranks, matrix [[2, 3], [1, 4]]: rank 0 sends 2 rows to itself, 3 to rank 1):
    rank 0 stages its 3 rows for rank 1; rank 1 stages its 1 row for rank 0
    rank 0 pulls rank 1's row 0; rank 1 pulls rank 0's rows 0..2
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .. import envs
from ..debug import phase
from ..kernels.launch import launch
from ..moves import chunk_bounds, chunk_count, offsets, pull_weights
from ..sizing import align, ceil_div, next_pow2

# Chunking pays when launches are cheap (graph replay) and the staged bytes are large; eager calls on slow hosts
# pay more in launches than they gain (eager 1 / 2 / 4 / 8 chunks = 393 / 420 / 454 / 947 us).
_CHUNKS_CAPTURED = 2  # 2x H200 dsv3 graph replay: 1 / 2 / 4 / 8 chunks = 259 / 247 / 251 / 280 us


def aligned(nbytes: int) -> int:
    return align(nbytes, 256)


class PullPlan:
    """What a pull derives once per route (host lists, index tensors, views of the staging areas)."""

    def __init__(self, route, me: int, num_ranks: int, device: torch.device):
        m = route.matrix
        assert m is not None, "the nvlink transport needs the split matrix of a packed route"
        self.me, self.num_ranks = me, num_ranks
        self.recv_splits = list(route.recv_splits)
        self.staged_rows = [sum(m[s]) - m[s][s] for s in range(num_ranks)]
        self.first_row_at = [sum(m[s][p] for p in range(me) if p != s) for s in range(num_ranks)]
        self.recv_off = offsets(route.recv_splits)
        send_off = offsets(route.send_splits)
        self.send_idx = route.send_index(device)
        self.own_rows = (send_off[me], send_off[me] + route.send_splits[me])  # send rows of my rows for myself
        self._views: dict = {}

    @property
    def self_idx(self) -> torch.Tensor:
        lo, hi = self.own_rows
        return self.send_idx[lo:hi]

    def staged_pieces(self, a: int, b: int) -> list:
        """Staged rows a .. b - 1 (the send rows other ranks pull, in order: every send row but my own block) as
        `[(index of their source rows, first staged row)]`: slices of the send index, two where the range spans my
        own block (no concatenation, which would be one more launch)."""
        (lo, hi), idx = self.own_rows, self.send_idx
        n_own = hi - lo
        pieces = []
        if a < min(b, lo):
            pieces.append((idx[a: min(b, lo)], a))
        start = max(a, lo)
        if b > start:
            pieces.append((idx[start + n_own: b + n_own], start))
        return pieces

    def stage_bytes(self, row_bytes: list) -> int:
        """The largest staging area any rank needs for fields of `row_bytes` bytes per row."""
        return max(sum(aligned(rows * b) for b in row_bytes) for rows in self.staged_rows)

    def num_chunks(self, row_bytes: list, capturing: bool) -> int:
        return chunk_count(envs.pull_chunks(), capturing, max(self.staged_rows) * sum(row_bytes), _CHUNKS_CAPTURED)

    def views(self, region, stage: int, moves: list, row_bytes: list, chunks: int) -> tuple:
        """`(staged, pulled, every)`: per chunk, `staged[c]` = (the pieces of my rows in chunk c (`staged_pieces`),
        its first staged row, one staging view per field) or None;
        `pulled[c]` = [(output row, rows, one peer view per field)] for every peer piece of chunk c;
        `every` = `pulled`'s pieces of all chunks together, one per peer. Made once per staging area, chunking and
        field kinds (slicing peer memory costs host time)."""
        weights = pull_weights(chunks)  # a small first chunk: its staging holds back the first pull
        key = (stage, weights, tuple((src.dtype, tuple(src.shape[1:])) for src, _ in moves))
        got = self._views.get(key)
        if got is not None:
            return got
        shapes = [(src.dtype, tuple(src.shape[1:])) for src, _ in moves]

        def field_views(rank: int, first: int, n: int) -> list:
            out, off = [], stage
            for (dtype, shape), nbytes in zip(shapes, row_bytes):
                out.append(region.peer(rank, off + first * nbytes, (n,) + shape, dtype))
                off += aligned(self.staged_rows[rank] * nbytes)
            return out

        staged, pulled = [], []
        bounds = [chunk_bounds(n, weights) for n in self.staged_rows]
        for c in range(chunks):
            a, b = bounds[self.me][c], bounds[self.me][c + 1]
            staged.append((self.staged_pieces(a, b), a, field_views(self.me, a, b - a)) if b > a else None)
            pieces = []
            for s in range(self.num_ranks):
                if s == self.me or self.recv_splits[s] == 0:
                    continue
                a, b = bounds[s][c], bounds[s][c + 1]
                lo = max(a, self.first_row_at[s])
                hi = min(b, self.first_row_at[s] + self.recv_splits[s])
                if hi > lo:
                    out_row = self.recv_off[s] + lo - self.first_row_at[s]
                    pieces.append((out_row, hi - lo, field_views(s, lo, hi - lo)))
            pulled.append(pieces)
        # One chunk: its pieces are already one per peer, each whole (eager calls: no second set of peer views).
        every = pulled[0] if chunks == 1 else [
            (self.recv_off[s], self.recv_splits[s], field_views(s, self.first_row_at[s], self.recv_splits[s]))
            for s in range(self.num_ranks) if s != self.me and self.recv_splits[s]]
        got = self._views[key] = (staged, pulled, every)
        return got


def pull_fields(tr, plan: PullPlan, moves: list, row_bytes: list, stage: int, capturing: bool,
                side: Optional["torch.cuda.Stream"], beside: tuple = ()) -> None:
    """One pull over `tr` (the nvlink transport: `region`, `barrier`). `side`: the stream that runs the pulls
    beside the staging and the gather of my own rows (None on CPU: all in order). `beside`: the caller's local
    copies `(src, dst)`, run after my own rows on the first stream (with `side`, while the last pull still travels;
    without, after it)."""
    chunks = plan.num_chunks(row_bytes, capturing)
    staged, pulled, every = plan.views(tr.region, stage, moves, row_bytes, chunks)
    lo, n_self = plan.recv_off[plan.me], plan.recv_splits[plan.me]
    main = torch.cuda.current_stream(tr.device) if side is not None else None
    by_words = _gathers_in_one_launch(moves, row_bytes)  # rows of whole words: word kernels may move them
    # In a graph the SMs read narrow fields (FP8 scales, weights) out of the peers after the last barrier, beside the
    # copy engines' pulls: in a replay each copy-engine copy costs 2-10 us of start-up (2x H200 timeline), more
    # than such a field's bytes take.
    by_sms = {i for i, b in enumerate(row_bytes) if b <= _SM_PULL_ROW_BYTES} if side is not None and by_words else ()

    def gather_own_rows():  # my rows for myself: no staging, no barrier
        if n_self:
            for src, out in moves:
                torch.index_select(src, 0, plan.self_idx, out=out[lo: lo + n_self])

    one_launch = chunks == 1 and side is None and by_words
    for c in range(chunks):
        synced = False
        with phase("stage"):
            if one_launch:  # my staged rows, my own rows and the barrier in one launch
                synced = gather_in_one_launch(plan, moves, row_bytes, None if staged[0] is None else staged[0][2],
                                              lo, tr.region.barrier_in_kernel() if _GATHER_BARRIER else None)
            elif staged[c] is not None:  # in a graph index_select gathers faster than one word launch (2x H200)
                pieces, first, views = staged[c]
                for idx, row in pieces:
                    for (src, _), view in zip(moves, views):
                        torch.index_select(src, 0, idx, out=view[row - first: row - first + idx.shape[0]])
        if not synced:
            tr.barrier()  # chunk c of every peer's staging area is complete
        if side is not None:
            side.wait_stream(main)
        with phase("pull"), _on(side):
            for out_row, n, views in pulled[c]:
                for i, ((_, out), peer) in enumerate(zip(moves, views)):
                    if i not in by_sms:
                        out[out_row: out_row + n].copy_(peer)
    # After the staging (so that the first pull starts as early as it can), beside the pulls: the SMs gather while
    # the copy engines pull (2x H200 profile: gathering my rows first held the first pull back by ~35 us). On one
    # stream: after the barrier, so that peers are not kept waiting for it. The one-launch gather (eager calls, bound
    # by launch cost) did them before the barrier, with the staged rows.
    if not one_launch:
        gather_own_rows()
    if by_sms:
        for out_row, n, views in every:
            for i in by_sms:
                copy_by_sms(views[i], moves[i][1][out_row: out_row + n])
    for src, dst in beside:  # in a graph, after the last pull they would cost a few us more (2x H200 A/B)
        dst.copy_(src)
    if side is not None:
        main.wait_stream(side)


_MAX_FIELDS = 4  # of `_gather_triton.gather_fields`
_GATHER_BARRIER = True  # the one-launch gather runs the barrier after it (False: a launch of its own; for A/B runs)
_WORDS_PER_PROGRAM = 1024
_SM_PULL_ROW_BYTES = 512  # fields of rows this narrow are pulled by the SMs in a graph


def copy_by_sms(src: torch.Tensor, dst: torch.Tensor) -> None:
    """`dst.copy_(src)` by a Triton kernel (`_gather_triton.copy_words`) instead of the copy engines: contiguous
    tensors of equal byte size, a whole number of 4-byte words, starting on 4 bytes; `src` may be a peer's memory.
    Callers check this (`_gathers_in_one_launch`); a call that breaks it fails an assertion before the launch."""
    from ..kernels._gather_triton import copy_words

    num_bytes = src.numel() * src.element_size()
    assert src.is_contiguous() and dst.is_contiguous() and num_bytes == dst.numel() * dst.element_size()
    assert num_bytes % 4 == 0 and src.data_ptr() % 4 == 0 and dst.data_ptr() % 4 == 0
    num_words = num_bytes // 4
    if num_words:
        launch(copy_words, (ceil_div(num_words, _WORDS_PER_PROGRAM * 2),), src, dst, num_words,
               BLOCK=_WORDS_PER_PROGRAM * 2, num_warps=4)


def _gathers_in_one_launch(moves: list, row_bytes: list) -> bool:
    """CUDA tensors, at most four fields, rows of whole 4-byte words, every tensor starting on 4 bytes."""
    return (moves[0][0].device.type == "cuda" and len(moves) <= _MAX_FIELDS
            and all(b % 4 == 0 and b for b in row_bytes)
            and all(src.data_ptr() % 4 == 0 and out.data_ptr() % 4 == 0 for src, out in moves))


def gather_in_one_launch(plan: PullPlan, moves: list, row_bytes: list, stage_views: Optional[list], lo: int,
                         barrier: Optional[dict] = None) -> bool:
    """`_gather_triton.gather_fields`: every send row of every field into my staging area (`stage_views`, one per
    field; None when I stage nothing) or, for my rows for myself, into the outputs from row `lo`; then, given
    `barrier`, the region's device barrier in the same launch.

    Args:
        moves: up to four `(src [T, ...], out [num_recv, ...])` pairs, row-contiguous, any dtype, rows of whole
            4-byte words, starting on 4 bytes (`_gathers_in_one_launch`); send row x is `src[plan.send_idx[x]]`.
        row_bytes: bytes of one row of each field.
        stage_views: one `[staged rows, ...]` view of my staging area per field, or None.
        lo: output row of my first row for myself.
        barrier: the kernel's barrier arguments (`SymmetricRegion.barrier_in_kernel`), or None.

    Returns:
        whether the barrier ran (not when there is no send row: nothing is launched).
    """
    from ..kernels._gather_triton import gather_fields

    num_send = plan.send_idx.shape[0]
    if not num_send:
        return False
    order = sorted(range(len(moves)), key=lambda i: -row_bytes[i])  # the widest field spans the programs' blocks
    args, widths = [], []
    for i in order:  # the tensors as they are: the kernel reads and writes their rows as int32 words
        src, out = moves[i]
        args += [src, stage_views[i] if stage_views is not None else out, out]
        widths.append(row_bytes[i] // 4)
    while len(widths) < _MAX_FIELDS:
        args += args[:3]
        widths.append(0)
    sync = barrier if barrier is not None else _NO_BARRIER
    launch(gather_fields, (num_send, ceil_div(widths[0], _WORDS_PER_PROGRAM)),
        plan.send_idx, plan.own_rows[0], plan.own_rows[1], lo, *args, W0=widths[0], W1=widths[1], W2=widths[2],
        W3=widths[3], P1=next_pow2(max(widths[1], 1)), P2=next_pow2(max(widths[2], 1)),
        P3=next_pow2(max(widths[3], 1)), BLOCK=_WORDS_PER_PROGRAM, BARRIER=barrier is not None, **sync, num_warps=4)
    return barrier is not None


# `gather_fields` without the barrier: its barrier arguments are not read (the pointers are any int).
_NO_BARRIER = dict(done_ptr=0, local_ptr=0, delta16_ptr=0, status_ptr=0, me=0, timeout_ns=0, flags_off=0, R=1,
                   R_POW2=1, SIGNAL=False, WAIT=False, USE_TIMER=False)


def _on(stream: Optional["torch.cuda.Stream"]):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
