"""The device barrier of the nvlink regions on CPU (TRITON_INTERPRET=1): several barriers in a row on three
simulated ranks in any arrival order, and a rank that never arrives, which the waiting rank's kernel must name.
Each case runs `barrier_sim.py` in a fresh interpreter (the interpreter flag must be set before triton is
imported). On GPU every nvlink test goes through this barrier; tests/test_gpu.py checks its timeout on 2x H200.
"""

import pytest

from interpreter import run_sim


@pytest.mark.parametrize("case", ["barriers", "timeout"])
def test_barrier_kernel(case):
    out = run_sim("barrier_sim.py", case, timeout=300)
    if case == "timeout":
        assert "timed out waiting for rank" in out, out[-3000:]
