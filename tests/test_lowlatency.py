"""DeepEP V1's low-latency API: the portable path on CPU (layouts and sums against the reference); on 2 GPUs the
nvlink kernels against the portable path, CUDA-graph replay, and the bounded device-side wait."""

import re

import pytest
import torch

import device_timeout_script
import ll_cases
from epcomm.testing import run_in_fresh_world


@pytest.mark.parametrize("use_fp8,use_ue8m0", [(False, False), (True, False), (True, True)],
                         ids=["bf16", "fp8", "fp8-ue8m0"])
def test_low_latency_dispatch_and_combine(run_ranks, use_fp8, use_ue8m0):
    assert all(run_ranks(2, ll_cases.check_low_latency, use_fp8=use_fp8, use_ue8m0=use_ue8m0))


def test_low_latency_empty_rank_and_three_ranks(run_ranks):
    assert all(run_ranks(2, ll_cases.check_low_latency, tokens=(7, 0), seed=1))
    assert all(run_ranks(3, ll_cases.check_low_latency, tokens=(4, 6, 0), num_experts=9, seed=2))


def test_low_latency_unsupported_options_raise(run_ranks):
    # Rank 1 alone passes the bad argument for the bf16, logfmt and zero-copy cases; rank 0 raises as well.
    for rank, msgs in enumerate(run_ranks(2, ll_cases.low_latency_errors)):
        assert len(msgs) == 6, msgs
        assert "x must be a bf16 tensor" in msgs[0]
        assert "dispatch_wait_recv_cost_stats must have dtype torch.int64, got torch.float32" in msgs[1], msgs[1]
        assert "use_logfmt=True (LogFMT combine payloads) is not implemented" in msgs[2]
        assert "zero_copy=True reads the expert outputs from get_next_low_latency_combine_buffer(handle)" in msgs[3]
        assert "out must have dtype" in msgs[4] and "bfloat16" in msgs[4], msgs[4]
        assert "out must have shape [4, 128], got (3, 128)" in msgs[5], msgs[5]
        if rank == 0:
            assert "group rank 1 rejected the call" in msgs[0] and "group rank 1 rejected the call" in msgs[2]


def test_wait_recv_cost_stats_name_the_late_rank(run_ranks):
    """CPU: rank 1 reaches each call 0.3 s late; rank 0's stats charge rank 1 with it, rank 1's charge nobody, and
    the stats add up over calls (DeepEP V1's `*_wait_recv_cost_stats`, in nanoseconds)."""
    for late_keeps_none in (False, True):  # the statistics are per rank: the late rank may keep none
        results = run_ranks(2, ll_cases.low_latency_wait_costs, 0.3, late_keeps_none=late_keeps_none)
        for rank, (dispatch_cost, combine_cost) in enumerate(results):
            if rank == 0:
                for cost in (dispatch_cost, combine_cost):
                    assert cost[0] == 0 and 2 * 0.25e9 <= cost[1] < 2 * 5e9, cost  # less the peer's own lag
            else:
                want = None if late_keeps_none else [0, 0]
                assert dispatch_cost == combine_cost == want, (dispatch_cost, combine_cost)


def test_low_latency_other_dispatch_handles_and_clean(run_ranks):
    """Handles of different dispatches on different ranks raise on every rank (docs/decisions.md "What ranks must
    agree on"); clean_low_latency_buffer recovers a shape whose hook was dropped and voids its old hooks and
    handles (DeepEP V1 `clean_low_latency_buffer`, ../shared/reference/peers.md §1.2)."""
    for rank, msgs in enumerate(run_ranks(2, ll_cases.low_latency_handles_and_clean)):
        assert len(msgs) == 6, msgs
        assert re.search(rf"^EPBuffer\.low_latency_combine: rank {rank}: ranks disagree on handle \(rank 0: the "
                         r"handle of call #\d+, rank 1: the handle of call #\d+\)", msgs[0]), msgs[0]
        assert "receive hook of the call two calls before this one" in msgs[1], msgs[1]
        assert msgs[2].startswith(f"EPBuffer.clean_low_latency_buffer: rank {rank}: ranks disagree on num_experts "
                                  "(rank 0: 4, rank 1: 8)"), msgs[2]
        assert ("hidden must be >= 1, got 0" if rank == 1 else "group rank 1 rejected the call") in msgs[3], msgs[3]
        assert msgs[4].startswith(f"low-latency receive hook (low_latency_dispatch): rank {rank}: "
                                  "clean_low_latency_buffer reset this call shape"), msgs[4]
        assert msgs[5].startswith(f"EPBuffer.low_latency_combine: rank {rank}: clean_low_latency_buffer reset"), \
            msgs[5]


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_low_latency_clean_on_gpu(pools):
    """nvlink: clean_low_latency_buffer clears the areas of a shape whose hook was dropped, between two barriers,
    and the calls after it are right; its argument checks and disagreements raise on every rank."""
    for rank, msgs in enumerate(pools.get(2, "nccl").run(ll_cases.low_latency_handles_and_clean)):
        assert len(msgs) == 5, msgs
        assert "receive hook of the call two calls before this one" in msgs[0], msgs[0]
        assert "ranks disagree on num_experts (rank 0: 4, rank 1: 8)" in msgs[1], msgs[1]
        assert ("hidden must be >= 1, got 0" if rank == 1 else "group rank 1 rejected the call") in msgs[2], msgs[2]
        assert "clean_low_latency_buffer reset this call shape" in msgs[3], msgs[3]
        assert "clean_low_latency_buffer reset" in msgs[4], msgs[4]


def test_low_latency_hook_order_is_checked_on_every_transport(run_ranks):
    hook_msg, recv_msg = "receive hook of the call two calls before this one", "has not been received"
    for rank, msgs in enumerate(run_ranks(2, ll_cases.low_latency_hook_order)):
        assert len(msgs) == 4, msgs
        assert hook_msg in msgs[0] and f"rank {rank}" in msgs[0], msgs[0]
        assert (hook_msg if rank == 1 else "group rank 1 rejected the call") in msgs[1], msgs[1]
        assert recv_msg in msgs[2], msgs[2]
        assert hook_msg in msgs[3] and "low_latency_combine" in msgs[3], msgs[3]


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("use_fp8,extras", [(True, False), (False, False), (True, True)])
def test_low_latency_graph_replay_on_gpu(pools, use_fp8, extras):
    assert pools.get(2, "nccl").run(ll_cases.low_latency_graph_replay, use_fp8=use_fp8, wait_costs=extras,
                                    zero_copy=extras) == [3, 3]


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_wait_recv_cost_stats_name_the_late_rank_on_gpu(pools):
    """nvlink: rank 1 launches each call 0.3 s late; rank 0's kernels wait for it, and charge it (summed over the
    waiting programs), not rank 0."""
    (dispatch_cost, combine_cost), _ = pools.get(2, "nccl").run(ll_cases.low_latency_wait_costs, 0.3, device="cuda")
    for cost in (dispatch_cost, combine_cost):
        assert cost[1] >= 2 * 0.25e9 and cost[0] < cost[1] // 10, cost


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_wait_recv_cost_stats_refused_on_collective_gpu(pools):
    """The collective transport on GPU exchanges no header to time the ranks by: every rank refuses the statistics
    (named in the message) before any data moves."""
    for rank, msgs in enumerate(pools.get(2, "nccl").run(ll_cases.low_latency_collective_refuses_wait_costs)):
        for name, msg in zip(("dispatch_wait_recv_cost_stats", "combine_wait_recv_cost_stats"), msgs):
            assert f"rank {rank}: {name} is measured on the nvlink transport" in msg, msg
            assert "collective transport on GPU" in msg, msg


def test_hardware_fp8_cast_only_where_triton_has_fp8(monkeypatch):
    """The send kernels use the hardware FP8 conversion on NVIDIA GPUs of compute capability 8.9 and up only (Triton
    has no float8e4nv below: an A100 keeps the integer spelling)."""
    from epcomm.lowlatency_nvlink import hardware_fp8

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, want in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert hardware_fp8(cuda) is want, capability
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert hardware_fp8(cuda) is False
    assert hardware_fp8(torch.device("cpu")) is False


def test_low_latency_size_hint_holds_every_returned_pair():
    """The combine returns every (token, expert) row; a transport with a receive area holds them all at once."""
    from epcomm import EPBuffer
    for n, hidden, ranks, experts in [(128, 7168, 2, 256), (256, 7168, 8, 256), (8, 512, 4, 8)]:
        hint = EPBuffer.get_low_latency_rdma_size_hint(n, hidden, ranks, experts)
        assert hint % (2 << 20) == 0
        assert hint >= ranks * n * min(32, experts // ranks) * hidden * 2, (n, hidden, ranks, experts, hint)


def test_low_latency_size_hint_bounds_every_call_it_sizes():
    """The hint is an upper bound of what a call checks, for both row formats and every top-k (FP8 records at a
    tiny hidden outgrew it, and the capacity error pointed back at the hint)."""
    from epcomm import EPBuffer, sizing
    for n, hidden, ranks, experts in [(4096, 16, 8, 48), (4096, 8, 16, 64), (128, 7168, 2, 256), (64, 100, 4, 8)]:
        hint = EPBuffer.get_low_latency_rdma_size_hint(n, hidden, ranks, experts)
        for num_topk in (1, 8, 32):
            for fp8 in (False, True):
                need = sizing.required_bytes(ranks, n, hidden, num_topk=num_topk, use_fp8_dispatch=fp8,
                                             allow_multiple_reduction=True, elem_size=2, which="dispatch")
                assert need <= hint, (n, hidden, ranks, experts, num_topk, fp8, need, hint)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_low_latency_nvlink_matches_portable_path(pools):
    assert pools.get(2, "nccl").run(ll_cases.low_latency_paths_agree) == [12, 12]


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_low_latency_device_wait_names_missing_rank_on_gpu():
    """Issue 3 item 4 on the low-latency kernels: a peer that never signals ends the wait after
    num_gpu_timeout_secs with a message naming it, and the kernel aborts (docs/decisions.md, "Errors and timeouts")."""
    device_timeout_script.check_timeout_names_rank_1("low-latency", 29561)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_low_latency_shape_disagreement_raises_on_every_rank_on_gpu(pools):
    for shape, row_format in pools.get(2, "nccl").run(ll_cases.low_latency_shape_disagreement):
        assert "ranks disagree on the call's shape" in shape, shape
        assert "num_max_dispatch_tokens_per_rank: rank 0=8, rank 1=16" in shape, shape
        assert "ranks disagree on the call's shape or row format (use_fp8: rank 0=1, rank 1=0)" in row_format, \
            row_format


def test_low_latency_malformed_arguments_raise_on_every_rank(run_ranks):
    for rank, msgs in enumerate(run_ranks(2, ll_cases.low_latency_more_errors)):
        assert len(msgs) == 15 and "no error" not in msgs, msgs
        dispatch, combine = "EPBuffer.low_latency_dispatch", "EPBuffer.low_latency_combine"
        if rank == 1:
            assert dispatch in msgs[0] and "x must be 2-D" in msgs[0], msgs[0]
            assert dispatch in msgs[1] and "x must be 2-D" in msgs[1], msgs[1]
            assert combine in msgs[5] and "topk_idx must be a torch.Tensor" in msgs[5], msgs[5]
            assert combine in msgs[6] and "topk_idx must have dtype" in msgs[6], msgs[6]
        else:  # the peer of the rank with the bad argument raises too
            assert all("group rank 1 rejected the call" in msgs[i] for i in (0, 1, 5, 6)), msgs
        assert "num_max_dispatch_tokens_per_rank must be an int, got bool" in msgs[2], msgs[2]
        assert "round_scale=True requires use_fp8=True" in msgs[3], msgs[3]
        assert "async_finish=True and return_recv_hook=True cannot be combined" in msgs[4], msgs[4]
        assert "handle comes from another EPBuffer" in msgs[7], msgs[7]
        assert "topk_idx was modified in place" in msgs[8], msgs[8]
        assert "num_max_dispatch_tokens_per_rank must be >= 1, got 0" in msgs[9], msgs[9]
        assert msgs[10].startswith(f"{dispatch}: rank {rank}: ") and "num_max_dispatch_tokens_per_rank" in msgs[10], \
            msgs[10]
        assert "ranks disagree on use_ue8m0 (rank 0: False, rank 1: True)" in msgs[11], msgs[11]
        assert re.search(r"topk_idx must be the routing of the low_latency_dispatch that made the handle: "
                         r"topk_idx\[2, 1\] is -?\d+, the dispatch's was -?\d+", msgs[12]), msgs[12]
        if rank == 1:
            assert re.search(r"topk_idx\[1, 0\] is -?\d+, the dispatch's was -?\d+", msgs[13]), msgs[13]
        else:
            assert "group rank 1 rejected the call" in msgs[13], msgs[13]
        assert "the buffer was destroyed" in msgs[14], msgs[14]


def test_low_latency_call_is_not_the_regular_call(run_ranks):
    """A low_latency_dispatch on one rank and a sync-free expand dispatch of the same shape on the other (or a
    low_latency_combine and a combine of its handle) are different calls: every rank raises naming both."""
    for rank, msgs in enumerate(run_ranks(2, ll_cases.low_latency_vs_regular_calls, timeout=60)):
        assert len(msgs) == 2, msgs
        for msg, (mine, other) in zip(msgs, (("low_latency_dispatch", "dispatch"),
                                             ("low_latency_combine", "combine"))):
            call = mine if rank == 0 else other
            assert msg.startswith(f"EPBuffer.{call}: rank {rank}: ranks disagree on op "
                                  f"(rank 0: {mine}, rank 1: {other}); every rank must make the same call at the same "
                                  "point (the low-latency calls are calls of their own"), msg


def test_low_latency_disagreements_and_capacity_name_their_arguments(run_ranks):
    """use_fp8 and use_ue8m0 disagreements name those arguments; N past the buffer names it and the low-latency
    size hint (not the regular call's names)."""
    dispatch = "EPBuffer.low_latency_dispatch"
    for rank, msgs in enumerate(run_ranks(2, ll_cases.low_latency_option_disagreements, timeout=60)):
        assert len(msgs) == 4, msgs
        assert msgs[0].startswith(f"{dispatch}: rank {rank}: ranks disagree on use_fp8 (rank 0: True, rank 1: "
                                  "False); every rank must pass the same use_fp8"), msgs[0]
        assert msgs[1].startswith(f"{dispatch}: rank {rank}: ranks disagree on use_ue8m0 (rank 0: False, rank 1: "
                                  "True); every rank must pass the same use_ue8m0"), msgs[1]
        for msg in msgs[2:] if rank == 1 else msgs[2:3]:
            assert msg.startswith(f"{dispatch}: rank {rank}: num_max_dispatch_tokens_per_rank=4096 needs "), msg
            assert "fits num_max_dispatch_tokens_per_rank <= " in msg and \
                "EPBuffer.get_low_latency_rdma_size_hint(4096, 1024, 2, 4)" in msg, msg
            assert "num_max_tokens_per_rank" not in msg and "get_buffer_size_hint" not in msg, msg
        if rank == 0:
            assert msgs[3].startswith(f"{dispatch}: rank 0: group rank 1 rejected the call: {dispatch}: rank 1: "
                                      "num_max_dispatch_tokens_per_rank=4096"), msgs[3]


def test_low_latency_per_rank_options_may_differ(run_ranks):
    assert run_ranks(2, ll_cases.low_latency_per_rank_options, timeout=60) == [True, True]


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_low_latency_timeout_names_the_call(kind):
    results = run_in_fresh_world(2, ll_cases.low_latency_missing_peer, 2.0, kind, timeout=60)
    msg, after = results[0]
    assert re.search(rf"^EPBuffer.low_latency_{kind}: count exchange: rank 0 waited 2 s .* group ranks \[1\] did "
                     "not arrive", msg), msg
    assert after is not None and f"EPBuffer.low_latency_{kind} timed out" in after, after
    assert results[1] == "skipped"


def test_low_latency_handle_indexed_like_v1_tuple_says_what_it_is():
    from epcomm import LowLatencyHandle

    handle = LowLatencyHandle(None, 8, 16, 2, torch.zeros(4, 2, dtype=torch.int64), 0, None)
    for use in (lambda: handle[1], lambda: tuple(handle)):
        with pytest.raises(TypeError, match=r"LowLatencyHandle is not DeepEP V1's tuple handle .*hidden"):
            use()


def test_low_latency_formats_count_apart_on_cpu(run_ranks):
    """(the portable path counted FP8 and BF16 calls together and refused what nvlink accepts)"""
    for msgs in run_ranks(2, ll_cases.low_latency_formats_count_apart):
        assert len(msgs) == 1 and "has not been called" in msgs[0], msgs


def test_low_latency_void_handles_and_hooks_raise_on_cpu(run_ranks):
    for rank, msgs in enumerate(run_ranks(2, ll_cases.low_latency_void_handles)):
        assert len(msgs) == 2 and msgs[0].startswith(f"EPBuffer.get_next_low_latency_combine_buffer: rank {rank}: "
                                                     "clean_low_latency_buffer reset this call shape"), msgs
        assert msgs[1].endswith(f"rank {rank}: the buffer was destroyed before the hook was called"), msgs
