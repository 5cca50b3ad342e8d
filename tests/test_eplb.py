"""The EPLB planners: redundant slots with fixed owners, and the hierarchical placement (docs/load_balancing.md)."""

import inspect
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epcomm.allocator import BufferAllocator
from epcomm.bench.eplb import run_eplb
from epcomm.eplb import RedundancyPlan, hierarchical_placement, plan_redundant_experts
from epcomm.lb import LoadBalancingMixin
from epcomm.routing import zipf_scores

PUBLIC = [plan_redundant_experts, hierarchical_placement, RedundancyPlan.map_topk_idx, BufferAllocator.allocate,
          BufferAllocator.materialize, LoadBalancingMixin.lb_prefetch_weights, LoadBalancingMixin.lb_reduce_grads,
          LoadBalancingMixin.lb_get_theoretical_num_sms, run_eplb]


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__qualname__)
def test_docstring_names_every_argument(fn):
    doc = inspect.getdoc(fn) or ""
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    missing = [p for p in params if not re.search(rf"\b{re.escape(p)}\b", doc)]
    assert not missing, f"{fn.__qualname__}: docstring does not describe {missing}"
    assert "Returns" in doc or fn.__name__ in ("materialize",), f"{fn.__qualname__}: no Returns section"
    assert "Raises" in doc or fn.__name__ in ("lb_get_theoretical_num_sms", "run_eplb"), fn.__qualname__


def test_worked_example():
    # R=2, L=2, C=1; expert 0 is hot: baseline rank loads [10, 2].
    plan = plan_redundant_experts(torch.tensor([[10, 0, 1, 1]]), 2, 1)
    # Slot 1: the hot expert goes to rank 1 taking 4 (half the gap); slot 2: nothing helps, a spare of expert 2.
    assert plan.redundancy_mapping.tolist() == [[[2], [0]]]
    assert plan.rank_load.tolist() == [[6.0, 6.0]] and plan.baseline_rank_load.tolist() == [[10.0, 2.0]]
    assert plan.replica_counts.tolist() == [[2, 1, 2, 1]]
    assert plan.physical_to_logical.tolist() == [[0, 1, 2, 2, 3, 0]]  # rank r: ids [3r, 3r + 3): L own, C slots
    assert plan.logical_to_physical[0, 0].tolist() == [0, 5] and plan.logical_to_physical[0, 2].tolist() == [3, 2]
    assert plan.copy_shares[0, 0].tolist() == [0.6, 0.4] and plan.copy_shares[0, 2].tolist() == [1.0, 0.0]
    assert plan.num_physical_experts == 6
    # Ten picks of expert 0 on rank 0: u = 0.05, 0.15, ... 0.95 -> six to the owner (u < 0.6), four to the replica.
    topk_idx = torch.tensor([[0, 2]] * 10 + [[-1, 3]])
    phys = plan.map_topk_idx(topk_idx)
    assert phys[:, 0].tolist() == [0] * 6 + [5] * 4 + [-1] and phys[:10, 1].tolist() == [3] * 10
    assert phys[10, 1] == 4 and phys.dtype == torch.int64
    assert plan.map_topk_idx(topk_idx.int(), rank=1).dtype == torch.int32


def _loads(draw_seed: int, layers: int, num_experts: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(draw_seed)
    if kind == "zipf":
        scores = zipf_scores(64 * layers, num_experts, generator=g)
        picks = scores.topk(min(2, num_experts), dim=1).indices.view(layers, -1)
        return torch.stack([torch.bincount(p, minlength=num_experts) for p in picks])
    if kind == "sparse":
        return torch.randint(0, 3, (layers, num_experts), generator=g) * (torch.rand(layers, num_experts,
                                                                                     generator=g) < 0.3)
    return torch.randint(0, 100, (layers, num_experts), generator=g).double()


def _check_plan(plan, load):
    R, L, C = plan.num_ranks, plan.num_local_experts, plan.num_redundant_slots
    E, stride = R * L, L + C
    load = load.double()
    for i in range(load.shape[0]):
        mapping = plan.redundancy_mapping[i]
        # every logical expert keeps its owner, the owner's copy is listed first
        owners = torch.arange(E) // L
        assert torch.equal(plan.logical_to_physical[i, :, 0], owners * stride + torch.arange(E) % L)
        assert torch.equal(plan.physical_to_logical[i].view(R, stride)[:, :L].reshape(-1), torch.arange(E))
        # the slot budget is used exactly; never an own expert; an expert at most once per rank
        assert int((mapping >= 0).sum()) == R * C and int(plan.replica_counts[i].sum()) == E + R * C
        for r in range(R):
            row = mapping[r].tolist()
            assert all(e // L != r for e in row) and len(set(row)) == len(row)
        assert torch.equal(plan.physical_to_logical[i].view(R, stride)[:, L:], mapping.long())
        # shares: a distribution over each expert's copies; the planned loads follow from them
        shares = plan.copy_shares[i]
        assert bool((shares >= 0).all()) and torch.allclose(shares.sum(1), torch.ones(E, dtype=torch.float64))
        assert bool((shares[plan.logical_to_physical[i] < 0] == 0).all())
        rank_of = torch.where(plan.logical_to_physical[i] >= 0, plan.logical_to_physical[i] // stride, 0)
        recomputed = torch.zeros(R, dtype=torch.float64).index_add_(0, rank_of.reshape(-1),
                                                                    (shares * load[i, :, None]).reshape(-1))
        assert torch.allclose(recomputed, plan.rank_load[i], rtol=1e-9, atol=1e-9)
        assert torch.equal(plan.baseline_rank_load[i], load[i].view(R, L).sum(1))
        # never worse; strictly better when one expert carries more than twice the mean load per rank
        assert float(plan.rank_load[i].max()) <= float(plan.baseline_rank_load[i].max())
        if R >= 2 and C >= 1 and float(load[i].max()) > 2 * float(load[i].sum()) / R:
            assert float(plan.rank_load[i].max()) < float(plan.baseline_rank_load[i].max())


@settings(max_examples=60, deadline=None)
@given(num_ranks=st.integers(1, 5), num_local=st.integers(1, 4), slots=st.integers(0, 4), layers=st.integers(1, 3),
       kind=st.sampled_from(["uniform", "zipf", "sparse"]), seed=st.integers(0, 2**16))
def test_plan_properties(num_ranks, num_local, slots, layers, kind, seed):
    slots = min(slots, (num_ranks - 1) * num_local)
    load = _loads(seed, layers, num_ranks * num_local, kind)
    plan = plan_redundant_experts(load, num_ranks, slots)
    _check_plan(plan, load)
    again = plan_redundant_experts(load.clone(), num_ranks, slots)  # deterministic
    for name in ("redundancy_mapping", "logical_to_physical", "copy_shares", "physical_to_logical", "rank_load"):
        assert torch.equal(getattr(plan, name), getattr(again, name)), name


@settings(max_examples=30, deadline=None)
@given(num_ranks=st.integers(2, 4), num_local=st.integers(1, 4), slots=st.integers(1, 3), rank=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_map_topk_idx_spreads_over_copies(num_ranks, num_local, slots, rank, seed):
    slots, rank = min(slots, (num_ranks - 1) * num_local), rank % num_ranks
    E = num_ranks * num_local
    g = torch.Generator().manual_seed(seed)
    topk_idx = zipf_scores(200, E, generator=g).topk(min(3, E), dim=1).indices
    topk_idx[torch.rand(topk_idx.shape, generator=g) < 0.1] = -1
    load = torch.bincount(topk_idx[topk_idx >= 0], minlength=E)[None]
    plan = plan_redundant_experts(load, num_ranks, slots)
    phys = plan.map_topk_idx(topk_idx, rank=rank)
    assert torch.equal(phys < 0, topk_idx < 0)
    back = torch.where(phys >= 0, plan.physical_to_logical[0][phys.clamp(min=0)], -1)
    assert torch.equal(back, topk_idx)  # each pick lands on a copy of its own expert
    for row in phys.tolist():  # distinct experts stay distinct physical ids
        picked = [p for p in row if p >= 0]
        assert len(set(picked)) == len(picked)
    counts = torch.bincount(phys[phys >= 0], minlength=plan.num_physical_experts).double()
    expected = load[0, :, None].double() * plan.copy_shares[0]
    l2p = plan.logical_to_physical[0]
    got = torch.where(l2p >= 0, counts[l2p.clamp(min=0)], 0.0)
    assert bool(((got - expected).abs() <= 1.0 + 1e-9).all()), (got, expected)  # each copy within one pick


def test_balanced_ranks_cannot_improve():
    # Two hot experts, one per rank: ranks are already even, so no placement lowers the maximum (why the
    # strict-improvement rule is stated against the mean load per rank, not per expert).
    load = torch.tensor([[10, 0, 0, 10, 0, 0]])
    plan = plan_redundant_experts(load, 2, 2)
    assert plan.rank_load.tolist() == plan.baseline_rank_load.tolist() == [[10.0, 10.0]]
    _check_plan(plan, load)


def test_zipf_balance_is_large():
    g = torch.Generator().manual_seed(0)
    topk = zipf_scores(4096, 256, generator=g).topk(8, dim=1).indices
    load = torch.bincount(topk.reshape(-1), minlength=256)[None]
    plan = plan_redundant_experts(load, 8, 4)
    before = float(plan.baseline_rank_load.max() / plan.baseline_rank_load.mean())
    after = float(plan.rank_load.max() / plan.rank_load.mean())
    assert before > 1.5 and after < 1.05, (before, after)


def test_plan_errors():
    ok = torch.ones(1, 4)
    with pytest.raises(TypeError, match=r"plan_redundant_experts: load must be a real tensor \[layers, E\], got list"):
        plan_redundant_experts([[1, 2]], 2, 1)
    with pytest.raises(ValueError, match=r"load must be 2-D \[layers, E\] with E >= 1, got shape \(4,\); pass "
                                         r"load\[None\] for one layer"):
        plan_redundant_experts(torch.ones(4), 2, 1)
    with pytest.raises(ValueError, match=r"load must be finite and >= 0, got min -1\.0"):
        plan_redundant_experts(torch.tensor([[1.0, -1.0]]), 2, 1)
    with pytest.raises(ValueError, match=r"load must be finite and >= 0, got min nan"):
        plan_redundant_experts(torch.tensor([[1.0, float("nan")]]), 2, 1)
    with pytest.raises(ValueError, match=r"load has E=4 experts, not a multiple of num_ranks=3"):
        plan_redundant_experts(ok, 3, 1)
    with pytest.raises(ValueError, match=r"num_redundant_slots must be in \[0, 2\], got 3"):
        plan_redundant_experts(ok, 2, 3)
    with pytest.raises(TypeError, match=r"num_ranks must be an int, got float"):
        plan_redundant_experts(ok, 2.0, 1)
    plan = plan_redundant_experts(ok, 2, 1)
    with pytest.raises(ValueError, match=r"map_topk_idx: topk_idx holds 4; logical ids must be in \[-1, E=4\)"):
        plan.map_topk_idx(torch.tensor([[0, 4]]))
    with pytest.raises(TypeError, match=r"topk_idx must be an int64 or int32 tensor, got torch\.float32"):
        plan.map_topk_idx(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"layer must be in \[0, 0\], got 1"):
        plan.map_topk_idx(torch.zeros(2, 2, dtype=torch.int64), layer=1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\], got 2"):
        plan.map_topk_idx(torch.zeros(2, 2, dtype=torch.int64), rank=2)
    for shape in ((2,), (1, 2, 2), ()):
        with pytest.raises(ValueError, match=re.escape(f"RedundancyPlan.map_topk_idx: topk_idx must be 2-D [T, K] "
                                                       f"(tokens x top-k), got shape {shape}")):
            plan.map_topk_idx(torch.zeros(shape, dtype=torch.int64))


def test_plans_compare_by_value():
    load = torch.tensor([[10.0, 1, 1, 1], [1, 1, 10, 1]])
    plan, again = plan_redundant_experts(load, 2, 1), plan_redundant_experts(load.clone(), 2, 1)
    assert plan == again and not plan != again and hash(plan) == hash(again) and {plan: 1}[again] == 1
    other = plan_redundant_experts(load.flip(0), 2, 1)
    assert plan != other and not plan == other
    assert plan != plan_redundant_experts(load, 2, 0)  # ints and tensor shapes differ
    # A tensor field of another dtype (same values) or one value apart: not equal.
    import dataclasses
    assert plan != dataclasses.replace(plan, redundancy_mapping=plan.redundancy_mapping.long())
    shares = plan.copy_shares.clone()
    shares[0, 0, 0] += 1e-9
    assert plan != dataclasses.replace(plan, copy_shares=shares)
    assert plan != "plan" and plan != None  # noqa: E711 -- another type: not equal, no error
    kw = dict(num_groups=2, num_nodes=1, num_gpus=2)
    placed = hierarchical_placement(load, 8, **kw)
    assert placed == hierarchical_placement(load.clone(), 8, **kw) and placed != hierarchical_placement(
        load.flip(0), 8, **kw)
    assert hash(placed) == hash(hierarchical_placement(load, 8, **kw)) and placed != plan


def test_planned_tensors_compare_by_identity():
    alloc = BufferAllocator()
    for _ in range(2):
        alloc.allocate((2, 4), torch.float32)
    first, second = alloc.allocations
    assert first == first and first != second and first in alloc.allocations and len({first, second}) == 2


# ----------------------------------------------------------------------------------------------------------
# hierarchical placement
# ----------------------------------------------------------------------------------------------------------
def test_hierarchical_worked_example():
    # 8 experts in 4 groups of 2, 2 nodes x 2 GPUs, 12 physical experts (3 per GPU).
    load = torch.tensor([[9.0, 1.0, 4.0, 4.0, 0.0, 2.0, 3.0, 1.0]])  # group loads 10, 8, 2, 4
    out = hierarchical_placement(load, 12, num_groups=4, num_nodes=2, num_gpus=4)
    # groups, heaviest first, to the least loaded node with room: 10 -> 0, 8 -> 1, 4 -> 1, 2 -> 0 (12 and 12)
    assert out.node_of_group.tolist() == [[0, 1, 0, 1]]
    # node 0 (experts 0, 1, 4, 5; loads 9, 1, 0, 2) has 6 slots: 2 extra copies of expert 0 (9 -> 4.5 -> 3);
    # node 1 (experts 2, 3, 6, 7; loads 4, 4, 3, 1): one extra copy each of experts 2 and 3.
    assert out.replica_counts.tolist() == [[3, 1, 2, 2, 1, 1, 1, 1]]
    # GPUs, heaviest copy first onto the least loaded GPU with room: every GPU carries 6.
    assert out.physical_to_logical.tolist() == [[0, 0, 4, 0, 5, 1, 6, 3, 7, 2, 2, 3]]
    assert out.gpu_load.tolist() == [[6.0, 6.0, 6.0, 6.0]]
    assert out.logical_to_physical[0, 0].tolist() == [0, 1, 3] and out.logical_to_physical[0, 1].tolist() == [5, -1, -1]
    assert float(out.gpu_load.sum()) == float(load.sum())


@settings(max_examples=40, deadline=None)
@given(num_groups=st.sampled_from([1, 2, 4, 8]), group_size=st.integers(1, 4), nodes=st.sampled_from([1, 2, 4]),
       gpus_per_node=st.integers(1, 3), extra_per_gpu=st.integers(0, 3), seed=st.integers(0, 2**16),
       layers=st.integers(1, 2))
def test_hierarchical_properties(num_groups, group_size, nodes, gpus_per_node, extra_per_gpu, seed, layers):
    E, G = num_groups * group_size, nodes * gpus_per_node
    per_gpu = -(-E // G) + extra_per_gpu
    P = per_gpu * G
    load = _loads(seed, layers, E, "zipf")
    out = hierarchical_placement(load, P, num_groups=num_groups, num_nodes=nodes, num_gpus=G)
    again = hierarchical_placement(load, P, num_groups=num_groups, num_nodes=nodes, num_gpus=G)
    assert torch.equal(out.physical_to_logical, again.physical_to_logical)
    assert out.physical_to_logical.shape == (layers, P)
    for i in range(layers):
        p2l = out.physical_to_logical[i]
        assert torch.equal(torch.bincount(p2l, minlength=E), out.replica_counts[i])
        assert bool((out.replica_counts[i] >= 1).all()) and int(out.replica_counts[i].sum()) == P
        l2p = out.logical_to_physical[i]
        for x in range(E):
            ids = l2p[x][l2p[x] >= 0]
            assert len(ids) == int(out.replica_counts[i, x]) and bool((p2l[ids] == x).all())
        assert abs(float(out.gpu_load[i].sum()) - float(load[i].sum())) < 1e-6 * (1 + float(load[i].sum()))
        if num_groups % nodes == 0:  # hierarchical: a group's experts stay on its node's GPUs
            node_of_group = out.node_of_group[i].tolist()
            assert all(node_of_group.count(n) == num_groups // nodes for n in range(nodes))
            per_node = P // nodes
            for p, x in enumerate(p2l.tolist()):
                assert p // per_node == node_of_group[x // group_size]


def test_hierarchical_balances_zipf_better_than_contiguous():
    g = torch.Generator().manual_seed(1)
    topk = zipf_scores(4096, 256, generator=g).topk(8, dim=1).indices
    load = torch.bincount(topk.reshape(-1), minlength=256)[None].double()
    out = hierarchical_placement(load, 288, num_groups=8, num_nodes=2, num_gpus=16)
    contiguous = load.view(16, 16).sum(1)
    assert float(out.gpu_load.max() / out.gpu_load.mean()) < 0.5 * float(contiguous.max() / contiguous.mean())


def test_hierarchical_errors():
    load = torch.ones(1, 8)
    with pytest.raises(ValueError, match=r"hierarchical_placement: E \(load\.shape\[1\]\)=8 must be a multiple of 3"):
        hierarchical_placement(load, 8, num_groups=3, num_nodes=1, num_gpus=2)
    with pytest.raises(ValueError, match=r"num_gpus=3 must be a multiple of 2"):
        hierarchical_placement(load, 12, num_groups=2, num_nodes=2, num_gpus=3)
    with pytest.raises(ValueError, match=r"num_physical_experts=10 must be a multiple of 4"):
        hierarchical_placement(load, 10, num_groups=2, num_nodes=2, num_gpus=4)
    with pytest.raises(ValueError, match=r"num_physical_experts=4 must be >= E=8"):
        hierarchical_placement(load, 4, num_groups=2, num_nodes=1, num_gpus=2)
    with pytest.raises(ValueError, match=r"num_nodes must be >= 1, got 0"):
        hierarchical_placement(load, 8, num_groups=2, num_nodes=0, num_gpus=2)


# ----------------------------------------------------------------------------------------------------------
# epcomm-bench --eplb
# ----------------------------------------------------------------------------------------------------------
def test_bench_eplb_runs_and_reports(pools, capsys, tmp_path):
    import json

    out_json = tmp_path / "eplb.json"
    args = ["--preset", "mixtral-8x7b", "--tokens", "16", "--iters", "2", "--warmup", "0", "--seed", "3",
            "--ranks", "2", "--json", str(out_json)]
    assert run_eplb(args, pool=pools.get(2)) == 0
    text = capsys.readouterr().out
    assert "gate: combined outputs through physical ids equal those through logical ids (bitwise)" in text
    assert "logical (before)" in text and "physical (EPLB)" in text
    record = json.loads(out_json.read_text())
    assert record["after"]["planned_max_over_mean"] <= record["before"]["planned_max_over_mean"]
    assert record["after"]["p50_s"] > 0 and record["failures"] == []
    with pytest.raises(SystemExit):
        run_eplb(["--preset", "mixtral-8x7b", "--ranks", "2", "--slots", "9"], pool=pools.get(2))
    assert "--slots must be in [1, 4], got 9" in capsys.readouterr().err


def test_hierarchical_placement_of_no_layers_is_empty():
    """A load table of no layers gives an empty placement of the right shapes, as plan_redundant_experts does (it
    raised inside torch.stack)."""
    p = hierarchical_placement(torch.ones(0, 8), 8, num_groups=2, num_nodes=2, num_gpus=2)
    assert p.physical_to_logical.shape == (0, 8) and p.replica_counts.shape == (0, 8)
    assert p.logical_to_physical.shape[:2] == (0, 8) and p.node_of_group.shape == (0, 2)
    assert p.gpu_load.shape == (0, 2)
