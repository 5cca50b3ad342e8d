"""Field moves of the packed (CPU-synced) layout: each field travels as its own array, straight into its output.

With exact splits known on the host, a dispatch or combine needs no byte records: every field (data, scales,
weights, top-k rows, token keys) is gathered in send order and lands at the receiver in its own output tensor,
rows grouped by source rank (ascending), in the sender's order within a source. The data rows of a non-expand
dispatch land in `recv_x` itself, so no epilogue pass touches them.

A `Route` says which rows go where; transports implement `Transport.move_fields(moves, route)`:

| transport | how a field moves |
| --- | --- |
| base (any) | gather in send order, `dispatch_rows`, copy into the output |
| collective | gather in send order, one `all_to_all_single` into the output |
| nvlink | gather into this rank's symmetric staging area (own rows straight into the output), one device barrier, then every rank copies its rows out of each peer's staging area (copy engine, over NVLink) |

Worked example (2 ranks, rank 0 sends tokens [0, 2] to rank 0 and [1, 2] to rank 1):
    route at rank 0: send_splits [2, 2], src_X [0, 2, 1, 2]; rank 1 sends 3 rows to rank 0
    out at rank 0: rows [tok0, tok2] from rank 0, then rank 1's three rows
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .streams import memo


@dataclass
class Route:
    """Which rows a packed move sends and receives (host lists + one device index), kept per handle.

    Fields:
        send_splits: list[int], R -- rows to each rank (grouped by destination, ascending).
        recv_splits: list[int], R -- rows from each rank.
        src_X: [X] int64 -- source row of each send row; None when the source rows are already in send order.
        matrix: R lists of R ints -- rows from rank s to rank d, for transports that read peers' memory; or None.
        cache: index tensors a transport derives once per route (e.g. the rows it stages).
    """

    send_splits: list
    recv_splits: list
    src_X: Optional[Tensor]
    matrix: Optional[list] = None
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_send(self) -> int:
        return sum(self.send_splits)

    @property
    def num_recv(self) -> int:
        return sum(self.recv_splits)

    def back(self) -> "Route":
        """The return direction (combine): received rows go back in their own order to their sources."""
        matrix = None if self.matrix is None else [list(col) for col in zip(*self.matrix)]
        return Route(list(self.recv_splits), list(self.send_splits), None, matrix)

    def send_index(self, device: torch.device) -> Tensor:
        """[X] int64: `src_X`, or `arange(X)` when the rows are already in send order (cached)."""
        if self.src_X is not None:
            return self.src_X
        return memo(self.cache, "arange", lambda: torch.arange(self.num_send, device=device))


def offsets(splits: list) -> list:
    """Exclusive prefix sum of a host list."""
    out, acc = [], 0
    for n in splits:
        out.append(acc)
        acc += n
    return out


# Chunk sizes of a staged move. A pull stages its first chunk before any row moves, so its first chunk is small and
# every later one weighs PULL_LATER times as much: 2x H200, dsv3 cached dispatch in a graph, 2 chunks of 1:1 / 1:2 /
# 1:3 = 215-218 / 210-216 / 208-209 us. A return push's last chunk is reduced after every write, but making it small
# lost there (combine, 3 chunks 1:1:1 / 4:2:1: 200-210 / 205-245 us at 132 SMs, 305-351 / 371-386 us at 28), so
# every chunk before the last weighs RETURN_EARLIER = 1 times the last: equal chunks (benchmarks/return_sweep.py).
PULL_LATER = 3
RETURN_EARLIER = 1


def pull_weights(chunks: int) -> tuple:
    """Relative chunk sizes of a pull: `(1, PULL_LATER, PULL_LATER, ...)`."""
    return (1,) + (PULL_LATER,) * (chunks - 1)


def return_weights(chunks: int) -> tuple:
    """Relative chunk sizes of a return push: `(.., RETURN_EARLIER, RETURN_EARLIER, 1)`."""
    return (RETURN_EARLIER,) * (chunks - 1) + (1,)


def chunk_bounds(rows: int, weights: tuple) -> list:
    """Row boundaries `[0, .., rows]` (len(weights) + 1) of a block of `rows` rows moved in chunks of relative size
    `weights` (integers: every rank computes the same boundaries). Equal weights: chunk c is
    `[c * rows // C, (c + 1) * rows // C)`."""
    total, acc, out = sum(weights), 0, [0]
    for w in weights:
        acc += w
        out.append(rows * acc // total)
    return out


def chunk_count(forced: int, capturing: bool, largest_bytes: int, most: int) -> int:
    """How many chunks a staged move takes: `forced` (an `EPCOMM_*_CHUNKS` value) when set; else one for an eager
    call (launch cost dominates it) and, in a CUDA graph, one per 4 MiB of the largest area, at most `most`. Every
    rank computes it from the split matrix, so all agree on the number of barriers."""
    if forced:
        return forced
    if not capturing:
        return 1
    return max(1, min(most, largest_bytes // (4 << 20)))


def row_bytes(t: Tensor) -> int:
    """Bytes of one row of `t` as a dense array, from its shape: a tensor of 0 or 1 rows counts as contiguous with
    any stride(0) (a column slice keeps a wider one), so the stride cannot tell where rows sit in a dense area."""
    return math.prod(t.shape[1:]) * t.element_size()


def transfer_word(*sizes: int) -> torch.dtype:
    """int64, int32 or uint8: the widest integer type dividing every byte count in `sizes` that gloo and NCCL
    both move (neither moves int16). Row gathers and copies then move words instead of bytes."""
    for dtype in (torch.int64, torch.int32):
        if all(n % dtype.itemsize == 0 for n in sizes):
            return dtype
    return torch.uint8


def as_words(t: Tensor) -> Tensor:
    """[rows, W] view of a contiguous tensor's rows in `transfer_word` of the row bytes."""
    rows, numel = t.shape[0], 1
    for d in t.shape[1:]:
        numel *= d
    raw = t.reshape(rows, numel).view(torch.uint8)
    return raw.view(transfer_word(raw.shape[1]))
