"""The nvlink low-latency kernels' program shapes against time: per-call p50 in a CUDA graph of 8 calls
(`epcomm.bench.timing.Timer.measure_graph`), slower of 2 ranks, at 1 / 128 / 256 tokens per rank (dsv3-decode shape,
FP8 dispatch, BF16 combine).

`EPCOMM_LL_SWEEP_CALLS=8,32` also times graphs of 32 calls and splits the time of a replay into a per-call part
(the slope between the two graph sizes: the kernels' own time) and a fixed part per replay (launch latency and the
ranks' start skew after the host barrier), so that a change in one is not read as a change in the other.
`EPCOMM_LL_SWEEP_TOKENS=128` times one token count.

Run on a machine with 2 GPUs: `python benchmarks/lowlatency_sweep.py` (`EPCOMM_LL_SWEEP_RANKS=1`: one GPU, one
rank). Each row sets the module constants of `epcomm.lowlatency_nvlink` (blocks of 128 channels per dispatch item,
combine rows per item, fused programs per SM, programs per SM that send the fused combine's rows for other ranks);
the defaults there came from this sweep (benchmarks/results/decode-ll_2xH200-NV18_2026-11-30.md).
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, NUM_EXPERTS, NUM_TOPK = 7168, 256, 8
REPLAYS, WARMUP = 40, 5
TOKENS = tuple(int(t) for t in os.environ.get("EPCOMM_LL_SWEEP_TOKENS", "1,128,256").split(","))
GRAPH_SIZES = tuple(int(c) for c in os.environ.get("EPCOMM_LL_SWEEP_CALLS", "8").split(","))
# (blocks/item, rows/item, programs/SM, combine senders/SM)
SHAPES = ((32, 2, 8, 2), (32, 4, 8, 2), (32, 4, 2, 2), (16, 2, 2, 2), (16, 4, 1, 1))
SENDERS = ((32, 2, 8, 1), (32, 2, 8, 2), (32, 2, 8, 4), (32, 2, 8, 8), (32, 4, 8, 2), (32, 1, 8, 2), (32, 4, 8, 4))
SWEEPS = {"shapes": SHAPES, "senders": SENDERS, "default": SHAPES[:1]}  # EPCOMM_LL_SWEEP picks one


def body(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import epcomm
    from epcomm import lowlatency_nvlink
    from epcomm.bench.timing import Timer, quantile

    timer = Timer(dist.group.WORLD, torch.device("cuda", rank), REPLAYS, WARMUP)

    def per_call_us(fn) -> list:
        """p50 per call of a graph of `calls` calls of fn, for each of GRAPH_SIZES (the bench's protocol: L2 flush
        and barrier first)."""
        return [quantile(timer.measure_graph(fn, calls=calls), 0.5) * 1e6 for calls in GRAPH_SIZES]

    lines = []
    for num_tokens in TOKENS:
        gen = torch.Generator().manual_seed(rank + num_tokens)
        x = torch.randn(num_tokens, HIDDEN, generator=gen).bfloat16().cuda()
        idx = torch.rand(num_tokens, NUM_EXPERTS, generator=gen).topk(NUM_TOPK, dim=1).indices.cuda()
        w = torch.rand(num_tokens, NUM_TOPK, generator=gen).cuda()
        for blocks, rows, per_sm, senders in SWEEPS[os.environ.get("EPCOMM_LL_SWEEP", "shapes")]:
            lowlatency_nvlink._BLOCKS_PER_PROGRAM = blocks
            lowlatency_nvlink._ROWS_PER_PROGRAM = rows
            lowlatency_nvlink._FUSED_PROGRAMS_PER_SM = per_sm
            lowlatency_nvlink._COMBINE_SENDERS_PER_SM = senders
            # A buffer per shape: the program shapes of a buffer's calls must not change while it lives.
            buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=num_tokens, hidden=HIDDEN, explicitly_destroy=True)

            def dispatch():
                return buf.low_latency_dispatch(x, idx, num_tokens, NUM_EXPERTS, use_fp8=True)
            handle = dispatch()[2]
            y = torch.randn(NUM_EXPERTS // world, world * num_tokens, HIDDEN, device="cuda").bfloat16()
            t = torch.tensor([per_call_us(dispatch), per_call_us(lambda: buf.low_latency_combine(y, idx, w, handle))],
                             device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            line = f"T={num_tokens} blocks/item={blocks} rows/item={rows} programs/SM={per_sm} senders/SM={senders}: "
            for what, row in zip(("dispatch", "combine"), t.tolist()):
                line += f"{what} " + ", ".join(f"{us:.1f}" for us in row) + " us"
                if len(GRAPH_SIZES) > 1:  # replay time = fixed + calls * per call, from the first and last sizes
                    a, b = GRAPH_SIZES[0], GRAPH_SIZES[-1]
                    slope = (b * row[-1] - a * row[0]) / (b - a)
                    line += f" (per call {slope:.1f}, fixed per replay {a * (row[0] - slope):.1f})"
                line += "; "
            lines.append(line + f"graphs of {GRAPH_SIZES} calls, per call, p50, slowest rank")
            buf.destroy()
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(os.environ.get("EPCOMM_LL_SWEEP_RANKS", "2"))  # 1: the kernels alone on one GPU (nothing crosses)
    mp.spawn(body, args=(world, 29537), nprocs=world)
