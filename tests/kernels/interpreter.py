"""Runs a kernel simulation script under the Triton interpreter in a fresh process (TRITON_INTERPRET=1 must be set
before triton is imported, so it cannot be switched on inside the test process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_sim(script: str, case: str, timeout: int = 600) -> str:
    """`python script case` next to this file with the interpreter on; asserts it exits 0 and ends with "ok".
    Returns stdout + stderr."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(Path(__file__).with_name(script)), case], capture_output=True, env=env,
                         timeout=timeout)
    out = res.stdout.decode() + res.stderr.decode()
    assert res.returncode == 0, out[-3000:]
    assert res.stdout.decode().strip().endswith("ok"), out[-3000:]
    return out
