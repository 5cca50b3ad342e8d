"""`EPCOMM_DEBUG=1` logging: sizes, choices and counts, one line per event, to the `epcomm` logger (stderr)."""

from __future__ import annotations

import contextlib
import logging
import time
from contextlib import contextmanager

import torch

from . import envs

logger = logging.getLogger("epcomm")


def _ensure_handler() -> None:
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[epcomm] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)


def log(msg: str) -> None:
    if envs.debug_enabled():
        _ensure_handler()
        logger.debug(msg)


def log_dispatch(buf, call, launched: dict) -> None:
    """Per-call counts: tokens sent to and received from each rank (host values only; no extra sync)."""
    if not envs.debug_enabled():
        return
    sent = launched.get("send_splits")
    recv = launched.get("recv_splits")
    layout = "expand" if call.do_expand else "non-expand"
    kind = "cached" if call.handle is not None else ("cpu-sync" if call.do_cpu_sync else "sync-free")
    kind += " fused" if launched.get("fused") else ""
    log(f"dispatch rank {buf.rank}: {kind} {layout}, T={call.x.num_tokens}, H={call.x.hidden}, "
        f"K={call.topk_idx.shape[1]}, dtype={call.x.data.dtype}, sent per rank={sent}, received per rank={recv}")


_phase_times: dict = {}


_NO_RANGE = contextlib.nullcontext()
# Read once, at import: a call enters a dozen phases, and each read of the environment costs host time.
_PHASE_TIMES = envs.phase_times_enabled(strict=False)  # read at import, which must not fail: EPBuffer checks it


def phase(name: str):
    """A profiler range (only while a profiler records: a range costs host time on every call); with
    `EPCOMM_PHASE_TIMES=1` (read when epcomm is imported) also the phase's wall time (device synchronised at both
    ends) accumulated in `phase_times()` -- a diagnostic that serialises the GPU, never for production."""
    if _PHASE_TIMES:
        return _timed_phase(name)
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"epcomm::{name}")
    return _NO_RANGE


@contextmanager
def _timed_phase(name: str):
    with torch.profiler.record_function(f"epcomm::{name}"):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        _phase_times[name] = _phase_times.get(name, 0.0) + time.perf_counter() - start


def phase_times(reset: bool = True) -> dict:
    """Seconds spent per phase since the last reset (see `phase`)."""
    out = dict(_phase_times)
    if reset:
        _phase_times.clear()
    return out
