"""agreement.gather_messages: every rank's error message through a bounded exchange of int64 rows (not an
unbounded object gather): non-ASCII text, empty messages, messages cut at MESSAGE_BYTES with a marker (also
inside a multi-byte character), and lone surrogates, which must not raise on the failing rank."""

import torch

from epcomm import agreement


def _exchange_between(messages):
    """A fake exchange for len(messages) ranks: rank s's row is what gather_messages built from messages[s]."""
    rows = []

    def capture(t):  # each rank's call: keep its row, answer once all rows are in (in order here)
        rows.append(t[0].clone())
        return torch.stack(rows + [rows[-1]] * (len(messages) - len(rows)))

    out = None
    for msg in messages:
        out = agreement.gather_messages(capture, msg, len(messages), torch.device("cpu"))
    return out  # the last rank's view: every row filled


def test_messages_round_trip():
    msgs = ["", "rank 1: topk_idx holds 9 (token 0)", "naïve → ✓ 中文", "x" * 10]
    assert _exchange_between(msgs) == msgs


def test_long_messages_are_cut_with_a_marker():
    n = agreement.MESSAGE_BYTES
    long_ascii = "a" * (n + 100)
    cut_in_char = "a" * (n - 7) + "é" * 10  # a 2-byte character straddles the cut
    got = _exchange_between([long_ascii, cut_in_char])
    assert got[0] == "a" * (n - 6) + " [...]"
    assert got[1] == "a" * (n - 7) + " [...]"  # the character the cut split is dropped whole


def test_lone_surrogates_do_not_raise():
    got = _exchange_between(["bad \ud800 value", "ok"])
    assert got[0] == "bad \\ud800 value" and got[1] == "ok"


def _disagreement(*signatures) -> str:
    """The message `agreement.check` raises on rank 0 for headers with these signatures (call id 1 everywhere)."""
    rows = [agreement.header(agreement.STATUS_OK, 1, sig, 7) for sig in signatures]
    try:
        agreement.check("EPBuffer.x", 0, rows, None, lambda msg: [msg] * len(rows))
    except ValueError as e:
        return str(e)
    return "no error"


def test_low_latency_headers_name_their_own_arguments():
    """A low-latency call is never taken for the regular call of the same shape, and its slots are named as its
    arguments; a regular dispatch keeps its names."""
    ll = dict(hidden=128, num_topk=2, num_experts=4, use_fp8=True, use_ue8m0=False,
              num_max_dispatch_tokens_per_rank=4)
    sig = agreement.low_latency_signature(**ll)
    regular = dict(sig, op=1)  # the same slots, the regular dispatch's op
    assert "ranks disagree on op (rank 0: low_latency_dispatch, rank 1: dispatch)" in _disagreement(sig, regular)
    assert "ranks disagree on use_fp8 (rank 0: True, rank 1: False)" in _disagreement(
        sig, agreement.low_latency_signature(**dict(ll, use_fp8=False)))
    assert "ranks disagree on use_ue8m0 (rank 0: False, rank 1: True)" in _disagreement(
        sig, agreement.low_latency_signature(**dict(ll, use_ue8m0=True)))
    assert "ranks disagree on num_max_dispatch_tokens_per_rank (rank 0: 4, rank 1: 8)" in _disagreement(
        sig, agreement.low_latency_signature(**dict(ll, num_max_dispatch_tokens_per_rank=8)))
    assert "ranks disagree on x (rank 0: an FP8 (data, scales) tuple, rank 1: a tensor)" in _disagreement(
        regular, dict(regular, fp8=False))
    # Slots that are no argument of their own are named by the argument they describe.
    assert "ranks disagree on topk_weights (rank 0: a tensor, rank 1: None)" in _disagreement(
        dict(regular, has_topk_weights=True), regular)
    assert _disagreement(sig, sig) == "no error"


def _framed_between(calls):
    """agreement.framed_exchange for len(calls) ranks, rank s sending rows of `calls[s] = (kind, label, width)`:
    what each rank returned or raised."""
    num_ranks = len(calls)
    frames = []
    for kind, label, width in calls:  # each rank's frame (the exchange hands back what it sent: row `rank`)
        def keep(t):
            frames.append(t[0].clone())
            return t
        send = torch.arange(num_ranks * width, dtype=torch.int64).view(num_ranks, width) + 1000
        agreement.framed_exchange(keep, send, kind=kind, label=label, rank=0)
    outcomes = []
    for rank, (kind, label, width) in enumerate(calls):
        send = torch.arange(num_ranks * width, dtype=torch.int64).view(num_ranks, width) + 1000
        try:
            outcomes.append(agreement.framed_exchange(lambda t: torch.stack(frames), send, kind=kind, label=label,
                                                      rank=rank))
        except ValueError as e:
            outcomes.append(str(e))
    return outcomes


def test_framed_exchange_passes_rows_of_one_kind():
    a, b, c = _framed_between([("count exchange", "EPBuffer.dispatch", 20), ("count exchange", "EPBuffer.combine",
                                                                            20), ("count exchange", "x", 20)])
    # Row s of each result is what rank s sent this rank (here every rank sends row 0 of its arange).
    assert torch.equal(a, b) and torch.equal(a, c) and a.shape == (3, 20) and a[:, 0].tolist() == [1000] * 3


def test_framed_exchange_names_every_rank_s_call_on_other_kinds_or_widths():
    for calls in ([("count exchange", "EPBuffer.dispatch", 20), ("load-balancing header", "EPBuffer.lb", 20)],
                  [("EngramBuffer header", "EngramBuffer.fetch", 3), ("EngramBuffer header", "EngramBuffer.set", 9)]):
        labels = [label for _, label, _ in calls]
        for rank, got in enumerate(_framed_between(calls)):
            assert got == (f"{labels[rank]}: rank {rank}: ranks are in different calls on this group (rank 0: "
                           f"{labels[0]}, rank 1: {labels[1]}); every rank of the group must make the same calls, on "
                           "the same buffers, in the same order"), got


def _frame_widths(rank, world):
    """Every framed row width and kind a round of calls sends on CPU (EPBuffer with an LB region, its calls and a
    failed call's messages; Bucket, Engram and PP buffers)."""
    import epcomm
    from epcomm import agreement as ag, comm

    seen = set()
    real = ag.framed_exchange

    def spy(exchange, send_RC, *, kind, label, rank):
        seen.add((kind, send_RC.shape[1]))
        return real(exchange, send_RC, kind=kind, label=label, rank=rank)

    ag.framed_exchange = comm.framed_exchange = spy
    try:
        ep = epcomm.EPBuffer(None, num_max_tokens_per_rank=4, hidden=8, num_topk=2,
                             lb_allocation_plan_or_num_bytes=2 << 20)
        x, idx = torch.randn(4, 8).bfloat16(), torch.tensor([[0, 1], [1, 2], [3, -1], [2, 0]])
        recv_x, _, _, handle, _ = ep.dispatch(x, idx, num_experts=4)
        ep.combine(recv_x, handle)
        ep.low_latency_dispatch(x, idx, 4, 4, use_fp8=False)
        ep.lb_prefetch_weights(torch.zeros(1, 2), torch.zeros(2, 2),
                               torch.tensor([[(r + 1) % world * 2] for r in range(world)], dtype=torch.int32))
        try:
            ep.dispatch(x, idx if rank == 0 else idx.float(), num_experts=4)
        except (TypeError, ValueError):
            pass
        ep.barrier()
        ep.destroy()
        bucket = epcomm.BucketBuffer(None, 2 << 20)
        bucket.all_reduce(bucket.storage[:64 * world].view(torch.float32)).wait()
        bucket.barrier()
        bucket.destroy()
        engram = epcomm.EngramBuffer(None, 2 << 20, 2 << 20)
        engram.set_config([2], 8, 2, 1)
        engram.write([torch.zeros(2, 8).bfloat16()])
        engram.fetch(torch.zeros(1, 2, 1, dtype=torch.int64))[0]()
        engram.destroy()
        epcomm.PPBuffer(None, 64, 1).destroy()
    finally:
        ag.framed_exchange = comm.framed_exchange = real
    return sorted(seen)


def test_frames_hold_every_row(run_ranks):
    """The rows the calls really send fit the frame's bound for other rows (`_WIDEST_ROW`), but for the messages
    and the count headers, which `frame_cols` covers by their own formulas."""
    seen = run_ranks(2, _frame_widths)[0]
    kinds = {kind for kind, _ in seen}
    assert {"count exchange", "error messages", "EPBuffer construction", "load-balancing header",
            "BucketBuffer header", "EngramBuffer header"} <= kinds, kinds
    for kind, width in seen:
        if kind == "error messages":
            assert width == 1 + agreement.MESSAGE_BYTES // 8
        elif kind == "count exchange":  # a count header (dispatch, combine, barrier, destroy, low-latency calls)
            assert width == agreement.HEADER_LEN + 2, width
        else:
            assert width <= agreement._WIDEST_ROW, (kind, width)
    for num_ranks in (1, 2, 300):
        assert agreement.frame_cols(num_ranks) - agreement._FRAME_HEAD >= max(
            1 + agreement.MESSAGE_BYTES // 8, agreement.HEADER_LEN + num_ranks, agreement._WIDEST_ROW)
