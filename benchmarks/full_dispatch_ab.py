"""The fused CPU-synced dispatch (`epcomm.exact_nvlink`) against the generic CPU-synced path, beside a cached
dispatch on the same handle: eager per-call p50 (CUDA events around the Python call, `epcomm.bench.timing.Timer`),
slower of 2 ranks, dsv3 rows (4096 tokens per rank, hidden 7168, 256 experts, top-8, uniform routing) on nvlink.
Cases: BF16 and FP8 non-expand, BF16 expand with alignment 128. The two paths alternate twice
(`EPCOMM_FUSED_EXACT=1` / `0`), since eager times on a shared host drift between runs.

Run on a machine with 2 GPUs: `python benchmarks/full_dispatch_ab.py`.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK = 4096, 7168, 256, 8
CASES = (("bf16 non-expand", "bf16", {}), ("fp8 non-expand", "fp8", {}),
         ("bf16 expand, alignment 128", "bf16", dict(do_expand=True, expert_alignment=128)))


def body(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import epcomm
    from epcomm.bench.timing import Timer, combine_ranks, quantile
    from epcomm.fp8 import per_token_cast_to_fp8

    device = torch.device("cuda", rank)
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                          explicitly_destroy=True, transport="nvlink")
    gen = torch.Generator().manual_seed(rank)
    x_bf16 = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16().to(device)
    inputs = {"bf16": x_bf16, "fp8": per_token_cast_to_fp8(x_bf16.float())}
    topk_idx = torch.rand(TOKENS, NUM_EXPERTS, generator=gen).topk(NUM_TOPK, dim=1).indices.to(device)
    weights = torch.rand(TOKENS, NUM_TOPK, generator=gen).to(device)
    timer = Timer(dist.group.WORLD, device, iters=20, warmup=5)

    def p50_us(fn) -> float:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, timer.measure(fn))
        return quantile(combine_ranks(per_rank), 0.5) * 1e6

    for name, dtype, kw in CASES:
        x = inputs[dtype]
        handle = buf.dispatch(x, topk_idx, weights, num_experts=NUM_EXPERTS, **kw)[3]
        results = {}
        for _ in range(2):
            for label, fused in (("full fused", "1"), ("full generic", "0")):
                os.environ["EPCOMM_FUSED_EXACT"] = fused
                results.setdefault(label, []).append(p50_us(
                    lambda: buf.dispatch(x, topk_idx, weights, num_experts=NUM_EXPERTS, **kw)))
            os.environ.pop("EPCOMM_FUSED_EXACT")
            results.setdefault("cached", []).append(p50_us(
                lambda: buf.dispatch(x, handle=handle, topk_weights=weights)))
        if rank == 0:
            print(f"{name}: " + " | ".join(f"{label} {', '.join(f'{v:,.0f}' for v in values)} us"
                                           for label, values in results.items()), flush=True)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(body, args=(2, 29581), nprocs=2)
