"""The ordered gradient sum of `lb_reduce_grads`, shared by both LB data paths (docs/decisions.md "LB gradient
reduction"): on the owner, every replica's gradient row is added into its expert's gradient in ascending (rank,
slot) order, accumulated in fp32 (fp64 for fp64) and rounded once. The collective path (lb.py) and the NVLink
path (lb_nvlink.py) deliver the rows in that order and run these same ops, so they give the same bits.

    # naive equivalent, one payload: rows[j] is the j-th row in ascending (rank, slot), experts[j] its target
    acc = expert_grads.to(fp32)
    for j in range(X):
        acc[experts[j]] += rows[j].to(fp32)
    expert_grads.copy_(acc.to(expert_grads.dtype))

Worked example: experts = [1, 0, 1] (rows from (rank 0, slot 2), (rank 1, slot 0), (rank 1, slot 3)) gives two
rounds, t = 0: rows [0, 1] into experts [1, 0]; t = 1: row [2] into expert [1]. Expert 1 gets `g1 + r0 + r2`,
added in that order. Rows and targets that are consecutive move as slices, others through index tensors.

Legend: X rows received, L local experts, B bytes per row.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

__all__ = ["lru_get", "ordered_accumulate"]

_CACHE_SIZE = 256


def ordered_accumulate(originals: list, rows: list, experts: list, cache: OrderedDict) -> None:
    """`originals[k][experts[j]] += rows[k][j]` for j ascending, fp32 (fp64 for fp64), rounded once; in place.

    Args:
        originals: K tensors [L, ...] fp32/fp64/bf16/fp16, contiguous -- the owner's gradients, added to.
        rows: K tensors [X, B] uint8 -- row j holds the bytes of one gradient row of `originals[k]`'s dtype.
        experts: list of X ints -- the local expert row j adds into.
        cache: an LRU dict (kept by the caller) for the index tensors of each `experts` list.
    """
    if not experts:
        return
    device = originals[0].device
    rounds = lru_get(cache, (tuple(experts), device), lambda: _Rounds(experts, device))
    for orig, rows_XB in zip(originals, rows):
        if rows_XB.shape[1] == 0:
            continue
        vals = rows_XB.contiguous().view(orig.dtype)
        grads = orig.view(orig.shape[0], -1)
        if orig.dtype in (torch.float32, torch.float64):  # the gradient is its own accumulator
            for sel_rows, sel_experts, _ in rounds.rounds:
                sel_experts.add_into(grads, sel_rows.get(vals))
        else:
            acc = rounds.uniq.get(grads).to(torch.float32)
            for sel_rows, _, sel_pos in rounds.rounds:
                sel_pos.add_into(acc, sel_rows.get(vals).to(torch.float32))
            rounds.uniq.put(grads, acc.to(orig.dtype))


class _Sel:
    """Rows `idx` of a tensor: a slice when they are consecutive and ascending, else an index tensor (built once)."""

    def __init__(self, idx: list, device: torch.device):
        lo = idx[0] if idx else 0
        self.span = (lo, lo + len(idx)) if idx == list(range(lo, lo + len(idx))) else None
        self.idx = None if self.span else torch.tensor(idx, dtype=torch.int64, device=device)

    def get(self, t: Tensor) -> Tensor:
        return t[self.span[0]:self.span[1]] if self.span else t.index_select(0, self.idx)

    def put(self, t: Tensor, v: Tensor) -> None:
        if self.span:
            t[self.span[0]:self.span[1]].copy_(v)
        else:
            t.index_copy_(0, self.idx, v)

    def add_into(self, t: Tensor, v: Tensor) -> None:
        """t[rows] += v, rows distinct: one rounding per element, as in a sequential add."""
        if self.span:
            t[self.span[0]:self.span[1]].add_(v)
        else:
            t.index_copy_(0, self.idx, t.index_select(0, self.idx) + v)


class _Rounds:
    """The sum as rounds: round t adds the t-th contribution (ascending j) of every expert, so targets are
    distinct within a round and each expert's sum is the sequential one in j order.

    Fields:
        uniq: `_Sel` of the experts that receive rows (ascending).
        rounds: list of (rows j, their experts, the experts' positions in `uniq`), each a `_Sel`.
    """

    def __init__(self, experts: list, device: torch.device):
        uniq = sorted(set(experts))
        pos = {e: p for p, e in enumerate(uniq)}
        rounds, seen = [], {}
        for j, e in enumerate(experts):
            t = seen[e] = seen.get(e, -1) + 1
            if t == len(rounds):
                rounds.append(([], []))
            rounds[t][0].append(j)
            rounds[t][1].append(e)
        self.uniq = _Sel(uniq, device)
        self.rounds = [(_Sel(js, device), _Sel(es, device), _Sel([pos[e] for e in es], device)) for js, es in rounds]


def lru_get(cache: OrderedDict, key, make):
    """`cache[key]`, made by `make()` on a miss; keeps the most recent `_CACHE_SIZE` entries."""
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
        if len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return value
