"""The fused sync-free dispatch (`epcomm.syncfree_nvlink`) against the generic sync-free path, by size: per-call p50
of `dispatch(do_cpu_sync=False)` in a CUDA graph (`epcomm.bench.timing.Timer.measure_graph`, one call per graph
and 8 per graph), slower of 2 ranks, dsv3 rows (hidden 7168, 256 experts, top-8, uniform routing), T = N tokens per
rank. Also the combine of the resulting handle (`combine_send` on the fused path, pack + copy-engine writes on the
generic one; the same reduction) and a cached dispatch on it (graph of 1 / graph of 8).

Run on a machine with 2 GPUs: `python benchmarks/syncfree_sweep.py [N ...]`. The default of
`EPCOMM_FUSED_SYNC_FREE_ROWS` (envs.py) comes from this sweep (docs/benchmarks.md).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, NUM_EXPERTS, NUM_TOPK = 7168, 256, 8
REPLAYS, WARMUP = 30, 5
CASES = (("bf16", False), ("bf16", True), ("fp8", False))  # (dtype, expand)


def body(rank: int, world: int, port: int, sizes: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import epcomm
    from epcomm.bench.timing import Timer, quantile
    from epcomm.fp8 import per_token_cast_to_fp8

    timer = Timer(dist.group.WORLD, torch.device("cuda", rank), REPLAYS, WARMUP)

    def p50_us(fn, calls) -> float:
        return quantile(timer.measure_graph(fn, calls=calls), 0.5) * 1e6

    lines = []
    for n in sizes:
        buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=n, hidden=HIDDEN, num_topk=NUM_TOPK,
                              explicitly_destroy=True, transport="nvlink")
        gen = torch.Generator().manual_seed(rank + n)
        x16 = torch.randn(n, HIDDEN, generator=gen).bfloat16().cuda()
        idx = torch.rand(n, NUM_EXPERTS, generator=gen).topk(NUM_TOPK, dim=1).indices.cuda()
        w = torch.rand(n, NUM_TOPK, generator=gen).cuda()
        for dtype, expand in CASES:
            x = per_token_cast_to_fp8(x16.float()) if dtype == "fp8" else x16
            row = []
            for path, rows in (("fused", str(1 << 30)), ("generic", "0")):
                os.environ["EPCOMM_FUSED_SYNC_FREE_ROWS"] = rows

                def dispatch():
                    return buf.dispatch(x, idx, w, num_experts=NUM_EXPERTS, do_cpu_sync=False, do_expand=expand)
                out = dispatch()
                y = (out[0][0].float() if dtype == "fp8" else out[0]).bfloat16()
                handle = out[3]

                def cached():
                    return buf.dispatch(x, handle=handle, topk_weights=w)
                t = torch.tensor([p50_us(dispatch, 1), p50_us(dispatch, 8),
                                  p50_us(lambda: buf.combine(y, handle, topk_weights=None if expand else out[2]), 1),
                                  p50_us(cached, 1), p50_us(cached, 8)], device="cuda")
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                row.append(f"{path} {t[0]:.1f} / {t[1]:.1f} us (combine {t[2]:.1f}, cached {t[3]:.1f} / {t[4]:.1f})")
            os.environ.pop("EPCOMM_FUSED_SYNC_FREE_ROWS")
            lines.append(f"N=T={n} R*N={world * n} {dtype} {'expand' if expand else 'non-expand'}: "
                         + "; ".join(row))
        buf.destroy()
    if rank == 0:
        print("dispatch(do_cpu_sync=False) per call, p50 of the slower rank, graph of 1 / graph of 8 calls")
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sizes = [int(v) for v in sys.argv[1:]] or [1, 32, 128, 256, 512, 1024, 2048]
    mp.spawn(body, args=(2, 29541, sizes), nprocs=2)
