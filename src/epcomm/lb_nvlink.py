"""The NVLink path of the LB calls: the LB region in symmetric memory, weights pushed into the replicas' slots
and gradients pulled from them through peer views, by the copy engines (DeepEP V2.5 behaviour, §6-7, §13).

Used when the buffer's transport is `nvlink` (one host, every GPU a peer of every other). At construction,
`attach_lb_region` (collective) gives the LB region its own `SymmetricRegion`, of the same size on every rank, and
moves the allocation plan's tensors onto it. In a call, a payload whose redundant tensor lies inside the region on
every rank moves here; any other payload takes the collective path (lb.py). Every rank sees the same headers
(each carries the region offset of every redundant tensor, -1 outside), so every rank makes the same choice.

    # lb_prefetch_weights on rank me, payload k (naive equivalent; peer_k(r) = rank r's redundant tensor k)
    barrier()                                                # the replicas are done with the old weights
    for r, c with e = mapping[r, c] >= 0 owned by me:
        peer_k(r)[c].copy_(expert_weights[k][e % L])         # a copy-engine write over NVLink
    barrier()                                                # every push has landed
    # lb_reduce_grads on rank me, payload k
    barrier()                                                # the replicas' gradients are final
    for r, c ascending with e = mapping[r, c] >= 0 owned by me:
        staging[j] = peer_k(r)[c]; j += 1                    # a copy-engine read over NVLink
    barrier()                                                # the replicas may be overwritten
    expert_grads[k] += staging rows in ascending (r, c)      # lb_sum.py: the collective path's ops, same bits

Ops per (peer, payload): a run of moves consecutive in both the local row and the slot is one `copy_` (copy
engine); one run, or rows of `BULK_ROW_BYTES` or more, take one `copy_` per run. Several runs of smaller rows:
a push gathers them (`index_select`) and writes them with one `copy_` when the peer's slots are contiguous, else
with an `index_copy_` into the peer view (SM stores); a pull reads them with one `index_select` from the peer
view into the staging rows (SM loads). Rows move as the widest integer word that divides their bytes and
offsets. Move lists and index tensors are built once per mapping (an LRU keyed on the mapping's contents).

Legend: R ranks, L local experts per rank, C redundant slots per rank, X rows this rank pulls, B bytes per expert
of one payload, W = B / word size.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from . import debug
from .lb_sum import lru_get
from .validate import warn_caller

__all__ = ["BULK_ROW_BYTES", "LBRegion", "PeerMoves", "attach_lb_region", "lb_moves", "pull_grads",
           "push_weights"]

# NOTE: a first guess, to be measured on 2x H200: a copy_ costs ~30 us of host time, which a row of >= 4 MiB
# hides behind its own transfer (~11 us at 380 GB/s); smaller rows in several runs go through one gather instead.
BULK_ROW_BYTES = 4 << 20
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@dataclass
class PeerMoves:
    """The rows that move between this rank and one peer in one LB call (host lists).

    Fields:
        peer: int -- the peer's group rank.
        rows: list[int] -- this rank's row of each move: the local expert (prefetch) or the staging row (reduce).
        slots: list[int] -- the peer's redundant slot of each move, ascending.
        runs: list[(row, slot, n)] -- maximal runs of moves consecutive in both `rows` and `slots`.
    """

    peer: int
    rows: list
    slots: list
    runs: list
    _index: dict = field(default_factory=dict, repr=False)

    def index(self, device: torch.device) -> tuple:
        """(rows, slots) as int64 tensors on `device`, built on first use and kept."""
        if device not in self._index:
            self._index[device] = (torch.tensor(self.rows, dtype=torch.int64, device=device),
                                   torch.tensor(self.slots, dtype=torch.int64, device=device))
        return self._index[device]

    @property
    def slots_contiguous(self) -> bool:
        return self.slots[-1] - self.slots[0] + 1 == len(self.slots)


def lb_moves(mapping: list, num_local_experts: int, rank: int, prefetch: bool) -> list:
    """The moves of `rank` per peer, peers ascending (host lists; no checks).

    Args:
        mapping: R lists of C ints -- `redundancy_mapping`; -1 = unused slot.
        num_local_experts: L > 0.
        rank: this group rank (the owner side of every move).
        prefetch: True: rows are local experts (pushes); False: rows number the pulled rows in ascending
            (rank, slot) order, the order of `lb_routes(...).send_rows`.

    Returns:
        list of `PeerMoves`, one per peer with at least one slot holding an expert of `rank`.

    Example: R = 2, L = 2, mapping = [[2, 3], [0, -1]]: rank 1 pushes its experts 0, 1 into rank 0's slots 0, 1,
    one run: `[PeerMoves(peer=0, rows=[0, 1], slots=[0, 1], runs=[(0, 0, 2)])]`.
    """
    moves, num_pulled = [], 0
    for r, row in enumerate(mapping):
        rows, slots = [], []
        for c, e in enumerate(row):
            if e >= 0 and e // num_local_experts == rank:
                rows.append(e % num_local_experts if prefetch else num_pulled)
                slots.append(c)
                num_pulled += 1
        if slots:
            runs = []
            for a, c in zip(rows, slots):
                if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == c:
                    runs[-1][2] += 1
                else:
                    runs.append([a, c, 1])
            moves.append(PeerMoves(r, rows, slots, [tuple(run) for run in runs]))
    return moves


class LBRegion:
    """The LB region of one buffer in symmetric memory, with cached peer views and move plans.

    Args:
        symm: a `transport.symm.SymmetricRegion` (or an object with its `local`, `peer` and `barrier`), whose
            barrier is bounded by `num_gpu_timeout_secs`.

    Fields:
        local: [nbytes] uint8 -- this rank's region (`EPBuffer.lb_storage`).
        nbytes: int -- the region's size, the same on every rank.
    """

    def __init__(self, symm):
        self.symm = symm
        self.local = symm.local
        self.nbytes = symm.local.numel()
        self._moves: OrderedDict = OrderedDict()
        self._views: OrderedDict = OrderedDict()

    def offset_of(self, t: Tensor) -> int:
        """Byte offset of `t` in this rank's region, or -1 when `t` is empty or not wholly inside it."""
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or t.device != self.local.device:
            return -1
        offset = t.data_ptr() - self.local.data_ptr()
        return offset if 0 <= offset and offset + nbytes <= self.nbytes else -1

    def moves(self, mapping: list, num_local_experts: int, rank: int, prefetch: bool) -> list:
        """`lb_moves(...)`, cached (with the index tensors it builds) per mapping contents."""
        key = (prefetch, num_local_experts, rank, tuple(tuple(row) for row in mapping))
        return lru_get(self._moves, key, lambda: lb_moves(mapping, num_local_experts, rank, prefetch))

    def peer(self, rank: int, offset: int, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
        """[rows, cols] `dtype` view of `rank`'s region at byte `offset` (on this device; memory on the peer)."""
        return lru_get(self._views, (rank, offset, rows, cols, dtype),
                       lambda: self.symm.peer(rank, offset, (rows, cols), dtype))

    def barrier(self) -> None:
        """Device barrier over the group on the current stream, bounded by `num_gpu_timeout_secs`."""
        self.symm.barrier()


def attach_lb_region(buf, symm_cls=None) -> Optional[LBRegion]:
    """Move `buf.lb_storage` (and its allocation plan's tensors) into symmetric memory. Collective.

    Only for the `nvlink` transport, after it exists: the ranks exchange their region sizes (one bounded header
    exchange); equal non-zero sizes allocate a zero-filled `SymmetricRegion` of that size, and the plan's tensors
    are moved onto it in place (`BufferAllocator.rebind`). Ranks with different sizes keep their local regions
    and warn: their LB calls take the collective path.

    Args:
        buf: the `EPBuffer` under construction (group, rank, device, transport, num_lb_bytes, lb_storage,
            lb_allocation_plan, num_gpu_timeout_secs).
        symm_cls: None (the `nvlink` transport's `SymmetricRegion`; other transports return None), or a class
            with its constructor and interface, used on any transport (tests: shared files between CPU ranks).

    Returns:
        LBRegion or None (another transport, an empty region, or sizes that differ).
    """
    if symm_cls is None:
        if buf.transport.name != "nvlink":
            return None
        from .transport.symm import SymmetricRegion as symm_cls
    mine = torch.tensor([buf.num_lb_bytes], dtype=torch.int64, device=buf.device)
    sizes = buf.transport.exchange_counts(mine.expand(buf.num_ranks, 1).contiguous(), wait=True, call_id=0,
                                          kind="LB region size", label="EPBuffer construction (LB region)")
    sizes = sizes[:, 0].tolist()
    if len(set(sizes)) > 1:
        warn_caller(f"EPBuffer: rank {buf.rank}: the ranks' LB regions differ in size ({sizes} bytes by group "
                      "rank); symmetric memory needs one size, so lb_prefetch_weights and lb_reduce_grads take "
                      "the collective path. Pass identical plans (or byte counts) on every rank")
        return None
    if sizes[0] == 0:
        return None
    region = LBRegion(symm_cls(buf.group, buf.num_lb_bytes, buf.device, timeout_s=buf.num_gpu_timeout_secs))
    region.local.zero_()
    if buf.lb_allocation_plan is not None:
        try:
            buf.lb_allocation_plan.rebind(region.local)
        except ValueError as e:  # not expected (nobody holds the plan's tensors yet); stay correct anyway
            warn_caller(f"EPBuffer: rank {buf.rank}: {e}; its LB calls take the collective path")
            return region
    buf.lb_storage = region.local
    debug.log(f"EPBuffer rank {buf.rank}: LB region of {buf.num_lb_bytes} bytes in symmetric memory")
    return region


def push_weights(region: LBRegion, moves: list, redundant: list, original: list, offsets: list) -> int:
    """The data movement of `lb_prefetch_weights` on the NVLink path, on the current stream. Collective.

    Args:
        region: this buffer's `LBRegion`.
        moves: `region.moves(..., prefetch=True)`.
        redundant: K tensors [C, ...] (this rank's; only their row count and bytes per expert are used).
        original: K tensors [L, ...], contiguous -- the experts pushed.
        offsets: K lists of R ints -- byte offset of redundant tensor k in each rank's region.

    Returns:
        int -- the torch ops issued for the data (barriers excluded), for tests and logs.
    """
    region.barrier()
    num_ops = 0
    for red, orig, offs in zip(redundant, original, offsets):
        nbytes = _row_bytes(orig)
        if nbytes == 0 or not moves:
            continue
        src = orig.view(orig.shape[0], -1).view(torch.uint8)
        size, word = _word(nbytes, src.data_ptr(), src.storage_offset(), *(offs[mv.peer] for mv in moves))
        src = src.view(word)
        for mv in moves:
            dst = region.peer(mv.peer, offs[mv.peer], red.shape[0], nbytes // size, word)
            num_ops += _push(dst, src, mv, nbytes)
    region.barrier()
    return num_ops


def pull_grads(region: LBRegion, moves: list, redundant: list, offsets: list) -> tuple:
    """The data movement of `lb_reduce_grads` on the NVLink path, on the current stream. Collective.

    Args:
        region: this buffer's `LBRegion`.
        moves: `region.moves(..., prefetch=False)`.
        redundant: K tensors [C, ...] (this rank's; only their row count and bytes per expert are used).
        offsets: K lists of R ints -- byte offset of redundant tensor k in each rank's region.

    Returns:
        (rows, num_ops) -- rows: K tensors [X, B] uint8, the replicas' gradient rows in ascending (rank, slot)
        order; num_ops: the torch ops issued for the data (barriers and allocations excluded).
    """
    region.barrier()
    num_rows = sum(len(mv.slots) for mv in moves)
    rows, num_ops = [], 0
    for red, offs in zip(redundant, offsets):
        nbytes = _row_bytes(red)
        staging = torch.empty(num_rows, nbytes, dtype=torch.uint8, device=region.local.device)
        rows.append(staging)
        if nbytes == 0 or num_rows == 0:
            continue
        size, word = _word(nbytes, staging.data_ptr(), *(offs[mv.peer] for mv in moves))
        dst = staging.view(word)
        for mv in moves:
            num_ops += _pull(dst, region.peer(mv.peer, offs[mv.peer], red.shape[0], nbytes // size, word), mv, nbytes)
    region.barrier()
    return rows, num_ops


def _push(dst_CW: Tensor, src_LW: Tensor, mv: PeerMoves, row_bytes: int) -> int:
    if len(mv.runs) == 1 or row_bytes >= BULK_ROW_BYTES:
        for a, c, n in mv.runs:
            dst_CW[c:c + n].copy_(src_LW[a:a + n])
        return len(mv.runs)
    rows_t, slots_t = mv.index(src_LW.device)
    if mv.slots_contiguous:  # gather locally, then one copy-engine write
        dst_CW[mv.slots[0]:mv.slots[0] + len(mv.slots)].copy_(src_LW.index_select(0, rows_t))
    else:
        dst_CW.index_copy_(0, slots_t, src_LW.index_select(0, rows_t))
    return 2


def _pull(dst_XW: Tensor, src_CW: Tensor, mv: PeerMoves, row_bytes: int) -> int:
    if len(mv.runs) == 1 or row_bytes >= BULK_ROW_BYTES:
        for a, c, n in mv.runs:
            dst_XW[a:a + n].copy_(src_CW[c:c + n])
        return len(mv.runs)
    _, slots_t = mv.index(src_CW.device)
    torch.index_select(src_CW, 0, slots_t, out=dst_XW[mv.rows[0]:mv.rows[0] + len(mv.rows)])
    return 1


def _row_bytes(t: Tensor) -> int:
    n = t.element_size()
    for d in t.shape[1:]:
        n *= d
    return n


def _word(nbytes: int, *addresses: int) -> tuple:
    """The widest integer word (size, dtype) dividing `nbytes` and every address or offset."""
    for size, dtype in _WORDS:
        if nbytes % size == 0 and all(a % size == 0 for a in addresses):
            return size, dtype
    raise AssertionError("unreachable: 1 divides everything")

