"""Direct launches of compiled Triton kernels (`epcomm.kernels.launch`) against Triton's usual `kernel[grid](...)`,
alternating call by call in one process (eager times on a shared host drift between runs and between machine
instances): full (CPU-synced) dispatch, cached dispatch and combine on nvlink, dsv3 rows (4096 tokens per rank,
hidden 7168, 256 experts, top-8, uniform routing), BF16 non-expand. Wall time of a synchronised call, p50 and p10
of the slower of 2 ranks, 48 calls per mode.

Run on a machine with 2 GPUs: `python benchmarks/direct_launch_ab.py`.
"""

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK = 4096, 7168, 256, 8


def body(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import epcomm
    from epcomm.kernels import launch

    direct = launch._prepare
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                          explicitly_destroy=True, transport="nvlink")
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16().cuda()
    idx = torch.rand(TOKENS, NUM_EXPERTS, generator=gen).topk(NUM_TOPK, dim=1).indices.cuda()
    w = torch.rand(TOKENS, NUM_TOPK, generator=gen).cuda()
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=NUM_EXPERTS)
    y = recv_x.clone()
    calls = {"full dispatch": lambda: buf.dispatch(x, idx, w, num_experts=NUM_EXPERTS),
             "cached dispatch": lambda: buf.dispatch(x, handle=handle, topk_weights=w),
             "combine": lambda: buf.combine(y, handle, topk_weights=recv_w)}
    for name, call in calls.items():
        times = {"direct": [], "usual": []}
        for _ in range(3):
            call()
        for _ in range(12):
            for mode in times:
                launch._prepare = direct if mode == "direct" else (lambda *args: (None, None, None, None))
                for _ in range(4):
                    dist.barrier()
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    call()
                    torch.cuda.synchronize()
                    times[mode].append((time.perf_counter() - start) * 1e6)
        launch._prepare = direct
        every = [None] * world
        dist.all_gather_object(every, times)
        if rank == 0:
            out = []
            for mode in times:
                slower = sorted(max(r[mode][i] for r in every) for i in range(len(times[mode])))
                out.append(f"{mode} p50 {statistics.median(slower):.0f} us, p10 {slower[len(slower) // 10]:.0f} us")
            print(f"{name}: " + " | ".join(out), flush=True)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(body, args=(2, 29597), nprocs=2)
