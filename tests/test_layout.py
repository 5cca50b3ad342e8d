"""Routing-metadata invariants, checked apart from data."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epcomm import layout


def _routing(seed, num_tokens, num_experts, num_topk, masked):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(num_tokens, num_experts, generator=gen).topk(num_topk, dim=1).indices
    return idx.masked_fill(torch.rand(num_tokens, num_topk, generator=gen) < masked, -1)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 999), num_tokens=st.integers(0, 50), num_ranks=st.integers(1, 5),
       num_local=st.integers(1, 6), num_topk=st.integers(1, 6), masked=st.sampled_from([0.0, 0.5, 1.0]))
def test_send_layout_invariants(seed, num_tokens, num_ranks, num_local, num_topk, masked):
    num_experts = num_ranks * num_local
    num_topk = min(num_topk, num_experts)
    idx = _routing(seed, num_tokens, num_experts, num_topk, masked)
    lay = layout.send_layout(idx, num_ranks, num_local)
    dest = torch.where(idx >= 0, idx // num_local, -1)
    for r in range(num_ranks):
        sent = (dest == r).any(1)
        slots = lay.token_slot_TR[:, r]
        # Tokens with an expert on r get slots 0..count-1 in ascending token order; the others -1.
        assert torch.equal(slots[sent], torch.arange(int(sent.sum())))
        assert bool((slots[~sent] == -1).all())
        assert int(lay.num_tokens_per_rank_R[r]) == int(sent.sum())
        # last_pos is the largest position with an expert on r.
        for t in range(num_tokens):
            positions = [j for j in range(num_topk) if int(dest[t, j]) == r]
            assert int(lay.last_pos_TR[t, r]) == (max(positions) if positions else -1)
    counts, pair_slot = layout.pair_slots(idx, num_ranks, num_local)
    assert int(counts.sum()) == int((idx >= 0).sum())  # totals = number of selections
    for r in range(num_ranks):
        assert torch.equal(pair_slot[dest == r].sort().values, torch.arange(int(counts[r])))
    slot_idx = layout.dst_buffer_slot_idx(lay, idx, num_local, n=64)
    assert int((slot_idx >= 0).sum()) == int(lay.num_tokens_per_rank_R.sum())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 999), num_rows=st.integers(0, 40), num_local=st.integers(1, 6), rank=st.integers(0, 2),
       alignment=st.sampled_from([1, 2, 3, 8]), num_topk=st.integers(1, 5))
def test_recv_layout_invariants(seed, num_rows, num_local, rank, alignment, num_topk):
    num_experts = 3 * num_local
    num_topk = min(num_topk, num_experts)
    idx = _routing(seed, num_rows, num_experts, num_topk, 0.3)
    valid = torch.ones(num_rows, dtype=torch.bool)
    lay = layout.recv_layout(idx, valid, rank, num_local, alignment, True, None)
    local = lay.local_idx_MK
    assert bool(((local == -1) | ((local >= 0) & (local < num_local))).all())
    n = torch.stack([(local == i).sum() for i in range(num_local)]) if num_local else torch.zeros(0)
    assert torch.equal(lay.num_unaligned_L, n)
    aligned = (n + alignment - 1) // alignment * alignment
    assert torch.equal(lay.aligned_start_L, aligned.cumsum(0) - aligned)
    assert lay.num_expanded_rows == int(aligned.sum())
    ptr = lay.row_ptr_MK
    assert torch.equal(ptr >= 0, local >= 0)
    used = ptr[ptr >= 0]
    assert used.unique().numel() == used.numel()  # every (row, expert) pair gets its own row
    for i in range(num_local):
        rows_i = ptr[local == i].sort().values
        start = int(lay.aligned_start_L[i])
        assert torch.equal(rows_i, torch.arange(start, start + int(n[i])))  # packed at the segment start
        # ascending received row (= ascending token key) inside the segment
        m_of_row = (local == i).nonzero()[:, 0]
        assert torch.equal(ptr[local == i], start + torch.arange(len(m_of_row)))
