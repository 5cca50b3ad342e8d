"""Where the time of an eager call goes, host and device together: the torch.profiler trace (CPU and CUDA) of the
last of 3 calls of a full dispatch, a cached dispatch and a combine (dsv3 shape, non-expand BF16, nvlink, rank 0).
Each line is a host range (`epcomm::` phases), a host call into the CUDA runtime (launches, copies, syncs; the
event polls of a bounded wait are counted, not listed) or a device kernel / copy, with its start in us from the
call's first event and its duration, so a device that waits for the host shows as a gap between device lines.
The profiler adds a few us of host time to each recorded op.

Run on a machine with 2 GPUs: `python benchmarks/eager_timeline.py`.
"""

import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dsv3_handle import NUM_EXPERTS, start

_RUNTIME_SHOWN = ("Launch", "Memcpy", "Synchronize", "Memset")


def call_events(trace: dict) -> list:
    """`(start_us, duration_us, where, name)` of the last `call` range and everything after its start."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    calls = [e for e in events if e.get("name") == "call" and e.get("cat") == "user_annotation"]
    t0 = calls[-1]["ts"]
    out, polls = [], 0
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["ts"] < t0:
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat == "cuda_runtime" and "EventQuery" in name:
            polls += 1
            continue
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            where = "device"
        elif cat == "user_annotation" and name.startswith("epcomm::"):
            where = "host"
        elif cat == "cuda_runtime" and any(k in name for k in _RUNTIME_SHOWN):
            where = "host"
        else:
            continue
        out.append((e["ts"] - t0, e.get("dur", 0.0), where, name))
    out.append((0.0, 0.0, "host", f"({polls} event polls)"))
    return out


def body(rank: int, world: int, port: int) -> None:
    buf, x, handle, y = start(rank, world, port)
    topk_idx = handle.topk_idx
    lines = []
    for label, fn in (("full dispatch", lambda: buf.dispatch(x, topk_idx, num_experts=NUM_EXPERTS)),
                      ("cached dispatch", lambda: buf.dispatch(x, handle=handle)),
                      ("combine", lambda: buf.combine(y, handle))):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                dist.barrier()
                torch.cuda.synchronize()
                with torch.profiler.record_function("call"):
                    fn()
                torch.cuda.synchronize()
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = call_events(json.load(f))
        span = max((s + d for s, d, where, _ in events if where == "device"), default=0.0)
        lines.append(f"== {label}: device busy until {span:.1f} us")
        lines += [f"  {s:8.1f} +{d:7.1f}  {where:6s} {name[:90]}" for s, d, where, name in sorted(events)]
    if rank == 0:
        print("\n".join(lines), flush=True)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(body, args=(2, 29597), nprocs=2)
