"""The nvlink low-latency kernels on CPU (TRITON_INTERPRET=1), against the reference's layout and sum order.

The cases run `lowlatency_sim.py` under the interpreter (interpreter.py: one process for all, a failing case again
alone): several dispatches (BF16, FP8 with fp32 / power-of-two / UE8M0 scales) and combines in a row on
simulated ranks (split kernels), on one rank (fused kernels), one rank fused among split peers, fused and split
calls interleaved on one area (a fused call while a split call's receive is pending), a receive whose peer never
sent, which must end and name that rank, and the combine's arrival counts: waits that must time out (a silent
peer, a call two ahead, one item not counted yet) and fused and split combines mixed with different token counts;
and the wait-cost statistics (a rank that never sent is charged, ranks already there are not).
The GPU suite runs the same kernels on 2x H200 (tests/ll_cases.py), with many programs per kernel: the
interpreter runs one.
"""

import re

import pytest

from interpreter import run_sim


CASES = ["two-ranks", "three-ranks", "one-rank-fused", "fused-with-peers", "mixed", "combine-waits", "combine-mixed",
         "cast", "wait-costs"]


@pytest.mark.parametrize("case", CASES)
def test_lowlatency_kernels(case):
    run_sim("lowlatency_sim.py", case, batch=CASES)


def test_lowlatency_receive_names_the_silent_rank():
    out = run_sim("lowlatency_sim.py", "timeout")
    assert "timed out waiting for rank" in out


def test_lowlatency_dispatch_names_a_bad_expert_id():
    """The host reads no expert ids: the send kernel prints the token holding one outside [-1, num_experts), for an
    id past the experts and one below -1 (on GPU it then traps: tests/test_lowlatency.py)."""
    out = run_sim("lowlatency_sim.py", "bad-id")
    message = "epcomm low-latency dispatch: topk_idx has an expert id outside [-1, num_experts) in token"
    assert re.findall(re.escape(message) + r":?\s+\[?(\d+)", out) == ["2", "2"], out[-2000:]
