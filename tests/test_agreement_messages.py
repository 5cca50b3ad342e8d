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
