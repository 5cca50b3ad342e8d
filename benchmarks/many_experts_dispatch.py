"""Full (CPU-synced) dispatch on nvlink with many local experts: 1024 experts on 2 ranks (512 local experts), 4096
tokens per rank, hidden 2048, top-8, uniform routing; expand with alignment 128 and non-expand. The expand plan's
work grows with the number of plan chunks squared times the local experts (recv_plan.plan_chunks bounds it).
Eager p50 / p10 of the slower rank (`epcomm.bench.timing.Timer`).

Run on a machine with 2 GPUs: `python benchmarks/many_experts_dispatch.py [SRC]`, SRC a source tree to import
epcomm from (default: the installed one), to compare two versions on one machine.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK = 4096, 2048, 1024, 8


def body(rank: int, world: int, port: int, src: str) -> None:
    if src:
        sys.path.insert(0, src)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import epcomm
    from epcomm.bench.timing import Timer, combine_ranks, quantile

    device = torch.device("cuda", rank)
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                          explicitly_destroy=True, transport="nvlink")
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16().to(device)
    idx = torch.rand(TOKENS, NUM_EXPERTS, generator=gen).topk(NUM_TOPK, dim=1).indices.to(device)
    w = torch.rand(TOKENS, NUM_TOPK, generator=gen).to(device)
    timer = Timer(dist.group.WORLD, device, iters=20, warmup=3)
    out = []
    for name, kw in (("expand, alignment 128", dict(do_expand=True, expert_alignment=128)), ("non-expand", {})):
        every = [None] * world
        dist.all_gather_object(every, timer.measure(lambda: buf.dispatch(x, idx, w, num_experts=NUM_EXPERTS, **kw)))
        slower = combine_ranks(every)
        out.append(f"{name}: p50 {quantile(slower, 0.5) * 1e6:.0f} us, p10 {quantile(slower, 0.1) * 1e6:.0f} us")
    if rank == 0:
        print(f"epcomm from {os.path.dirname(epcomm.__file__)}: " + " | ".join(out), flush=True)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    source = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else ""
    mp.spawn(body, args=(2, 29599, source), nprocs=2)
