"""`EventHandle()` (reference §3.2): a point on the current stream; a completed marker where there is no CUDA."""

import pytest
import torch

import epcomm
from epcomm.events import EventHandle


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.is_initialized(), reason="CUDA is in use")
def test_event_handle_without_cuda_is_a_completed_marker():
    ev = EventHandle()
    assert ev.event is None and ev.query()
    ev.current_stream_wait()  # a no-op
    assert epcomm.EPBuffer.capture().event is None and EventHandle.completed().event is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_event_handle_records_on_the_current_stream():
    """(was: a completed marker, so a stream that waited on it did not wait)"""
    torch.cuda.init()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time on the current stream
    ev = EventHandle()
    assert ev.event is not None and not ev.query()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ev.current_stream_wait()
        done = torch.ones(1, device="cuda")
    side.synchronize()
    assert ev.query() and done.item() == 1
    assert epcomm.EPBuffer.capture().event is not None
