"""The building blocks of the nvlink pull path, timed alone on 2 GPUs (one short call; rank 0 prints).

Usage: python benchmarks/pull_primitives.py [--rows 4096] [--hidden 7168]
Each line: median of 20 after 3 warm-up, CUDA events around the op, a device barrier before each; GB/s = bytes
moved / time. Rows are BF16 `[rows, hidden]` (58.7 MB at the dsv3 size).
"""

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29557", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    from epcomm.transport.symm import SymmetricRegion

    rows, hidden = args.rows, args.hidden
    nbytes = rows * hidden * 2
    region = SymmetricRegion(dist.group.WORLD, 2 * nbytes, torch.device("cuda", rank))
    peer = 1 - rank
    local = torch.randn(rows, hidden, device="cuda").bfloat16()
    out = torch.empty_like(local)
    mine = region.peer(rank, 0, (rows, hidden), torch.bfloat16)
    mine.copy_(local)
    theirs = region.peer(peer, 0, (rows, hidden), torch.bfloat16)
    theirs_w = region.peer(peer, 0, (rows, hidden * 2 // 8), torch.int64)
    idx = torch.randperm(rows, device="cuda")
    words, out_w = local.view(torch.int64), out.view(torch.int64)
    ops = {
        "symm barrier": (lambda: region.barrier(0), 0),
        "CE pull (copy_ from peer view)": (lambda: out.copy_(theirs), nbytes),
        "CE push (copy_ into peer view)": (lambda: region.peer(peer, nbytes, (rows, hidden), torch.bfloat16)
                                           .copy_(local), nbytes),
        "SM pull (index_select int64 from peer)": (lambda: torch.index_select(theirs_w, 0, idx, out=out_w), nbytes),
        "SM pull (contiguous clone via [:] index)": (lambda: out_w.copy_(theirs_w.index_select(0, idx)), nbytes),
        "local gather index_select int64": (lambda: torch.index_select(words, 0, idx, out=out_w), nbytes),
        "local gather index_select bf16": (lambda: torch.index_select(local, 0, idx, out=out), nbytes),
        "local gather index_select uint8": (lambda: torch.index_select(local.view(torch.uint8), 0, idx,
                                                                      out=out.view(torch.uint8)), nbytes),
        "local copy_ (D2D)": (lambda: out.copy_(local), nbytes),
    }
    lines = []
    for name, (fn, moved) in ops.items():
        times = []
        for it in range(23):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            if it >= 3:
                times.append(start.elapsed_time(end) * 1e3)
        med = statistics.median(times)
        gbs = f"{moved / med / 1e3:8.1f} GB/s" if moved else ""
        lines.append(f"rank {rank} {name:44s} {med:9.1f} us {gbs}")
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    mp.spawn(run, args=(2, p.parse_args()), nprocs=2)
