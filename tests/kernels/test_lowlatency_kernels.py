"""The nvlink low-latency kernels on CPU (TRITON_INTERPRET=1), against the reference's layout and sum order.

Each case runs `lowlatency_sim.py` in a fresh interpreter (the interpreter flag must be set before triton is
imported): several dispatches (BF16, FP8 with fp32 / power-of-two / UE8M0 scales) and combines in a row on
simulated ranks (split kernels), on one rank (fused kernels), one rank fused among split peers, fused and split
calls interleaved on one area (a fused call while a split call's receive is pending), a receive whose peer never
sent, which must end and name that rank, and the combine's arrival counts: waits that must time out (a silent
peer, a call two ahead, one item not counted yet) and fused and split combines mixed with different token counts.
The GPU suite runs the same kernels on 2x H200 (tests/ll_cases.py), with many programs per kernel: the
interpreter runs one.
"""

import pytest

from interpreter import run_sim


@pytest.mark.parametrize("case", ["two-ranks", "three-ranks", "one-rank-fused", "fused-with-peers", "mixed", "timeout",
                                  "combine-waits", "combine-mixed", "cast"])
def test_lowlatency_kernels(case):
    out = run_sim("lowlatency_sim.py", case)
    if case == "timeout":
        assert "timed out waiting for rank" in out
