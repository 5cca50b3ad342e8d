"""`EventHandle` and `EventOverlap`: the stream/event protocol (DeepEP V2.5 EPBuffer behaviour, §3.2-3.5).

On CUDA an `EventHandle` is a recorded `torch.cuda.Event`. On CPU every operation is already complete when it
returns, so an `EventHandle` is a completed marker and waiting on it is a no-op (docs/decisions.md "Events on CPU");
the rest of the contract (first wait returns the deferred results, second wait returns None) is unchanged.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch

from .compile_guard import eager_under_compile


class EventHandle:
    """A point on a stream that another stream can wait for.

    Args:
        device: the device whose current stream is captured; CPU gives a completed marker. Default: the current
            CUDA device once CUDA is initialized (reference §3.2: `EventHandle()` records on the current stream),
            else CPU.
        stream: record on this CUDA stream instead of the current one.
    """

    def __init__(self, device: Optional[torch.device] = None, stream: Optional["torch.cuda.Stream"] = None):
        self.event: Optional[torch.cuda.Event] = None
        if device is None and stream is None:
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        device = torch.device(device) if device is not None else None
        if stream is not None or (device is not None and device.type == "cuda"):
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream(device))

    @classmethod
    def completed(cls) -> "EventHandle":
        """A completed marker (what CPU calls return: their work is done when they return)."""
        return cls(torch.device("cpu"))

    @eager_under_compile
    def current_stream_wait(self) -> None:
        """Make the current stream wait for this point (no-op on CPU)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def query(self) -> bool:
        """True when the work before this point has finished."""
        return self.event is None or self.event.query()


class EventOverlap:
    """What dispatch/combine return as their event: wait on it before using asynchronous results.

    Fields:
        event: `EventHandle` or None (None for synchronous calls; waiting on it then raises).
        extra_tensors: tensors kept alive until the event is dropped (legacy; None).
        hook_after_wait: called once by the first wait; its value is returned by that wait (deferred epilogue).

    `with event:` waits when the block ends (`with event(release_handle=True):` then drops the event); for a deferred
    call that is its first wait, whose results are dropped (reference §3.3), with a warning.
    """

    def __init__(
        self,
        event: Optional[EventHandle] = None,
        extra_tensors: Optional[tuple] = None,
        hook_after_wait: Optional[Callable[[], Any]] = None,
    ):
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait = hook_after_wait
        self._release_on_exit = False
        self._released = False  # a wait with release_handle=True dropped the event
        self._failed: Optional[BaseException] = None  # what the deferred epilogue raised at the first wait

    def register_hook_after_wait(self, hook: Callable[[], Any]) -> None:
        """Register the function the next wait calls; at most one at a time.

        Raises:
            ValueError: a hook is already registered.
        """
        if self.hook_after_wait is not None:
            raise ValueError("EventOverlap.register_hook_after_wait: a hook is already registered; wait first")
        self.hook_after_wait = hook

    @eager_under_compile
    def current_stream_wait(self, release_handle: bool = False) -> Any:
        """Make the current stream wait for the event, then run the hook once and return its value.

        Args:
            release_handle: drop the event afterwards.

        Returns:
            The hook's value on the first wait of a deferred call (the results tuple), else None.

        Raises:
            ValueError: the event is None (the call was synchronous; there is nothing to wait for).
        """
        return self._wait("current_stream_wait", release_handle)

    @eager_under_compile
    def wait(self) -> Any:
        """Same as `current_stream_wait()`.

        Raises:
            ValueError: the event is None (the call was synchronous; there is nothing to wait for).
        """
        return self._wait("wait", False)

    def _wait(self, method: str, release_handle: bool) -> Any:
        if self._failed is not None:  # its results are lost: say so again rather than return None
            raise ValueError(f"EventOverlap.{method}: the first wait of this event raised "
                             f"{type(self._failed).__name__}: {self._failed}") from self._failed
        if self.event is None:
            if self._released:
                raise ValueError(f"EventOverlap.{method}: the event was released by an earlier wait with "
                                 "release_handle=True (current_stream_wait or a `with event(release_handle=True)` "
                                 "block); there is nothing left to wait for")
            raise ValueError(
                f"EventOverlap.{method}: event is None (the call was synchronous); "
                "pass async_with_compute_stream=True (async_finish=True for the low-latency calls) to get an event to "
                "wait on"
            )
        self.event.current_stream_wait()
        hook, self.hook_after_wait = self.hook_after_wait, None
        try:
            result = hook() if hook is not None else None
        except BaseException as e:
            self._failed = e
            raise
        if release_handle:
            self.event, self._released = None, True
        return result

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        if self.event is not None:
            if self.hook_after_wait is not None:  # as DeepEP: the exit's wait is the first one, its value is lost
                warnings.warn("EventOverlap: a `with` block's exit ran this deferred call's epilogue and dropped its "
                              "results (reference §3.3: a later wait() gets None, or raises if the block released "
                              "the event); call ev.wait() to get them", stacklevel=2)
            self.current_stream_wait(release_handle=self._release_on_exit)
        self._release_on_exit = False
