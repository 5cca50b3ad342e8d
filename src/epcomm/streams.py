"""The stream and event protocol of dispatch/combine (DeepEP V2.5 EPBuffer behaviour, §3.4-3.5).

On CUDA a call with an event option runs its communication on the buffer's high-priority comm stream after
`previous_event` (or the current stream); its epilogue runs there too, or on the current stream at wait time when
deferred. A synchronous call runs on the current stream (`CallOrder`: same outcome, less host time). Tensors that
cross streams are recorded with the caching allocator. On CPU everything is synchronous and the events are
completed markers (docs/decisions.md "Events on CPU").
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional

import torch
from torch import Tensor

from .events import EventHandle, EventOverlap


def capturing(device: torch.device) -> bool:
    """The current stream of `device` is being captured into a CUDA graph (no host reads, no pageable copies)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def memo(cache: dict, key, make: Callable):
    """`cache[key]`, made by `make()` on a miss (per-handle index tensors derived from the routing alone).

    A miss under CUDA-graph capture is made but not kept: a tensor made inside a capture holds its values only once
    the graph has been replayed, so an eager call that found it before the first replay would read garbage. Such a
    value is made again by every capture (and replayed with it) until an eager call keeps one."""
    value = cache.get(key)
    if value is None:
        value = make()
        if not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
            cache[key] = value
    return value


class CallOrder:
    """Which stream a buffer's call runs on, and the order of its calls across streams (DeepEP V2.5 EPBuffer
    behaviour, §3.4).

    A synchronous call (no `previous_event`, `async_with_compute_stream`, `allocate_on_comm_stream` or
    `defer_epilogue`) runs on the current stream: the reference runs it on the comm stream between two waits (the
    comm stream for the current one, then the current one for the comm stream), with the same outcome for the
    caller, and those waits and switches cost every synchronous call host time (~6 driver calls). The other
    calls, the barrier and the load-balancing and header exchanges run on the comm stream as the reference says.

    The transports reuse staging areas and count device barriers from call to call, so calls must reach the device
    in the order they were made, whatever their stream: a call on another stream than the buffer's previous call
    first waits for it (the comm stream's work so far, or an event recorded after the previous synchronous call).
    Under CUDA-graph capture every call runs on the comm stream, as the reference's, so the calls of one capture
    keep their order at replay by the comm stream's order; nothing there waits for work outside the graph (capture
    begins after a device synchronisation). Calls on another device than the current one run on the comm stream
    too (switching to it makes the buffer's device current).

    An asynchronous call may read tensors that a synchronous call allocated on another stream (a handle's): until
    its event has completed the buffer keeps a reference to them (`hold`), so that their memory is not reused by the
    stream that allocated them while the comm stream still reads it. On CPU every call is synchronous and nothing
    here applies.
    """

    def __init__(self, device: torch.device, comm: Optional["torch.cuda.Stream"]):
        self.device, self.comm = device, comm
        self._last = None  # None, "comm", or the `_cuda_getCurrentStream` key of the last synchronous call's stream
        self._done = None  # event recorded after the last synchronous call's work (made at first use)
        self._held: list = []  # (event, objects): kept alive until the event has completed (`hold`)

    def is_direct(self, previous_event, async_op: bool, allocate_on_comm_stream: bool, defer: bool) -> bool:
        """Whether the call runs on the current stream: CUDA, synchronous, none of the comm-stream options, the
        buffer's device current, not under CUDA-graph capture."""
        return (self.comm is not None and previous_event is None and not async_op and not allocate_on_comm_stream
                and not defer and torch._C._cuda_getDevice() == self.device.index
                and not torch.cuda.is_current_stream_capturing())

    def hold(self, event, objects) -> None:
        """Keep `objects` alive until `event` (a CUDA event on the comm stream, None: nothing) has completed; the
        completed ones are let go at each call."""
        if event is not None and objects:
            self._held.append((event, objects))

    def _let_go(self) -> None:
        while self._held and self._held[0][0].query():
            self._held.pop(0)

    @contextmanager
    def launch(self, previous_event: Optional[EventHandle], direct: bool):
        """Run the enclosed launch on the current stream (`direct`) or on the comm stream after `previous_event`
        (or after the current stream); either way after the buffer's previous call."""
        if self.comm is None:
            yield
            return
        if self._held:
            self._let_go()
        if direct:
            last = self._last
            if last is not None and last != torch._C._cuda_getCurrentStream(self.device.index):
                stream = current_stream(self.device.index)
                if last == "comm":
                    follow(stream, self.comm)
                else:
                    stream.wait_event(self._done)
            try:
                yield
            except BaseException:  # work enqueued before the error: a later call on another stream waits for it
                self._direct_done()
                raise
            return
        self.to_comm(previous_event)
        with switched_to(self.comm):
            yield

    def to_comm(self, previous_event: Optional[EventHandle] = None) -> None:
        """Order the comm stream after `previous_event` (else the current stream) and after the buffer's last call;
        the comm stream holds the buffer's last work from now on."""
        event = getattr(previous_event, "event", None)  # an EventHandle's CUDA event; an EventOverlap's EventHandle
        event = getattr(event, "event", event)
        if event is not None:
            self.comm.wait_event(event)
        else:
            follow(self.comm, current_stream(self.device.index))
        last = self._last
        if last not in (None, "comm") and not torch.cuda.is_current_stream_capturing() and (
                event is not None or last != torch._C._cuda_getCurrentStream(self.device.index)):
            self.comm.wait_event(self._done)
        self._last = "comm"

    def finish(self, epilogue: Callable, inputs: list, async_op: bool, defer: bool, direct: bool, keep=None):
        """Run or defer `epilogue` and build the event; a `direct` call's epilogue runs on the current stream, and
        the call is then marked done there. An asynchronous or deferred call `hold`s `keep` (the handle it reads)
        until its event has completed.

        Returns:
            `(outputs, EventOverlap)`; or, when `defer`, an `EventOverlap` whose first wait returns the outputs.
        """
        if self.comm is None or not direct:
            result = finish(self.device, self.comm, epilogue, inputs, async_op, defer)
            if self.comm is not None and keep is not None and (async_op or defer):
                overlap = result if defer else result[1]
                self.hold(overlap.event.event, keep)
            return result
        try:
            return epilogue(), EventOverlap(None)
        finally:
            self._direct_done()

    def _direct_done(self) -> None:
        """A synchronous call's work is enqueued on the current stream: record where it ends, for a later call on
        another stream."""
        if self._done is None:
            self._done = torch.cuda.Event()
        self._last = torch._C._cuda_getCurrentStream(self.device.index)
        self._done.record(_stream_of(self._last))


_CURRENT: dict = {}  # torch._C._cuda_getCurrentStream's (id, device index, device type) -> a Stream of that id
_LINKS: dict = {}  # (waiting stream id, stream id, device index) -> the event `follow` records for that pair


def current_stream(index: int) -> "torch.cuda.Stream":
    """`torch.cuda.current_stream(index)`, without a new `Stream` object per call: a Stream is only its id, so one
    object per id serves every call (an eager call asked for the current stream twice)."""
    return _stream_of(torch._C._cuda_getCurrentStream(index))


def _stream_of(key: tuple) -> "torch.cuda.Stream":
    """The `Stream` of a `_cuda_getCurrentStream` key (one object per key)."""
    stream = _CURRENT.get(key)
    if stream is None:
        if len(_CURRENT) >= 256:  # a bound for programs that make streams without end
            _CURRENT.clear()
        stream = _CURRENT[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream


def follow(waiter: "torch.cuda.Stream", stream: "torch.cuda.Stream") -> None:
    """`waiter.wait_stream(stream)` with one event kept per pair of streams rather than a new event per call (its
    creation and destruction are two driver calls on top of the record and the wait; a later record does not
    change what an earlier wait waits for). Under CUDA-graph capture, torch's own `wait_stream`."""
    if torch.cuda.is_current_stream_capturing():
        waiter.wait_stream(stream)
        return
    key = (waiter.stream_id, stream.stream_id, stream.device_index)
    event = _LINKS.get(key)
    if event is None:
        if len(_LINKS) >= 256:
            _LINKS.clear()
        event = _LINKS[key] = torch.cuda.Event()
    event.record(stream)
    waiter.wait_event(event)


def ordered_exchange(transport, order: Optional[CallOrder], device: torch.device, send_RC: Tensor,
                     call_id: int, what: str = "count exchange", **frame) -> Tensor:
    """`transport.exchange_counts(send_RC, wait=True, ...)` for a call that does not run on the comm stream (the
    buffer's barrier, load-balancing headers, a low-latency shape's first call): on the comm stream, after the
    current stream's work and the buffer's last call (`CallOrder.to_comm`). The nvlink transport's device barriers
    count calls in its region, so they must run in one order with the barriers of the calls, where an asynchronous
    call may still be running. Under capture, on the current stream as before (a host wait cannot be captured
    anyway).

    Args:
        transport: the buffer's transport; order: its `CallOrder` (None without one: on the current stream);
            device: the buffer's device.
        send_RC: [R, C] int64 on `device` -- row p goes to rank p; call_id, what, frame (`kind`, `label`): as
            `exchange_counts`.

    Returns:
        [R, C] int64 on `device`: row s from rank s, complete (the host has waited for it).

    Raises:
        TimeoutError: a peer did not arrive within the transport's timeout (`exchange_counts`).
    """
    if device.type != "cuda" or order is None or order.comm is None or capturing(device):
        return transport.exchange_counts(send_RC, wait=True, call_id=call_id, what=what, **frame)
    order.to_comm()
    with switched_to(order.comm):
        return transport.exchange_counts(send_RC, wait=True, call_id=call_id, what=what, **frame)


@contextmanager
def switched_to(stream: "torch.cuda.Stream"):
    """`with torch.cuda.stream(stream)` at a fraction of its host cost (~9 us per use on 2x H200 hosts, twice per
    call) when `stream` is on the current device, the usual case: the current stream is saved and restored by its
    id, as `torch.cuda.set_stream` does, without making a `Stream` object for it. Else torch's own context, which
    also makes the stream's device current for the block."""
    index = stream.device_index
    if torch._C._cuda_getDevice() != index:
        with torch.cuda.stream(stream):
            yield
        return
    previous_id, previous_index, previous_type = torch._C._cuda_getCurrentStream(index)
    torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=index, device_type=stream.device_type)
    try:
        yield
    finally:
        torch._C._cuda_setStream(stream_id=previous_id, device_index=previous_index, device_type=previous_type)


def finish(device: torch.device, comm: Optional["torch.cuda.Stream"], epilogue: Callable, inputs: list,
           async_op: bool, defer: bool):
    """Run or defer `epilogue` and build the event.

    Returns:
        `(outputs, EventOverlap)`; or, when `defer`, an `EventOverlap` whose first wait returns the outputs.
    """
    if device.type != "cuda":
        if defer:
            return EventOverlap(EventHandle.completed(), hook_after_wait=epilogue)
        return epilogue(), EventOverlap(EventHandle.completed() if async_op else None)
    compute = current_stream(device.index)
    for t in inputs:
        if t is not None:
            t.record_stream(comm)
    if defer:
        event = EventHandle(stream=comm)

        def hook():
            outputs = _record_outputs(epilogue(), compute)
            # The epilogue may read rows a transport lends until its next call (nvlink's areas): later calls on the
            # comm stream come after it even when their `previous_event` was recorded before this wait. (Not under
            # capture, where the wait would leave the comm stream joined to the graph with nothing after it.)
            if not capturing(device):
                comm.wait_stream(torch.cuda.current_stream(device))
            return outputs
        return EventOverlap(event, hook_after_wait=hook)
    with switched_to(comm):
        outputs = _record_outputs(epilogue(), compute)
    if not async_op:  # no event to make (an event costs ~7 us of host time)
        follow(compute, comm)
        return outputs, EventOverlap(None)
    return outputs, EventOverlap(EventHandle(stream=comm))


def _record_outputs(outputs, stream: "torch.cuda.Stream"):
    """Outputs made on the comm stream are used on `stream`: tell the caching allocator."""
    def visit(o):
        if isinstance(o, Tensor):
            o.record_stream(stream)
        elif isinstance(o, (tuple, list)):
            for i in o:
                visit(i)
    visit(outputs)
    return outputs
