"""The oracle itself: `epcomm.reference.dispatch` refuses a bad or inconsistent call on every rank (rather than return
results that tests and users would compare against), and its handle gives the aligned per-expert counts that
`EPHandle` gives."""

import pytest
import torch

import epcomm
import epcomm.reference as ref


def _call(rank: int, world: int, case: str):
    gen = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(6, 16, generator=gen)
    idx = torch.rand(6, 8, generator=gen).topk(2, dim=1).indices
    w = torch.rand(6, 2, generator=gen)
    num_experts = {"huge-experts": 2 ** 40, "experts-not-multiple": 7}.get(case, 8)
    if rank == 1:
        if case == "id-out-of-range":
            idx[0, 0] = 8
        elif case == "expert-twice":
            idx[2] = torch.tensor([3, 3])
        elif case == "ranks-disagree":
            num_experts = 16
        elif case == "num-experts-none":  # raised before the all-gather, leaving the peer in it
            num_experts = None
        elif case == "topk-idx-1d":
            idx = idx[:, 0]
        elif case == "x-dtype-differs":  # a gloo abort in the moves after the check
            x = x.double()
    try:
        ref.dispatch(x, idx, w, num_experts)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case,own,peer", [
    ("huge-experts", r"num_experts=1099511627776 must be in \[1, 65536\]", None),
    ("experts-not-multiple", "num_experts=7 must be in", None),
    ("id-out-of-range", r"topk_idx holds ids outside \[-1, num_experts=8\) \(token 0, position 0: 8\)",
     r"group ranks \[1\] passed invalid"),
    ("expert-twice", r"a topk_idx row names an expert twice \(token 2: \[3, 3\]\)",
     r"group ranks \[1\] passed invalid"),
    ("ranks-disagree", r"ranks disagree on num_experts \(rank 0: 8, rank 1: 16\)", None),
    ("num-experts-none", r"num_experts must be an int, got None", r"group ranks \[1\] passed invalid"),
    ("topk-idx-1d", r"topk_idx must be a \[T, K\] int64/int32 tensor", r"group ranks \[1\] passed invalid"),
    ("x-dtype-differs", r"ranks disagree on dtype \(rank 0: torch.float32, rank 1: torch.float64\)", None),
])
def test_reference_refuses_bad_calls_on_every_rank(run_ranks, case, own, peer):
    import re

    messages = run_ranks(2, _call, case, timeout=60)
    assert re.search(f"rank 1: {own}", messages[1]), messages
    assert re.search(f"rank 0: {peer or own}", messages[0]), messages


def _aligned_counts(rank: int, world: int):
    gen = torch.Generator().manual_seed(3 + rank)
    x = torch.randn(20, 16, generator=gen)
    idx = torch.rand(20, 8, generator=gen).topk(3, dim=1).indices
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=32, hidden=16, num_topk=3, explicitly_destroy=True)
    try:
        *_, handle, _ = buf.dispatch(x, idx, None, num_experts=8, do_expand=True, expert_alignment=4)
        *_, ref_handle = ref.dispatch(x, idx, None, 8, num_max_tokens_per_rank=32, do_expand=True,
                                      expert_alignment=4)
        return handle.num_recv_tokens_per_expert_list, ref_handle.num_recv_tokens_per_expert_list
    finally:
        buf.destroy()


def test_reference_handle_gives_aligned_counts(run_ranks):
    for ours, oracle in run_ranks(2, _aligned_counts, timeout=60):
        assert ours == oracle and all(n % 4 == 0 for n in oracle) and sum(oracle) > 0, (ours, oracle)


def _nan_weights_round_trip(rank: int, world: int):
    """One routed weight, a signalling NaN (quiet bit clear): epcomm and the reference return its bits unchanged
    (the reference's one-element float write quieted it)."""
    x = torch.randn(1, 4)
    idx = torch.tensor([[-1, 0]])
    w = torch.rand(1, 2)
    w.view(torch.int32)[0, 1] = -4194305  # 0xffbfffff
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=1, hidden=4, num_topk=2, dtype=torch.float32,
                          explicitly_destroy=True)
    try:
        recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=2 * world, do_expand=True)
        r_x, _, r_w, r_handle = ref.dispatch(x, idx, w, 2 * world, do_expand=True)
        got = buf.combine(recv_x, handle, topk_weights=recv_w)[1]
        want = ref.combine(r_x, r_handle, topk_weights=r_w)[1]
        routed = (idx >= 0).to(torch.int32)
        return [t.view(torch.int32) for t in (got, want)] + [w.view(torch.int32) * routed]
    finally:
        buf.destroy()


def _half_weights(rank: int, world: int):
    """The oracle takes weights of any float dtype (epcomm's buffer takes fp32/fp64): bf16 weights return as sent."""
    x = torch.randn(3, 4)
    idx = torch.tensor([[0, -1], [1, 0], [-1, 1]])
    w = torch.rand(3, 2).bfloat16()
    r_x, _, r_w, r_handle = ref.dispatch(x, idx, w, 2 * world, do_expand=True)
    got = ref.combine(r_x, r_handle, topk_weights=r_w)[1]
    return torch.equal(got, w * (idx >= 0)), got.dtype


def test_reference_returns_half_weights(run_ranks):
    assert run_ranks(1, _half_weights, timeout=60) == [(True, torch.bfloat16)]


def test_weights_return_with_their_bits(run_ranks):
    for got, want, sent in run_ranks(1, _nan_weights_round_trip, timeout=60):
        assert torch.equal(want, sent), (want, sent)
        assert torch.equal(got, sent), (got, sent)


def _bias_forms(rank: int, world: int):
    """The oracle's bias: a tensor, or a pair whose items may be None (each adds 0), as EPBuffer.combine takes it;
    another tuple length is refused."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 8, generator=gen)
    idx = torch.tensor([[0, 1], [1, -1], [-1, 0], [1, 0]])
    b = torch.randn(4, 8, generator=gen)
    r_x, _, _, r_handle = ref.dispatch(x, idx, None, 2 * world)
    alone = ref.combine(r_x, r_handle, bias=b)[0]
    pairs = [ref.combine(r_x, r_handle, bias=pair)[0] for pair in ((b, None), (None, b), [b, None])]
    with pytest.raises(ValueError, match=r"bias as a tuple must be \(bias_0, bias_1\), got 1 items"):
        ref.combine(r_x, r_handle, bias=(b,))
    return all(torch.equal(p, alone) for p in pairs) and not torch.equal(alone, ref.combine(r_x, r_handle)[0])


def test_reference_bias_forms(run_ranks):
    assert run_ranks(1, _bias_forms, timeout=60) == [True]
