"""Edge cases that must work, each against `epcomm.reference`, bitwise."""


import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

import ep_cases


@pytest.mark.parametrize("do_expand", [False, True], ids=["nonexpand", "expand"])
@pytest.mark.parametrize("case", [
    dict(tokens=(12, 0)),                                      # a rank with no tokens: torch.empty((0, H))
    dict(routing=ep_cases.routing_all_to_rank0),               # rank 1 receives 0 rows
    dict(routing=ep_cases.routing_all_masked),                 # every selection is -1
    dict(routing=ep_cases.routing_all_local),                  # every expert of a token is local
    dict(routing=ep_cases.routing_one_expert),                 # all tokens to one expert
    dict(routing=ep_cases.routing_alignment_counts, num_experts=10, expert_alignment=4),  # 0, 1, a-1, a, a+1
    dict(tokens=(16, 16)),                                     # exactly num_max_tokens_per_rank tokens
    dict(num_topk=1, num_experts=4),
    dict(num_topk=32, num_experts=64, hidden=16),
    dict(routing=ep_cases.routing_masked_tails, num_experts=12, expert_alignment=2),  # -1 tails, zero weights
], ids=["empty-rank", "recv-nothing", "all-masked", "all-local", "one-expert", "alignment-counts", "exactly-N",
        "top1", "top32", "masked-tails"])
def test_edge_case(run_ranks, case, do_expand):
    for sync in (True, False):
        run_ranks(2, ep_cases.check_mode, do_expand=do_expand, do_cpu_sync=sync, num_bias=2, **case)


@pytest.mark.parametrize("dtype,hidden", [("bf16", 7), ("fp16", 1), ("fp16", 3), ("fp32", 5), ("fp8", 7)])
def test_odd_row_sizes(run_ranks, dtype, hidden):
    """Rows that are not a whole number of 4-byte words (odd hidden in 2-byte dtypes) move on every layout and
    sync mode; the FP8 case combines in BF16 at the same odd hidden."""
    for do_expand in (False, True):
        for sync in (True, False):
            run_ranks(2, ep_cases.check_mode, dtype=dtype, hidden=hidden, do_expand=do_expand, do_cpu_sync=sync,
                      num_bias=1)


def test_rank_receiving_nothing_gets_empty_outputs(run_ranks):
    out = run_ranks(2, ep_cases.check_mode, routing=ep_cases.routing_all_to_rank0, dtype="fp32")
    assert out[1]["num_valid"] == 0 and out[1]["recv_rows"] == (0, 64)


def test_one_buffer_reused_with_changing_token_counts(run_ranks):
    shapes = run_ranks(2, ep_cases.reused_buffer)
    assert len(set(shapes[0])) > 3, shapes  # the calls really had different sizes


def test_memory_does_not_grow(run_ranks):
    for rss in run_ranks(2, ep_cases.memory_growth, timeout=300):
        growth = (rss[1000] - rss[100]) / rss[100]
        assert growth < 0.01, f"RSS grew {growth:.2%} between iteration 100 and 1000 ({rss})"


def test_events_on_cpu(run_ranks):
    assert all(run_ranks(2, ep_cases.events_on_cpu))


def test_async_event(run_ranks):
    run_ranks(2, ep_cases.check_mode, async_op=True, do_expand=True, num_bias=1)


def test_subgroups_side_by_side(run_ranks):
    # Two EP groups of 2 in a world of 4, each with its own buffer, run at the same time.
    out = run_ranks(4, ep_cases.check_mode, groups=[[0, 1], [2, 3]], tokens=(9, 14), do_expand=True,
                    expert_alignment=2, num_bias=1)
    assert len(out) == 4
    # A sub-group that leaves out a rank of the world (ranks 1, 2 of 3): rank 0 only creates the group.
    run_ranks(3, _subgroup_of_three)


def _subgroup_of_three(rank, world):
    import torch.distributed as dist
    group = dist.new_group([1, 2])  # every rank of the world creates it, as torch requires
    if rank == 0:
        return None
    return ep_cases.check_mode(rank, world, group=group, tokens=(5, 8))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    tokens=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    num_topk=st.integers(1, 8),
    experts_per_rank=st.integers(1, 12),
    masked_ratio=st.sampled_from([0.0, 0.3, 0.9]),
    do_expand=st.booleans(),
    expert_alignment=st.sampled_from([1, 2, 5, 16]),
    do_cpu_sync=st.booleans(),
    allow_multiple_reduction=st.booleans(),
)
def test_random_routings(run_ranks, seed, tokens, num_topk, experts_per_rank, masked_ratio, do_expand,
                         expert_alignment, do_cpu_sync, allow_multiple_reduction):
    num_experts = 2 * experts_per_rank
    num_topk = min(num_topk, num_experts)
    run_ranks(2, ep_cases.check_mode, seed=seed, tokens=tokens if max(tokens) else (1, 0), num_topk=num_topk,
              num_experts=num_experts, masked_ratio=masked_ratio, do_expand=do_expand,
              expert_alignment=expert_alignment, do_cpu_sync=do_cpu_sync, num_bias=seed % 3,
              allow_multiple_reduction=allow_multiple_reduction, hidden=24)


def test_handle_exposes_recv_topk_idx(run_ranks):
    assert all(run_ranks(2, ep_cases.handle_recv_topk_idx))


@pytest.mark.parametrize("do_cpu_sync", [False, True], ids=["sync-free", "cpu-sync"])
def test_narrowed_handle_combines_the_valid_rows(run_ranks, do_cpu_sync):
    """DeepEP V2.5's test narrows `handle.recv_src_metadata` to the received rows and combines those only
    (reference §11.1: a non-expand combine takes `recv_src_metadata.shape[0]` rows)."""
    valid = run_ranks(2, ep_cases.narrowed_handle, do_cpu_sync=do_cpu_sync)
    assert all(v > 0 for v in valid), valid


@pytest.mark.multigpu
@pytest.mark.skipif(__import__("torch").cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("do_cpu_sync", [False, True], ids=["sync-free", "cpu-sync"])
def test_narrowed_handle_combines_the_valid_rows_on_gpu(pools, do_cpu_sync):
    valid = pools.get(2, "nccl").run(ep_cases.narrowed_handle, device="cuda", do_cpu_sync=do_cpu_sync)
    assert all(v > 0 for v in valid), valid


@pytest.mark.parametrize("do_expand, expert_alignment", [(False, 1), (True, 1), (True, 4)],
                         ids=["nonexpand", "expand-a1", "expand-a4"])
@pytest.mark.parametrize("world", [2, 3])
def test_sync_free_tails_match_cpu_synced(run_ranks, world, do_expand, expert_alignment):
    """`do_cpu_sync=False` with -1 selections (leading, trailing, whole rows of -1) and zero weights on routed
    selections: valid rows, handle fields, combine and cached dispatch bitwise equal to the CPU-synced call and the
    reference; tails -1 / 0 (docs/decisions.md contracts; reference §9.4, §9.5, §9.8, §24 item 8). With 3 ranks
    the last one has no tokens."""
    valid = run_ranks(world, ep_cases.syncfree_matches_synced, do_expand=do_expand, expert_alignment=expert_alignment,
                      seed=world)
    assert sum(valid) > 0, valid


@pytest.mark.parametrize("do_expand", [False, True], ids=["nonexpand", "expand"])
def test_empty_rank_with_broadcast_strides(run_ranks, do_expand):
    """A rank with no tokens whose empty inputs have the strides of broadcast ops (top-1 weights scaled by a
    factor): every call completes and matches the reference, where the transports' byte views used to fail on that
    rank after its peers had met it in the header exchange (they then waited for the timeout)."""
    rows = run_ranks(2, ep_cases.empty_rank_broadcast_strides, do_expand=do_expand)
    assert rows[0] > 0 and rows[1] > 0, rows


@pytest.mark.parametrize("fp8,do_expand", [(False, False), (False, True), (True, False)])
def test_size_one_last_dim_with_another_stride(run_ranks, fp8, do_expand):
    """Top-1 routings, hidden-1 rows and one-pack FP8 scales laid out column-major (the last dim has size 1 and a
    stride other than 1, which torch calls contiguous): every call completes and matches the reference, where a
    byte view used to fail on that rank after its peers had met it in the header exchange."""
    rows = run_ranks(2, ep_cases.size_one_last_dim_strides, fp8=fp8, do_expand=do_expand)
    assert rows[0] > 0 and rows[1] > 0, rows


@pytest.mark.parametrize("fp8,do_expand", [(False, False), (False, True), (True, False)])
def test_views_into_packed_buffers(run_ranks, fp8, do_expand):
    """Row payloads that are contiguous views starting off a word boundary of their storage (`flat[1:].view(T, H)`)
    are accepted as the reference accepts them; a word view of them used to fail after the header exchange and break
    the buffer and the process group."""
    rows = run_ranks(2, ep_cases.packed_views, fp8=fp8, do_expand=do_expand)
    assert rows[0] > 0 and rows[1] > 0, rows


@pytest.mark.parametrize("do_expand", [False, True], ids=["nonexpand", "expand"])
def test_inference_mode_routing_edited_after_dispatch(run_ranks, do_expand):
    """docs/decisions.md: inference tensors have no version counter, so dispatch keeps a copy of such a routing;
    an edit after the dispatch used to give silently wrong combined weights."""
    rows = run_ranks(2, ep_cases.inference_routing_edited, do_expand=do_expand)
    assert rows[0] > 0 and rows[1] > 0, rows


@pytest.mark.parametrize("num_bias", [1, 2])
@pytest.mark.parametrize("do_expand", [False, True], ids=["nonexpand", "expand"])
@pytest.mark.parametrize("packed", [False, True], ids=["own-storage", "packed-view"])
def test_deferred_combine_reads_bias_at_wait(run_ranks, do_expand, num_bias, packed):
    """Reference §3.5: a deferred combine reads `bias` when its event is first waited on (a bias written after the
    call, before the wait, is the one added), and its expert outputs at the call; a bias that starts off a word
    boundary of its storage too (it is not copied at the call)."""
    assert run_ranks(2, ep_cases.deferred_combine_bias, do_expand=do_expand, num_bias=num_bias,
                     packed=packed) == [True, True]


@pytest.mark.parametrize("load_dynamo", [False, True])
def test_warnings_point_at_the_callers_line(run_ranks, load_dynamo):
    for files, here in run_ranks(2, ep_cases.warning_at_caller, load_dynamo):
        assert files == [here], (files, here)
