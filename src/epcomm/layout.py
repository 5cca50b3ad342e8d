"""Routing metadata from `topk_idx`: who sends which token where, and where each received row lands.

Everything here is prefix sums over counts (no sort), so rows come out in the canonical token-key order of
docs/decisions.md decision 4: non-expand rows in ascending `g = src_rank * N + src_token`, expand rows grouped by local
expert and ascending `g` inside each segment (DeepEP V2.5 EPBuffer behaviour, §9.3-9.7).

Shape legend (docs/shapes.md): T tokens here, K top-k, R ranks, L local experts, M received rows
(allocated), S expanded rows (allocated), N num_max_tokens_per_rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .sizing import align


def cumsum_rows(x_NC: Tensor) -> Tensor:
    """Cumulative sum down the rows of a 2-D tensor, computed as a scan along the last dimension.

    NOTE: `x.cumsum(0)` on a [4096, 3] int64 CUDA tensor took 499 us (2x H200, torch 2.11); the transposed
    innermost scan takes a few us.
    """
    return x_NC.t().contiguous().cumsum(1).t()


def dest_rank_of(topk_idx_TK: Tensor, num_local_experts: int) -> Tensor:
    """[T, K] int64: the rank owning each selected expert, -1 where the selection is -1."""
    idx = topk_idx_TK.long()
    return (torch.div(idx, num_local_experts, rounding_mode="floor")).masked_fill(idx < 0, -1)


@dataclass(frozen=True, kw_only=True)
class SendLayout:
    """Sender-side routing of one rank's tokens (rank dedup: one row per token per destination rank).

    Fields:
        num_tokens_per_rank_R: [R] int64 -- tokens sent to each rank.
        token_slot_TR: [T, R] int64 -- index of token t among the tokens sent to rank r (ascending t), -1 if
            t is not sent to r. The k-th row this rank sends to r (and the k-th row r sends back in combine)
            belongs to the token with slot k.
        last_pos_TR: [T, R] int64 -- largest top-k position of token t whose expert lives on rank r, -1 if none;
            the position of r's partial in the canonical combine order (reference §11.2, `m_r`).
    """

    num_tokens_per_rank_R: Tensor
    token_slot_TR: Tensor
    last_pos_TR: Tensor


def send_layout(topk_idx_TK: Tensor, num_ranks: int, num_local_experts: int) -> SendLayout:
    """Compute the sender-side layout; local, no communication."""
    num_tokens, num_topk = topk_idx_TK.shape
    dest_TK = dest_rank_of(topk_idx_TK, num_local_experts)
    # Column 0 of the scatter targets collects the -1 selections and is dropped.
    col_TK = dest_TK + 1
    is_sent_TR = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.int64, device=dest_TK.device)
    is_sent_TR.scatter_(1, col_TK, 1)
    is_sent_TR = is_sent_TR[:, 1:]
    token_slot_TR = (cumsum_rows(is_sent_TR) - 1).masked_fill(is_sent_TR <= 0, -1)
    pos_TK = torch.arange(num_topk, device=dest_TK.device).expand(num_tokens, num_topk)
    last_pos_TR = torch.full((num_tokens, num_ranks + 1), -1, dtype=torch.int64, device=dest_TK.device)
    last_pos_TR.scatter_reduce_(1, col_TK, pos_TK, reduce="amax", include_self=True)
    return SendLayout(
        num_tokens_per_rank_R=is_sent_TR.sum(0),
        token_slot_TR=token_slot_TR,
        last_pos_TR=last_pos_TR[:, 1:],
    )


def dst_buffer_slot_idx(layout: SendLayout, topk_idx_TK: Tensor, num_local_experts: int, n: int) -> Tensor:
    """[T, K] int32: `dest_rank * N + slot` at the largest top-k position per destination rank, else -1 (§10)."""
    dest_TK = dest_rank_of(topk_idx_TK, num_local_experts)
    safe_TK = dest_TK.clamp(min=0)
    pos_TK = torch.arange(topk_idx_TK.shape[1], device=dest_TK.device).expand_as(dest_TK)
    is_last_TK = (dest_TK >= 0) & (layout.last_pos_TR.gather(1, safe_TK) == pos_TK)
    slot_TK = safe_TK * n + layout.token_slot_TR.gather(1, safe_TK)
    return slot_TK.masked_fill(~is_last_TK, -1).to(torch.int32)


def pair_slots(topk_idx_TK: Tensor, num_ranks: int, num_local_experts: int) -> tuple[Tensor, Tensor]:
    """Per-selection slots for combines that return every (token, expert) row on its own.

    Returns:
        num_pairs_per_rank_R: [R] int64 -- valid selections whose expert lives on rank r.
        pair_slot_TK: [T, K] int64 -- index of selection (t, j) among those of its rank, ordered by t then j;
            -1 for -1 selections.
    """
    dest_TK = dest_rank_of(topk_idx_TK, num_local_experts)
    flat = dest_TK.reshape(-1)
    onehot = torch.zeros(flat.numel(), num_ranks + 1, dtype=torch.int64, device=flat.device)
    onehot.scatter_(1, (flat + 1).unsqueeze(1), 1)
    onehot = onehot[:, 1:]
    rank_in_dest = (cumsum_rows(onehot) - 1).gather(1, flat.clamp(min=0).unsqueeze(1)).squeeze(1)
    pair_slot = rank_in_dest.masked_fill(flat < 0, -1).view_as(dest_TK)
    return onehot.sum(0), pair_slot


@dataclass(frozen=True, kw_only=True)
class RecvLayout:
    """Receiver-side placement of the rows this rank received.

    Fields:
        local_idx_MK: [M, K] int64 -- local expert id of each column (`topk_idx - rank * L` when the expert is
            local, else -1); all -1 on rows past the valid extent.
        num_unaligned_L: [L] int64 -- received (token, local expert) pairs per expert (`n_i`).
        aligned_start_L: [L] int64 -- first expanded row of each expert (`align` of the previous end).
        row_ptr_MK: [M, K] int64 or None -- expand layout: expanded row holding (row m, position j), -1 if the
            expert is not local; None for the non-expand layout.
        num_expanded_rows: int -- allocated expanded rows (exact with CPU sync, worst case otherwise); 0 when
            the layout is non-expand.
    """

    local_idx_MK: Tensor
    num_unaligned_L: Tensor
    aligned_start_L: Tensor
    row_ptr_MK: Optional[Tensor]
    num_expanded_rows: int


def recv_layout(
    recv_topk_idx_MK: Tensor,
    valid_M: Tensor,
    rank: int,
    num_local_experts: int,
    expert_alignment: int,
    do_expand: bool,
    num_expanded_rows: Optional[int],
) -> RecvLayout:
    """Local expert ids, per-expert counts and (expand) row pointers for the received rows.

    Args:
        recv_topk_idx_MK: [M, K] int64 -- the senders' global expert ids, one row per received token.
        valid_M: [M] bool -- rows inside the valid extent (all True with CPU sync).
        num_expanded_rows: allocated expanded rows; None to size exactly (needs the counts on the host).
    """
    num_local = num_local_experts
    idx = recv_topk_idx_MK.long()
    is_local = (idx >= rank * num_local) & (idx < (rank + 1) * num_local) & valid_M.unsqueeze(1)
    local_idx_MK = (idx - rank * num_local).masked_fill(~is_local, -1)
    # One-hot over local experts; an expert appears at most once per row, so cumsum gives the in-segment rank.
    onehot_ML = torch.zeros(idx.shape[0], num_local + 1, dtype=torch.int64, device=idx.device)
    onehot_ML.scatter_(1, local_idx_MK + 1, 1)
    onehot_ML = onehot_ML[:, 1:]
    num_unaligned_L = onehot_ML.sum(0)
    aligned_L = torch.div(num_unaligned_L + expert_alignment - 1, expert_alignment, rounding_mode="floor")
    aligned_L = aligned_L * expert_alignment
    aligned_start_L = aligned_L.cumsum(0) - aligned_L
    row_ptr_MK = None
    if do_expand:
        if num_expanded_rows is None:
            num_expanded_rows = int(aligned_L.sum())
        safe_MK = local_idx_MK.clamp(min=0)
        rank_in_expert_MK = (cumsum_rows(onehot_ML) - 1).gather(1, safe_MK)
        row_ptr_MK = (aligned_start_L[safe_MK] + rank_in_expert_MK).masked_fill(~is_local, -1)
    return RecvLayout(
        local_idx_MK=local_idx_MK,
        num_unaligned_L=num_unaligned_L,
        aligned_start_L=aligned_start_L,
        row_ptr_MK=row_ptr_MK,
        num_expanded_rows=int(num_expanded_rows or 0) if do_expand else 0,
    )


def worst_case_expanded_rows(num_ranks: int, n: int, num_topk: int, num_local: int, alignment: int) -> int:
    """Expanded rows allocated without CPU sync (reference §9.5)."""
    return align(num_ranks * n * min(num_topk, num_local) + (alignment - 1) * num_local, alignment)
