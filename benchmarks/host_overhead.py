"""Host time against device time of one full dispatch, one cached dispatch and one combine on 2 GPUs (rank 0
prints).

Usage: python benchmarks/host_overhead.py [--transport nvlink] [--tokens 4096] [--out DIR]
For each op: the wall time of a synchronised call, the host time to enqueue it (the call returns before the
device finishes), the device time (CUDA events around the call), then the top Python functions by own time and
epcomm's functions by cumulative time (cProfile, 20 calls) and the device kernels by total time (torch.profiler, 5
calls). A call is host-bound when its enqueue time is close to its wall time.
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import epcomm
from epcomm.routing import make_routing


def run(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29558")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    gen = torch.Generator().manual_seed(rank)
    idx, w = make_routing("dsv3", args.tokens, generator=gen)
    idx, w = idx.cuda(), w.cuda()
    x = torch.randn(args.tokens, 7168, device="cuda").bfloat16()
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=args.tokens, hidden=7168, num_topk=8,
                          transport=args.transport)
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=256)
    ops = {
        "full dispatch": lambda: buf.dispatch(x, idx, w, num_experts=256),
        "cached dispatch": lambda: buf.dispatch(x, handle=handle, topk_weights=w),
        "combine": lambda: buf.combine(recv_x, handle, topk_weights=recv_w),
    }
    report = []
    for name, fn in ops.items():
        for _ in range(5):
            fn()
        walls, enqueues, devices = [], [], []
        for _ in range(20):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            fn()
            t1 = time.perf_counter()
            end.record()
            end.synchronize()
            t2 = time.perf_counter()
            walls.append((t2 - t0) * 1e6)
            enqueues.append((t1 - t0) * 1e6)
            devices.append(start.elapsed_time(end) * 1e3)
        report.append(f"== {name}: wall {statistics.median(walls):.0f} us, host enqueue "
                      f"{statistics.median(enqueues):.0f} us, device {statistics.median(devices):.0f} us")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            fn()
            torch.cuda.synchronize()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats("epcomm", 45)
        report.append(text.getvalue())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                fn()
                torch.cuda.synchronize()
        report.append(p.key_averages().table(sort_by="cuda_time_total", row_limit=20))
    if rank == 0:
        text = "\n".join(report)
        print(text[:12000], flush=True)
        if args.out:
            with open(os.path.join(args.out, f"host_overhead_{args.transport}.txt"), "w") as f:
                f.write(text)
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="nvlink")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--out", default="")
    mp.spawn(run, args=(2, p.parse_args()), nprocs=2)
