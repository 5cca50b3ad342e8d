"""How every time in `epcomm-bench` is taken (docs/benchmarks.md, "Time" and "Graph replay").

Before each call (warm-up and timed alike): on GPU, write a 256 MB buffer (evicts L2) and synchronise; then a
barrier over the group, so that every rank starts the call together. The call is timed around the Python call:
CUDA events on the current stream on GPU (read after the loop), `time.perf_counter` on CPU. Warm-up calls are
dropped. `measure_graph` times replays of a CUDA graph of the call the same way. The ranks' times are combined per call by `combine_ranks` (the slowest rank ends a collective).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

L2_FLUSH_BYTES = 256 * 1000 * 1000


class Timer:
    """Times a callable on one rank of `group` (collective: every rank times the same calls in the same order).

    Args:
        group: the process group to barrier on.
        device: the rank's device (cpu or cuda:i).
        iters: timed calls.
        warmup: untimed calls before them.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, iters: int, warmup: int):
        self.group, self.device, self.iters, self.warmup = group, device, iters, warmup
        self.cuda = device.type == "cuda"
        self._flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if self.cuda else None

    def barrier(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group, device_ids=[self.device.index])
            torch.cuda.synchronize(self.device)
        else:
            dist.barrier(group=self.group)

    def measure(self, fn: Callable[[], object]) -> list:
        """Seconds of each of `iters` calls of `fn` after `warmup` calls."""
        times, events = [], []
        for _ in range(self.warmup + self.iters):
            if self._flush is not None:
                self._flush.zero_()
            self.barrier()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                events.append((start, end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            times = [s.elapsed_time(e) * 1e-3 for s, e in events]
        return times[self.warmup:]


    def measure_graph(self, fn: Callable[[], object], calls: int = 1) -> list:
        """Seconds per call of `fn`, from replays of a CUDA graph that captured `calls` calls back to back (GPU only;
        same protocol as `measure`). With `calls=1`: what a caller who captures the call alone pays. With more, the
        replay's launch latency and the ranks' start skew after the barrier are shared by the calls, as in a decode
        step that captures every layer in one graph."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # kernels compiled and allocator pools warm before the capture
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return [t / calls for t in self.measure(graph.replay)]


def combine_ranks(per_rank: list) -> list:
    """Per-call time of the group: the slowest rank's time of each call."""
    return [max(ts) for ts in zip(*per_rank)]


def quantile(values: list, q: float) -> float:
    """Linear-interpolated quantile of a non-empty list (q in [0, 1])."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
