"""Multi-process test harness: a persistent pool of ranks with a watchdog.

A :class:`WorkerPool` spawns ``world_size`` processes once, each with a
``torch.distributed`` default group, then runs any number of tasks
``fn(rank, world_size, *args, **kwargs)`` on them (``fn`` module-level), so the
start-up cost (importing torch) is paid once per world size (:class:`PoolCache`).
A hung task trips a watchdog that kills every worker; a dead worker is noticed
at once.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["PoolCache", "RankFailure", "WatchdogTimeout", "WorkerDied", "WorkerPool", "run_in_fresh_world"]

_PEER_FAILED_GRACE_S = 20.0  # after one rank raised, how long its peers may still take (`run(peer_grace=)`)
_KILL_GRACE_S = 1.0  # SIGTERM -> SIGKILL delay for workers being killed
_STACK_DUMP_S = 0.5  # time given to hung workers to print their stacks


class RankFailure(AssertionError):
    """Ranks raised; ``failures`` maps each to its rebuilt exception (``remote_traceback``)."""

    def __init__(self, message: str, failures: dict[int, BaseException] | None = None):
        super().__init__(message)
        self.failures = failures or {}


# A worker killed by SIGKILL that nobody here sent: on a host that runs out of memory, the kernel's OOM killer.
_KILLED_HINT = ("; a SIGKILL nobody sent is often the host's out-of-memory killer: try fewer tokens, a smaller shape "
                "or fewer ranks")


class WorkerDied(RankFailure):
    """A worker exited (crash, ``os._exit``, signal); ``exitcodes`` maps rank -> exit code."""

    def __init__(self, message: str, exitcodes: dict[int, int | None] | None = None):
        super().__init__(message)
        self.exitcodes = exitcodes or {}


class WatchdogTimeout(Exception):
    """Some ranks (``ranks``) did not answer in time; all workers were killed."""

    def __init__(self, message: str, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = ranks or []


def _error_info(exc: BaseException) -> dict:
    try:
        blob = pickle.dumps(exc)
    except Exception:  # unpicklable exception state: parent falls back to text
        blob = None
    return {"cls": type(exc).__name__, "msg": str(exc), "tb": traceback.format_exc(), "blob": blob}


def _send(conn, seq: int, ok: bool, payload: Any) -> None:
    conn.send_bytes(pickle.dumps((seq, ok, payload), protocol=pickle.HIGHEST_PROTOCOL))


def _exit_when_orphaned(parent_pid: int) -> None:
    # A worker blocked in a collective never reads its pipe, so EOF cannot stop it.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(rank, world_size, backend, port, parent_pid, start_timeout, conn) -> None:
    os.environ["EPCOMM_TEST_WORKER"] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    faulthandler.enable()  # a crashing rank prints its Python stack to stderr
    if hasattr(signal, "SIGUSR1"):  # lets the watchdog print a hung worker's stacks
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    torch.set_num_threads(1)  # ranks share few cores; avoid oversubscription
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=start_timeout))
        dist.init_process_group(backend, rank=rank, world_size=world_size, store=store)
    except BaseException as exc:
        _send(conn, 0, False, _error_info(exc))
        return
    _send(conn, 0, True, None)
    while True:
        try:
            seq, blob = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # parent went away
            break
        if blob is None:  # graceful shutdown
            break
        try:
            fn, args, kwargs = pickle.loads(blob)
            ok, payload = True, pickle.dumps(fn(rank, world_size, *args, **kwargs),
                                             protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # incl. pytest.fail/skip outcomes
            ok, payload = False, _error_info(exc)
        _send(conn, seq, ok, payload)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # skip torch's slow interpreter teardown; nothing is left to clean up


def _rebuild(info: dict) -> BaseException:
    try:
        exc = pickle.loads(info["blob"]) if info["blob"] is not None else None
    except Exception:  # class not importable here, odd __init__, ...
        exc = None
    if not isinstance(exc, BaseException) or str(exc) != info["msg"]:
        exc = RuntimeError(f"{info['cls']}: {info['msg']}")
    exc.remote_traceback = info["tb"]
    return exc


def _failures(replies: dict) -> dict[int, BaseException]:
    return {rank: _rebuild(payload) for rank, (ok, payload) in sorted(replies.items()) if not ok}


def _describe(failures: dict[int, BaseException]) -> str:
    return "\n".join(f"--- rank {rank}: {type(exc).__name__}: {exc}\n"
                     f"{getattr(exc, 'remote_traceback', '').rstrip()}"
                     for rank, exc in sorted(failures.items()))


class WorkerPool:
    """``world_size`` spawned worker processes, each a rank of a process group.

    Args:
        world_size: Number of ranks (>= 1).
        backend: ``torch.distributed`` backend, ``"gloo"`` or ``"nccl"`` (then
            rank ``r`` uses ``cuda:r``).
        start_timeout: Seconds allowed for spawning and group initialization.

    Raises:
        WatchdogTimeout: The workers did not come up within ``start_timeout``.
        RankFailure: A worker failed to initialize its process group.
        WorkerDied: A worker exited during start-up.
    """

    def __init__(self, world_size: int, backend: str = "gloo", *, start_timeout: float = 120.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self._dead: str | None = None  # why the pool is unusable; None while usable
        self._seq = 0
        self._procs: list = []
        self._conns: list = []
        # The parent hosts the rendezvous store on an OS-chosen port: no port race.
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                                    timeout=timedelta(seconds=start_timeout))
        ctx = multiprocessing.get_context("spawn")  # fork is unsafe with torch threads
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_worker_main, name=f"epcomm-rank{rank}", daemon=True,
                                   args=(rank, world_size, backend, self._store.port, os.getpid(),
                                         start_timeout, child_end))
                proc.start()
                child_end.close()  # so the parent sees EOF when the worker dies
                self._procs.append(proc)
                self._conns.append(parent_end)
            replies = self._collect(0, start_timeout, "process-group start-up")
        except BaseException:
            self._kill("start-up failed")
            raise
        failures = _failures(replies)
        if failures:
            self._kill("start-up failed")
            raise RankFailure(f"{self!r} failed to start:\n{_describe(failures)}", failures)

    def __repr__(self) -> str:
        return f"WorkerPool(world_size={self.world_size}, backend={self.backend!r})"

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """True while the pool can run tasks (not closed, killed, or crashed)."""
        return self._dead is None and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0,
            return_exceptions: bool = False, peer_grace: float = _PEER_FAILED_GRACE_S, **kwargs: Any) -> list:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank.

        Args:
            fn: Module-level function, importable by name in the workers.
            *args: Picklable positional arguments passed to every rank.
            timeout: Seconds the watchdog waits for all ranks to answer.
            return_exceptions: Put each failing rank's exception (same class and
                ``str()``, with ``remote_traceback``) in its result slot instead
                of raising.
            peer_grace: Once a rank has raised, the other ranks get at most this many
                more seconds (a rank blocked in a collective with a failed rank never
                returns); default 20. Raise it for tasks whose ranks wait out a
                longer timeout of their own after a peer failed.
            **kwargs: Picklable keyword arguments passed to every rank.

        Returns:
            The per-rank return values, in rank order.

        Raises:
            RuntimeError: The pool is closed or dead.
            TypeError: ``fn`` or the arguments cannot be pickled.
            RankFailure: A rank raised (unless ``return_exceptions``).
            WorkerDied: A worker process exited; the pool is now dead.
            WatchdogTimeout: Some rank did not answer in time; the pool is now dead.
        """
        if isinstance(peer_grace, bool) or not isinstance(peer_grace, (int, float)) or not peer_grace > 0:
            raise ValueError(f"peer_grace must be a number of seconds > 0, got {peer_grace!r}")
        if not self.alive:
            self._kill(self._dead or "a worker process exited while idle")
            raise RuntimeError(f"{self!r} is not usable ({self._dead}); start a new pool "
                               "(PoolCache.get restarts dead pools)")
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            blob = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(f"cannot send task {name!r} to the workers ({exc}); fn must be a "
                            "module-level function and its arguments picklable") from exc
        self._seq += 1
        self._broadcast(pickle.dumps((self._seq, blob), protocol=pickle.HIGHEST_PROTOCOL))
        replies = self._collect(self._seq, timeout, name, peer_grace)
        results: list = []
        failures: dict[int, BaseException] = {}
        for rank in range(self.world_size):
            ok, payload = replies[rank]
            if ok:
                try:
                    results.append(pickle.loads(payload))
                    continue
                except Exception as exc:
                    payload = {"cls": "RuntimeError", "blob": None, "tb": traceback.format_exc(),
                               "msg": f"rank {rank}: cannot unpickle result: {exc!r}"}
            failures[rank] = _rebuild(payload)
            results.append(failures[rank])
        if failures and not return_exceptions:
            raise RankFailure(f"task {name!r} failed on {len(failures)} of {self.world_size} "
                              f"ranks:\n{_describe(failures)}", failures)
        return results

    def close(self, timeout: float = 10.0) -> None:
        """Shut down gracefully (workers destroy their group), killing any left after ``timeout``.

        Idempotent; safe on a dead pool.
        """
        if self._dead is None:
            self._dead = "closed"
            self._broadcast(pickle.dumps((0, None)))  # the shutdown message
            deadline = time.monotonic() + timeout
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        self._kill(self._dead)

    def _broadcast(self, message: bytes) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(message)
            except OSError:  # dead worker: _collect reports it with its exit code
                pass

    def _kill(self, reason: str) -> None:
        """Mark the pool dead and terminate every worker (SIGTERM, then SIGKILL)."""
        if self._dead is None:
            self._dead = reason
        for signal_proc in ("terminate", "kill"):  # SIGTERM, then SIGKILL after a grace period
            deadline = time.monotonic() + _KILL_GRACE_S
            for proc in self._procs:
                if proc.is_alive():
                    getattr(proc, signal_proc)()
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for conn in self._conns:
            conn.close()
        self._store = None  # stops the rendezvous server

    def _collect(self, seq: int, timeout: float, what: str,
                 peer_grace: float = _PEER_FAILED_GRACE_S) -> dict[int, tuple[bool, Any]]:
        """Wait for every rank's reply to task ``seq``, watching for deaths and the deadline."""
        deadline = time.monotonic() + timeout
        pending, replies, dead = set(range(self.world_size)), {}, {}
        cut = None  # why the deadline came early, for the message
        while pending:
            failed = sorted(r for r, (ok, _) in replies.items() if not ok)
            if failed and cut is None:
                # A rank raised: peers blocked in a collective with it never return, so cut the wait short.
                if time.monotonic() + peer_grace < deadline:
                    deadline = time.monotonic() + peer_grace
                    cut = f"within peer_grace={peer_grace:g}s after ranks {failed} raised"
                else:
                    cut = ""
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._timeout(sorted(pending), replies, cut or f"within {timeout:g}s", what)
            waitables = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            multiprocessing.connection.wait(waitables, timeout=remaining)  # wakes on reply or death
            for rank in sorted(pending):
                try:
                    if self._conns[rank].poll():
                        rseq, ok, payload = pickle.loads(self._conns[rank].recv_bytes())
                        if rseq == seq:
                            replies[rank] = (ok, payload)
                            pending.discard(rank)
                        continue
                except (EOFError, OSError):
                    pass
                if not self._procs[rank].is_alive():
                    self._procs[rank].join(1.0)
                    dead[rank] = self._procs[rank].exitcode
            if dead:
                self._kill(f"rank(s) {sorted(dead)} died")
                lines = [f"rank {r} (pid {self._procs[r].pid}) exited with exit code {code}"
                         + (f" (signal {signal.strsignal(-code)})" if code and code < 0 else "")
                         + (_KILLED_HINT if code == -getattr(signal, "SIGKILL", 9) else "")
                         for r, code in sorted(dead.items())]
                raise WorkerDied(f"{self!r}: worker died while running {what!r}:\n"
                                 + "\n".join(lines + [_describe(_failures(replies))]).rstrip(), dead)
        return replies

    def _timeout(self, hung: list[int], replies: dict, within: str, what: str) -> None:
        if hasattr(signal, "SIGUSR1"):  # ask hung workers to print their stacks first
            for rank in hung:
                try:
                    os.kill(self._procs[rank].pid, signal.SIGUSR1)
                except OSError:
                    pass
            time.sleep(_STACK_DUMP_S)
        self._kill(f"watchdog fired on {what!r}")
        raise WatchdogTimeout(
            f"watchdog: {what!r} did not finish {within} on {self!r}; ranks {hung} did "
            f"not answer; all workers were killed (their stacks went to stderr)\n"
            + _describe(_failures(replies)).rstrip(), hung)


class PoolCache:
    """At most one live :class:`WorkerPool` per ``(world_size, backend)``.

    Meant as a session-scoped pytest fixture: dead pools (watchdog, crash) are
    replaced on the next :meth:`get`.

    Args:
        start_timeout: Passed to every :class:`WorkerPool` it starts.
    """

    def __init__(self, start_timeout: float = 120.0):
        self.start_timeout = start_timeout
        self._pools: dict[tuple[int, str], WorkerPool] = {}

    def get(self, world_size: int, backend: str = "gloo") -> WorkerPool:
        """Return the live pool for ``(world_size, backend)``, starting one if needed.

        Raises:
            WatchdogTimeout, RankFailure, WorkerDied: A new pool failed to start.
        """
        key = (world_size, backend)
        pool = self._pools.get(key)
        if pool is not None and pool.alive:
            return pool
        if pool is not None:
            del self._pools[key]
            pool.close()  # reap what is left of the dead pool
        self._pools[key] = pool = WorkerPool(world_size, backend, start_timeout=self.start_timeout)
        return pool

    def close_all(self) -> None:
        """Close every pool (gracefully, then killing stragglers)."""
        while self._pools:
            self._pools.popitem()[1].close()


def run_in_fresh_world(world_size: int, fn: Callable[..., Any], *args: Any, backend: str = "gloo",
                       timeout: float = 120.0, return_exceptions: bool = False,
                       peer_grace: float = _PEER_FAILED_GRACE_S, **kwargs: Any) -> list:
    """Run ``fn`` once on a new pool that is killed afterwards.

    For tests that leave the process group unusable (e.g. a collective that
    times out because one rank never joins). Arguments, return value and
    exceptions are those of :meth:`WorkerPool.run` (plus start-up errors).
    """
    pool = WorkerPool(world_size, backend, start_timeout=max(timeout, 120.0))
    try:
        return pool.run(fn, *args, timeout=timeout, return_exceptions=return_exceptions, peer_grace=peer_grace,
                        **kwargs)
    finally:
        pool._kill("one-shot pool finished")  # no graceful destroy: the group may be wedged
