"""`epcomm.comm`: the device barrier, the communication stream, and the communication context of one group.

DeepEP V2.5 behaviour, §3.1, §5 and §17. `barrier(buffer, ...)` and `get_comm_stream(buffer)` take any epcomm
buffer (`EPBuffer`, `BucketBuffer`, `PPBuffer`, `EngramBuffer`). `CommContext` is what the reference calls a
communication context: one process group as a buffer uses it (device, group ranks, an id shared by its ranks,
the physical domain, bounded host waits, the barrier). `BucketBuffer` holds one per group, `PPBuffer` and
`EngramBuffer` one each.

Every host wait here is bounded by `num_cpu_timeout_secs`: a peer that does not arrive raises `TimeoutError`
naming the missing group ranks, and the context is unusable afterwards (destroy the buffer). Device-side waits
of the collective path (NCCL on CUDA) are bounded by the process group's own NCCL timeout.
"""

from __future__ import annotations

import secrets
import socket
import time
import warnings
import zlib
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import gloo_exit
from .agreement import STATUS_OK, STATUS_TYPE, framed_exchange, gather_messages, rejected, status_of
from .compile_guard import eager_under_compile
from .waits import (PeerFailed, TransportTimeout, bounded_wait, break_group, fail_mid_call, group_broken,
                    require_group_usable)
from .validate import Checker, construction_timeout

__all__ = ["CommContext", "barrier", "destroy_all_managed_nccl_comm", "get_comm_stream", "get_logical_domain_size",
           "get_physical_domain_size", "group_device"]


def group_device(group: dist.ProcessGroup) -> torch.device:
    """The device a buffer on `group` lives on: the current CUDA device with NCCL, else CPU (docs/decisions.md decision 2)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def new_comm_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """A high-priority CUDA stream for a buffer's communication (reference §3.1); None on CPU."""
    return torch.cuda.Stream(device=device, priority=-1) if device.type == "cuda" else None


class CommContext:
    """One process group as a buffer uses it. Construction is collective over `group` (one bounded exchange).

    Args:
        group: the process group; None for the default (world) group. Messages use group ranks.
        owner: the owning buffer's name, used in messages (e.g. "BucketBuffer").
        num_cpu_timeout_secs: bound on every host wait of this context (seconds).
        comm_stream: the owning buffer's communication stream (CUDA), or None.
        agree: name -> int values every rank must pass identically (e.g. a group's index in a buffer's list).

    Fields:
        group, rank, num_ranks, device: the group, this rank's group rank, the group size, the device.
        uid: int -- an id every rank of the context shares (drawn by group rank 0).
        num_nvlink_ranks: int -- ranks of the group on this rank's host; num_rdma_ranks: int -- hosts.
        timeout_s: float -- `num_cpu_timeout_secs`.

    Raises:
        ValueError: the ranks passed different `agree` values (every rank raises).
        TypeError / ValueError: `error` -- a rank's own construction check failed; it raises it, its peers raise
            the same class naming it.
        TimeoutError: a peer did not construct its context within `num_cpu_timeout_secs`.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], *, owner: str, num_cpu_timeout_secs: float,
                 comm_stream: Optional["torch.cuda.Stream"] = None, agree: Optional[dict] = None,
                 error: Optional[BaseException] = None):
        self.group = group if group is not None else dist.group.WORLD
        gloo_exit.arm(self.group)
        self.owner = owner
        self.rank = self.group.rank()
        # A construction is collective: on a group holding a pending collective it would meet that one.
        require_group_usable(self.group, f"{owner} construction: rank {self.rank}")
        self.num_ranks = self.group.size()
        self.device = group_device(self.group)
        self.timeout_s = float(num_cpu_timeout_secs)
        self.comm_stream = comm_stream
        self.broken: Optional[str] = None
        self.destroyed = False
        self._call_id = 0
        self.uid = 0
        host = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
        agree = dict(agree or {})
        # A rank whose own checks failed still joins the exchange (with placeholder values), so that every rank
        # raises: its own error there, "group rank r rejected the construction" elsewhere.
        values = [v if isinstance(v, int) and not isinstance(v, bool) else 0 for v in agree.values()]
        # Rank 0's draw names the context (store keys, handles): from the OS's entropy, since training scripts seed
        # Python's `random` alike on every rank, and two groups' contexts must not share an id.
        mine = torch.tensor([[secrets.randbits(62), host, status_of(error), *values]], dtype=torch.int64,
                            device=self.device)
        rows = self.exchange(mine.expand(self.num_ranks, mine.shape[1]).contiguous(), f"{owner} construction")
        rows = rows.tolist()
        failed = [r for r, row in enumerate(rows) if row[2] != STATUS_OK]
        # The `agree` names the ranks passed different values for (compared even when a rank failed), on the
        # error raised as `disagreed`: a caller building several contexts decides from it whether to go on.
        differs = [(i, name) for i, name in enumerate(agree) if len({row[3 + i] for row in rows}) > 1]
        disagreed = tuple(name for _, name in differs)
        if failed:
            self.broken = "construction failed"
            messages = gather_messages(lambda t: self.exchange(t, f"{owner} construction messages",
                                                               kind="error messages"),
                                       str(error) if error is not None else "", self.num_ranks, self.device)
            exc = error
            if exc is None:
                exc = (TypeError if rows[failed[0]][2] == STATUS_TYPE else ValueError)(
                    rejected(owner, self.rank, failed, messages, "the construction", self.group))
            exc.disagreed = disagreed
            raise exc
        if disagreed:
            self.broken = "construction failed"
            i, first = differs[0]
            values = [row[3 + i] for row in rows]
            exc = ValueError(f"{owner}: rank {self.rank}: group ranks disagree on {first} ("
                             + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)) + ")")
            exc.disagreed = disagreed
            raise exc
        self.uid = rows[0][0]
        hosts = [row[1] for row in rows]
        self.num_nvlink_ranks = sum(1 for h in hosts if h == hosts[self.rank])
        self.num_rdma_ranks = self.num_ranks // self.num_nvlink_ranks \
            if self.num_ranks % self.num_nvlink_ranks == 0 else self.num_ranks

    # -- state ---------------------------------------------------------------------------------------
    def checker(self, call: str) -> Checker:
        """A `Checker` for `call` on this rank, after checking the context is usable.

        Raises:
            ValueError: the buffer was destroyed, or an earlier wait timed out.
        """
        c = Checker(call, self.rank, self.device)
        if self.destroyed:
            c.fail(ValueError, f"the {self.owner} was destroyed; create a new one")
        if self.broken is not None:
            c.fail(ValueError, f"the {self.owner} is unusable after an earlier failure ({self.broken}); destroy "
                               "it and restart the process group")
        require_group_usable(self.group, f"{call}: rank {self.rank}")
        return c

    def can_meet_peers(self) -> bool:
        """Whether a collective on the context may still run: neither it nor its process group is broken (after a
        timeout or a mid-call failure of any epcomm buffer on the group, a new collective would meet the pending
        one). `destroy()` then only frees local memory."""
        return self.broken is None and group_broken(self.group) is None

    def next_call_id(self) -> int:
        self._call_id += 1
        return self._call_id

    def take_back_call_id(self) -> None:
        """The exchange just made met another buffer's (its ids differ): that wait was not this buffer's, so its
        number goes back, and the buffers' later waits keep the same numbers on every rank (the store keys that
        name missing ranks)."""
        self._call_id -= 1

    def after_agreement(self, call: str, e: BaseException, *, err: Optional[BaseException] = None,
                        every_rank: tuple = ()) -> None:
        """Raise `e`, an error of `call` after the ranks agreed on it (or while waiting in its header), the way it
        calls for: a timeout (the bounded wait broke the context already), `err` (this rank's own error before the
        header, which every rank saw there) and errors of the `every_rank` types (what the header exchange raises on
        every rank together) pass as they are; any other is this rank's own (`fail_mid_call`)."""
        if isinstance(e, (TimeoutError,) + every_rank) or e is err:
            raise e
        self.fail_mid_call(call, e)

    def fail_mid_call(self, call: str, e: BaseException) -> None:
        """An error of this rank's own (out of memory, ...) while `call` moves data, after the ranks agreed on it
        (`waits.fail_mid_call`): the context and its process group are broken, and the peers' bounded waits raise
        `PeerFailed` naming this rank instead of timing out. Re-raises `e` (or `PeerFailed` for an earlier failure
        of a peer)."""
        def mark_broken(reason: str) -> None:
            self.broken = reason
            break_group(self.group, f"{self.owner}: {reason}")

        fail_mid_call(e, uid=self.uid, call_id=self._call_id, rank=self.rank, call=call, owner=self.owner,
                      group=self.group, mark_broken=mark_broken, unit="collective")

    # -- bounded waits -------------------------------------------------------------------------------
    def wait(self, work: "dist.Work", what: str) -> None:
        """Wait on the host for a collective `work` of this context, at most `timeout_s` (every rank calls it).

        Raises:
            TimeoutError: a peer did not arrive; names the missing group ranks. The context is broken after.
        """
        try:
            bounded_wait(work, what=what, call_id=self.next_call_id(), rank=self.rank, num_ranks=self.num_ranks,
                         uid=self.uid, device=self.device, timeout_s=self.timeout_s, owner=self.owner,
                         group=self.group, unit="collective")
        except TransportTimeout as e:
            self.broken = f"{what}: a peer failed during it" if isinstance(e, PeerFailed) else f"{what} timed out"
            break_group(self.group, f"{self.owner}: {self.broken}")
            raise

    def complete(self, work: "dist.Work", what: str) -> None:
        """Order later work after `work`: a bounded host wait on CPU, a stream wait (no host wait) on CUDA."""
        if self.device.type == "cpu":
            self.wait(work, what)
        else:
            work.wait()

    def sync_stream(self, stream: Optional["torch.cuda.Stream"], what: str) -> None:
        """Wait on the host, at most `timeout_s`, for the work queued so far on a CUDA `stream` (no-op on CPU).

        Raises:
            TimeoutError: the stream did not drain in time (a device-side wait on a peer that is not coming).
        """
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + self.timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                self.broken = f"{what} timed out"
                break_group(self.group, f"{self.owner}: {what} timed out")
                raise TransportTimeout(f"{what}: rank {self.rank} waited {self.timeout_s:g} s "
                                       f"(num_cpu_timeout_secs) for {self.device} to finish its queued work; a peer "
                                       f"did not arrive. The {self.owner} is unusable now: destroy it and restart")
            time.sleep(1e-4)

    # -- collectives ---------------------------------------------------------------------------------
    def exchange(self, send_RC: Tensor, what: str, *, kind: Optional[str] = None,
                 label: Optional[str] = None) -> Tensor:
        """Send row r of `send_RC` ([R, C] int64) to group rank r; return [R, C], row s from rank s (bounded). On CPU
        the rows travel framed (`agreement.framed_exchange`, `kind` default `what`, `label` default `what`)."""
        def exchange(send: Tensor) -> Tensor:
            recv = torch.empty_like(send)
            if self.num_ranks == 1:
                return recv.copy_(send)
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
            self.wait(work, what)
            return recv

        if self.device.type != "cpu":
            return exchange(send_RC)
        return framed_exchange(exchange, send_RC, kind=kind or what, label=label or what, rank=self.rank)

    def barrier(self, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True,
                *, call: str = "barrier", same_buffer: bool = True) -> None:
        """Barrier over the group on the current stream (collective; reference §17.1).

        On CUDA: `with_cpu_sync` drains the current and communication streams on the host before and after
        (bounded); otherwise `wait_comm_stream` orders the current stream after the communication stream before
        the barrier and the communication stream after the current stream afterwards. `sequential` has no
        effect (one logical domain). On CPU every option is a plain barrier with a bounded host wait: a framed
        exchange, so that a peer in another call raises at once (`agreement.framed_exchange`).

        Raises:
            ValueError: the buffer was destroyed or is broken.
            TimeoutError: a peer did not arrive within `num_cpu_timeout_secs`.
        """
        self.checker(call)
        if self.device.type != "cuda":
            # The context's id rides along: barriers of two buffers of one class on a group would pair silently.
            # (`same_buffer=False`: a construction's or destroy's barrier, whose order between buffers is free.)
            uids = self.exchange(torch.full((self.num_ranks, 1), self.uid, dtype=torch.int64), call)
            if same_buffer and len(set(uids.view(-1).tolist())) > 1:
                self.take_back_call_id()
                same = [r for r, u in enumerate(uids.view(-1).tolist()) if u == self.uid]
                raise ValueError(f"{call}: rank {self.rank}: ranks are in barriers of different {self.owner}s on "
                                 f"this group (group ranks {same} in this one); every rank must call the same buffer "
                                 "in the same order")
            return
        if with_cpu_sync:
            self.sync_stream(self.comm_stream, call)
            self.sync_stream(None, call)
        elif wait_comm_stream and self.comm_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.comm_stream)
        work = dist.all_reduce(torch.zeros(1, device=self.device), group=self.group, async_op=True)
        if with_cpu_sync:
            self.wait(work, call)
            self.sync_stream(None, call)
        else:
            work.wait()  # the current stream waits; the device wait is bounded by the group's NCCL timeout
            if wait_comm_stream and self.comm_stream is not None:
                self.comm_stream.wait_stream(torch.cuda.current_stream(self.device))


@eager_under_compile
def barrier(buffer, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True,
            context_idx: Optional[int] = None) -> None:
    """Device barrier over a buffer's group, on the current stream, bounded by the timeout (collective).

    DeepEP V2.5 behaviour, §17.1. Naive equivalent:
        torch.cuda.current_stream().wait_stream(comm_stream)   # wait_comm_stream (CUDA only)
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        comm_stream.wait_stream(torch.cuda.current_stream())

    Args:
        buffer: an `EPBuffer`, `BucketBuffer`, `PPBuffer` or `EngramBuffer`.
        wait_comm_stream: order the barrier after the communication stream and the communication stream after
            the barrier (CUDA; no effect on CPU). Default True.
        with_cpu_sync: drain the device on the host before and after (bounded by `num_cpu_timeout_secs`).
        sequential: accepted; no effect (one logical domain).
        context_idx: which of the buffer's contexts (`buffer.contexts[i]`, one per group of a `BucketBuffer`);
            None = the first. An `EPBuffer` has one context (0).

    Returns:
        None. Host-blocking on CPU (bounded); on CUDA only with `with_cpu_sync`.

    Raises:
        TypeError: `buffer` is not an epcomm buffer.
        ValueError: `context_idx` out of range; the buffer was destroyed.
        TimeoutError: a peer did not arrive within the buffer's `num_cpu_timeout_secs`.
    """
    contexts = getattr(buffer, "contexts", None)
    if contexts is None:
        if not callable(getattr(buffer, "barrier", None)):
            raise TypeError(f"epcomm.comm.barrier: buffer must be an epcomm buffer (EPBuffer, BucketBuffer, "
                            f"PPBuffer, EngramBuffer), got {type(buffer).__name__}")
        if context_idx not in (None, 0):
            raise ValueError(f"epcomm.comm.barrier: an {type(buffer).__name__} has one context; context_idx must "
                             f"be None or 0, got {context_idx}")
        buffer.barrier(wait_comm_stream, with_cpu_sync, sequential)
        return
    name = type(buffer).__name__
    if not contexts:
        raise ValueError(f"epcomm.comm.barrier: the {name} was destroyed; create a new one")
    idx = 0 if context_idx is None else context_idx
    if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < len(contexts):
        raise ValueError(f"epcomm.comm.barrier: context_idx must be None or in [0, {len(contexts)}) (the {name} has "
                         f"{len(contexts)} contexts), got {context_idx}")
    contexts[idx].barrier(wait_comm_stream, with_cpu_sync, sequential, call=f"{name}.barrier")


def get_comm_stream(buffer) -> Optional["torch.cuda.Stream"]:
    """The buffer's high-priority communication stream (reference §3.1); None on CPU.

    Args:
        buffer: an `EPBuffer`, `BucketBuffer`, `PPBuffer` or `EngramBuffer`.

    Returns:
        `torch.cuda.Stream` or None (CPU).

    Raises:
        TypeError: `buffer` is not an epcomm buffer.
    """
    getter = getattr(buffer, "get_comm_stream", None)
    if not callable(getter):
        raise TypeError(f"epcomm.comm.get_comm_stream: buffer must be an epcomm buffer, got {type(buffer).__name__}")
    return getter()


def get_physical_domain_size(group_or_buffer=None, *, num_cpu_timeout_secs: float = 300) -> tuple:
    """`(num_rdma_ranks, num_nvlink_ranks)`: hosts, and ranks per host, of a buffer's group or of a group
    (reference §2).

    Args:
        group_or_buffer: an epcomm buffer (its values; local), or a `ProcessGroup` (None: the default group).
            For a group it is collective: every rank of the group calls it (one bounded exchange of host names).
        num_cpu_timeout_secs: bound on that exchange (epcomm keyword). Default 300.

    Returns:
        `(num_rdma_ranks, num_nvlink_ranks)`: ints; `(1, R)` on one host.

    Raises:
        TypeError: neither a buffer nor a process group; a timeout that is not a number. ValueError: a timeout
            that is not > 0 (on every rank of the group). TimeoutError: a rank of the group did not call it.
    """
    call = "epcomm.comm.get_physical_domain_size"
    getter = getattr(group_or_buffer, "get_physical_domain_size", None)
    if callable(getter):
        return getter()
    if group_or_buffer is not None and not isinstance(group_or_buffer, dist.ProcessGroup):
        raise TypeError(f"{call}: group_or_buffer must be an epcomm buffer or a ProcessGroup (None: the default "
                        f"group), got {type(group_or_buffer).__name__}")
    group = dist.group.WORLD if group_or_buffer is None else group_or_buffer
    err = None
    try:  # a bad timeout still joins the exchange (with the default bound), so that every rank raises
        Checker(call, group.rank(), torch.device("cpu")).seconds("num_cpu_timeout_secs", num_cpu_timeout_secs)
    except (TypeError, ValueError) as e:
        err = e
    ctx = CommContext(group, owner=call, num_cpu_timeout_secs=construction_timeout(num_cpu_timeout_secs, err),
                      error=err)
    ctx.destroyed = True  # a context for one exchange; nothing to release
    return ctx.num_rdma_ranks, ctx.num_nvlink_ranks


def get_logical_domain_size(group_or_buffer=None, allow_hybrid_mode: Optional[bool] = None) -> tuple:
    """`(num_scaleout_ranks, num_scaleup_ranks)` (reference §2): always `(1, R)` in epcomm, which runs one logical
    domain in the canonical order whatever `allow_hybrid_mode` (docs/decisions.md decision 4). Local.

    Args:
        group_or_buffer: an epcomm buffer, or a `ProcessGroup` (None: the default group).
        allow_hybrid_mode: accepted for the reference's signature; no effect.

    Returns:
        `(1, R)`: ints, R the group's size.

    Raises:
        TypeError: neither a buffer nor a process group.
    """
    getter = getattr(group_or_buffer, "get_logical_domain_size", None)
    if callable(getter):
        return getter(allow_hybrid_mode)
    group = dist.group.WORLD if group_or_buffer is None else group_or_buffer
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError("epcomm.comm.get_logical_domain_size: group_or_buffer must be an epcomm buffer or a "
                        f"ProcessGroup (None: the default group), got {type(group_or_buffer).__name__}")
    return 1, group.size()


def destroy_all_managed_nccl_comm() -> None:
    """Nothing to do (reference §1): epcomm keeps no NCCL communicators of its own; it uses those of the process
    groups it is given, which `torch.distributed.destroy_process_group` releases."""


class ContextLifecycle:
    """Stream, barrier, context-manager and garbage-collection behaviour shared by the collective buffers (§5).

    The class needs `context` (a `CommContext`), `destroy()`, `explicitly_destroy` and `_destroyed`. Leaving a `with` block normally destroys
    the buffer (collective); leaving it with an exception in flight does not (peers may not reach `destroy`).
    """

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The buffer's communication stream; None on CPU."""
        return self.context.comm_stream

    @property
    def main_context(self) -> Optional[CommContext]:
        """The first communication context (reference §5), None after `destroy()`."""
        return None if getattr(self, "_destroyed", True) or not self.contexts else self.contexts[0]

    def get_physical_domain_size(self) -> tuple:
        """`(num_rdma_ranks, num_nvlink_ranks)` of the first group (reference §2).

        Raises:
            ValueError: the buffer was destroyed.
        """
        ctx = self._live_context("get_physical_domain_size")
        return ctx.num_rdma_ranks, ctx.num_nvlink_ranks

    def get_logical_domain_size(self, allow_hybrid_mode: Optional[bool] = None) -> tuple:
        """Always `(1, R)` of the first group: one logical domain (docs/decisions.md decision 4).

        Raises:
            ValueError: the buffer was destroyed.
        """
        return 1, self._live_context("get_logical_domain_size").num_ranks

    def _live_context(self, name: str) -> CommContext:
        if getattr(self, "_destroyed", True) or not self.contexts:
            raise ValueError(f"{type(self).__name__}.{name}: the buffer was destroyed")
        return self.contexts[0]

    def print_memory_usage(self) -> None:
        """Print the buffer's allocated regions (GiB) (reference §5).

        Raises:
            ValueError: the buffer was destroyed.
        """
        if getattr(self, "_destroyed", True):
            raise ValueError(f"{type(self).__name__}.print_memory_usage: the buffer was destroyed")
        gib = 1 << 30
        parts = ", ".join(f"{name} {nbytes / gib:.3f} GiB" for name, nbytes in self._memory_regions().items())
        device = self.contexts[0].device if self.contexts else "?"
        print(f"{type(self).__name__} rank {self.contexts[0].rank}: {parts} on {device}")

    def _memory_regions(self) -> dict:
        """name -> bytes of each region the buffer holds (each class names its own)."""
        return {"storage": getattr(self, "num_bytes", 0)}

    @eager_under_compile
    def barrier(self, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Barrier over the group on the current stream (collective; reference §17.1).

        Args:
            wait_comm_stream, with_cpu_sync, sequential: as `epcomm.comm.barrier`.

        Returns:
            None, once every rank has arrived.

        Raises:
            ValueError: destroyed or broken buffer. TimeoutError: a peer did not arrive.
        """
        self.context.barrier(wait_comm_stream, with_cpu_sync, sequential, call=f"{type(self).__name__}.barrier")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.destroy()

    def __del__(self):
        if getattr(self, "explicitly_destroy", False) and not getattr(self, "_destroyed", True):
            warnings.warn(f"{type(self).__name__} was created with explicitly_destroy=True but destroy() was never "
                          "called", ResourceWarning, stacklevel=1)
