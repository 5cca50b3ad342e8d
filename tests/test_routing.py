"""Tests for epcomm.routing (gates, synthetic scores, presets)."""

import dataclasses
import math

import pytest
import torch

from epcomm.routing import (
    PRESETS,
    MoEPreset,
    deepseek_v3_gate,
    get_preset,
    make_routing,
    softmax_topk,
    topk_from_scores,
    uniform_scores,
    zipf_scores,
)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _logit(p):
    p = torch.tensor(p, dtype=torch.float64)
    return torch.log(p / (1 - p)).float()


def _check_routing(idx, w, num_tokens, num_experts, num_topk, scale=1.0):
    assert idx.dtype == torch.int64 and w.dtype == torch.float32
    assert idx.shape == (num_tokens, num_topk) and w.shape == (num_tokens, num_topk)
    masked = idx == -1
    assert ((idx >= 0) & (idx < num_experts) | masked).all()
    # no expert twice in a row: replace masked entries with distinct negatives, then look for equal neighbours
    tagged = torch.where(masked, -1 - torch.arange(num_topk).expand_as(idx), idx)
    s = tagged.sort(dim=1).values
    assert (s[:, 1:] != s[:, :-1]).all()
    assert (w[masked] == 0).all() and (w[~masked] > 0).all()
    full = ~masked.any(dim=1)
    torch.testing.assert_close(w[full].sum(1), torch.full((int(full.sum()),), scale), rtol=0, atol=1e-5)


# ---------------------------------------------------------------- gates


def test_deepseek_v3_gate_hand_worked():
    # 8 experts in 4 groups of 2: g0={0,1} g1={2,3} g2={4,5} g3={6,7}.
    s = [0.9, 0.1, 0.6, 0.6, 0.8, 0.75, 0.2, 0.2]
    logits = _logit([s])
    # group scores (top-2 sum = whole group here): g0 1.0, g1 1.2, g2 1.55, g3 0.4 -> keep g2, g1.
    # Expert 0 has the highest score but its group loses, so the picks are 4 and 5 (plain top-2 is 0, 4).
    idx, w = deepseek_v3_gate(logits, 2, n_group=4, topk_group=2)
    assert idx.tolist() == [[4, 5]]
    torch.testing.assert_close(w, torch.tensor([[0.8 / 1.55, 0.75 / 1.55]]))
    assert topk_from_scores(torch.tensor([s]), 2, sorted=True)[0].tolist() == [[0, 4]]
    # bias +0.3 on expert 2: selection scores g1 = 0.9 + 0.6 = 1.5 -> still g2, g1, but now expert 2 (0.9)
    # beats 5 (0.75); weights use the unbiased sigmoid scores 0.6 and 0.8, times routed_scaling_factor 2.5.
    bias = torch.tensor([0, 0, 0.3, 0, 0, 0, 0, 0])
    idx, w = deepseek_v3_gate(logits, 2, n_group=4, topk_group=2, bias=bias, routed_scaling_factor=2.5)
    assert idx.tolist() == [[2, 4]]
    torch.testing.assert_close(w, torch.tensor([[2.5 * 0.6 / 1.4, 2.5 * 0.8 / 1.4]]))


def test_deepseek_v3_gate_group_score_is_top2_sum():
    # g0 = {0..3}: top-2 sum 1.05 (full sum 1.2); g1 = {4..7}: top-2 sum 0.95 (full sum 1.7). Top-2 wins g0.
    logits = _logit([[0.9, 0.15, 0.1, 0.05, 0.5, 0.45, 0.4, 0.35]])
    idx, w = deepseek_v3_gate(logits, 2, n_group=2, topk_group=1)
    assert idx.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.tensor([[0.9 / 1.05, 0.15 / 1.05]]))


def test_deepseek_v3_gate_one_group_is_plain_sigmoid_topk():
    logits = torch.randn(64, 32, generator=_gen(1))
    idx, w = deepseek_v3_gate(logits, 4, n_group=1, topk_group=1)
    s, ref = torch.sigmoid(logits).topk(4, dim=1)
    assert torch.equal(idx, ref)
    torch.testing.assert_close(w, s / s.sum(1, keepdim=True))


def test_deepseek_v3_gate_picks_only_kept_groups():
    logits = torch.randn(256, 256, generator=_gen(2))
    idx, w = deepseek_v3_gate(logits, 8, n_group=8, topk_group=4, bias=0.1 * torch.randn(256, generator=_gen(3)))
    _check_routing(idx, w, 256, 256, 8)
    groups_per_row = torch.tensor([len(set((r // 32).tolist())) for r in idx])
    assert (groups_per_row <= 4).all()


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_matches_reference(renormalize):
    logits = torch.randn(100, 128, generator=_gen(4)).to(torch.bfloat16)
    idx, w = softmax_topk(logits, 8, renormalize=renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    ref_w, ref_idx = probs.topk(8, dim=-1)
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32


def test_topk_from_scores():
    scores = torch.tensor([[1.0, 4.0, 2.0, 3.0], [2.0, 1.0, 1.5, 8.0]])
    idx, w = topk_from_scores(scores, 2, sorted=True)
    assert idx.tolist() == [[1, 3], [3, 0]]
    torch.testing.assert_close(w, torch.tensor([[4 / 7, 3 / 7], [0.8, 0.2]]))
    idx, w = topk_from_scores(uniform_scores(300, 64, generator=_gen(5)), 6)
    _check_routing(idx, w, 300, 64, 6)


# ---------------------------------------------------------------- scores


def test_uniform_scores():
    s = uniform_scores(50, 16, generator=_gen(6))
    assert s.shape == (50, 16) and s.dtype == torch.float32 and (s >= 1).all()
    assert uniform_scores(0, 16).shape == (0, 16)


def test_zipf_top1_frequencies_follow_zipf():
    # top-1 of p_e / Exp(1) is expert e with probability exactly p_e; the permutation is the first draw.
    e, t, a = 16, 100_000, 1.2
    s = zipf_scores(t, e, exponent=a, generator=_gen(7))
    perm = torch.randperm(e, generator=_gen(7))
    freq = torch.bincount(s.argmax(1), minlength=e).double() / t
    p = torch.arange(1, e + 1, dtype=torch.float64).pow(-a)
    torch.testing.assert_close(freq[perm], p / p.sum(), rtol=0, atol=0.01)
    assert (s > 0).all() and s.dtype == torch.float32


def test_zipf_skew_hot_expert():
    idx, _ = topk_from_scores(zipf_scores(4096, 256, generator=_gen(8)), 8)
    load = torch.bincount(idx.flatten(), minlength=256).double()
    assert load.max() >= 4 * load.mean()
    idx, _ = make_routing("dsv3", 4096, skew="zipf", generator=_gen(8))
    load = torch.bincount(idx.flatten(), minlength=256).double()
    assert load.max() >= 4 * load.mean()
    uni, _ = make_routing("dsv3", 4096, generator=_gen(8))
    load = torch.bincount(uni.flatten(), minlength=256).double()
    assert load.max() < 2 * load.mean()


# ---------------------------------------------------------------- presets and make_routing


def test_presets_numbers():
    got = {n: (p.num_tokens, p.hidden, p.num_experts, p.num_topk, p.routing, p.n_group, p.topk_group,
               p.fp8_dispatch) for n, p in PRESETS.items()}
    assert got == {
        "dsv3": (4096, 7168, 256, 8, "uniform", None, None, False),
        "dsv3-grouped": (4096, 7168, 256, 8, "grouped", 8, 4, False),
        "dsv3-decode": (128, 7168, 256, 8, "uniform", None, None, True),
        "qwen3-30b-a3b": (4096, 2048, 128, 8, "softmax", None, None, False),
        "mixtral-8x7b": (4096, 4096, 8, 2, "softmax", None, None, False),
    }
    assert all(p.name == n and p.description for n, p in PRESETS.items())
    assert get_preset("mixtral-8x7b") is PRESETS["mixtral-8x7b"]


def test_presets_immutable():
    with pytest.raises(TypeError):
        PRESETS["x"] = PRESETS["dsv3"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["dsv3"].num_tokens = 1


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("skew", [None, "zipf"])
def test_make_routing_invariants(name, skew):
    p = PRESETS[name]
    idx, w = make_routing(name, 512, skew=skew, generator=_gen(9))
    _check_routing(idx, w, 512, p.num_experts, p.num_topk)
    idx, w = make_routing(p, 0, skew=skew, generator=_gen(9))
    assert idx.shape == (0, p.num_topk) and w.shape == (0, p.num_topk)


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.37, 1.0])
def test_masked_ratio(ratio):
    idx, w = make_routing("qwen3-30b-a3b", 300, generator=_gen(10), masked_ratio=ratio)
    masked = idx == -1
    assert int(masked.sum()) == round(ratio * 300 * 8)
    _check_routing(idx, w, 300, 128, 8)
    assert (w.sum(1) <= 1 + 1e-5).all()


@pytest.mark.parametrize("name", ["dsv3", "dsv3-grouped", "mixtral-8x7b"])
def test_determinism(name):
    a = make_routing(name, 256, skew="zipf", generator=_gen(11), masked_ratio=0.1)
    b = make_routing(name, 256, skew="zipf", generator=_gen(11), masked_ratio=0.1)
    c = make_routing(name, 256, skew="zipf", generator=_gen(12), masked_ratio=0.1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


# ---------------------------------------------------------------- errors


def test_preset_errors():
    with pytest.raises(ValueError, match=r"unknown MoE preset 'dsv4'; valid names: dsv3, dsv3-grouped, dsv3-decode, "
                                         r"qwen3-30b-a3b, mixtral-8x7b"):
        get_preset("dsv4")
    with pytest.raises(ValueError, match=r"unknown MoE preset 'nope'"):
        make_routing("nope", 4)
    with pytest.raises(TypeError, match=r"preset_or_name must be a MoEPreset or a preset name, got int"):
        make_routing(3, 4)
    with pytest.raises(ValueError, match=r"routing must be one of .*got 'topk'"):
        MoEPreset("x", 1, 1, 8, 2, "topk")
    with pytest.raises(ValueError, match=r"routing 'grouped' needs n_group and topk_group"):
        MoEPreset("x", 1, 1, 8, 2, "grouped")


def test_make_routing_errors():
    with pytest.raises(ValueError, match=r"skew must be None or 'zipf', got 'pareto'"):
        make_routing("dsv3", 4, skew="pareto")
    with pytest.raises(ValueError, match=r"masked_ratio must be in \[0, 1\], got 1.5"):
        make_routing("dsv3", 4, masked_ratio=1.5)
    with pytest.raises(ValueError, match=r"num_tokens must be >= 0, got -1"):
        make_routing("dsv3", -1)


def test_gate_errors():
    x = torch.randn(4, 12)
    with pytest.raises(ValueError, match=r"num_experts \(logits.shape\[1\] = 12\) must be divisible by n_group = 5"):
        deepseek_v3_gate(x, 2, n_group=5, topk_group=1)
    with pytest.raises(ValueError, match=r"topk_group must be in \[1, 4\], got 5"):
        deepseek_v3_gate(x, 2, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match=r"num_topk must be in \[1, 6\], got 7"):
        deepseek_v3_gate(x, 7, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match=r"bias must have shape \(12,\) to match logits \[T, E\], got \(8,\)"):
        deepseek_v3_gate(x, 2, n_group=4, topk_group=2, bias=torch.zeros(8))
    with pytest.raises(ValueError, match=r"logits must be a 2-D tensor \[T, E\], got shape \(12,\)"):
        softmax_topk(x[0], 2)
    with pytest.raises(ValueError, match=r"num_topk must be in \[1, 12\], got 13"):
        topk_from_scores(x, 13)
    with pytest.raises(TypeError, match=r"scores must have a floating dtype, got torch.int64"):
        topk_from_scores(x.long(), 2)
    with pytest.raises(ValueError, match=r"exponent must be >= 0, got -1"):
        zipf_scores(2, 4, exponent=-1)
    assert not math.isnan(float(zipf_scores(1, 4, exponent=0).sum()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_make_routing_cuda(name):
    g = torch.Generator(device="cuda").manual_seed(0)
    idx, w = make_routing(name, 1024, skew="zipf", generator=g, device="cuda", masked_ratio=0.05)
    assert idx.is_cuda and w.is_cuda
    p = PRESETS[name]
    _check_routing(idx.cpu(), w.cpu(), 1024, p.num_experts, p.num_topk)
