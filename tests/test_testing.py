"""Tests for the multi-rank harness in :mod:`epcomm.testing`.

Task functions live at module level here; conftest.py puts tests/ on sys.path so
the spawned workers can import this module by name.
"""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from epcomm.testing import RankFailure, WatchdogTimeout, WorkerDied, run_in_fresh_world


def _allreduce_rank(rank, world_size, offset=0):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world_size, t.item() + offset, os.environ.get("EPCOMM_TEST_WORKER"), torch.get_num_threads()


def _scaled(rank, world_size, base):
    return base * (rank + 1), torch.full((2, 3), rank, dtype=torch.int64)


def _raise_on_rank(rank, world_size, bad_rank):
    if rank == bad_rank:
        raise ValueError(f"bad value on rank {rank}")
    return "ok"


def _raise_everywhere(rank, world_size):
    raise ValueError(f"rank {rank} refuses")


class _OddError(Exception):
    def __init__(self, a, b):  # pickle's type(exc)(*exc.args) cannot rebuild this
        super().__init__(f"{a}/{b}")


def _raise_odd(rank, world_size):
    raise _OddError("x", rank)


def _return_unpicklable(rank, world_size):
    return lambda: rank


def _sleep_on_rank(rank, world_size, sleepy_rank, seconds):
    if rank == sleepy_rank:
        time.sleep(seconds)
    return rank


def _exit_on_rank(rank, world_size, dying_rank, code):
    if rank == dying_rank:
        os._exit(code)
    time.sleep(30)  # the survivor would hang; the pool must not wait for it


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_in_rank_order(run_ranks, world_size):
    results = run_ranks(world_size, _allreduce_rank, offset=0.5)
    total = world_size * (world_size + 1) / 2 + 0.5
    assert results == [(r, world_size, total, "1", 1) for r in range(world_size)]


def test_tensors_round_trip(run_ranks):
    base = torch.arange(4, dtype=torch.float32)
    results = run_ranks(2, _scaled, base)
    for rank, (scaled, filled) in enumerate(results):
        torch.testing.assert_close(scaled, base * (rank + 1))
        torch.testing.assert_close(filled, torch.full((2, 3), rank, dtype=torch.int64))


def test_exception_on_one_rank_raises(pools):
    pool = pools.get(2)
    with pytest.raises(RankFailure) as info:
        pool.run(_raise_on_rank, 1)
    message = str(info.value)
    assert "rank 1" in message and "ValueError" in message and "bad value on rank 1" in message
    assert "_raise_on_rank" in message  # the remote traceback
    assert "rank 0" not in message
    assert list(info.value.failures) == [1]
    assert pool.alive and pool.run(_raise_on_rank, 5) == ["ok", "ok"]


def test_exception_on_one_rank_returned(pools):
    pool = pools.get(2)
    ok, err = pool.run(_raise_on_rank, 1, return_exceptions=True)
    assert ok == "ok"
    assert type(err) is ValueError and str(err) == "bad value on rank 1"
    assert "_raise_on_rank" in err.remote_traceback
    errs = pool.run(_raise_everywhere, return_exceptions=True)
    assert all(isinstance(e, ValueError) and f"rank {r}" in str(e) for r, e in enumerate(errs))


def test_unrebuildable_exception_and_result(pools):
    pool = pools.get(2)
    errs = pool.run(_raise_odd, return_exceptions=True)
    assert [str(e) for e in errs] == ["_OddError: x/0", "_OddError: x/1"]
    assert all(isinstance(e, RuntimeError) and "_raise_odd" in e.remote_traceback for e in errs)
    with pytest.raises(RankFailure, match="rank 0"):
        pool.run(_return_unpicklable)
    with pytest.raises(TypeError, match="module-level"):
        pool.run(lambda rank, world_size: rank)
    assert pool.alive


def test_watchdog_kills_hung_pool_and_cache_restarts(pools):
    pool = pools.get(2)
    start = time.monotonic()
    with pytest.raises(WatchdogTimeout) as info:
        pool.run(_sleep_on_rank, 1, 60.0, timeout=3.0)
    assert time.monotonic() - start < 10
    assert info.value.ranks == [1]
    assert "[1]" in str(info.value) and "_sleep_on_rank" in str(info.value)
    assert not pool.alive
    with pytest.raises(RuntimeError, match="not usable"):
        pool.run(_allreduce_rank)
    fresh = pools.get(2)
    assert fresh is not pool and fresh.alive
    assert [r[2] for r in fresh.run(_allreduce_rank)] == [3.0, 3.0]


def _raise_or_sleep(rank, world_size, seconds):
    if rank == 1:
        raise ValueError("rank 1 gave up")
    time.sleep(seconds)  # a rank still in a bounded wait of its own
    return rank


def test_peer_grace_after_a_rank_raised_is_named_and_adjustable():
    """Once a rank raised, its peers get `peer_grace` seconds more: the watchdog then says that, not the task's
    timeout; a longer grace lets a rank finish a wait of its own."""
    start = time.monotonic()
    with pytest.raises(WatchdogTimeout) as info:
        run_in_fresh_world(2, _raise_or_sleep, 30.0, timeout=90, return_exceptions=True, peer_grace=1.0)
    assert time.monotonic() - start < 20
    assert "did not finish within peer_grace=1s after ranks [1] raised" in str(info.value), str(info.value)
    results = run_in_fresh_world(2, _raise_or_sleep, 2.0, timeout=90, return_exceptions=True, peer_grace=10.0)
    assert results[0] == 0 and isinstance(results[1], ValueError), results


def test_dead_worker_reported_promptly(pools):
    pool = pools.get(2)
    start = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        pool.run(_exit_on_rank, 1, 3, timeout=60.0)
    assert time.monotonic() - start < 10  # noticed at once, not at the 60 s timeout
    assert info.value.exitcodes == {1: 3}
    assert "rank 1" in str(info.value) and "exit code 3" in str(info.value)
    assert not pool.alive


def _killed_on_rank(rank, world_size, dying_rank):
    if rank == dying_rank:
        os.kill(os.getpid(), signal.SIGKILL)  # as the host's out-of-memory killer would
    time.sleep(30)


def test_killed_worker_hints_at_memory(pools):
    pool = pools.get(2)
    with pytest.raises(WorkerDied) as info:
        pool.run(_killed_on_rank, 0, timeout=60.0)
    assert "signal Killed" in str(info.value) and "out-of-memory killer" in str(info.value), str(info.value)


def test_run_in_fresh_world():
    assert run_in_fresh_world(1, _allreduce_rank, offset=1.0) == [(0, 1, 2.0, "1", 1)]


def test_close_and_context_manager(pools):
    with pools.get(1) as pool:  # the cache replaces the closed pool on its next get()
        assert pool.alive and pool.run(_sleep_on_rank, 0, 0.0) == [0]
    assert not pool.alive
    with pytest.raises(RuntimeError, match="not usable"):
        pool.run(_sleep_on_rank, 0, 0.0)
    pool.close()  # idempotent
