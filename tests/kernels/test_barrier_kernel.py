"""The device barrier of the nvlink regions on CPU (TRITON_INTERPRET=1): several barriers in a row on three
simulated ranks in any arrival order, and a rank that never arrives, which the waiting rank's kernel must name.
Each case runs `barrier_sim.py` in a fresh interpreter (the interpreter flag must be set before triton is
imported). On GPU every nvlink test goes through this barrier; tests/test_gpu.py checks its timeout on 2x H200.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("case", ["barriers", "timeout"])
def test_barrier_kernel(case):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = Path(__file__).with_name("barrier_sim.py")
    res = subprocess.run([sys.executable, str(script), case], capture_output=True, env=env, timeout=300)
    out = res.stdout.decode() + res.stderr.decode()
    assert res.returncode == 0, out[-3000:]
    assert res.stdout.decode().strip().endswith("ok")
    if case == "timeout":
        assert "timed out waiting for rank" in out, out[-3000:]
