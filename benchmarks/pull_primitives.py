"""The building blocks of the nvlink pull path, timed alone on 2 GPUs (one short call; rank 0 prints).

Usage: python benchmarks/pull_primitives.py [--rows 4096] [--hidden 7168]
Each line: median of 20 after 3 warm-up, CUDA events around the op, a device barrier before each; GB/s = bytes
moved / time. Rows are BF16 `[rows, hidden]` (58.7 MB at the dsv3 size). Both ranks run each op at once, so the
link carries both directions, as in a dispatch. The "parallel" lines split one pull into parts that run at once on
their own streams: copy-engine copies, or a copy-engine copy beside SMs that read the rest (`index_select`).
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
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
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
    lanes = [torch.cuda.Stream() for _ in range(4)]

    def parallel(*parts):
        """Each part on its own stream, all after the current stream's work; the current stream waits for all."""
        main = torch.cuda.current_stream()
        for lane, part in zip(lanes, parts):
            lane.wait_stream(main)
            with torch.cuda.stream(lane):
                part()
        for lane in lanes[:len(parts)]:
            main.wait_stream(lane)

    def ce(lo, hi):
        return lambda: out[lo:hi].copy_(theirs[lo:hi])

    def sm(lo, hi):
        ident = torch.arange(lo, hi, device="cuda")
        return lambda: torch.index_select(theirs_w, 0, ident, out=out_w[lo:hi])
    half, quarter = rows // 2, rows // 4
    ops = {
        "symm barrier": (lambda: region.barrier(), 0),
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
        "parallel: CE pull in 2 streams": (lambda: parallel(ce(0, half), ce(half, rows)), nbytes),
        "parallel: CE pull in 4 streams": (lambda: parallel(*(ce(q * quarter, (q + 1) * quarter) for q in range(4))),
                                           nbytes),
        "parallel: CE pull 3/4 + SM pull 1/4": (lambda: parallel(ce(0, rows - quarter), sm(rows - quarter, rows)),
                                                nbytes),
        "parallel: CE pull 7/8 + SM pull 1/8": (lambda: parallel(ce(0, rows - rows // 8), sm(rows - rows // 8, rows)),
                                                nbytes),
        "parallel: CE pull 1/2 + SM pull 1/2": (lambda: parallel(ce(0, half), sm(half, rows)), nbytes),
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
