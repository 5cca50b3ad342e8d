"""streams.CallOrder's decisions on fake streams (CPU): which stream a call runs on and what it waits for.

The GPU body `ep_cases.stream_order` checks the same on real streams by event times; here every wait is logged, so
each rule of docs/decisions.md "Streams on CUDA" is pinned exactly: a synchronous call runs on the current stream;
a call on another stream than the buffer's previous call waits for it (the comm stream, or the event recorded
after the previous synchronous call); under capture or with another device current, calls take the comm stream;
an asynchronous call holds the handle it reads until its event completes.
"""

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from epcomm import streams


class FakeEvent:
    def __init__(self, log):
        self.log, self.mark, self.completed = log, None, False

    def record(self, stream):
        self.mark = f"{stream.name}@{len(self.log)}"
        self.log.append(f"record {self.mark}")

    def query(self):
        return self.completed


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(f"{self.name} waits {event.mark}")


@pytest.fixture
def world(monkeypatch):
    """A fake CUDA device 0 with streams A, B and the comm stream; `world.current` names the current stream."""
    log = []
    w = SimpleNamespace(log=log, current="A", device=0, capturing=False)
    named = {name: FakeStream(name, log) for name in ("A", "B", "comm")}
    # The CPU wheel has no CUDA bindings: raising=False adds them for the test.
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: (w.current, 0, 1), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: w.device, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: w.capturing)
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(log))
    monkeypatch.setattr(streams, "current_stream", lambda index: named[w.current])
    monkeypatch.setattr(streams, "_stream_of", lambda key: named[key[0]])
    monkeypatch.setattr(streams, "follow", lambda waiter, stream: log.append(f"{waiter.name} follows {stream.name}"))

    @contextmanager
    def switched_to(stream):
        before, w.current = w.current, stream.name
        try:
            yield
        finally:
            w.current = before
    monkeypatch.setattr(streams, "switched_to", switched_to)

    def finish(device, comm, epilogue, inputs, async_op, defer):  # the comm-stream epilogue, as streams.finish
        event = FakeEvent(log)
        event.record(comm)
        overlap = SimpleNamespace(event=SimpleNamespace(event=event))
        if defer:
            return overlap
        with switched_to(comm):
            return epilogue(), overlap
    monkeypatch.setattr(streams, "finish", finish)
    w.order = streams.CallOrder(torch.device("cuda", 0), named["comm"])
    w.streams = named
    return w


def call(w, stream, *, previous_event=None, async_op=False, keep=None):
    """One dispatch/combine as buffer.py makes it, issued from `stream`; returns where its work ran."""
    w.current = stream
    direct = w.order.is_direct(previous_event, async_op, False, False)
    ran = []
    with w.order.launch(previous_event, direct):
        ran.append(w.current)
    w.order.finish(lambda: ran.append(w.current), [], async_op, False, direct, keep)
    return ran


def test_synchronous_calls_on_one_stream_wait_for_nothing(world):
    assert call(world, "A") == ["A", "A"]
    assert call(world, "A") == ["A", "A"]
    assert not [line for line in world.log if "wait" in line or "follow" in line]


def test_a_synchronous_call_on_another_stream_waits_for_the_previous_one(world):
    call(world, "A")
    mark = world.order._done.mark
    world.log.clear()
    assert call(world, "B") == ["B", "B"]
    assert world.log[0] == f"B waits {mark}"


def test_a_synchronous_call_after_an_asynchronous_one_follows_the_comm_stream(world):
    assert call(world, "A", async_op=True) == ["comm", "comm"]
    world.log.clear()
    call(world, "A")
    assert world.log[0] == "A follows comm"


def test_a_comm_stream_call_after_a_synchronous_one_waits_for_it(world):
    call(world, "A")
    mark = world.order._done.mark
    # From the same stream without previous_event: following the current stream is enough.
    world.log.clear()
    call(world, "A", async_op=True)
    assert world.log[0] == "comm follows A" and not any("waits" in line for line in world.log)
    # From another stream, or with a previous_event taken before the synchronous call: it waits for that call too.
    call(world, "A")
    mark = world.order._done.mark
    world.log.clear()
    call(world, "B", async_op=True)
    assert world.log[:2] == ["comm follows B", f"comm waits {mark}"]
    call(world, "A")
    mark = world.order._done.mark
    earlier = FakeEvent([])
    earlier.mark = "A@before"
    world.log.clear()
    call(world, "A", previous_event=SimpleNamespace(event=earlier), async_op=True)
    assert world.log[:2] == ["comm waits A@before", f"comm waits {mark}"]


def test_capture_and_another_device_take_the_comm_stream(world):
    world.capturing = True
    assert call(world, "A") == ["comm", "comm"]
    world.capturing = False
    world.device = 1
    assert call(world, "A") == ["comm", "comm"]


def test_capture_waits_for_nothing_outside_the_graph(world):
    call(world, "A")
    world.capturing = True
    world.log.clear()
    call(world, "B")
    assert world.log[0] == "comm follows B" and not any("waits" in line for line in world.log)


def test_an_asynchronous_call_holds_its_handle_until_its_event_completes(world):
    handle = object()
    call(world, "A", async_op=True, keep=handle)
    (event, held), = world.order._held
    assert held is handle and not event.completed
    call(world, "A")
    assert len(world.order._held) == 1  # still running: kept
    event.completed = True
    call(world, "A")
    assert world.order._held == []
    call(world, "A", keep=handle)  # a synchronous call holds nothing
    assert world.order._held == []


def test_an_error_after_enqueuing_still_marks_the_call(world):
    world.current = "A"
    with pytest.raises(RuntimeError):
        with world.order.launch(None, True):
            raise RuntimeError("out of memory")
    mark = world.order._done.mark
    world.log.clear()
    call(world, "B")
    assert world.log[0] == f"B waits {mark}"
