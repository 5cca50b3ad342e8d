"""The nvlink combine of a CPU-synced handle by pull and by return push (transport/push_back.py), in chunks, at the
default and at all SMs; and the cached dispatch's pull in chunks; chunks of equal size, a return push whose chunks
before the last weigh `moves.RETURN_EARLIER` times the last, and a pull whose chunks after the first weigh
`moves.PULL_LATER` times the first. Per-call p50 of the slower of 2 ranks, one call
replayed from a CUDA graph (`epcomm.bench.timing.Timer.measure_graph`) and eager (`Timer.measure`), dsv3 shape
(4096 tokens per rank, hidden 7168, 256 experts, top-8, uniform routing), non-expand BF16. Every variant is first
checked bitwise against the default path's result.

Run on a machine with 2 GPUs: `python benchmarks/return_sweep.py`. The defaults of `EPCOMM_RETURN_CHUNKS` and
`EPCOMM_PULL_CHUNKS` in a graph, and the two weights, come from this sweep (transport/nvlink.py, transport/pull.py,
moves.py).
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dsv3_handle import start

COMBINE = (("pull", "", 1), ("push", "1", 1)) + tuple(("push", c, g) for c in ("2", "3", "4") for g in (1, 2, 3))
PULL = (("1", 1),) + tuple((c, g) for c in ("2", "3", "4") for g in (1, 2, 3))


def body(rank: int, world: int, port: int) -> None:
    from epcomm import moves
    from epcomm.bench.timing import Timer, quantile

    buf, x, handle, y = start(rank, world, port)
    timer = Timer(dist.group.WORLD, torch.device("cuda", rank), 30, 5)
    lines = []
    default_return, default_pull = moves.RETURN_EARLIER, moves.PULL_LATER

    def measure(label: str, env: dict, fn, want) -> None:
        os.environ.update(env)
        got = fn()[0]
        torch.cuda.synchronize()
        t = torch.tensor([quantile(timer.measure_graph(fn), 0.5) * 1e6, quantile(timer.measure(fn), 0.5) * 1e6,
                          0.0 if torch.equal(got, want) else 1.0], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        for name in env:
            os.environ.pop(name)
        lines.append(f"{label}: graph {t[0]:.1f} us, eager {t[1]:.1f} us"
                     + ("" if t[2] == 0 else " -- NOT BITWISE EQUAL to the default path"))

    for num_sms in (0, torch.cuda.get_device_properties(rank).multi_processor_count):
        want = buf.combine(y, handle, num_sms=num_sms)[0].clone()
        for mode, chunks, weight in COMBINE:
            moves.RETURN_EARLIER = weight
            env = {"EPCOMM_NVLINK_RETURN": mode, **({"EPCOMM_RETURN_CHUNKS": chunks} if chunks else {})}
            measure(f"combine num_sms={num_sms or 'default'} {mode} chunks={chunks or '-'} earlier={weight}", env,
                    lambda: buf.combine(y, handle, num_sms=num_sms), want)
    moves.RETURN_EARLIER = default_return
    want = buf.dispatch(x, handle=handle)[0].clone()
    for chunks, weight in PULL:
        moves.PULL_LATER = weight
        measure(f"cached dispatch pull chunks={chunks} later={weight}", {"EPCOMM_PULL_CHUNKS": chunks},
                lambda: buf.dispatch(x, handle=handle), want)
    moves.PULL_LATER = default_pull
    if rank == 0:
        print("per call, p50 of the slower rank (dsv3, non-expand BF16)")
        print("\n".join(lines), flush=True)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(body, args=(2, 29581), nprocs=2)
