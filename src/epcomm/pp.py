"""`PPBuffer`: pipeline-parallel send/recv between ring neighbours (DeepEP V2.5 behaviour, §16).

Each directed pair of neighbours `s -> d` (`d = s +- 1 mod R`) is one FIFO: the k-th `recv(x, s)` on `d` returns
the bytes of the k-th `send(y, d)` on `s`. At world 2 both neighbours are the same rank, so there are two FIFOs,
one per direction.

How it maps onto `torch.distributed`:

* Every FIFO has its own two-rank backend (a *channel*, `ProcessGroupGloo` or `ProcessGroupNCCL` on the default
  store under a prefix named by the buffer's id), made at construction and used once in a global order. NCCL
  runs the point-to-point operations of one communicator in order on one stream, so two neighbours sending to
  each other through one group can deadlock (each send waits for a receive queued behind the other send); one
  channel per direction cannot. A timeout also breaks only the buffer's own channels, never the caller's group.
* `send` copies `x` into the next slot of the FIFO's ring (`num_max_inflight_tensors` slots of
  `num_max_tensor_bytes`) and posts the slot's send. It waits only when every slot is in flight, for the oldest
  to be received (bounded), so the caller may overwrite `x` as soon as `send` returns (in stream order on CUDA).
* `recv` receives straight into `x`. On CPU it waits on the host (bounded); on CUDA the current stream waits.
* On CPU a 32-byte header (sequence number, byte count) travels ahead of each payload: a `recv` whose `x` has
  another size raises `ValueError` and the FIFO stays in step (gloo aborts the process on a size mismatch).
  The receive of the next header is posted as soon as the previous one is read; `destroy` closes it.
  On CUDA the sizes must match (checking would need a host sync), as with NCCL send/recv.

Timeouts: host waits (CPU, `destroy`) are bounded by `num_cpu_timeout_secs` and name the peer; device waits on
CUDA are bounded by the channels' NCCL timeout, set to `num_gpu_timeout_secs` (the watchdog then aborts).

Implicit destruction never communicates and never blocks the interpreter for good:

* A buffer dropped without `destroy()` while its sends are in flight hands its channels to a daemon thread that
  waits (bounded) for those sends alone, so that the neighbour can still receive them, then lets the channels go
  (freeing a channel closes its connections under any message still in it).
* At interpreter exit an `atexit` handler first closes the receiving side of every buffer (this process receives
  nothing more, so a neighbour's pending sends to it fail at once instead of waiting for the timeout), then waits
  for this rank's own unreceived sends, at most `num_cpu_timeout_secs` (on CUDA also at most half of
  `num_gpu_timeout_secs`), until the neighbour receives them or closes its side, and lets the channels go. No
  thread is ever left inside a gloo wait at exit: CPython ends such a daemon thread with a forced unwind through
  C++ frames, which aborts the process ("terminate called without an active exception"), and a thread started
  during finalisation never runs, so that `Thread.start()` waits for ever.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import sizing
from .comm import ContextLifecycle, CommContext, new_comm_stream
from .compile_guard import eager_under_compile
from .waits import PeerFailed, backend_said, communication_error, default_store
from .transport.base import TransportTimeout
from .validate import Checker, construction_timeout, process_group, warn_caller

__all__ = ["PPBuffer"]

# Buffers dropped without destroy() while their sends were in flight (`_Dropped`). A daemon thread of their own
# keeps the channels alive until the sends are received or `num_cpu_timeout_secs` has passed (a neighbour's recv
# has timed out by then), so that a recv still gets them (a channel freed early closes its connection under the
# message). Garbage collection itself never communicates: the thread only waits for this rank's own sends.
# At exit `_at_exit` closes every receiving side, waits (bounded) for those threads and for the sends of the buffers
# still alive, and lets their channels go; after it (`_EXITING`) implicit destruction only frees local memory.
_DRAINING: list = []
_DRAINING_LOCK = threading.RLock()  # reentrant: a finalizer may run while its holder allocates
_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # buffers constructed and not destroyed
_EXITING = False

_HEADER_MAGIC, _CLOSE_MAGIC = 0x5050, 0x5043  # "PP" marks a message header, "PC" the last header at destroy
_TAG_HEADER, _TAG_PAYLOAD, _TAG_WARMUP = 1, 2, 3


@dataclass
class _Fifo:
    """One direction to or from one neighbour."""

    peer: int  # the neighbour's rank in the buffer's group
    channel: object  # the two-rank backend (ProcessGroupGloo / ProcessGroupNCCL) that carries this FIFO only
    channel_peer: int  # the neighbour's rank in `channel` (the sender is 0, the receiver 1)
    count: int = 0  # messages sent (send side) or received (recv side) so far
    slots: Optional[Tensor] = None  # send side: [num_max_inflight_tensors, num_max_tensor_bytes] uint8
    headers: Optional[Tensor] = None  # CPU: [num_max_inflight_tensors, 4] int64 (send) or [1, 4] (recv)
    works: list = field(default_factory=list)  # send side, per slot: the works of its last message
    pending: Optional["dist.Work"] = None  # recv side (CPU): the header receive posted ahead of the next recv


@dataclass(eq=False)
class _Dropped:
    """This rank's part of a buffer dropped without `destroy()` while its sends were in flight."""

    works: list  # the sends still in flight
    send: list  # the send FIFOs (their channels and slots), kept until `works` complete or `deadline`
    recv: list  # the receive FIFOs (channels and the header receives posted ahead), let go at exit
    deadline: float  # time.monotonic() after which nobody waits for `works` any more
    cpu: bool
    pid: int  # the process that dropped it (a forked child leaves it alone)
    thread: Optional[threading.Thread] = None


class PPBuffer(ContextLifecycle):
    """Pipeline send/recv to `(rank +- 1) mod world` with bounded in-flight tensors (collective construction).

    Args:
        group: the pipeline group (>= 2 ranks) this rank belongs to; None for the default group. Messages use
            group ranks.
        num_max_tensor_bytes: int > 0 -- largest tensor one send may carry (bytes).
        num_max_inflight_tensors: int > 0 -- sends that may be outstanding per FIFO (per neighbour and
            direction) before a further send waits for the oldest to be received.
        sl_idx: RDMA service level; accepted, no effect.
        num_gpu_timeout_secs: NCCL timeout of the channels (CUDA device waits; seconds, > 0). Default 100.
        explicitly_destroy: warn at garbage collection when `destroy()` was not called. Without `destroy()` the
            buffer's unreceived sends stay receivable for `num_cpu_timeout_secs`, also past the end of the script
            (module docstring: implicit destruction).
        num_cpu_timeout_secs: bound on every host wait (epcomm keyword; seconds, > 0). Default 300.

    Fields:
        num_bytes: int -- the reference's storage size `align(4 * align(num_max_tensor_bytes, 64) *
            num_max_inflight_tensors, 2 MiB)`; epcomm allocates the send rings only (receives land in `x`).
        rank, num_ranks, device: this rank's group rank, the group size, the buffer's device.

    Raises:
        TypeError: `group` not a ProcessGroup or None (this rank only, before any exchange: e.g. `dist.new_group`'s
            value on a rank outside the new group); sizes that are not ints; timeouts that are not numbers.
        ValueError: sizes <= 0, timeouts <= 0, a one-rank group.
        TimeoutError: a peer did not construct within `num_cpu_timeout_secs`.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], num_max_tensor_bytes: int, num_max_inflight_tensors: int,
                 sl_idx: Optional[int] = None, num_gpu_timeout_secs: float = 100, explicitly_destroy: bool = False,
                 *, num_cpu_timeout_secs: float = 300):
        self.explicitly_destroy = explicitly_destroy
        self._destroyed = True  # until construction succeeds
        group = process_group("PPBuffer", group)
        rank, num_ranks = group.rank(), group.size()
        err = None  # a failed check still joins the construction exchange, so that every rank raises
        try:
            c = Checker("PPBuffer", rank, None)
            c.timeouts(num_cpu_timeout_secs, num_gpu_timeout_secs)
            for name, value in (("num_max_tensor_bytes", num_max_tensor_bytes),
                                ("num_max_inflight_tensors", num_max_inflight_tensors)):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"PPBuffer: rank {rank}: {name} must be an int, got {type(value).__name__}")
                if value <= 0:
                    raise ValueError(f"PPBuffer: rank {rank}: {name} must be > 0, got {value}")
            if num_ranks < 2:
                raise ValueError(f"PPBuffer: rank {rank}: the group has {num_ranks} rank; a pipeline ring needs >= 2")
        except (TypeError, ValueError) as e:
            err = e
        self.num_max_tensor_bytes = num_max_tensor_bytes
        self.num_max_inflight_tensors = num_max_inflight_tensors
        self.sl_idx, self.num_gpu_timeout_secs, self.num_cpu_timeout_secs = sl_idx, num_gpu_timeout_secs, \
            num_cpu_timeout_secs
        self.context = CommContext(group, owner="PPBuffer",
                                   num_cpu_timeout_secs=construction_timeout(num_cpu_timeout_secs, err),
                                   agree={"num_max_tensor_bytes": num_max_tensor_bytes,
                                          "num_max_inflight_tensors": num_max_inflight_tensors}, error=err)
        self.num_bytes = sizing.align(4 * sizing.align(num_max_tensor_bytes, 64) * num_max_inflight_tensors,
                                      sizing.ALLOCATION_ALIGNMENT)
        self.contexts = [self.context]
        self.rank, self.num_ranks, self.device = rank, num_ranks, self.context.device
        self.context.comm_stream = new_comm_stream(self.device)
        self._check_sizes = self.device.type == "cpu"
        self._warned: set = set()
        self._send: dict = {}
        self._recv: dict = {}
        self._channels: list = []
        self._make_channels()
        self._warm_up_channels()
        for fifo in self._send.values():
            fifo.slots = torch.empty(num_max_inflight_tensors, num_max_tensor_bytes, dtype=torch.uint8,
                                     device=self.device)
            fifo.works = [[] for _ in range(num_max_inflight_tensors)]
            if self._check_sizes:
                fifo.headers = torch.zeros(num_max_inflight_tensors, 4, dtype=torch.int64)
        for fifo in self._recv.values():
            if self._check_sizes:
                fifo.headers = torch.zeros(1, 4, dtype=torch.int64)
                self._post_header(fifo)
        self._pid = os.getpid()
        self._destroyed = False
        _LIVE.add(self)

    def _make_channels(self) -> None:
        """One two-rank backend per directed neighbour pair this rank is in (sender = channel rank 0).

        The channels are standalone backends (`ProcessGroupGloo` / `ProcessGroupNCCL`) on the default store under
        a prefix named by the buffer's id, not `dist.new_group` groups: those are named from a per-process group
        counter (or, with local synchronisation, from the number of groups a process holds), which ranks of
        different pipeline groups, or processes with different group histories, do not share.
        """
        store = default_store()
        if store is None:
            raise ValueError(f"PPBuffer: rank {self.rank}: the default process group exposes no store; initialise "
                             "torch.distributed with an init_method or a store")
        R, cuda = self.num_ranks, self.device.type == "cuda"
        for s, d in sorted({(s, (s + o) % R) for s in range(R) for o in (1, -1)}):
            if self.rank not in (s, d):
                continue
            prefix = dist.PrefixStore(f"epcomm/pp/{self.context.uid}/{s}-{d}/", store)
            rank = 0 if self.rank == s else 1
            if cuda:
                opts = dist.ProcessGroupNCCL.Options()
                opts.is_high_priority_stream = False
                opts._timeout = timedelta(seconds=self.num_gpu_timeout_secs)  # the watchdog bounds device waits
                channel = dist.ProcessGroupNCCL(prefix, rank, 2, opts)
            else:
                channel = dist.ProcessGroupGloo(prefix, rank, 2, timedelta(seconds=self.num_cpu_timeout_secs))
            self._channels.append(channel)
            if rank == 0:
                self._send[d] = _Fifo(peer=d, channel=channel, channel_peer=1)
            else:
                self._recv[s] = _Fifo(peer=s, channel=channel, channel_peer=0)

    def _warm_up_channels(self) -> None:
        """One message per channel, channel by channel in the one order every rank uses (collective).

        NCCL creates a point-to-point communicator at its first use and blocks the host until the peer uses it
        too; two neighbours whose first calls are sends to each other would wait for each other forever. Every
        channel is used once here, in a global order, so later sends and receives never block the host.
        """
        deadline = time.monotonic() + self.context.timeout_s
        token = torch.zeros(1, dtype=torch.int64, device=self.device)
        for s, d in sorted([(self.rank, f.peer) for f in self._send.values()]
                           + [(f.peer, self.rank) for f in self._recv.values()]):
            fifo = self._send[d] if s == self.rank else self._recv[s]
            op = fifo.channel.send if s == self.rank else fifo.channel.recv
            self._wait(op([token], fifo.channel_peer, _TAG_WARMUP), deadline, lambda s=s, d=d: (
                f"PPBuffer: rank {self.rank}: group rank {d if s == self.rank else s} did not open channel {s} -> {d} "
                f"within {self.context.timeout_s:g} s (num_cpu_timeout_secs)"), host=True)

    # -- API -----------------------------------------------------------------------------------------
    @eager_under_compile
    def send(self, x: Tensor, dst_rank_idx: int, num_sms: Optional[int] = None) -> None:
        """Send `x` to the neighbour `dst_rank_idx`, in FIFO order, on the current stream.

        Returns once `x` is copied into a slot (CPU) or the copy is queued (CUDA); waits first only when
        `num_max_inflight_tensors` sends to that neighbour are still unreceived. Not collective: the neighbour
        calls `recv(y, src_rank_idx=rank)` with `y.nbytes == x.nbytes`.

        Args:
            x: [...] any dtype -- contiguous, non-empty, `x.nbytes <= num_max_tensor_bytes`, on the buffer's device.
            dst_rank_idx: int -- `(rank + 1) % R` or `(rank - 1) % R` (group ranks).
            num_sms: None (all SMs) or > 0; no effect on CPU (warns once) or with NCCL.

        Raises:
            TypeError: x not a tensor, dst_rank_idx not an int. ValueError: not a neighbour, empty /
            non-contiguous / too large x, device, destroyed buffer. TimeoutError: (CPU) every slot stayed in
            flight for `num_cpu_timeout_secs`; names the neighbour. PeerFailed (a TimeoutError): (CPU) the
            channel to the neighbour closed (its process ended, or its side timed out or was dropped).

        Returns:
            None.
        """
        call = "PPBuffer.send"
        c = self.context.checker(call)
        self._check_x(c, x)
        fifo = self._send[self._check_peer(c, "dst_rank_idx", dst_rank_idx)]
        self._check_sms(c, num_sms)
        k, n = fifo.count, self.num_max_inflight_tensors
        slot = k % n
        deadline = time.monotonic() + self.context.timeout_s
        for work in fifo.works[slot]:
            self._wait(work, deadline, lambda: (
                f"{call}: rank {self.rank}: send #{k} to group rank {fifo.peer} waited {self.context.timeout_s:g} s "
                f"(num_cpu_timeout_secs) for a free slot: group rank {fifo.peer} has not received send #{k - n} "
                f"(num_max_inflight_tensors={n} sends may be in flight per neighbour); every send needs a matching "
                f"recv(x, src_rank_idx={self.rank}) there. The PPBuffer is unusable now: destroy it and restart"),
                peer=fifo.peer)
        payload = fifo.slots[slot, :x.nbytes]
        payload.copy_(x.reshape(-1).view(torch.uint8))
        works = []
        try:
            if self._check_sizes:
                header = fifo.headers[slot]
                header.copy_(torch.tensor([_HEADER_MAGIC, k, x.nbytes, 0], dtype=torch.int64))
                works.append(fifo.channel.send([header], fifo.channel_peer, _TAG_HEADER))
            works.append(fifo.channel.send([payload], fifo.channel_peer, _TAG_PAYLOAD))
        except RuntimeError as exc:
            if communication_error(exc):
                raise self._channel_closed(call, exc, fifo.peer) from exc
            raise
        fifo.works[slot] = works
        fifo.count += 1

    @eager_under_compile
    def recv(self, x: Tensor, src_rank_idx: int, num_sms: Optional[int] = None) -> Tensor:
        """Receive the next tensor from the neighbour `src_rank_idx` into `x` (FIFO order), on the current stream.

        The receiver chooses shape and dtype; the bytes are copied. CPU: returns when the data is in `x`
        (bounded host wait). CUDA: the current stream waits for the data (bounded by the NCCL timeout).

        Args:
            x: [...] any dtype -- contiguous, non-empty, `x.nbytes` equal to the matching send's, on the device;
                not requiring grad unless under `torch.no_grad()` (the write is not recorded by autograd).
            src_rank_idx: int -- `(rank + 1) % R` or `(rank - 1) % R` (group ranks).
            num_sms: None (all SMs) or > 0; no effect on CPU (warns once) or with NCCL.

        Returns:
            `x`, filled.

        Raises:
            TypeError: x not a tensor, src_rank_idx not an int. ValueError: not a neighbour, bad x (also: x
            requires grad with grad mode on), (CPU) a size
            that differs from the send's (the message is consumed). TimeoutError: (CPU) no data within
            `num_cpu_timeout_secs`. PeerFailed (a TimeoutError): (CPU) the channel to the neighbour closed.
        """
        call = "PPBuffer.recv"
        c = self.context.checker(call)
        self._check_x(c, x)
        if x.requires_grad and torch.is_grad_enabled():  # as torch's in-place rule, since autograd never sees it
            c.fail(ValueError, "x requires grad, and recv writes it in place where autograd does not see it; receive "
                               "into a tensor that does not require grad (then call .requires_grad_()), or call "
                               "recv under torch.no_grad()")
        fifo = self._recv[self._check_peer(c, "src_rank_idx", src_rank_idx)]
        self._check_sms(c, num_sms)
        k = fifo.count
        deadline = time.monotonic() + self.context.timeout_s

        def late() -> str:
            return (f"{call}: rank {self.rank}: waited {self.context.timeout_s:g} s (num_cpu_timeout_secs) for send "
                    f"#{k} from group rank {fifo.peer}; it never came: every recv needs a matching "
                    f"send(x, dst_rank_idx={self.rank}) there. The PPBuffer is unusable now: destroy it and restart")
        target = x.reshape(-1).view(torch.uint8)
        mismatch = None
        if self._check_sizes:
            self._wait(fifo.pending, deadline, late, peer=fifo.peer)
            magic, seq, nbytes, _ = fifo.headers[0].tolist()
            assert magic == _HEADER_MAGIC and seq == k, f"PPBuffer FIFO out of step: header {magic, seq}, k={k}"
            self._post_header(fifo)
            if nbytes != x.nbytes:
                mismatch, target = nbytes, torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        work = fifo.channel.recv([target], fifo.channel_peer, _TAG_PAYLOAD)
        self._wait(work, deadline, late, peer=fifo.peer)
        fifo.count += 1
        if mismatch is not None:
            c.fail(ValueError, f"x has {x.nbytes} bytes but send #{k} from group rank {fifo.peer} carried {mismatch}; "
                               "recv into a tensor of the sent size (shape and dtype may differ). The message was "
                               "consumed; the FIFO continues with the next send")
        return x

    def __del__(self):
        """Implicit destruction: frees local memory, never communicates, never blocks (module docstring)."""
        super().__del__()
        if getattr(self, "_destroyed", True):
            return
        works = self._send_works()
        if not works:
            return  # the channels close as they go
        entry = _Dropped(works, list(self._send.values()), list(self._recv.values()),
                         time.monotonic() + self._drain_s(), self.device.type == "cpu", self._pid)
        with _DRAINING_LOCK:
            # During finalisation a new thread never runs (Thread.start() would wait for ever), and after the exit
            # handler nobody would wait for it; the exit handler has waited for the sends already.
            if _EXITING or sys.is_finalizing() or self._pid != os.getpid():
                return
            entry.thread = threading.Thread(target=_drain, args=(entry,), name="epcomm-pp-drain", daemon=True)
            _DRAINING.append(entry)
            try:
                entry.thread.start()
            except RuntimeError:  # no thread to be had: let go now
                _DRAINING.remove(entry)

    # -- lifecycle -----------------------------------------------------------------------------------
    @eager_under_compile
    def destroy(self) -> None:
        """Wait for this rank's sends to be received (bounded), then release the buffer (collective; after a timeout
        or a mid-call failure of an epcomm buffer on the group, local only: no collective runs on a broken group).

        Raises:
            ValueError: a send that its neighbour has not received (every rank raises at once, naming the sends; the
                buffer stays usable: receive them, then destroy again); (CPU) a rank of the group is in another
                call (every rank raises, naming each rank's call).
            TimeoutError: a rank did not reach destroy, or a received send did not complete, within
                `num_cpu_timeout_secs`.
        """
        if self._destroyed:
            return
        if self.context.can_meet_peers():
            self._agree_counts()  # every rank is in this call, and every send was received, before any wait
            deadline = time.monotonic() + self.context.timeout_s
            for fifo in self._send.values():
                for works in fifo.works:
                    for work in works:
                        self._wait(work, deadline, lambda f=fifo: (
                            f"PPBuffer.destroy: rank {self.rank}: group rank {f.peer} did not receive every send "
                            f"within {self.context.timeout_s:g} s (num_cpu_timeout_secs); {f.count} were sent"),
                            host=True)
            if self._check_sizes:
                self._close_headers(deadline)
            self.context.barrier(call="PPBuffer.destroy", with_cpu_sync=self.device.type == "cuda",
                                 same_buffer=False)
        for channel in self._channels:
            channel.shutdown()
        self._channels, self._send, self._recv = [], {}, {}
        self.context.destroyed = self._destroyed = True
        _LIVE.discard(self)

    # -- helpers -------------------------------------------------------------------------------------
    def _send_works(self) -> list:
        """This rank's send works of the last message of every slot (those may still be in flight)."""
        return [w for fifo in self._send.values() for slot in fifo.works for w in slot]

    def _drain_s(self) -> float:
        """How long a dropped buffer's sends are waited for. On CUDA, let go before the channels' NCCL watchdog
        (num_gpu_timeout_secs) would end the process."""
        if self.device.type == "cpu":
            return self.context.timeout_s
        return min(self.context.timeout_s, self.num_gpu_timeout_secs / 2)

    def _agree_counts(self) -> None:
        """Destroy: every rank sends every rank its messages sent to and received from each group rank, so that a
        send nobody received raises on every rank at once (it left the sender waiting for the timeout), with the
        same message; the buffer stays usable, so the messages can still be received before a second destroy.

        Raises:
            ValueError: some send was not received (names each pair and the sends); (CPU) a rank is in another call.
        """
        R = self.num_ranks
        mine = torch.zeros(2 * R, dtype=torch.int64)
        for peer, fifo in self._send.items():
            mine[peer] = fifo.count
        for peer, fifo in self._recv.items():
            mine[R + peer] = fifo.count
        rows = self.context.exchange(mine.expand(R, 2 * R).contiguous().to(self.device), "PPBuffer.destroy")
        rows = rows.tolist()  # rows[s] = [sent by s to each rank, received by s from each rank]
        unreceived = [(s, d, rows[d][R + s], rows[s][d]) for s in range(R) for d in range(R)
                      if rows[s][d] != rows[d][R + s]]
        if unreceived:
            pairs = "; ".join(f"group rank {s} sent {sent} message{'s' * (sent != 1)} to group rank {d}, which "
                              f"received {got} (" + (f"send #{got} is" if sent - got == 1 else
                                                     f"sends #{got}..#{sent - 1} are") + " unreceived)"
                              for s, d, got, sent in unreceived)
            raise ValueError(f"PPBuffer.destroy: rank {self.rank}: {pairs}; receive every message before destroy() "
                             "(the buffer is still usable, and every rank raised this)")

    def _post_header(self, fifo: _Fifo) -> None:
        """CPU: post the receive of the next header now, so that it arrives while the caller works."""
        # NOTE: a header received on demand costs one more gloo rendezvous per message: 4.6 ms per 1 MiB
        # send+recv pair, 3.5 ms with the header posted ahead, 2.6 ms without headers (2 gloo ranks, 2 cores).
        fifo.pending = fifo.channel.recv([fifo.headers[0]], fifo.channel_peer, _TAG_HEADER)

    def _close_headers(self, deadline: float) -> None:
        """Destroy on CPU: answer every header receive posted ahead with a closing header."""
        close = torch.tensor([_CLOSE_MAGIC, 0, 0, 0], dtype=torch.int64)
        works = [f.channel.send([close], f.channel_peer, _TAG_HEADER) for f in self._send.values()]
        for f in self._recv.values():
            self._wait(f.pending, deadline, lambda f=f: (
                f"PPBuffer.destroy: rank {self.rank}: group rank {f.peer} did not reach destroy within "
                f"{self.context.timeout_s:g} s (num_cpu_timeout_secs)"))
            if f.headers[0, 0] != _CLOSE_MAGIC:
                self.context.broken = "destroy found an unreceived message"
                raise ValueError(f"PPBuffer.destroy: rank {self.rank}: send #{f.count} from group rank {f.peer} was "
                                 "never received; receive every message before destroy()")
        for w in works:
            self._wait(w, deadline, lambda: f"PPBuffer.destroy: rank {self.rank}: a neighbour did not reach destroy")

    def _check_x(self, c, x) -> None:
        if not isinstance(x, Tensor):
            c.fail(TypeError, f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.device.type != self.device.type or (self.device.index is not None and x.device != self.device):
            c.fail(ValueError, f"x is on {x.device} but the buffer lives on {self.device}; move it there")
        if not x.is_contiguous():
            c.fail(ValueError, f"x must be contiguous (got strides {tuple(x.stride())})")
        if x.numel() == 0:
            c.fail(ValueError, "x is empty; send/recv move at least one element")
        if x.is_conj() or x.is_neg():  # its bytes are not its values: a byte move would drop the lazy operation
            c.fail(ValueError, "x is a lazily conjugated or negated view; call .resolve_conj() / .resolve_neg()")
        if x.nbytes > self.num_max_tensor_bytes:
            c.fail(ValueError, f"x has {x.nbytes} bytes but num_max_tensor_bytes is {self.num_max_tensor_bytes}; "
                               "make a PPBuffer with a larger num_max_tensor_bytes")

    def _check_peer(self, c, name: str, peer) -> int:
        R = self.num_ranks
        neighbours = sorted({(self.rank + 1) % R, (self.rank - 1) % R})
        peer = c.integer(name, peer)
        if peer not in neighbours:
            c.fail(ValueError, f"{name} must be a ring neighbour of rank {self.rank}: (rank + 1) % {R} or "
                               f"(rank - 1) % {R}, i.e. one of {neighbours}; got {peer}")
        return peer

    def _check_sms(self, c, num_sms) -> None:
        if num_sms is None:
            return
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms <= 0:
            c.fail(ValueError, f"num_sms must be None (all SMs) or > 0, got {num_sms}")
        if "num_sms" not in self._warned:
            self._warned.add("num_sms")
            warn_caller("epcomm: PPBuffer num_sms has no effect (the collective path uses no SM budget)")

    def _wait(self, work: "dist.Work", deadline: float, late, *, host: bool = False,
              peer: Optional[int] = None) -> None:
        """CPU: a host wait until `deadline`; CUDA: the current stream waits, or (`host`) a bounded host poll.

        Raises:
            TimeoutError: the deadline passed (`late()` is the message; it starts with the call's name); or
                (`PeerFailed`) the channel to the neighbour closed meanwhile (its process ended, or its side timed
                out or was dropped). The buffer is broken afterwards.
        """
        if self.device.type == "cuda":
            if not host:
                work.wait()
                return
            while not work.is_completed():
                if time.monotonic() > deadline:
                    self.context.broken = "a wait timed out"
                    raise TransportTimeout(late())
                time.sleep(1e-4)
            return
        # NOTE: gloo point-to-point works never report is_completed() (torch 2.13), so one timed wait stands in
        # for polling; a gloo timeout closes the channel, which only this buffer uses.
        remaining = max(deadline - time.monotonic(), 1e-3)
        try:
            work.wait(timeout=timedelta(seconds=remaining))
        except RuntimeError as exc:
            self.context.broken = "a wait timed out" if time.monotonic() >= deadline - 0.01 else str(exc)
            if time.monotonic() >= deadline - 0.01 or "timeout" in str(exc).lower():
                raise TransportTimeout(late()) from None
            if communication_error(exc):
                raise self._channel_closed(late().split(":", 1)[0], exc, peer) from exc
            raise

    def _channel_closed(self, call: str, exc: BaseException, peer: Optional[int] = None) -> PeerFailed:
        """The error of a wait or send of `call` whose channel to the neighbour (group rank `peer`, where known)
        closed (gloo's own RuntimeError, `exc`, names no rank); the buffer is broken afterwards."""
        self.context.broken = f"{call}: the channel to a neighbour closed"
        said = backend_said(exc)
        who = "the neighbour" if peer is None else f"the neighbour (group rank {peer})"
        return PeerFailed(f"{call}: rank {self.rank}: the channel to {who} closed while this rank waited or "
                          "sent: its process exited or was killed, or its PPBuffer timed out or was dropped (the "
                          f"backend said: {said}). The PPBuffer is unusable now: destroy it and restart")


def _wait_sends(works: list, deadline: float, cpu: bool) -> None:
    """Wait until each send completes, fails (a closed or timed-out channel: nothing more goes through it) or
    `deadline` passes. Gloo's point-to-point works report completion only through a timed wait; NCCL's are polled."""
    for work in works:
        try:
            if cpu:
                work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            else:
                while not work.is_completed() and time.monotonic() < deadline:
                    time.sleep(1e-3)
        except Exception:  # noqa: BLE001 -- the peer received nothing more, or closed its side
            pass


def _drain(entry: _Dropped) -> None:
    """A dropped buffer's thread: wait (bounded) for its sends, then let go of its channels."""
    try:
        _wait_sends(entry.works, entry.deadline, entry.cpu)
    finally:
        # Freeing a work or channel leaves the GIL for a moment; at exit a daemon thread that takes it back is ended
        # by a forced unwind that aborts in C++. So the entry leaves the list only after that: the exit handler
        # joins every thread still listed.
        entry.works, entry.send, entry.recv = [], [], []  # the channels close here
        with _DRAINING_LOCK:
            if entry in _DRAINING:
                _DRAINING.remove(entry)


def _at_exit() -> None:
    """Interpreter exit: bounded, never aborts (module docstring). Closes the receiving side of every buffer of
    this process (live or dropped), waits for this rank's unreceived sends until the peers receive them, close their
    side or the timeout, then lets the channels go; implicit destruction after this frees local memory only."""
    global _EXITING
    pid = os.getpid()
    with _DRAINING_LOCK:
        _EXITING = True
        dropped = [e for e in _DRAINING if e.pid == pid]
    live = [b for b in list(_LIVE) if not b._destroyed and b._pid == pid]
    now = time.monotonic()
    waits = []
    for buf in live:
        if buf.context.broken is None:
            buf.context.broken = "the process is exiting: its channels were closed at exit"
        waits.append((buf._send_works(), now + buf._drain_s(), buf.device.type == "cpu"))
    # This process receives nothing more: close the receiving channels first (CPU; an NCCL peer would not notice).
    for entry in dropped:
        if entry.cpu:
            entry.recv = []
    for buf in live:
        if buf.device.type == "cpu":
            buf._recv = {}
            buf._channels = [f.channel for f in buf._send.values()]
    for works, deadline, cpu in waits:
        _wait_sends(works, deadline, cpu)
    for entry in dropped:
        if entry.thread is not None:
            entry.thread.join(timeout=max(entry.deadline - time.monotonic(), 0.0) + 5.0)
    for buf in live:
        if buf.device.type == "cpu":
            buf._send, buf._channels = {}, []


atexit.register(_at_exit)
