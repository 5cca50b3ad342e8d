"""interpreter.run_sim's batches can only save time, never hide a failure: a case the batch process did not pass runs
again alone and fails there with its own output."""

import subprocess

import pytest

import interpreter


def _fake_run(calls: list, batch_stdout: str, alone_rc: int):
    def run(script, cases, timeout):
        calls.append(list(cases))
        if len(cases) > 1:  # the batch: a crash after the first case
            return subprocess.CompletedProcess([], 1, batch_stdout.encode(), b"Traceback: boom")
        return subprocess.CompletedProcess([], alone_rc, f"{cases[0]} ok\nok\n".encode() if alone_rc == 0 else b"",
                                           b"AssertionError: field x differs")
    return run


def test_a_case_the_batch_did_not_pass_runs_alone_and_fails(monkeypatch):
    pytest.importorskip("triton")
    calls = []
    monkeypatch.setattr(interpreter, "_passed_in_batch", {})
    monkeypatch.setattr(interpreter, "_run", _fake_run(calls, "a ok\n", alone_rc=1))
    assert interpreter.run_sim("x_sim.py", "a", batch=["a", "b"]) == ""  # passed in the batch: no second process
    with pytest.raises(AssertionError, match="field x differs"):
        interpreter.run_sim("x_sim.py", "b", batch=["a", "b"])
    assert calls == [["a", "b"], ["b"]]


def test_a_batch_that_times_out_passes_nothing(monkeypatch):
    pytest.importorskip("triton")
    calls = []

    def run(script, cases, timeout):
        calls.append(list(cases))
        if len(cases) > 1:
            raise subprocess.TimeoutExpired("sim", timeout)
        return subprocess.CompletedProcess([], 0, f"{cases[0]} ok\nok\n".encode(), b"")

    monkeypatch.setattr(interpreter, "_passed_in_batch", {})
    monkeypatch.setattr(interpreter, "_run", run)
    for case in ("a", "b"):
        assert "ok" in interpreter.run_sim("x_sim.py", case, batch=["a", "b"])
    assert calls == [["a", "b"], ["a"], ["b"]]
