"""The `nvlink` transport of `EngramBuffer`: table shards in torch symmetric memory, rows read one-sided.

Every rank's table shard (and, for FP8, its scale shard) lives in one `SymmetricRegion` that `set_config`
allocates (collective; reused while a new configuration fits):

    [ table shard: sum(N) rows x row bytes | pad to 256 B | scale shard: sum(N) rows x P * 4 bytes ]

`write` copies the local shard between two device barriers: the first waits until every peer has finished
reading the old rows (each rank orders the barrier after its communication stream, where its fetches read), the
second publishes the new rows. `fetch` reads each owner's rows straight from the owner's region:
`torch.index_select` on a peer view is a kernel on this GPU whose loads go over NVLink, and the rank's own rows
come from its local region. No collective, no message to the owner, no work on the owner's GPU.

`choose_transport` is the construction-time decision shared by every rank of the group (one bounded exchange).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .sizing import ALLOCATION_ALIGNMENT, align
from .transport import symm
from .transport.symm import SymmetricRegion

__all__ = ["TRANSPORTS", "NVLinkTable", "choose_transport", "unavailable_reason"]

TRANSPORTS = ("auto", "collective", "nvlink")
_SF_ALIGN = 256  # the scale shard starts on a 256-byte boundary (any word view is aligned)


unavailable_reason = symm.nvlink_unavailable  # shared with EPBuffer's transport choice


def choose_transport(context, asked) -> str:
    """Agree on the transport of one buffer: "nvlink" or "collective" (collective; one bounded exchange).

    `auto` picks nvlink when every rank of the group is a CUDA GPU on one host that can use symmetric memory,
    else collective. Every rank decides from the same exchanged rows, so every rank raises together.

    Args:
        context: the buffer's `CommContext` (group, device, ranks per host, bounded exchange).
        asked: str -- "auto", "collective" or "nvlink" (what this rank passed).

    Returns:
        "nvlink" or "collective".

    Raises:
        ValueError: an unknown name on any rank; ranks that passed different names; "nvlink" where it cannot
            run (the message says why). TimeoutError: a peer did not construct within `num_cpu_timeout_secs`.
    """
    who = f"{context.owner}: rank {context.rank}"
    code = TRANSPORTS.index(asked) if isinstance(asked, str) and asked in TRANSPORTS else -1
    reason = unavailable_reason(context.device)
    mine = torch.tensor([[code, int(reason is None)]], dtype=torch.int64, device=context.device)
    rows = context.exchange(mine.expand(context.num_ranks, 2).contiguous(), f"{context.owner} construction").tolist()
    if code < 0:
        raise ValueError(f"{who}: transport={asked!r} is unknown; expected one of {', '.join(map(repr, TRANSPORTS))}")
    bad = [r for r, row in enumerate(rows) if row[0] < 0]
    if bad:
        raise ValueError(f"{who}: group rank {bad[0]} rejected the construction: the transport it passed is not one "
                         f"of {', '.join(map(repr, TRANSPORTS))}")
    if len({row[0] for row in rows}) > 1:
        desc = ", ".join(f"rank {r}: {TRANSPORTS[row[0]]!r}" for r, row in enumerate(rows))
        raise ValueError(f"{who}: ranks disagree on transport ({desc}); every rank must pass the same transport")
    why_not = None
    if context.device.type != "cuda":
        why_not = reason
    elif context.num_nvlink_ranks != context.num_ranks:
        why_not = "its ranks are on several hosts (nvlink reads peers' memory, so every rank must share one host)"
    elif not all(row[1] for row in rows):
        not_ready = [r for r, row in enumerate(rows) if not row[1]]
        why_not = (f"group ranks {not_ready} cannot use torch symmetric memory with peer access to every other GPU"
                   + (f" (this rank: {reason})" if reason else ""))
    if asked == "nvlink" and why_not is not None:
        raise ValueError(f"{who}: transport='nvlink' cannot run for this group: {why_not}; pass transport='auto' "
                         "or 'collective'")
    return "collective" if asked == "collective" or why_not is not None else "nvlink"


class NVLinkTable:
    """A rank's table and scale shards in one symmetric region, with views of every peer's (collective).

    Args:
        group: the buffer's process group (every rank constructs it, with the same `nbytes`).
        device: the buffer's CUDA device.
        nbytes: int -- region size; `region_bytes(...)` of the largest configuration it will hold.
        timeout_s: float -- bound on every device barrier (`num_gpu_timeout_secs`).

    Fields:
        region: the `SymmetricRegion`.
        table: [rows, row] uint8 -- this rank's table shard (local memory), after `configure`.
        scales: [rows, P * 4] uint8 -- this rank's scale shard (0 columns without FP8), after `configure`.
    """

    def __init__(self, group, device: torch.device, nbytes: int, timeout_s: float):
        self.region = SymmetricRegion(group, nbytes, device, timeout_s=timeout_s)
        self.rank, self.num_ranks, self.device = group.rank(), group.size(), device
        self.table = self.scales = None
        self._rows_R: list = []
        self._sfs_R: Optional[list] = None

    @staticmethod
    def region_bytes(rows: int, row: int, sf_bytes: int) -> int:
        """Bytes a configuration needs: the table, then the scales at a 256-byte boundary (2 MiB aligned)."""
        return align(align(rows * row, _SF_ALIGN) + rows * sf_bytes, ALLOCATION_ALIGNMENT)

    def configure(self, rows: int, row: int, sf_bytes: int, row_word: torch.dtype, sf_word: torch.dtype) -> None:
        """Lay out `rows` rows of `row` bytes (+ `sf_bytes` of scales each) and build every rank's views (local).

        `row_word` / `sf_word`: integer dtypes whose size divides `row` / `sf_bytes`; rows are read as those words.
        """
        assert self.region_bytes(rows, row, sf_bytes) <= self.region.nbytes
        sf_off = align(rows * row, _SF_ALIGN)
        self.table = self.region.local[:rows * row].view(rows, row)
        self.scales = self.region.local[sf_off:sf_off + rows * sf_bytes].view(rows, sf_bytes)

        def views(local: Tensor, offset: int, word: torch.dtype) -> list:
            cols = local.shape[1] // word.itemsize
            return [local.view(word) if r == self.rank else self.region.peer(r, offset, (rows, cols), word)
                    for r in range(self.num_ranks)]
        self._rows_R = views(self.table, 0, row_word)
        self._sfs_R = views(self.scales, sf_off, sf_word) if sf_bytes else None

    # -- write: barrier, local copies (the caller's), barrier ------------------------------------------------
    # The stream steps are skipped when `comm_stream` is None: the tests drive this path on CPU ranks through a
    # file-backed stand-in for the region (tests/collective_cases.py, FileRegion).
    def begin_write(self, comm_stream: Optional["torch.cuda.Stream"]) -> None:
        """Wait (device side, bounded) until every peer has finished reading this rank's old rows."""
        if comm_stream is not None:  # this rank's own reads of peers (its fetches) come before its arrival
            torch.cuda.current_stream(self.device).wait_stream(comm_stream)
        self.region.barrier()

    def end_write(self, comm_stream: Optional["torch.cuda.Stream"]) -> None:
        """Publish the rows copied since `begin_write` (device barrier); later fetches read after it."""
        self.region.barrier()
        if comm_stream is not None:
            comm_stream.wait_stream(torch.cuda.current_stream(self.device))

    # -- fetch ---------------------------------------------------------------------------------------
    def read(self, rows_X: Tensor, counts_R: list) -> tuple:
        """Read rows of every owner's shards, one-sided, on the current stream.

        Args:
            rows_X: [X] int64 -- table rows grouped by owner in rank order: the first `counts_R[0]` are rank 0's.
            counts_R: [R] ints -- rows per owner (host values).

        Returns:
            `(rows [X, row words], scales [X, P*4 words] or None)`, in `rows_X` order.
        """
        num_rows = rows_X.numel()
        got = torch.empty(num_rows, self._rows_R[0].shape[1], dtype=self._rows_R[0].dtype, device=self.device)
        got_sf = None if self._sfs_R is None else torch.empty(num_rows, self._sfs_R[0].shape[1],
                                                              dtype=self._sfs_R[0].dtype, device=self.device)
        starts = [0]
        for n in counts_R:
            starts.append(starts[-1] + n)
        # Peers first, starting after this rank (ranks do not all read rank 0 at once); own rows last.
        for k in range(1, self.num_ranks + 1):
            owner = (self.rank + k) % self.num_ranks
            lo, hi = starts[owner], starts[owner + 1]
            if lo == hi:
                continue
            ids = rows_X[lo:hi]
            torch.index_select(self._rows_R[owner], 0, ids, out=got[lo:hi])
            if got_sf is not None:
                torch.index_select(self._sfs_R[owner], 0, ids, out=got_sf[lo:hi])
        return got, got_sf

    def release(self) -> None:
        """Drop the views and the region (local; the caller drained every peer's reads first)."""
        self._rows_R, self._sfs_R = [], None
        self.table = self.scales = self.region = None
