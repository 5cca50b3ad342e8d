"""The nvlink regions' device barrier against torch's: device time per barrier (a CUDA graph of 100 barriers) and
host time of an eager call (200 calls, no synchronisation), on 2 ranks.

Run on a machine with 2 GPUs: `python benchmarks/barrier_latency.py`. Results:
benchmarks/results/decode-ll2_2xH200-NV18_2026-11-30.md ("Device barrier").
"""

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BARRIERS_PER_GRAPH, REPLAYS, EAGER_CALLS = 100, 40, 200


def graph_us(fn) -> float:
    """p50 over REPLAYS of (replay time of a graph of BARRIERS_PER_GRAPH calls of fn) / BARRIERS_PER_GRAPH."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(BARRIERS_PER_GRAPH):
            fn()
    times = []
    for _ in range(REPLAYS):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / BARRIERS_PER_GRAPH)
    return sorted(times)[len(times) // 2]


def body(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    from epcomm.transport.symm import SymmetricRegion

    region = SymmetricRegion(dist.group.WORLD, 1 << 20, torch.device("cuda", rank))
    lines = []
    for name, fn in (("epcomm", region.barrier), ("torch", lambda: region.handle.barrier(channel=0))):
        device = graph_us(fn)
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(EAGER_CALLS):
            fn()
        host = (time.perf_counter() - start) / EAGER_CALLS * 1e6
        torch.cuda.synchronize()
        lines.append(f"rank {rank} {name} barrier: device {device:.2f} us (graph of {BARRIERS_PER_GRAPH}, p50), "
                     f"host {host:.1f} us per eager call")
    print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(body, args=(2, 29539), nprocs=2)
