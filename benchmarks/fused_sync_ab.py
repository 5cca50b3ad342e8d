"""In-process A/B of the barrier inside the pull's gather, the publish inside the fused dispatch's send plan and the
per-expert totals inside its plan kernel (`new`) against a launch of their own each (`old`; `pull._GATHER_BARRIER`,
`exact_nvlink._FUSED_PUBLISH`, `recv_plan._TOTALS_IN_ROWS`), one rank, nvlink, dsv3 rows (4096 tokens, hidden
7168, 256 experts, top-8, BF16, weights): full dispatch, cached dispatch and combine (unchanged: the control). The modes alternate in blocks of 4 calls in one process (processes on
a shared host differ by up to 2x); outputs are compared bitwise first. Host time = the calling thread's CPU time of
a call after a device synchronisation; wall also waits for the device.

Run from the repository root on one GPU: `python benchmarks/fused_sync_ab.py`
(benchmarks/results/host-s21_H200_2026-12-02.md).
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from epcomm import exact_nvlink, recv_plan
from epcomm.transport import pull

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_wall import dsv3_ops  # noqa: E402

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29667")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
buf, ops = dsv3_ops(0)


def use(fused):
    pull._GATHER_BARRIER = exact_nvlink._FUSED_PUBLISH = recv_plan._TOTALS_IN_ROWS = fused


def flat(out):
    ts = []
    for o in out if isinstance(out, tuple) else (out,):
        if isinstance(o, torch.Tensor):
            ts.append(o)
        elif isinstance(o, tuple):
            ts += [t for t in o if isinstance(t, torch.Tensor)]
        elif hasattr(o, "__dataclass_fields__"):
            ts += [getattr(o, f) for f in o.__dataclass_fields__ if isinstance(getattr(o, f, None), torch.Tensor)]
    return ts


for name in ("full", "cached", "combine"):
    fn = ops[name]
    res = {}
    for fused in (False, True):
        use(fused)
        res[fused] = [t.clone() for t in flat(fn())]
    same = len(res[False]) == len(res[True]) and all(torch.equal(a, b) for a, b in zip(res[False], res[True]))
    print(f"{name}: {len(res[True])} output tensors, old == new bitwise: {same}", flush=True)
    times = {"old": [], "new": []}
    walls = {"old": [], "new": []}
    modes = [("old", False), ("new", True)]
    for block in range(20):
        for label, fused in modes[block % 2:] + modes[:block % 2]:
            use(fused)
            for _ in range(4):
                torch.cuda.synchronize()
                t0, c0 = time.perf_counter(), time.thread_time()
                fn()
                times[label].append((time.thread_time() - c0) * 1e6)
                torch.cuda.synchronize()
                walls[label].append((time.perf_counter() - t0) * 1e6)
    med = {k: statistics.median(v) for k, v in times.items()}
    p20 = {k: statistics.quantiles(v, n=5)[0] for k, v in times.items()}
    wmed = {k: statistics.median(v) for k, v in walls.items()}
    print(f"inproc {name:8s} host (thread time) old {med['old']:5.0f} (p20 {p20['old']:.0f})  new {med['new']:5.0f} "
          f"(p20 {p20['new']:.0f})  {100 * (med['new'] - med['old']) / med['old']:+.0f}%;  wall to device done old "
          f"{wmed['old']:5.0f} new {wmed['new']:5.0f} us", flush=True)

# The sync-free dispatch at decode size (128 tokens) in CUDA graphs of 8 calls, one graph per mode, replays alternating.
import epcomm  # noqa: E402
from epcomm.routing import make_routing  # noqa: E402

small = epcomm.EPBuffer(None, num_max_tokens_per_rank=128, hidden=7168, num_topk=8, explicitly_destroy=True)
idx, w = make_routing("dsv3", 128, generator=torch.Generator().manual_seed(3))
idx, w, x = idx.cuda(), w.cuda(), torch.randn(128, 7168, device="cuda").bfloat16()
graphs = {}
for label, fused in (("old", False), ("new", True)):
    use(fused)
    for _ in range(3):
        small.dispatch(x, idx, w, num_experts=256, do_cpu_sync=False)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(8):
            small.dispatch(x, idx, w, num_experts=256, do_cpu_sync=False)
    graphs[label] = g
replay = {"old": [], "new": []}
for i in range(60):
    for label in (("old", "new") if i % 2 else ("new", "old")):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs[label].replay()
        end.record()
        end.synchronize()
        replay[label].append(start.elapsed_time(end) * 1e3 / 8)
print("graph sync-free dispatch, 128 tokens, per call in graphs of 8: " + ", ".join(
    f"{k} p50 {statistics.median(v):.1f} us (p20 {statistics.quantiles(v, n=5)[0]:.1f})" for k, v in replay.items()),
    flush=True)
del graphs
small.destroy()
use(True)
buf.destroy()
dist.destroy_process_group()
