"""Placing received rows in their final layout, and the rows combine sends back (shared by every transport).

Dispatch epilogue: compact the worst-case receive buffer (sync-free mode), unpack records, then either keep one
row per received token (non-expand) or scatter one row per (token, local expert) into aligned expert segments
(expand). Combine prologue: the per-rank partials (expand with multiple reduction) or the individual rows that
go back. DeepEP V2.5 EPBuffer behaviour, §9.4-9.6, §9.11-9.12, §11.2-11.4.

Shape legend (docs/shapes.md): T tokens, H hidden, K top-k, R ranks, L local experts, M received rows,
S expanded rows, P scale packs, X rows of a transfer buffer.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .kernels import canonical_reduce
from .moves import as_words
from .records import scatter_index
from .sizing import align


def gather_rows(src_XH: Tensor, idx_Y: Tensor) -> Tensor:
    """[Y, ...]: row y is `src_XH[idx_Y[y]]`, zero where the index is -1. Fresh tensor.

    Contiguous rows move as the widest integer words their bytes allow (moves.as_words): fewer elements per row
    (CPU, dsv3 rows: 3x faster for FP8, 1.5x for BF16), the same bits; FP8 has few kernels, so it always moves
    as integers."""
    if (src_XH.dim() >= 2 and src_XH.is_contiguous() and src_XH.shape[0] and src_XH.dtype != torch.int64
            and not src_XH.requires_grad):  # (a word view has no gradient)
        try:
            words = as_words(src_XH)
        except RuntimeError:  # a start not aligned to the word: element by element below
            words = None
        if words is not None and words.element_size() > src_XH.element_size():
            return gather_rows(words, idx_Y).view(src_XH.dtype).view((idx_Y.shape[0],) + tuple(src_XH.shape[1:]))
    if src_XH.dtype == torch.float8_e4m3fn:  # few kernels exist for FP8: move its bytes
        return gather_rows(src_XH.view(torch.uint8), idx_Y).view(src_XH.dtype)
    if src_XH.shape[0] == 0:
        return src_XH.new_zeros((idx_Y.shape[0],) + tuple(src_XH.shape[1:]))
    out = src_XH[idx_Y.clamp(min=0)]
    mask = (idx_Y < 0).view(-1, *([1] * (src_XH.dim() - 1)))
    return out.masked_fill_(mask, 0)


def place_sf(sf_XP: Tensor, col_major: bool) -> Tensor:
    """Scale factors row-major `[X, P]`, or column-major with pack stride `align(X, 4)` (reference §9.11)."""
    if not col_major:
        return sf_XP.contiguous()
    rows, packs = sf_XP.shape
    out = torch.empty_strided((rows, packs), (1, align(rows, 4)), dtype=sf_XP.dtype, device=sf_XP.device)
    return out.copy_(sf_XP)


def expanded_sources(row_ptr_MK: Tensor, num_expanded_rows: int) -> Tensor:
    """[S] int64: the flat (row, position) index `m * K + j` placed at each expanded row, -1 for padding/tail."""
    return scatter_index(row_ptr_MK.reshape(-1), num_expanded_rows)


def expand_weights(weights_MK: Tensor, pair_S: Tensor) -> Tensor:
    """[S]: the weight of the (token, position) pair at each expanded row, 0 for padding/tail."""
    return gather_rows(weights_MK.reshape(-1), pair_S)


def src_metadata(g_M: Tensor, src_rank_M: Tensor, local_idx_MK: Tensor, row_ptr_MK: Optional[Tensor],
                 valid_M: Tensor) -> Tensor:
    """[M, K + 2] int32 `recv_src_metadata` (reference §10); -1 on rows past the valid extent."""
    num_rows, num_topk = local_idx_MK.shape
    pos_MK = torch.arange(num_topk, device=g_M.device).expand(num_rows, num_topk)
    last_pos_M = pos_MK.masked_fill(local_idx_MK < 0, -1).amax(1) if num_topk else g_M.new_full((num_rows,), -1)
    meta = torch.full((num_rows, num_topk + 2), -1, dtype=torch.int64, device=g_M.device)
    meta[:, 0] = g_M
    meta[:, 1] = src_rank_M * num_topk + last_pos_M
    if row_ptr_MK is not None:
        meta[:, 2:] = row_ptr_MK
    return meta.masked_fill_(~valid_M.unsqueeze(1), -1).to(torch.int32)


def expert_partials(x_SH: Tensor, row_ptr_MK: Tensor) -> Tensor:
    """[M, H]: per received token, the canonical sum of its expanded rows (level 1 of reference §11.2)."""
    return canonical_reduce(x_SH, row_ptr_MK)


def pair_rows_by_source(row_ptr_MK: Tensor, src_rank_M: Tensor, num_ranks: int, capacity: Optional[int]) -> tuple:
    """Send order for combines that return every (token, position) row on its own.

    Pairs go in (row m, position j) order, which groups them by source rank. Returns `(send_src_X,
    num_pairs_per_source_R)` where `send_src_X[x]` is the expanded row sent as row x (-1 for holes) and holes
    pad each source block to `capacity` rows when given (sync-free), else blocks are packed back to back.
    """
    flat = row_ptr_MK.reshape(-1)
    valid = flat >= 0
    src_rank = src_rank_M.repeat_interleave(row_ptr_MK.shape[1]).clamp(min=0)
    counts_R = torch.zeros(num_ranks, dtype=torch.int64, device=flat.device)
    counts_R.scatter_add_(0, src_rank, valid.long())
    order = valid.long().cumsum(0) - 1  # index among all valid pairs (grouped by source)
    if capacity is None:
        dst = order.masked_fill(~valid, -1)
        num_rows = flat.numel() and int(valid.sum())
    else:
        before_R = counts_R.cumsum(0) - counts_R
        dst = (src_rank * capacity + order - before_R[src_rank]).masked_fill(~valid, -1)
        num_rows = num_ranks * capacity
    send_src = scatter_index(dst, num_rows)
    if flat.numel() == 0:
        return torch.full_like(send_src, -1), counts_R
    return (flat[send_src.clamp(min=0)]).masked_fill(send_src < 0, -1), counts_R
