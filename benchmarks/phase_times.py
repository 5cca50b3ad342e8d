"""Where a dispatch/combine spends its time, phase by phase, on 2 GPUs (EPCOMM_PHASE_TIMES=1 diagnostics).

Usage: python benchmarks/phase_times.py [--transport nvlink] [--tokens 4096] [--expand]
Each phase is timed with the device synchronised at both ends, so the sum exceeds a real call; the split says
which phase to attack. Prints rank 0 and rank 1, median over 10 calls, in microseconds.
"""

import argparse
import os
import statistics

os.environ["EPCOMM_PHASE_TIMES"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import epcomm  # noqa: E402
from epcomm.debug import phase_times  # noqa: E402
from epcomm.routing import make_routing  # noqa: E402


def run(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29556")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(rank)
    idx, w = make_routing("dsv3", args.tokens, generator=gen)
    idx, w = idx.cuda(), w.cuda()
    x = torch.randn(args.tokens, 7168, device="cuda").bfloat16()
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=args.tokens, hidden=7168, num_topk=8,
                          transport=args.transport)
    samples = {}
    for it in range(13):
        dist.barrier()
        torch.cuda.synchronize()
        phase_times()
        out = buf.dispatch(x, idx, w, num_experts=256, do_expand=args.expand)
        full = phase_times()
        buf.dispatch(x, handle=out[3], topk_weights=w)
        cached = phase_times()
        buf.combine(out[0], out[3], topk_weights=out[2])
        comb = phase_times()
        if it >= 3:
            for tag, d in (("full", full), ("cached", cached), ("combine", comb)):
                for k, v in d.items():
                    samples.setdefault(f"{tag}:{k}", []).append(v * 1e6)
    lines = [f"rank {rank} {k:32s} {statistics.median(v):9.0f} us" for k, v in sorted(samples.items())]
    print("\n".join(lines), flush=True)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="auto")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--expand", action="store_true")
    a = p.parse_args()
    mp.spawn(run, args=(2, a), nprocs=2)
