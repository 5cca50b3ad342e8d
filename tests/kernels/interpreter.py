"""Runs kernel simulation scripts under the Triton interpreter in a fresh process (TRITON_INTERPRET=1 must be set
before triton is imported, so it cannot be switched on inside the test process).

Starting a process that imports torch and triton costs ~2.5 s, more than most cases take. So `run_sim` with
`batch=` runs every case of the batch in one process, once per script, and a case passes when that process printed
`<case> ok` for it. Any other case (the batch failed before or at it, or it is not in the batch) runs alone in a
fresh process, which gives its own output and error."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

_passed_in_batch: dict = {}  # (script, batch) -> the cases the batch process printed "<case> ok" for


def _run(script: str, cases, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, str(Path(__file__).with_name(script)), *cases], capture_output=True,
                          env=env, timeout=timeout)


def _batch(script: str, batch: tuple, timeout: int) -> set:
    key = (script, batch)
    if key not in _passed_in_batch:
        try:
            res = _run(script, batch, timeout)  # a hanging case costs one timeout, then the cases run alone
            lines = set(res.stdout.decode().splitlines())
        except subprocess.TimeoutExpired:
            lines = set()
        _passed_in_batch[key] = {case for case in batch if f"{case} ok" in lines}
    return _passed_in_batch[key]


def run_sim(script: str, case: str, timeout: int = 600, batch=None) -> str:
    """`python script case` next to this file with the interpreter on; asserts it exits 0 and ends with "ok".
    Returns stdout + stderr. With `batch` (every case of the test's parametrisation, `case` among them), a case the
    batch process passed returns "" at once: tests that read the output leave `batch` out."""
    pytest.importorskip("triton")
    if batch is not None and case in _batch(script, tuple(batch), timeout):
        return ""
    res = _run(script, [case], timeout)
    out = res.stdout.decode() + res.stderr.decode()
    assert res.returncode == 0, out[-3000:]
    assert res.stdout.decode().strip().endswith("ok"), out[-3000:]
    return out
