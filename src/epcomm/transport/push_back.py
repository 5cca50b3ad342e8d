"""The nvlink transport's return push: combine rows written straight into their origins' areas (`return_fields`).

In the combine direction each rank's rows for rank d are one contiguous block of its expert outputs (the rows it
received from d, in d's send order), so no gather is needed: the copy engines write each block from the expert
outputs straight into d's area, at the rows d expects from this rank, and d's reduction reads the area in place
after one device barrier. Against the pull (`pull.py`) this saves the sender's staging gather and the receiver's
copy into a fresh tensor: the bytes cross NVLink once and are read once.

Rank d's area (one of the two staging areas, alternating by call as for the pull) holds, per field, `num_recv[d]`
rows at an offset aligned to 256 bytes; rows from rank s start at row `recv_off[d][s]` (rows of lower ranks
first). Every rank derives all of it from the split matrix, so no offsets travel.

In a CUDA graph (or with `EPCOMM_RETURN_CHUNKS`) the writes run on a second stream in chunks, each published by
its own barrier (on a third stream) and an event, so that the origin reduces the tokens of chunk c while chunk c + 1
travels.

The result is borrowed: views of this rank's area, valid until its next call lets peers write the area again (two
calls later, after a barrier that this rank reaches only when the reads enqueued before it are done).

Worked example (2 ranks, matrix [[2, 3], [1, 4]]: rank 0 returns 2 rows to itself and 3 to rank 1):
    rank 0 copies its rows 0..1 into its own area at row 0, rows 2..4 into rank 1's area at row 4
    rank 1 copies its row 0 into rank 0's area at row 2, rows 1..4 into its own area at row 0
"""

from __future__ import annotations

from typing import Optional

import torch

from ..debug import phase
from ..moves import chunk_bounds, offsets, return_weights
from .pull import aligned


class ReturnPlan:
    """Offsets a return push derives once per route: where each rank's rows land in every area."""

    def __init__(self, route, me: int, num_ranks: int):
        m = route.matrix
        assert m is not None and route.src_X is None, "a return push needs the split matrix and rows in send order"
        self.me, self.num_ranks = me, num_ranks
        self.num_recv = [sum(m[s][d] for s in range(num_ranks)) for d in range(num_ranks)]
        self.recv_off = [offsets([m[s][d] for s in range(num_ranks)]) for d in range(num_ranks)]  # [d][s]
        self.send_splits = list(route.send_splits)
        self.send_off = offsets(route.send_splits)

    def area_bytes(self, row_bytes: list) -> int:
        """The largest area any rank needs for fields of `row_bytes` bytes per row."""
        return max(sum(aligned(n * b) for b in row_bytes) for n in self.num_recv)

    def field_offsets(self, rank: int, stage: int, row_bytes: list) -> list:
        """Byte offset of each field in `rank`'s area."""
        out, off = [], stage
        for b in row_bytes:
            out.append(off)
            off += aligned(self.num_recv[rank] * b)
        return out


def return_fields(tr, plan: ReturnPlan, srcs: list, row_bytes: list, stage: int, streams: Optional[tuple],
                  chunks: int = 1, skip_own: bool = False) -> tuple:
    """Write my rows of every field into their origins' areas, device barriers; return views of my area.

    `tr` is the nvlink transport (`region`, `barrier`); `srcs` are [X, ...] contiguous tensors in send order. The
    writes go in `chunks` steps: step c writes chunk c of every block (`moves.chunk_bounds` by
    `moves.return_weights`), then a barrier. With `streams` None the steps run in order on the current stream and
    the result is ready in stream order: `(views, None, own)`. With `streams = (copies, signals)` the writes run back to back on the first and each
    step's barrier on the second, once its writes are done (so a peer that is late for barrier c does not hold
    back write c + 1); the result is `(views, ready, own)` with one event per step, after which chunk c of every
    source's rows may be read (so the reduction of early chunks overlaps the writes of later ones). With
    `skip_own` my rows for myself are not copied: `own` is `(row, count, src_row)`, saying that rows
    `row .. row + count - 1` of the views are to be read from `srcs` at `src_row` (else None).
    """
    me, num_ranks = plan.me, plan.num_ranks
    peers = [(me + k) % num_ranks for k in range(1, num_ranks)]  # not every rank writes to rank 0 first

    bounds = {d: chunk_bounds(plan.send_splits[d], return_weights(chunks)) for d in range(num_ranks)}

    def write(dest: int, c: int) -> None:
        a, b = bounds[dest][c], bounds[dest][c + 1]
        if b == a:
            return
        lo = plan.send_off[dest] + a
        for src, off, nbytes in zip(srcs, plan.field_offsets(dest, stage, row_bytes), row_bytes):
            view = tr.region.peer(dest, off + (plan.recv_off[dest][me] + a) * nbytes,
                                  (b - a,) + tuple(src.shape[1:]), src.dtype)
            view.copy_(src[lo: lo + b - a])

    views = [tr.region.peer(me, off, (plan.num_recv[me],) + tuple(src.shape[1:]), src.dtype)
             for src, off in zip(srcs, plan.field_offsets(me, stage, row_bytes))]
    own = (plan.recv_off[me][me], plan.send_splits[me], plan.send_off[me]) if skip_own else None
    if streams is None:
        for c in range(chunks):
            with phase("push"):
                for dest in peers:
                    write(dest, c)
            tr.barrier()  # chunk c of every peer's rows is in my area
            if not skip_own:
                write(me, c)  # one stream: after the barrier, so that peers are not kept waiting for it
        return views, None, own
    copies, signals = streams
    copies.wait_stream(torch.cuda.current_stream(tr.device))
    for src in srcs:
        src.record_stream(copies)
    ready = []
    for c in range(chunks):
        with torch.cuda.stream(copies), phase("push"):
            for dest in peers + ([] if skip_own else [me]):
                write(dest, c)
        written = torch.cuda.Event()
        written.record(copies)
        signals.wait_event(written)
        with torch.cuda.stream(signals):
            tr.barrier()  # chunk c of every peer's rows is in my area
        ready.append(torch.cuda.Event())
        ready[-1].record(signals)
    return views, ready, own
