"""Every user mistake raises a clear error on every rank, before data moves; no input hangs a rank.

docs/decisions.md "Errors and timeouts"; reference §9.2, §11.1, §24 items 9, 10, 16, 17, 20.
"""

import os
import re

import pytest
import torch

import epcomm
import error_cases
from epcomm.testing import run_in_fresh_world

# scenario -> (exception class, pattern in the offending rank's message)
EXPECTED = {
    "x_int_dtype": (TypeError, r"x must have dtype in .*got torch\.int32"),
    "do_expand_str": (TypeError, r"do_expand must be a bool, got str 'yes'"),
    "num_sms_negative": (ValueError, r"num_sms must be an int >= 0 \(0 = get_theoretical_num_sms\), got -3"),
    "x_3d": (ValueError, r"x must be 2-D, got shape \(1, 6, 32\)"),
    "x_hidden_zero": (ValueError, r"x has shape \(6, 0\): hidden must be >= 1"),
    "x_meta_device": (ValueError, r"x is on meta but the buffer lives on cpu"),
    "x_tuple_len3": (ValueError, r"x as a tuple must be \(data, scales\), got 3 elements"),
    "x_sparse": (TypeError, r"x must be a dense \(strided\) tensor, got layout torch\.sparse_coo"),
    "topk_idx_sparse": (TypeError, r"topk_idx must be a dense \(strided\) tensor, got layout torch\.sparse_coo"),
    "weights_sparse": (TypeError, r"topk_weights must be a dense \(strided\) tensor, got layout torch\.sparse_coo"),
    "fp8_scales_no_columns": (ValueError, r"x\[1\] \(scales\) has shape \(6, 0\): it needs at least one column"),
    "combine_x_sparse": (TypeError, r"x must be a dense \(strided\) tensor, got layout torch\.sparse_coo"),
    "too_many_tokens": (ValueError, r"x has 17 tokens but num_max_tokens_per_rank is 16"),
    "topk_idx_float": (TypeError, r"topk_idx must have dtype in \(torch\.int64, torch\.int32\), got torch\.float32"),
    "topk_idx_rows": (ValueError, r"topk_idx must have shape \[6, \*\] \(a row per token of x\), got \(5, 2\)"),
    "topk_33": (ValueError, r"topk_idx has 33 columns; num_topk must be in \[1, 32\]"),
    "topk_id_too_large": (ValueError, r"topk_idx holds 8 \(token 0\); ids must be in \[-1, num_experts=8\)"),
    "topk_id_below_minus_one": (ValueError, r"topk_idx holds -2"),
    "topk_repeated_expert": (ValueError, r"topk_idx row 0 names expert 3 more than once"),
    "weights_dtype": (TypeError, r"topk_weights must have dtype torch\.float32, got torch\.float64 \(weights are "
                                  r"fp32, fp64 when x is fp64; x is torch\.bfloat16\)"),
    "weights_shape": (ValueError, r"topk_weights must have shape \[6, 2\], got \(6, 1\)"),
    "stats_dtype": (TypeError, r"cumulative_local_expert_recv_stats must have dtype torch\.int32"),
    "stats_shape": (ValueError, r"cumulative_local_expert_recv_stats must have shape \[4\], got \(8,\)"),
    # (was: torch's own error on rank 1 after the data moved, and rank 0 returned)
    "stats_stride_zero": (ValueError, r"cumulative_local_expert_recv_stats has stride 0 \(an expanded view"),
    "num_experts_not_multiple": (ValueError, r"num_experts=7 must be a multiple of the group size 2"),
    "num_experts_missing": (ValueError, r"num_experts is required for a non-cached dispatch"),
    # DeepEP-style dispatch(x, idx, w, E): E lands in the stats argument
    "num_experts_as_stats": (ValueError, r"num_experts is required for a non-cached dispatch; "
                                         r"cumulative_local_expert_recv_stats \(the fourth positional argument\) got "
                                         r"the int 8: pass num_experts=8 by keyword"),
    "num_experts_huge": (ValueError, r"num_experts must be <= 65536 \(epcomm's layouts keep per-expert tables; "
                                     r"DeepEP allows 2048\), got 1099511627776"),
    "alignment_zero": (ValueError, r"expert_alignment must be >= 1, got 0"),
    "alignment_huge": (ValueError, r"expert_alignment=1099511627776, num_max_tokens_per_rank=16: with 4 local "
                                   r"experts and 2 ranks the aligned rows could reach \d+, past the int32 row"),
    "zero_padding_without_expand": (ValueError, r"do_zero_padding=True requires do_expand=True"),
    "expert_ids_without_expand": (ValueError, r"emit_expert_ids=True requires do_expand=True"),
    "defer_without_async": (ValueError, r"defer_epilogue=True requires async_with_compute_stream=True"),
    "previous_event_without_comm_alloc": (ValueError, r"previous_event requires allocate_on_comm_stream=True"),
    "previous_event_type": (TypeError, r"previous_event must be None, an EventHandle \(EPBuffer.capture\(\)\) or an "
                                       r"EventOverlap, got str"),
    "do_handle_copy": (ValueError, r"do_handle_copy must be False"),
    "num_qps_too_many": (ValueError, r"num_qps=10000 must be in \[0, num_allocated_qps=65\]"),
    "capacity_hidden": (ValueError, r"the call needs \d+ bytes .*hidden=65536.* but the buffer has num_bytes=\d+; "
                                    r"at this shape it fits num_max_tokens_per_rank <= \d+\. Size the buffer with "
                                    r"EPBuffer.get_buffer_size_hint\(group, \d+, 65536, \d+, use_fp8_dispatch=False, "
                                    r"dtype=torch\.bfloat16\)"),
    "combine_rows": (ValueError, r"x has \d+ rows but the handle's non-expand layout has \d+"),
    "combine_x_fp8_tuple": (TypeError, r"x must be a float tensor here"),
    "combine_bias_len3": (ValueError, r"bias as a tuple must be \(bias_0, bias_1\), got 3 elements"),
    "combine_bias_shape": (ValueError, r"bias must have shape \[6, 32\], got \(5, 32\)"),
    "combine_bias_dtype": (TypeError, r"bias must have dtype torch\.bfloat16, got torch\.float32"),
    "combine_weights_shape": (ValueError, r"topk_weights must have shape \[\d+, 2\], got \(\d+, 1\)"),
    "combine_weights_dtype": (TypeError, r"topk_weights must have dtype torch\.float32, got torch\.float64"),
    "combine_expand_weights_dtype": (TypeError, r"topk_weights must have dtype torch\.float32, got torch\.float16"),
    "combine_expand_weights_without_multiple_reduction": (
        ValueError, r"topk_weights must be None for an expand-layout combine when the buffer has "
                    r"allow_multiple_reduction=False \(reference §11\.1\)"),
    "combine_handle_type": (TypeError, r"handle must be an EPHandle from dispatch, got object"),
    "combine_topk_idx_modified": (ValueError, r"topk_idx tensor passed to dispatch was modified in place"),
    "cached_with_topk_idx": (ValueError, r"topk_idx must be None when handle is given"),
    "cached_with_cpu_sync": (ValueError, r"do_cpu_sync must be None or False with handle"),
    "cached_layout_mismatch": (ValueError, r"do_expand=True does not match the handle's do_expand=False"),
    "cached_num_experts_mismatch": (ValueError, r"num_experts=16 does not match the handle's num_experts=8"),
    "cached_tokens_mismatch": (ValueError, r"num_max_tokens_per_rank=8 does not match the handle's "
                                           r"num_max_tokens_per_rank=16; pass the values of the dispatch"),
    "cached_alignment_mismatch": (ValueError, r"expert_alignment=4 does not match the handle's expert_alignment=1"),
    "cached_tokens_vs_buffer": (ValueError, r"num_max_tokens_per_rank=16 does not match the handle's "
                                            r"num_max_tokens_per_rank=8"),
    "cached_alignment_vs_handle": (ValueError, r"expert_alignment=1 does not match the handle's expert_alignment=4"),
    "cached_stats": (ValueError, r"cumulative_local_expert_recv_stats must be None with handle"),
    "cached_topk_idx_modified": (ValueError, r"modified in place after the dispatch"),
    "cached_token_count": (ValueError, r"x has 5 tokens but the handle's dispatch had 6"),
}
# Ranks disagree: every rank raises the same message kind.
DISAGREE = {
    "disagree_hidden": r"ranks disagree on hidden \(rank 0: 32, rank 1: 16\)",
    "disagree_num_experts": r"ranks disagree on num_experts \(rank 0: 8, rank 1: 16\)",
    "disagree_layout": r"ranks disagree on do_expand \(rank 0: False, rank 1: True\)",
    "disagree_alignment": r"ranks disagree on expert_alignment \(rank 0: 1, rank 1: 4\)",
    "disagree_dtype": r"ranks disagree on dtype \(rank 0: torch.bfloat16, rank 1: torch.float16\)",
    "disagree_sync": r"ranks disagree on do_cpu_sync \(rank 0: True, rank 1: False\)",
    # Per-call arguments (docs/decisions.md "What ranks must agree on"; reference §9.2, §9.11, §11.1).
    "disagree_topk": r"ranks disagree on num_topk \(rank 0: 2, rank 1: 3\); every rank must pass topk_idx with the "
                     r"same number of columns",
    "disagree_fp8": r"ranks disagree on dtype \(rank 0: torch\.bfloat16, rank 1: torch\.float8_e4m3fn\); every "
                    r"rank must pass x in the same dtype",
    "disagree_scale_columns": r"ranks disagree on the scale columns of x \(x\[1\]\.shape\[1\]\) \(rank 0: 1, "
                              r"rank 1: 2\)",
    "disagree_weights_given": r"^EPBuffer\.dispatch: .*ranks disagree on topk_weights \(rank 0: a tensor, rank 1: "
                              r"None\); every rank must pass topk_weights on every rank or on none",
    "disagree_combine_weights_given": r"^EPBuffer\.combine: .*ranks disagree on topk_weights \(rank 0: a tensor, "
                                      r"rank 1: None\)",
    # Rank 0 passes the handle of the first of two dispatches, rank 1 the second's (each named by its call id).
    "disagree_combine_handle": r"^EPBuffer\.combine: .*ranks disagree on handle \(rank 0: the handle of call #\d+, "
                               r"rank 1: the handle of call #\d+\); every rank must pass the handle of the same "
                               r"dispatch",
    "disagree_cached_handle": r"^EPBuffer\.dispatch: .*ranks disagree on handle \(rank 0: the handle of call #\d+, "
                              r"rank 1: the handle of call #\d+\)",
}


@pytest.fixture(scope="module")
def outcomes(pools):
    return pools.get(2).run(error_cases.run_scenarios, timeout=300)


def test_every_scenario_is_pinned():
    assert set(error_cases.scenarios()) == set(EXPECTED) | set(DISAGREE)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_input_raises_on_every_rank(outcomes, name):
    exc, pattern = EXPECTED[name]
    offender, peer = outcomes[1][name], outcomes[0][name]
    assert offender is not None and peer is not None, f"{name}: rank 1 raised {offender}, rank 0 raised {peer}"
    assert offender[0] == exc.__name__ and peer[0] == exc.__name__, (offender, peer)
    assert re.search(pattern, offender[1]), offender[1]
    assert offender[1].startswith(("EPBuffer.dispatch: rank 1: ", "EPBuffer.combine: rank 1: ")), offender[1]
    # The peer names the offending group rank and carries its message.
    assert re.search(r"rank 0: group rank 1 rejected the call: .*" + pattern, peer[1]), peer[1]


@pytest.mark.parametrize("name", sorted(DISAGREE))
def test_disagreeing_ranks_raise_everywhere(outcomes, name):
    for rank in (0, 1):
        cls, msg = outcomes[rank][name]
        assert cls == "ValueError" and re.search(DISAGREE[name], msg), msg
        assert f"rank {rank}: " in msg


@pytest.fixture(scope="module")
def three_rank_disagreements(pools):
    return pools.get(3).run(error_cases.per_call_disagreements, timeout=120)


@pytest.mark.parametrize("case, field, values", [
    ("topk", "num_topk", "rank 0: 2, rank 1: 2, rank 2: 3"),
    ("fp8", "dtype", "rank 0: torch.bfloat16, rank 1: torch.bfloat16, rank 2: torch.float8_e4m3fn"),
    ("weights", "topk_weights", "rank 0: a tensor, rank 1: a tensor, rank 2: None"),
    ("combine_weights", "topk_weights", "rank 0: a tensor, rank 1: a tensor, rank 2: None"),
])
def test_per_call_disagreement_on_three_ranks(three_rank_disagreements, case, field, values):
    """One of three ranks differs in a per-call argument (top-k width, FP8 x beside bf16 x, topk_weights given or
    not): every rank raises promptly naming the argument and each rank's value, and the next call works
    (docs/decisions.md "What ranks must agree on"; reference §9.2, §11.1)."""
    for rank in range(3):
        got = three_rank_disagreements[rank][case]
        assert got is not None and got[0] == "ValueError", (rank, got)
        assert f"rank {rank}: ranks disagree on {field} ({values})" in got[1], got[1]
        assert got[2] < 10, f"rank {rank} took {got[2]:.1f} s"


def test_two_offenders_each_raise_their_own_and_the_peer_names_both(run_ranks):
    ok, bad_idx, too_many = run_ranks(3, error_cases.two_offenders)
    assert bad_idx[0] == "TypeError" and bad_idx[1].startswith("EPBuffer.dispatch: rank 1: topk_idx must have dtype"), \
        bad_idx
    assert too_many[0] == "ValueError" and too_many[1].startswith("EPBuffer.dispatch: rank 2: x has 17 tokens"), \
        too_many
    assert ok[0] == "TypeError", ok  # the first offender's class
    assert ok[1] == (f"EPBuffer.dispatch: rank 0: group rank 1 rejected the call: {bad_idx[1]}; "
                     f"group rank 2 rejected it too: {too_many[1]}"), ok[1]


@pytest.mark.parametrize("pair, labels", [
    ("dispatch vs lb_prefetch_weights", ("EPBuffer.dispatch", "EPBuffer.lb_prefetch_weights")),
    ("lb_prefetch_weights vs barrier", ("EPBuffer.lb_prefetch_weights", "EPBuffer.barrier")),
    ("engram.fetch vs engram.set_config", ("EngramBuffer.fetch", "EngramBuffer.set_config")),
    ("dispatch vs bucket.all_reduce", ("EPBuffer.dispatch", "BucketBuffer.all_reduce")),
    ("bucket.all_reduce vs bucket.barrier", ("BucketBuffer.all_reduce", "BucketBuffer.barrier")),
    ("engram.fetch vs dispatch", ("EngramBuffer.fetch", "EPBuffer.dispatch")),
    ("pp.destroy vs barrier", ("PPBuffer.destroy", "EPBuffer.barrier")),
])
def test_calls_of_other_kinds_raise_on_every_rank(run_ranks, pair, labels):
    """Calls whose header rows differ in width (on one buffer or two of one group) used to abort gloo on one rank
    (agreement.framed_exchange); every rank raises naming both calls, and the next dispatch works."""
    for rank, (raised, after) in enumerate(run_ranks(2, error_cases.calls_of_other_kinds, pair)):
        assert raised is not None and raised.startswith(f"{labels[rank]}: rank {rank}: ranks are in different calls "
                                                        f"on this group (rank 0: {labels[0]}, rank 1: {labels[1]})"), \
            raised
        assert after > 0


def test_two_offenders_at_construction(run_ranks):
    ok, size, timeout = run_ranks(3, error_cases.construct_two_bad)
    assert size.startswith("EPBuffer: rank 1: num_bytes must be") and timeout.startswith("EPBuffer: rank 2: "), \
        (size, timeout)
    assert ok == (f"EPBuffer: rank 0: group rank 1 rejected the construction: {size}; group rank 2 rejected it too: "
                  f"{timeout}"), ok


def test_dispatch_while_peer_combines(run_ranks):
    for rank, msg in enumerate(run_ranks(2, error_cases.dispatch_vs_combine)):
        assert msg is not None and re.search(r"ranks disagree on op \(rank 0: dispatch, rank 1: combine\)", msg), msg


def test_calls_on_different_buffers_of_one_group(run_ranks):
    for msg in run_ranks(2, error_cases.two_buffers):
        assert msg is not None and "same buffer" in msg, msg
        assert re.search(r"ranks disagree on buffer \(rank 0: the EPBuffer of uid 0x[0-9a-f]+, rank 1: the EPBuffer "
                         r"of uid 0x[0-9a-f]+\)", msg), msg


def test_integer_arguments_on_one_rank(run_ranks):
    for rank, out in enumerate(run_ranks(2, error_cases.integer_arguments)):
        assert out[0] == "ok", out[0]
        named = "EPBuffer.dispatch: rank 1" if rank == 1 else "EPBuffer.dispatch: rank 0: group rank 1 rejected"
        for got, text in zip(out[1:5], ("num_qps must be an int, got NoneType None",
                                        "num_max_tokens_per_rank must be an int, got bool True",
                                        "num_experts must fit in a 64-bit integer, got 9223372036854775808",
                                        "num_sms must be an int, got str '4'")):
            assert got.startswith(("TypeError: " if "an int" in text else "ValueError: ") + named), got
            assert text in got, (text, got)
        assert "num_allocated_qps must be an int, got str 'a'" in out[5], out[5]


def test_deep_copied_handle_works_and_pickling_is_refused(run_ranks):
    for same, modified in run_ranks(2, error_cases.deep_copied_handle):
        assert same
        assert modified is not None and "was modified in place after the dispatch" in modified, modified


def test_handle_from_another_buffer_and_use_after_destroy(run_ranks):
    for out in run_ranks(2, error_cases.other_buffer_handle):
        assert "handle comes from another EPBuffer" in out[0]
        assert "handle comes from another EPBuffer" in out[1]
        assert "the buffer was destroyed" in out[2] and "the buffer was destroyed" in out[3]


@pytest.mark.parametrize("where", ["resolve", "move", "combine"])
def test_out_of_memory_on_one_rank_mid_call(where):
    """An error of one rank's own (out of memory). Before the header exchange it travels there as a bad argument:
    every rank raises, nothing is pending, the buffers stay usable. After it, that rank re-raises it and its buffer
    and group refuse later calls and constructions (they would meet the peers' pending collective); the peers learn
    it from the store and raise PeerFailed naming it within a few seconds, not at their 20 s timeout."""
    results = run_in_fresh_world(4, error_cases.failure_mid_call, 20.0, where, timeout=90)
    first, elapsed, (after, another, bucket) = results[1]
    assert first.startswith("OutOfMemoryError: CPU out of memory (injected)"), first
    if where == "resolve":
        assert after == another == bucket == "no error", (after, another, bucket)
        for r in (0, 2, 3):
            msg, _, (after, another, bucket) = results[r]
            assert msg.startswith("ValueError: EPBuffer.dispatch: rank") and "group rank 1 rejected the call" in msg
            assert "CPU out of memory (injected)" in msg, msg
            assert after == another == bucket == "no error", (after, another, bucket)
        return
    op = "EPBuffer.combine" if where == "combine" else "EPBuffer.dispatch"
    assert "unusable after an earlier failure" in after and "failed on this rank" in after, after
    for made in (another, bucket):
        assert "construction: rank 1: the process group is unusable after an earlier failure" in made, made
    for r in (0, 2, 3):
        msg, elapsed, (after, another, bucket) = results[r]
        assert msg.startswith(f"PeerFailed: {op}: "), msg
        assert f"group rank 1 stopped with an error during its {op} (call #" in msg, msg
        assert "OutOfMemoryError: CPU out of memory (injected)" in msg, msg
        assert elapsed < 10, elapsed
        assert "unusable after an earlier failure" in after, after
        for made in (another, bucket):
            assert "the process group is unusable after an earlier failure" in made, made


def test_out_of_memory_in_a_low_latency_call():
    results = run_in_fresh_world(2, error_cases.low_latency_failure_mid_call, 20.0, timeout=90)
    first, _, after = results[1]
    assert first.startswith("OutOfMemoryError: CPU out of memory (injected)"), first
    assert "unusable after an earlier failure" in after, after
    msg, elapsed, after = results[0]
    assert msg.startswith("PeerFailed: ") and "group rank 1 stopped with an error during its " \
        "EPBuffer.low_latency_dispatch" in msg and "OutOfMemoryError" in msg, msg
    assert elapsed < 10, elapsed
    assert "unusable after an earlier failure" in after, after


@pytest.mark.parametrize("which,op,unit", [("bucket", "BucketBuffer.all_gather", "collective"),
                                           ("engram", "EngramBuffer.fetch", "collective"),
                                           ("engram-write", "EngramBuffer.write", "collective"),
                                           ("lb", "EPBuffer.lb_prefetch_weights", "call")])
def test_out_of_memory_on_one_rank_in_a_collective_buffer(which, op, unit):
    """The bucket, Engram and load-balancing calls report an error of one rank's own after the ranks agreed on the
    call as dispatch does: that rank re-raises it and refuses the next call; its peers raise PeerFailed naming it,
    the call and the error within a few seconds, not at their 20 s timeout, and refuse the next call too. Bucket and
    Engram numbers count the buffer's collectives (several per call), an EPBuffer's its calls."""
    results = run_in_fresh_world(3, error_cases.collective_failure_mid_call, 20.0, which, timeout=90)
    first, _, after = results[1]
    assert first.startswith("OutOfMemoryError: CPU out of memory (injected)"), first
    assert "unusable after an earlier failure" in after, after
    for r in (0, 2):
        msg, elapsed, after = results[r]
        assert msg.startswith("PeerFailed: "), msg
        assert re.search(rf"waited for {unit} #\d+ but group rank 1 stopped with an error during its {op} "
                         rf"\({'after ' if unit == 'collective' else ''}{unit} #\d+\)", msg), msg
        assert "OutOfMemoryError: CPU out of memory (injected)" in msg, msg
        assert elapsed < 10, elapsed
        assert "unusable after an earlier failure" in after, after


def test_missing_peer_times_out_naming_it():
    results = run_in_fresh_world(2, error_cases.missing_peer, 3.0, timeout=60)
    msg, elapsed, after = results[0]
    assert re.search(r"^EPBuffer.dispatch: count exchange: rank 0 waited 3 s .* group ranks \[1\] did not arrive.*os._exit", msg), msg
    assert elapsed < 3.0 + 5.0, elapsed
    assert "unusable after an earlier failure" in after
    assert results[1] == "skipped"


def test_late_peer_raises_at_once_naming_the_rank_that_gave_up():
    (msg0, elapsed0), (msg1, elapsed1) = run_in_fresh_world(2, error_cases.late_peer, 4.0, timeout=60)
    assert "waited 4 s (num_cpu_timeout_secs)" in msg0 and "group ranks [1] did not arrive" in msg0, msg0
    assert 3.5 < elapsed0 < 6, elapsed0  # the timeout as set, not a second past it
    assert re.search(r"rank 1 waited [\d.]+ s for call #1 but group rank 0 gave up waiting in call #1 of this "
                     r"EPBuffer \(its own timeout\)", msg1), msg1
    assert elapsed1 < 3.5, elapsed1  # before its own 4 s


def test_missing_peer_in_a_subgroup_is_named_by_its_global_rank_too():
    results = run_in_fresh_world(3, error_cases.missing_peer_in_subgroup, 3.0, timeout=60)
    assert results[0] is None and results[2] == "skipped", results
    assert re.search(r"^EPBuffer.dispatch: count exchange: rank 0 \(global rank 1\) waited 3 s .* group ranks \[1\] "
                     r"\(global ranks \[2\]\) did not arrive", results[1]), results[1]


def test_rejected_call_in_a_subgroup_names_the_global_ranks_too():
    results = run_in_fresh_world(3, error_cases.rejected_in_subgroup, 10.0, timeout=60)
    assert results[0] is None, results
    assert "topk_idx" in results[2] and "rejected" not in results[2], results[2]  # its own error
    assert re.search(r"^EPBuffer.dispatch: rank 0 \(global rank 1\): group rank 1 \(global rank 2\) rejected the "
                     r"call: .*topk_idx", results[1]), results[1]


def test_late_rank_with_a_bad_value_times_out_in_the_message_gather():
    """The message gather of a failed call is bounded like every host wait (agreement.gather_messages)."""
    results = run_in_fresh_world(2, error_cases.late_rank_with_bad_value, 2.0, timeout=60)
    (msg0, elapsed0), (msg1, elapsed1) = results
    assert msg0.startswith("TransportTimeout") and "group ranks [1] did not arrive" in msg0, msg0
    # Bounded (not gloo's 30 min), in the header exchange or the message gather (whether rank 1's exchange pairs
    # with rank 0's abandoned one is up to gloo), naming the rank that is gone.
    assert re.search(r"^TransportTimeout: EPBuffer.dispatch: (count exchange|error messages): rank 1 waited "
                     r"[\d.]+ s .* group ranks? \[?0\]? (did not arrive|gave up waiting)", msg1), msg1
    assert elapsed1 < 2.0 + 4.0, elapsed1


def test_missing_peer_at_construction_times_out_naming_it():
    msg, skipped = run_in_fresh_world(2, error_cases.missing_at_construction, 3.0, timeout=60)
    assert re.search(r"^EPBuffer construction: .*rank 0 waited 3 s .* group ranks \[1\] did not arrive", msg), msg
    assert skipped == "skipped"


def test_constructor_checks(run_ranks):
    with pytest.raises(ValueError, match=r"get_buffer_size_hint: the number of ranks \(2\), num_max_tokens_per_rank "
                                         r"\(0\)"):
        epcomm.EPBuffer.get_buffer_size_hint(2, 0, 128)
    errs = run_ranks(2, _construct_bad, return_exceptions=True)
    for e in errs:
        assert isinstance(e, ValueError) and "num_bytes must be a positive multiple of 2 MiB" in str(e), e


def _construct_bad(rank, world):
    epcomm.EPBuffer(None, num_bytes=3 * 1024 * 1024)


def _construct_nvlink_on_cpu(rank, world):
    epcomm.EPBuffer(None, num_max_tokens_per_rank=8, hidden=32, transport="nvlink")


def test_nvlink_on_cpu_names_the_rank(run_ranks):
    for rank, e in enumerate(run_ranks(2, _construct_nvlink_on_cpu, return_exceptions=True)):
        assert isinstance(e, ValueError) and f"EPBuffer: rank {rank}: transport='nvlink' cannot run" in str(e), e


@pytest.mark.parametrize("kind,exc,pattern", [
    ("num_bytes", ValueError, r"num_bytes must be a positive multiple of 2 MiB .* got 1000 \(EPBuffer.get_buffer_size_"
                              r"hint gives one\); DeepEP V1's Buffer\(group, num_nvl_bytes, num_rdma_bytes\)"),
    ("tokens_negative", ValueError, r"num_max_tokens_per_rank must be in \[0, 1073741823\] \(0: pass it to each "
                                    r"dispatch; token keys src_rank \* N \+ src_token are int32\), got -1$"),
    ("v1_bytes", ValueError, r"num_max_tokens_per_rank must be in \[0, 1073741823\] .* got 1073741824; DeepEP V1's "
                             r"Buffer\(group, num_nvl_bytes, num_rdma_bytes\) does not map argument by argument: "
                             r"EPBuffer\(group, num_max_tokens_per_rank=N, hidden=H, num_topk=K\) sizes itself "
                             r"\(docs/porting.md\)"),
    ("timeout", ValueError, r"num_cpu_timeout_secs must be > 0 seconds, got -1"),
    ("timeout_type", TypeError, r"num_cpu_timeout_secs must be a number of seconds, got str"),
    ("dtype", TypeError, r"dtype must be a float dtype .* got torch.int8"),
    ("topk_33", ValueError, r"num_topk must be in \[0, 32\] \(0 sizes for 32; every call's top-k is at most 32\), "
                            r"got 33"),
    ("topk_type", TypeError, r"num_topk must be an int, got float"),
    ("tokens_type", TypeError, r"num_max_tokens_per_rank must be an int, got float 8.5"),
    ("hidden_type", TypeError, r"hidden must be an int, got str '64'"),
    ("bytes_type", TypeError, r"num_bytes must be an int, got float 4194304.0"),
    ("env", ValueError, r"EPCOMM_FUSED_SYNC_FREE_ROWS must be an integer >= 0, got '4k'"),
    ("env_return", ValueError, r"EPCOMM_NVLINK_RETURN must be 'push' or 'pull', got 'fetch'"),
    ("env_chunks", ValueError, r"EPCOMM_RETURN_CHUNKS must be an integer in \[1, 64\], got '0'"),
    ("env_debug", ValueError, r"EPCOMM_DEBUG must be 1 \(or true\) to switch it on, or 0 \(or false, or unset\), "
                              r"got 'maybe'"),
])
def test_constructor_error_on_one_rank_raises_everywhere(run_ranks, kind, exc, pattern):
    out = run_ranks(2, error_cases.construct_one_bad, kind)
    assert out[1][0] == exc.__name__ and re.search(pattern, out[1][1]), out[1]
    assert out[1][1].startswith("EPBuffer: rank 1: "), out[1]  # the offending rank names itself too
    assert out[0][0] == exc.__name__ and "group rank 1 rejected the construction" in out[0][1], out[0]
    assert re.search(pattern, out[0][1]) and out[0][2] < 10, out[0]  # promptly, not after the timeout


@pytest.mark.parametrize("kind,field,values", [
    ("tokens", "num_max_tokens_per_rank", "rank 0: 16, rank 1: 17"), ("size", "num_bytes", None),
    ("hidden", "hidden", "rank 0: 32, rank 1: 64"), ("topk", "num_topk", "rank 0: 0 (sizes for 32), rank 1: 4"),
    ("half", "dtype", "rank 0: torch.bfloat16, rank 1: torch.float16"),
    ("fp8", "use_fp8_dispatch", "rank 0: False, rank 1: True"),
    ("reduction", "allow_multiple_reduction", "rank 0: True, rank 1: False"),
])
def test_constructor_shape_disagreement(run_ranks, kind, field, values):
    """One region size, one default capacity and one combine layout per buffer: ranks that differ raise at
    construction, naming the argument the caller passed rather than the size it implies."""
    for name, msg, elapsed in run_ranks(2, error_cases.construct_one_bad, kind):
        assert name == "ValueError" and f"ranks disagree on {field}" in msg and elapsed < 10, msg
        assert values is None or f"({values})" in msg, msg


@pytest.mark.parametrize("kind,want", [
    ("env_differs", "ranks disagree on EPCOMM_PULL_CHUNKS (rank 0: unset, rank 1: 2)"),
    ("env_choice_differs", "ranks disagree on EPCOMM_NVLINK_RETURN (rank 0: 'push', rank 1: 'pull')"),
])
def test_constructor_environment_disagreement(run_ranks, kind, want):
    """EPCOMM_* variables that choose kernels and barrier counts on nvlink must be alike on every rank."""
    for name, msg, elapsed in run_ranks(2, error_cases.construct_one_bad, kind):
        assert name == "ValueError" and want in msg and msg.startswith("EPBuffer: rank "), msg


def test_constructor_num_topk_default_is_32(run_ranks):
    """num_topk=0 sizes for 32: a rank that passes 0 and one that passes 32 build the same buffer."""
    assert run_ranks(2, error_cases.construct_one_bad, "topk_default") == [None, None]


def test_constructor_transport_disagreement(run_ranks):
    for name, msg, elapsed in run_ranks(2, error_cases.construct_one_bad, "transport"):
        assert name == "ValueError" and "ranks disagree on transport (rank 0: 'auto', rank 1: 'collective')" in msg


def test_barrier_while_peer_dispatches(run_ranks):
    for msg in run_ranks(2, error_cases.barrier_vs_dispatch):
        assert msg is not None and "ranks disagree on op (rank 0: barrier, rank 1: dispatch)" in msg, msg


def test_inputs_requiring_grad_warn(run_ranks):
    """(FP8 scales and a bias requiring grad gave no warning; a pair with a None was refused)"""
    for out in run_ranks(2, error_cases.grad_warning):
        for name in ("x", "scales", "bias"):
            assert any("not recorded by autograd; use epcomm.TokenDispatcher" in m for m in out[name]), (name, out)
        assert out["pairs"] == [True, True], out


def test_numpy_ints_are_ints(run_ranks):
    assert run_ranks(2, error_cases.numpy_ints) == [True, True]


@pytest.mark.parametrize("which", ["conj", "bucket-oom", "engram-oom"])
def test_collective_buffer_error_before_the_header_travels_in_it(which):
    results = run_in_fresh_world(2, error_cases.collective_error_before_header, which, timeout=90)
    (outcome0, next0), (outcome1, next1) = results
    if which == "conj":
        assert outcome1.startswith("ValueError: ") and "lazily conjugated or negated view" in outcome1, outcome1
        assert next0 == next1 == [1.0] * 4 + [2.0] * 4, (next0, next1)
    else:
        assert outcome1 == "OutOfMemoryError: CPU out of memory (injected)", outcome1
        assert next0 == next1 == ([3.0] * 16 if which == "bucket-oom" else True), (next0, next1)
    assert outcome0.startswith("ValueError: ") and "group rank 1 rejected the call" in outcome0, outcome0
    assert ("conjugated" if which == "conj" else "CPU out of memory (injected)") in outcome0, outcome0


def test_calls_on_two_bucket_buffers_of_one_group_raise():
    for outcome, sums in run_in_fresh_world(2, error_cases.two_bucket_buffers, timeout=60):
        assert "ranks are in calls of different BucketBuffers on this group" in outcome, outcome
        assert sums == [2.0, 2.0], sums


def test_destroy_after_a_failure_on_the_group_is_local():
    results = run_in_fresh_world(2, error_cases.destroy_after_failure, timeout=60)
    assert results[0] == ["PeerFailed", "destroyed", "destroyed", "destroyed"], results[0]
    assert results[1] == ["OutOfMemoryError", "destroyed", "destroyed", "destroyed"], results[1]


def test_a_lost_connection_is_not_recorded_as_the_rank_s_own_failure(monkeypatch):
    """A peer that died without a record (killed, exited) shows as the group's own error on the survivors: it breaks
    the buffer but is not announced, so no survivor names a healthy rank as the one that failed."""
    from epcomm import waits

    announced, broken = [], []
    monkeypatch.setattr(waits, "announce_failure", lambda *args: announced.append(args))
    monkeypatch.setattr(waits, "peer_failure", lambda uid, group=None: None)
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:30616")
    with pytest.raises(waits.PeerFailed, match=r"^BucketBuffer.all_reduce: rank 0: the process group's connection to "
                       r"a peer failed during collective #3 and no peer recorded an error of its own: a peer process "
                       r"exited or was killed \(the backend said: \[gloo.*Connection closed by peer") as info:
        waits.fail_mid_call(lost, uid=1, call_id=3, rank=0, call="BucketBuffer.all_reduce", owner="BucketBuffer",
                            group=None, mark_broken=broken.append, unit="collective")
    assert info.value.__cause__ is lost
    assert announced == [] and broken == ["BucketBuffer.all_reduce: the process group failed during the call "
                                          "(RuntimeError)"], (announced, broken)
    own = torch.OutOfMemoryError("CPU out of memory")
    with pytest.raises(torch.OutOfMemoryError):
        waits.fail_mid_call(own, uid=1, call_id=4, rank=0, call="BucketBuffer.all_reduce", owner="BucketBuffer",
                            group=None, mark_broken=broken.append)
    assert len(announced) == 1 and announced[0][2] == 0, announced


def test_failure_after_the_last_collective_reaches_the_next_buffer_of_the_group():
    """Rank 1 fails in a bucket reduce-scatter after its collectives (its peers complete the call); every rank then
    calls another buffer of the group: the peers raise PeerFailed naming rank 1 and its call within a few seconds
    (the failure is recorded for the group, not only for the first buffer), instead of waiting out the timeout."""
    results = run_in_fresh_world(3, error_cases.failure_after_last_collective, 20.0, timeout=90)
    assert results[1][0].startswith("OutOfMemoryError"), results[1]
    assert "unusable after an earlier failure" in results[1][1], results[1]
    for r in (0, 2):
        first, second, elapsed = results[r]
        assert first == "no error", first
        assert second.startswith("PeerFailed: BucketBuffer.all_reduce header: ") and \
            "group rank 1 stopped with an error during its BucketBuffer.reduce_scatter" in second, second
        assert elapsed < 10, elapsed


@pytest.mark.parametrize("where", ["move", "combine"])
def test_an_internal_value_error_mid_call_is_the_rank_s_own(where):
    """A ValueError of the code's own on one rank after the header exchange (a bug, not an agreement every rank
    reaches) is reported as that rank's failure: the peers raise PeerFailed naming it instead of being aborted by
    gloo when that rank's next call meets their pending collective."""
    results = run_in_fresh_world(4, error_cases.failure_mid_call, 20.0, where, True, timeout=90)
    first, _, (after, _, _) = results[1]
    assert first == "ValueError: an internal error (injected)", first
    assert "unusable after an earlier failure" in after and "failed on this rank" in after, after
    for r in (0, 2, 3):
        msg, elapsed, (after, _, _) = results[r]
        assert msg.startswith("PeerFailed: ") and "ValueError: an internal error (injected)" in msg, msg
        assert elapsed < 10, elapsed


def _run_peer_exit(what: str) -> list:
    """tests/peer_exit_script.py on two processes; rank 0's outcome lines."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).resolve().parent / "peer_exit_script.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, str(script), str(port), str(r), what], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=env) for r in range(2)]
    try:
        out = procs[0].communicate(timeout=120)[0].decode()
        procs[1].wait(timeout=30)
    finally:
        for p in procs:
            p.kill()
    return [line for line in out.splitlines() if " after " in line or line == "no error"], out


def test_a_peer_process_that_exits_gives_peer_failed_in_a_barrier_too():
    """The same in a BucketBuffer's barrier (it raised gloo's bare error and left the buffer usable, so every later
    destroy raised it again): PeerFailed, then refused, then a local destroy."""
    lines, out = _run_peer_exit("barrier")
    assert len(lines) == 3, out[-3000:]
    assert re.match(r"PeerFailed after [\d.]+ s: BucketBuffer.barrier: rank 0: the process group's connection to a "
                    r"peer failed", lines[0]), out[-3000:]
    assert lines[1].startswith("ValueError") and "unusable after an earlier failure" in lines[1], out[-3000:]
    assert lines[2] == "no error", out[-3000:]


def test_a_peer_process_that_exits_gives_peer_failed_at_once():
    """A peer's process exits (killed, crashed) with nothing on record: the survivor's call raises PeerFailed (a
    TimeoutError) saying so within seconds, rather than the backend's bare RuntimeError, and its next call is
    refused."""
    lines, out = _run_peer_exit("dispatch")
    assert len(lines) == 2, out[-3000:]
    first = re.match(r"PeerFailed after ([\d.]+) s: EPBuffer.dispatch: .*rank 0: the process group's connection to a "
                     r"peer failed during call #\d+ .*a peer process exited or was killed", lines[0])
    assert first and float(first.group(1)) < 10, out[-3000:]
    assert lines[1].startswith("ValueError") and "unusable after an earlier failure" in lines[1], out[-3000:]


def test_calls_on_two_buffers_of_a_group_name_the_buffers(run_ranks):
    for rank, msg in enumerate(run_ranks(2, error_cases.barriers_of_two_buffers)):
        assert msg.startswith(f"EPBuffer.barrier: rank {rank}: ranks disagree on buffer (rank 0: "), msg
        assert "make the call on the same buffer" in msg, msg


def test_late_bucket_peer_raises_at_once_naming_the_rank_that_gave_up():
    (msg0, _), (msg1, elapsed1) = run_in_fresh_world(2, error_cases.late_bucket_peer, 4.0, timeout=60)
    assert "group ranks [1] did not arrive" in msg0, msg0
    assert re.search(r"BucketBuffer.all_reduce.*rank 1 waited [\d.]+ s for collective #\d+ but group rank 0 gave up "
                     r"waiting in collective #\d+ of this BucketBuffer", msg1), msg1
    assert elapsed1 < 3.5, elapsed1


def test_routing_edited_before_a_deferred_wait_raises_there(run_ranks):
    """Docs/decisions.md: in-place edits of topk_idx through torch are detected, deferred calls too."""
    out0, out1 = run_ranks(2, error_cases.routing_edited_before_deferred_wait, timeout=120)
    assert len(out1) == 6, out1
    for case, (err, same) in out1.items():
        assert err and re.search(r"^EPBuffer\.(dispatch|combine): rank 1: topk_idx was modified in place between the "
                                 r"call and the first wait\(\) of its deferred epilogue \(version \d+ -> \d+\)", err), \
            (case, err)
        assert err.startswith(f"EPBuffer.{case[0]}"), (case, err)
        assert " | EventOverlap.wait: the first wait of this event raised ValueError: " in err, (case, err)
        assert same and out0[case] == (None, True), (case, same, out0[case])
