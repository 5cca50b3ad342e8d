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
    assert "ranks disagree on fp8 (rank 0: True, rank 1: False)" in _disagreement(regular, dict(regular, fp8=False))
    assert _disagreement(sig, sig) == "no error"
