"""Host time of eager calls (full and cached dispatch, combine with and without weights back), for A/B runs of
host-side changes: run it once per source tree, alternating, on one machine (eager times on a shared host drift).

Usage: PYTHONPATH=<tree>/src python benchmarks/host_wall.py [--ranks 2] [--label new] [--port 29620]
The dsv3 shape (4096 tokens, hidden 7168, 256 experts, top-8), BF16, the default transport. Each call starts after a
device synchronisation and a barrier; the line gives, per op, the median over 25 calls of the wall time of the
Python call and of the calling thread's CPU time (`time.thread_time`), in us. When both agree the call is bound by
host work, and the CPU time is the figure that other processes on the host disturb least.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def dsv3_ops(rank: int) -> tuple:
    """A buffer of the dsv3 shape and the eager calls to time on it (name -> call), after one full dispatch."""
    import epcomm
    from epcomm.routing import make_routing

    idx, w = make_routing("dsv3", 4096, generator=torch.Generator().manual_seed(rank))
    idx, w = idx.cuda(), w.cuda()
    x = torch.randn(4096, 7168, device="cuda").bfloat16()
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=4096, hidden=7168, num_topk=8)
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=256)
    return buf, {"full": lambda: buf.dispatch(x, idx, w, num_experts=256),
                 "cached": lambda: buf.dispatch(x, handle=handle, topk_weights=w),
                 "combine": lambda: buf.combine(recv_x, handle),
                 "combine-w": lambda: buf.combine(recv_x, handle, topk_weights=recv_w)}


def body(rank: int, world: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    buf, ops = dsv3_ops(rank)
    line = []
    for name, fn in ops.items():
        for _ in range(5):
            fn()
        walls, cpus = [], []
        for _ in range(25):
            dist.barrier()
            torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            walls.append((time.perf_counter() - t0) * 1e6)
            cpus.append((time.thread_time() - c0) * 1e6)
            torch.cuda.synchronize()
        line.append(f"{name} {statistics.median(walls):5.0f}/{statistics.median(cpus):5.0f}")
    print(f"{args.label} rank {rank} (wall/cpu us): " + "  ".join(line), flush=True)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--label", default="")
    parser.add_argument("--port", type=int, default=29620)
    args = parser.parse_args()
    mp.spawn(body, args=(args.ranks, args), nprocs=args.ranks)
