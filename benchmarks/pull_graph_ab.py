"""The nvlink cached dispatch in a CUDA graph, with and without session 10's two changes to its pull, alternating
in one process (graph timings drift between machine instances): narrow fields (FP8 scales, weights) read out of the
peers by the SMs (`transport/pull.py`, `_SM_PULL_ROW_BYTES`) or by copy-engine copies, and no barrier after a
captured pull's copies or one (as before). dsv3 rows (4096 tokens per rank, hidden 7168, 256 experts, top-8,
uniform routing), non-expand: BF16, BF16 with top-k weights, FP8 with scales. Per-call p50 of the slower of 2 ranks
(`epcomm.bench.timing.Timer.measure_graph`) for a graph of 8 calls back to back (the ranks' start skew after the
host barrier shared by the calls) and of 1 call; 3 rounds of every variant.

Run on a machine with 2 GPUs: `python benchmarks/pull_graph_ab.py`.
"""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dsv3_handle import start


def body(rank: int, world: int, port: int) -> None:
    from epcomm import streams
    from epcomm.bench.timing import Timer, quantile
    from epcomm.fp8 import per_token_cast_to_fp8
    from epcomm.transport import pull

    buf, x, handle, _ = start(rank, world, port)
    x_fp8 = per_token_cast_to_fp8(x)
    weights = torch.rand(x.shape[0], 8, device=x.device)
    timer = Timer(dist.group.WORLD, torch.device("cuda", rank), 30, 5)
    sm_row_bytes, transport = pull._SM_PULL_ROW_BYTES, type(buf.transport)
    move_fields = transport.move_fields

    def with_closing_barrier(self, moves, route, *, call_id, beside=()):
        move_fields(self, moves, route, call_id=call_id, beside=beside)
        if streams.capturing(self.device):
            self.barrier()

    variants = {"now": (sm_row_bytes, move_fields), "closing barrier": (sm_row_bytes, with_closing_barrier),
                "copy-engine narrow fields": (0, move_fields), "before": (0, with_closing_barrier)}
    calls = {"bf16": lambda: buf.dispatch(x, handle=handle),
             "bf16 + weights": lambda: buf.dispatch(x, handle=handle, topk_weights=weights),
             "fp8": lambda: buf.dispatch(x_fp8, handle=handle)}
    for per_graph in (8, 1):
        for label, call in calls.items():
            times = {name: [] for name in variants}
            for _ in range(3):
                for name, (row_bytes, move) in variants.items():
                    pull._SM_PULL_ROW_BYTES, transport.move_fields = row_bytes, move
                    t = torch.tensor([quantile(timer.measure_graph(call, calls=per_graph), 0.5) * 1e6], device="cuda")
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    times[name].append(f"{t.item():.1f}")
            if rank == 0:
                cells = [f"{name} {', '.join(v)} us" for name, v in times.items()]
                print(f"{per_graph} per graph, {label}: " + " | ".join(cells), flush=True)
    pull._SM_PULL_ROW_BYTES, transport.move_fields = sm_row_bytes, move_fields
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(body, args=(2, 29589), nprocs=2)
