"""Host time of eager calls (full and cached dispatch, combine with and without weights back) on 2 GPUs, by epcomm
phase and by function, with no device synchronisation inside a call (unlike `EPCOMM_PHASE_TIMES`, which
synchronises around each phase).

Usage: python benchmarks/host_phases.py [--ranks 1] [--profile full,cached,combine,combine-w]
The dsv3 shape (4096 tokens, hidden 7168, 256 experts, top-8), BF16, nvlink. Each line: the median over 20 calls of
the host time spent inside that range per call, in us, inclusive of what it calls; both ranks print. The ranges are
`debug.phase`'s and a list of functions of the dispatch path (wrapped for the run). Host-bound calls
(benchmarks/results/dsv3-s11_*) spend their time here: a range that costs much names the Python to cut.
`--profile OPS`: rank 0 also prints, for each op named, the 40 functions of most own time over 20 calls (cProfile),
then epcomm's 40 functions of most cumulative time.
"""
import contextlib
import functools
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from host_wall import dsv3_ops


def body(rank, world, port, profile=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    import epcomm.debug as dbg
    from epcomm import buffer as bufmod
    from epcomm import exact_nvlink, pipeline, recv_plan, resolve
    from epcomm.transport import nvlink, pull
    acc = defaultdict(float)

    @contextlib.contextmanager
    def phase(name):  # every module that imported `debug.phase` gets this one
        t = time.perf_counter()
        try:
            yield
        finally:
            acc["phase:" + name] += time.perf_counter() - t
    for mname, m in list(sys.modules.items()):
        if mname.startswith("epcomm") and getattr(m, "phase", None) is dbg.phase:
            m.phase = phase
    dbg.phase = phase

    def wrap(owner, attr, label):
        f = getattr(owner, attr)
        @functools.wraps(f)
        def g(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t
        setattr(owner, attr, g)
    for owner, attr in [(exact_nvlink, "send_plan"), (exact_nvlink, "read_rows"), (exact_nvlink, "dispatch_launch"),
                        (exact_nvlink, "dispatch_finish"), (recv_plan, "plan_rows"), (recv_plan, "outputs"),
                        (recv_plan, "carve"), (pipeline, "_move_fields"), (pipeline, "cached_launch"),
                        (pipeline, "cached_finish"), (pull, "pull_fields"), (pull.PullPlan, "__init__"),
                        (pull.PullPlan, "views"), (pull, "gather_in_one_launch"),
                        (nvlink.NVLinkTransport, "_host_wait"), (nvlink.NVLinkTransport, "publish_rows"),
                        (nvlink.NVLinkTransport, "move_fields"), (nvlink.NVLinkTransport, "barrier"),
                        (bufmod.EPBuffer, "_finish"), (bufmod.EPBuffer, "agree"), (resolve, "resolve_dispatch"),
                        (bufmod.EPBuffer, "_exchange_header"), (bufmod.EPBuffer, "dispatch")]:
        wrap(owner, attr, f"{owner.__name__}.{attr}")
    buf, ops = dsv3_ops(rank)  # the calls host_wall.py times
    lines = []
    for name, fn in ops.items():
        for _ in range(5):
            fn()
        per = defaultdict(list)
        walls = []
        for _ in range(20):
            dist.barrier()
            torch.cuda.synchronize()
            acc.clear()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            walls.append((t1 - t0) * 1e6)
            for k, v in acc.items():
                per[k].append(v * 1e6)
        lines.append(f"== rank {rank} {name}: host {statistics.median(walls):.0f} us (call returns)")
        for k, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
            lines.append(f"   {statistics.median(v):8.1f} us  {k}")
    print("\n".join(lines), flush=True)
    for name in (profile or "").split(","):
        if not name or rank != 0:
            continue
        import cProfile
        import pstats
        prof = cProfile.Profile()
        for _ in range(20):
            torch.cuda.synchronize()
            prof.enable()
            ops[name]()
            prof.disable()
        print(f"== cProfile of 20 {name} calls", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)
        pstats.Stats(prof).sort_stats("cumulative").print_stats("epcomm", 40)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--profile", default="", help="comma-separated ops to profile: full,cached,combine,combine-w")
    args = parser.parse_args()
    mp.spawn(body, args=(args.ranks, 29597, args.profile), nprocs=args.ranks)
