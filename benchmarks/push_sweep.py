"""Time the push kernel alone on 2 GPUs (dsv3 BF16 rows) across grid/block/warp choices, beside the copy engine.

Usage: python benchmarks/push_sweep.py. Prints one line per configuration: median of 20 launches (CUDA events).
"""

import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from epcomm.kernels.push import push_rows, region_deltas
from epcomm.records import Field, RecordSpec
from epcomm.transport.symm import SymmetricRegion


def timed(fn, n=20):
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def run(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29557")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    tokens, hidden = 4096, 7168
    spec = RecordSpec([Field("x", torch.bfloat16, (hidden,)), Field("w", torch.float32, (8,))])
    region = SymmetricRegion(dist.group.WORLD, world * tokens * spec.nbytes + (1 << 16), torch.device("cuda", rank))
    delta16 = region_deltas(region.ptrs, rank)
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    w = torch.rand(tokens, 8, device="cuda")
    src = torch.arange(tokens, device="cuda").repeat(world)  # every token to every rank: 2 x 58.7 MB
    sms = torch.cuda.get_device_properties(rank).multi_processor_count
    lines = []
    for programs in (sms, 2 * sms, 4 * sms):
        for block in (1024, 2048):
            for warps in (4, 8, 16):
                t = timed(lambda: push_rows(region.local, delta16, 0, spec, {"x": x, "w": w}, src, tokens, rank,
                                            num_programs=programs, block=block, num_warps=warps))
                lines.append(f"push programs={programs} block={block} warps={warps}: {t:7.1f} us "
                             f"({tokens * hidden * 2 / t / 1e3:.0f} GB/s to the peer)")
    peer = region.peer(1 - rank, 0, (tokens * hidden,), torch.bfloat16)
    lines.append(f"copy engine x -> peer: {timed(lambda: peer.copy_(x.view(-1))):.1f} us")
    idx = torch.arange(world * tokens, device="cuda")
    area = region.local[: world * tokens * spec.nbytes].view(world * tokens, spec.nbytes)[:, : hidden * 2]
    lines.append(f"copy-out index_select 8192 rows: {timed(lambda: area.index_select(0, idx)):.1f} us")
    lines.append(f"device barrier: {timed(lambda: region.barrier()):.1f} us")
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2,), nprocs=2)
