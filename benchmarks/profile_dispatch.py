"""Profile one dsv3 dispatch/cached dispatch/combine per transport on 2 GPUs: where does the time go?

Usage: python benchmarks/profile_dispatch.py [--transport nvlink] [--tokens 4096] [--expand]
Prints rank 0's torch.profiler table (CPU and CUDA time per op) and the wall time of each call.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import epcomm
from epcomm.routing import make_routing


def run(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(rank)
    idx, w = make_routing("dsv3", args.tokens, generator=gen)
    idx, w = idx.cuda(), w.cuda()
    x = torch.randn(args.tokens, 7168, device="cuda").bfloat16()
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=args.tokens, hidden=7168, num_topk=8,
                          transport=args.transport)

    def calls():
        out = buf.dispatch(x, idx, w, num_experts=256, do_expand=args.expand)
        cached = buf.dispatch(x, handle=out[3], topk_weights=w)
        comb = buf.combine(out[0], out[3], topk_weights=out[2])
        return out, cached, comb

    for _ in range(3):
        calls()
    torch.cuda.synchronize()
    for name, fn in [("full", lambda: buf.dispatch(x, idx, w, num_experts=256, do_expand=args.expand))]:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if rank == 0:
            print(f"{name} dispatch wall {1e6 * (time.perf_counter() - t0):.0f} us")
    dist.barrier()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        if args.only_full:
            buf.dispatch(x, idx, w, num_experts=256, do_expand=args.expand)
        else:
            calls()
        torch.cuda.synchronize()
    if rank == 0:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=40))
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="auto")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--expand", action="store_true")
    p.add_argument("--only-full", action="store_true")
    a = p.parse_args()
    mp.spawn(run, args=(2, a), nprocs=2)
