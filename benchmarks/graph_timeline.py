"""Where the time of a CUDA-graph replay goes: the device timeline (torch.profiler, CUDA activities) of the last of
3 replays of one cached dispatch (BF16, then FP8 with scales) and of one combine (all SMs, then 24) of a
CPU-synced dsv3 handle on nvlink, rank 0: every kernel and copy with its start (us from the first) and duration,
so stages that wait for each other show as gaps.

Run on a machine with 2 GPUs: `python benchmarks/graph_timeline.py`.
"""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dsv3_handle import start

def last_replay(prof) -> list:
    """The device events of the last replay, as `(start_us, duration_us, name)` from its first event: those after
    the last NCCL kernel (each replay follows a `dist.barrier()`, whose all-reduce is the only NCCL kernel)."""
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    nccl = [i for i, e in enumerate(events) if e.name.startswith("nccl")]
    events = events[nccl[-1] + 1:] if nccl else events
    t0 = events[0].time_range.start if events else 0.0
    return [(e.time_range.start - t0, e.time_range.end - e.time_range.start, e.name) for e in events]


def body(rank: int, world: int, port: int) -> None:
    buf, x, handle, y = start(rank, world, port)
    from epcomm.fp8 import per_token_cast_to_fp8

    x_fp8 = per_token_cast_to_fp8(x)
    all_sms = torch.cuda.get_device_properties(rank).multi_processor_count
    lines = []
    for label, fn in (("cached dispatch", lambda: buf.dispatch(x, handle=handle)),
                      ("cached dispatch, FP8", lambda: buf.dispatch(x_fp8, handle=handle)),
                      (f"combine, num_sms={all_sms}", lambda: buf.combine(y, handle, num_sms=all_sms)),
                      ("combine, num_sms=24", lambda: buf.combine(y, handle, num_sms=24))):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiled kernels and the handle's index tensors made before the capture
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                dist.barrier()
                graph.replay()
                torch.cuda.synchronize()
        events = last_replay(prof)
        span = max((s + d for s, d, _ in events), default=0.0)
        lines.append(f"== {label}: {len(events)} device events, {span:.1f} us")
        lines += [f"  {s:8.1f} +{d:7.1f}  {name[:96]}" for s, d, name in events]
    if rank == 0:
        print("\n".join(lines), flush=True)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(body, args=(2, 29591), nprocs=2)
