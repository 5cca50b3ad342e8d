"""Redundant-expert load balancing: weight prefetch, gradient reduction, errors on every rank, physical ids
end to end (DeepEP V2.5 behaviour, §13; docs/decisions.md "LB gradient reduction", "Errors and timeouts")."""

import re

import lb_cases
import pytest
import torch

from epcomm.lb import lb_routes
from epcomm.testing import run_in_fresh_world

# Bytes per expert of each payload (weights, scale factors ...): reference §13.4's sweep, trimmed for CPU, plus
# sizes that are not multiples of 32 (epcomm's collective path has no alignment rule).
PAYLOADS = [(1 << 20, 16384, 4096), (12320, 12256, 32), (1152, 544, 288), (96, 64, 32), (20480,), (36, 6, 1)]


def test_routes_worked_example():
    # 2 ranks, L=2: rank 0 holds experts 2, 3 (both rank 1's); rank 1 holds expert 0 and an empty slot.
    mapping = [[2, 3], [0, -1]]
    r0, r1 = lb_routes(mapping, 2, 0), lb_routes(mapping, 2, 1)
    assert (r0.send_rows, r0.send_splits, r0.recv_slots, r0.recv_splits) == ([0], [0, 1], [0, 1], [0, 2])
    assert (r1.send_rows, r1.send_splits, r1.recv_slots, r1.recv_splits) == ([0, 1], [2, 0], [0], [1, 0])
    assert r0.num_transfers == r1.num_transfers == 3


@pytest.mark.parametrize("pattern", ["random", "ring", "spread"])
def test_prefetch_patterns_four_ranks(run_ranks, pattern):
    for i, payload in enumerate(PAYLOADS[1:]):
        filled = run_ranks(4, lb_cases.check_prefetch, pattern=pattern, payload_bytes=payload, shaped=i % 2 == 1,
                           use_event=i % 2 == 0, seed=i)
        assert sum(filled) > 0


def test_prefetch_megabytes_two_ranks(run_ranks):
    run_ranks(2, lb_cases.check_prefetch, pattern="random", payload_bytes=PAYLOADS[0], num_local=2, num_slots=2,
              shaped=True)


def test_prefetch_all_slots_empty_moves_nothing(run_ranks):
    run_ranks(2, lb_cases.check_prefetch, pattern="ring", payload_bytes=(64,), num_slots=0)


@pytest.mark.parametrize("pattern", ["random", "ring", "spread"])
def test_reduce_exact_small_integers(run_ranks, pattern):
    for hidden in (24, 3064, 16392):
        run_ranks(4, lb_cases.check_reduce, pattern=pattern, hidden=hidden, seed=hidden)


def test_reduce_order_is_ascending_rank_slot(run_ranks):
    # Random fp32 values: only the sequential sum in ascending (rank, slot) order matches bitwise.
    run_ranks(4, lb_cases.check_reduce, pattern="spread", hidden=1000, num_slots=6, random=True, empty_ratio=0)
    run_ranks(2, lb_cases.check_reduce, pattern="random", hidden=1 << 18, num_local=4, num_slots=3)


def test_reduce_dtypes_and_payloads(run_ranks):
    run_ranks(2, lb_cases.check_reduce, pattern="spread", hidden=40, num_payloads=3)
    for dtype in (torch.bfloat16, torch.float64):
        run_ranks(2, lb_cases.check_reduce, pattern="spread", hidden=40, num_local=4, num_slots=4, dtype=dtype,
                  random=True)


def test_lb_num_sms_hint(run_ranks):
    assert run_ranks(2, _num_sms) == [10, 10]


def _num_sms(rank, world):
    buf = lb_cases.make_buffer()
    with pytest.warns(UserWarning, match="num_sms has no effect on CPU"):
        buf.lb_prefetch_weights(torch.zeros(0, 4), torch.ones(1, 4), torch.zeros(world, 0, dtype=torch.int32),
                                num_sms=8)
    value = buf.lb_get_theoretical_num_sms()
    buf.destroy()
    return value


# ----------------------------------------------------------------------------------------------------------
# errors: the offending rank names its mistake, the peer names the offending rank
# ----------------------------------------------------------------------------------------------------------
P, R = "EPBuffer.lb_prefetch_weights", "EPBuffer.lb_reduce_grads"
EXPECTED = {
    "payload_type": (TypeError, P, r"redundant_expert_weights must be a tensor or a sequence of tensors, got str"),
    "payload_none": (TypeError, P, r"expert_weights\[1\] must be a torch\.Tensor, got NoneType"),
    "too_many_payloads": (ValueError, P, r"redundant_expert_weights has 17 tensors; expected 1 to 16 payloads"),
    "length_mismatch": (ValueError, P, r"redundant_expert_weights has 1 tensors but expert_weights has 2"),
    "slot_rows": (ValueError, P, r"redundant_expert_weights has 3 rows but redundancy_mapping has C=2 slots per "
                                 r"rank; expected shape \[2, \.\.\.\]"),
    "bytes_per_expert": (ValueError, P, r"redundant_expert_weights holds 32 bytes per expert but expert_weights "
                                        r"holds 16"),
    "zero_local": (ValueError, P, r"expert_weights has 0 rows; expected num_local_experts=0 > 0"),
    "non_contiguous": (ValueError, P, r"expert_weights must be contiguous \(strides \(1, 2\)\)"),
    "meta_device": (ValueError, P, r"redundant_expert_weights is on meta but the buffer lives on cpu"),
    "mapping_dtype": (TypeError, P, r"redundancy_mapping must have dtype torch\.int32 \(or int64\), got "
                                    r"torch\.float32"),
    "mapping_shape": (ValueError, P, r"redundancy_mapping must have shape \[2, C\] \(one row per group rank\), got "
                                     r"\(3, 2\)"),
    "mapping_range": (ValueError, P, r"redundancy_mapping\[0, 1\] = 4; expected an expert id in \[0, 4\)"),
    "self_host": (ValueError, P, r"redundancy_mapping\[1, 1\] = 3 is an expert of group rank 1 itself .* every rank "
                                 r"must pass the same\)"),
    "num_sms_type": (TypeError, P, r"num_sms must be an int, got float"),
    "event_type": (TypeError, P, r"previous_event must be an EventHandle or None, got str"),
    "grad_dtype": (TypeError, R, r"redundant_expert_grads must have dtype in \(torch\.float32, .*got torch\.int32"),
    "grad_pair_dtype": (TypeError, R, r"redundant_expert_grads has dtype torch\.float32 but expert_grads has "
                                      r"torch\.float64; a pair shares one dtype"),
    "grad_elements": (ValueError, R, r"redundant_expert_grads holds 8 elements per expert but expert_grads holds 4"),
}
DISAGREE = {  # each rank's value (docs/decisions.md "Errors and timeouts"), the mapping's first difference
    "disagree_mapping": r"ranks disagree on the redundancy_mapping \(rank 0: \[\[2, 3\], \[0, 1\]\], rank 1: "
                        r"\[\[2, -1\], \[0, 1\]\]\); first difference: redundancy_mapping\[0, 1\] is 3 on rank 0 but "
                        r"-1 on rank 1; every rank must pass the same redundancy_mapping$",
    "disagree_long_mapping": r"ranks disagree on the redundancy_mapping \(rank 0: digest 0x[0-9a-f]+, rank 1: digest "
                             r"0x[0-9a-f]+\); first difference: redundancy_mapping\[1, 37\] is 1 on rank 0 but -1 "
                             r"on rank 1;",
    "disagree_op": r"ranks disagree on the operation \(rank 0: EPBuffer\.lb_prefetch_weights, rank 1: "
                   r"EPBuffer\.lb_reduce_grads\); every rank must make the same call",
    "disagree_bytes": r"ranks disagree on the bytes per expert of redundant_expert_weights \(rank 0: 32, rank 1: 16\); "
                      r"every rank must pass payloads with the same bytes per expert$",
    "disagree_bytes_payloads": r"ranks disagree on the bytes per expert of each payload \(rank 0: \[32, 12\], rank 1: "
                               r"\[32, 16\]\)",
    "disagree_grad_dtype": r"ranks disagree on the dtype x elements per expert of redundant_expert_grads \(rank 0: "
                           r"torch\.float32 x 8, rank 1: torch\.float64 x 8\); every rank must pass gradients of the "
                           r"same dtypes and elements per expert$",
}


@pytest.fixture(scope="module")
def outcomes(pools):
    return pools.get(2).run(lb_cases.run_error_scenarios, timeout=120)


def test_every_scenario_is_pinned():
    assert set(lb_cases.error_scenarios()) == set(EXPECTED) | set(DISAGREE)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_lb_input_raises_on_every_rank(outcomes, name):
    exc, call, pattern = EXPECTED[name]
    offender, peer = outcomes[1][name], outcomes[0][name]
    assert offender is not None and peer is not None, (offender, peer)
    assert offender[0] == exc.__name__ and peer[0] == exc.__name__, (offender, peer)
    with pytest.raises(exc, match=re.escape(f"{call}: rank 1: ") + pattern):
        raise exc(offender[1])
    with pytest.raises(exc, match=re.escape(f"{call}: rank 0: group rank 1 rejected the call: ") + ".*" + pattern):
        raise exc(peer[1])


@pytest.mark.parametrize("name", sorted(DISAGREE))
def test_disagreeing_lb_calls_raise_everywhere(outcomes, name):
    for rank in (0, 1):
        cls, msg = outcomes[rank][name]
        with pytest.raises(ValueError, match=f"rank {rank}: " + DISAGREE[name]):
            raise {"ValueError": ValueError, "TypeError": TypeError}[cls](msg)


def test_disagreement_lists_each_rank_compactly():
    from epcomm.lb import _per_rank, _reference_rank

    assert _per_rank(["a", "b"]) == "rank 0: a, rank 1: b"
    # Past 8 ranks the ranks that agree are listed together, in runs.
    assert _per_rank(["x"] * 3 + ["y"] + ["x"] * 8) == "ranks 0-2, 4-11: x; rank 3: y"
    assert _reference_rank([5, 7, 7]) == 1 and _reference_rank([5, 7]) == 0  # the majority; ties: lowest rank


def test_missing_peer_times_out_naming_it():
    results = run_in_fresh_world(2, lb_cases.lb_missing_peer, 2.0, timeout=60)
    msg, elapsed = results[0]
    assert re.search(r"^EPBuffer.lb_\w+: load-balancing header: rank 0 waited 2 s .* group ranks \[1\] did not "
                     r"arrive", msg), msg
    assert elapsed < 2.0 + 5.0, elapsed
    assert results[1] == "skipped"


def test_constructor_accepts_plans_and_checks_them(run_ranks):
    for out in run_ranks(2, lb_cases.constructor_errors):
        kind, msg = out[0]
        assert kind == "TypeError" and re.search(r"lb_allocation_plan_or_num_bytes must be an int byte count or an "
                                                 r"epcomm\.BufferAllocator, got str", msg), msg
        assert out[1][0] == "ValueError" and "must be a multiple of 2 MiB (2097152) >= 0, got 3145728" in out[1][1]
        assert out[2][0] == "ValueError" and "the BufferAllocator is already materialized" in out[2][1]
        assert out[3] == (4 << 20, (4 << 20,), None)


# ----------------------------------------------------------------------------------------------------------
# end to end
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("do_expand", [True, False], ids=["expand", "non-expand"])
def test_physical_ids_give_the_same_output_and_gradients(run_ranks, do_expand):
    res = run_ranks(2, lb_cases.check_physical_equivalence, do_expand=do_expand, seed=3)
    assert max(res[0]["after"]) < max(res[0]["before"]), res[0]  # the hot expert's rank sheds load
    res = run_ranks(3, lb_cases.check_physical_equivalence, do_expand=do_expand, num_local=2, num_slots=2,
                    seed=5)
    assert max(res[0]["after"]) < max(res[0]["before"]), res[0]


# ----------------------------------------------------------------------------------------------------------
# GPU (NCCL): the same checks on CUDA tensors
# ----------------------------------------------------------------------------------------------------------
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.multigpu
@two_gpus
@pytest.mark.parametrize("pattern", ["random", "spread"])
@pytest.mark.parametrize("payload", PAYLOADS, ids=[str(p[0]) for p in PAYLOADS])
def test_prefetch_on_gpu(pools, pattern, payload):
    pools.get(2, "nccl").run(lb_cases.check_prefetch, pattern=pattern, payload_bytes=payload, device="cuda",
                             use_event=True)


@pytest.mark.multigpu
@two_gpus
@pytest.mark.parametrize("hidden", [24, 3072, 1 << 18])
def test_reduce_on_gpu(pools, hidden):
    for random in (False, True):
        pools.get(2, "nccl").run(lb_cases.check_reduce, pattern="spread", hidden=hidden, num_local=4, num_slots=4,
                                 random=random, device="cuda")


@pytest.mark.multigpu
@two_gpus
@pytest.mark.parametrize("do_expand", [True, False])
def test_physical_ids_on_gpu(pools, do_expand):
    pools.get(2, "nccl").run(lb_cases.check_physical_equivalence, do_expand=do_expand, device="cuda")


def _lb_plan_after_failed_construction(rank, world):
    """Rank 1 passes a bad num_topk: the construction fails on every rank, each rank's LB plan is as passed (not
    materialized on the ranks whose own checks passed), and the same plans build the buffer on a retry."""
    import epcomm
    plan = epcomm.BufferAllocator()
    weights = plan.allocate((2, 64), torch.float32)
    try:
        epcomm.EPBuffer(None, num_bytes=2 << 20, num_topk=99 if rank == 1 else 2, lb_allocation_plan_or_num_bytes=plan,
                        num_cpu_timeout_secs=30)
        raise AssertionError("the construction must fail")
    except ValueError:
        pass
    out = [plan.materialized, weights.device.type]
    buf = epcomm.EPBuffer(None, num_bytes=2 << 20, num_topk=2, lb_allocation_plan_or_num_bytes=plan,
                          num_cpu_timeout_secs=30)
    out += [plan.materialized, weights.data_ptr() == buf.lb_storage.data_ptr()]
    buf.destroy()
    return out


def test_lb_plan_is_released_when_the_construction_fails(run_ranks):
    assert run_ranks(2, _lb_plan_after_failed_construction) == [[False, "meta", True, True]] * 2
