"""Shared pytest fixtures: a session-wide cache of multi-rank worker pools."""

import sys
from pathlib import Path

import pytest

from epcomm.testing import PoolCache

# Spawned workers unpickle task functions by module name and inherit the parent's
# sys.path, so test modules (tests/ has no __init__.py) must be importable from it:
# as "test_x" (pytest's default prepend import mode) or "tests.test_x" (importlib mode).
for _path in (Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))


@pytest.fixture(scope="session")
def pools():
    """Session-wide :class:`epcomm.testing.PoolCache`, closed at session end."""
    cache = PoolCache()
    yield cache
    cache.close_all()


@pytest.fixture
def run_ranks(pools):
    """``run_ranks(world_size, fn, *args, timeout=120.0, return_exceptions=False, **kwargs)``.

    Runs ``fn(rank, world_size, *args, **kwargs)`` on the cached gloo pool of that
    size and returns the per-rank results (see :meth:`epcomm.testing.WorkerPool.run`).
    """

    def run(world_size, fn, *args, timeout=120.0, return_exceptions=False, **kwargs):
        pool = pools.get(world_size, "gloo")
        return pool.run(fn, *args, timeout=timeout, return_exceptions=return_exceptions, **kwargs)

    return run
