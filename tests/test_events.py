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


def _deferred_event_uses(rank, world):
    """A deferred dispatch's results after a `with` block, and the message after a released event."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=8, hidden=16, num_topk=2)
    gen = torch.Generator().manual_seed(rank)
    x, idx = torch.randn(8, 16, generator=gen), torch.rand(8, 4, generator=gen).topk(2, dim=1).indices
    want = buf.dispatch(x, idx, num_experts=4)[0]
    ev = buf.dispatch(x, idx, num_experts=4, async_with_compute_stream=True, defer_epilogue=True)
    with pytest.warns(UserWarning, match=r"a `with` block's exit ran this deferred call's epilogue and dropped its "
                                         r"results"):
        with ev:
            pass
    out = dict(with_block=ev.wait() is None)  # as DeepEP (reference §3.3): the exit's wait was the first
    ev = buf.dispatch(x, idx, num_experts=4, async_with_compute_stream=True, defer_epilogue=True)
    got = ev.wait()
    out.update(first=torch.equal(got[0], want), second=ev.wait())
    ev = buf.dispatch(x, idx, num_experts=4, async_with_compute_stream=True, defer_epilogue=True)
    out["released"] = torch.equal(ev.current_stream_wait(release_handle=True)[0], want)
    try:
        ev.wait()
    except ValueError as e:
        out["after_release"] = str(e)
    buf.destroy()
    return out


def test_a_with_block_on_a_deferred_event_warns_and_released_events_say_so(run_ranks):
    """(was: `with ev:` dropped the results without a word; a wait after a release said "synchronous")"""
    for out in run_ranks(2, _deferred_event_uses):
        assert out["with_block"] and out["first"] and out["second"] is None and out["released"], out
        assert out["after_release"].startswith("EventOverlap.wait: the event was released by an earlier wait with "
                                               "release_handle=True"), out

