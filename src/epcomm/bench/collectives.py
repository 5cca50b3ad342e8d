"""`epcomm-bench --suite collectives`: the barrier, bucket collectives, PP send/recv, Engram fetch and the LB calls,
each timed against its `torch.distributed` equivalent (NCCL on GPU, gloo on CPU) in the same run.

| op | epcomm | equivalent | bytes (for GB/s) |
| --- | --- | --- | --- |
| barrier | `epcomm.comm.barrier(bucket_buffer)` | `dist.barrier()` | - |
| all_gather | `BucketBuffer.all_gather(shard)`, in place | `dist.all_gather_into_tensor` | gathered tensor |
| reduce_scatter | `BucketBuffer.reduce_scatter(bucket)`, in place | `dist.reduce_scatter_tensor` | input bucket |
| all_reduce | `BucketBuffer.all_reduce(bucket)`, in place | `dist.all_reduce` | bucket |
| pp | `PPBuffer.send` to next + `recv` from previous | `dist.batch_isend_irecv` of the same pair | tensor |
| engram | `EngramBuffer.fetch` of random rows (one layer) | `dist.all_to_all_single` of the same rows | rows fetched |
| lb_prefetch | `EPBuffer.lb_prefetch_weights` of BF16 experts | `all_to_all_single` of the same bytes | received |
| lb_reduce | `EPBuffer.lb_reduce_grads` of FP32 gradients | `all_to_all_single` + `add_` | received |

LB placement: `LB_SLOTS` redundant slots (in the LB region) and as many local experts per rank, slot c of rank r
hosting expert c of rank r + 1, so each rank moves all its experts to or from one peer; bytes: those one rank
receives. Expert size: one DeepSeek-V3 routed expert (3 x 7168 x 2048 parameters; 88 MB in BF16) on GPU,
`--size-mib / LB_SLOTS` bytes of BF16 on CPU or when `--size-mib` is given. On 2+ GPUs a copy-engine peer copy
(256 MiB, cuda:0 -> cuda:1, `runner.measure_peer_copy`) is timed in the same run; "vs ceiling" = an LB row's GB/s
over its GB/s. The LB calls are checked against values each rank recomputes for its neighbour.

Engram's `epcomm` row uses the default transport (`nvlink` when every rank is a GPU of one host, else
`collective`; the JSON record names it); when that is nvlink, an `epcomm-collective` row times the collective
transport forced on the same rows.

Before any number is printed every op is checked bitwise against its equivalent on small-integer data (rows of
a table every rank rebuilds, for Engram and LB); a mismatch prints FAILED (the op gets no rows) and the exit
status is 1; when every op matched, a line under the header says so ("correctness: every op below matched ...").
Times are the slowest rank's per call (`bench.timing`: a barrier before each call; on GPU also an L2 flush and
CUDA events); "vs torch" = epcomm p50 / equivalent p50 (below 1: faster). The table is the last thing printed on
stdout.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import __version__
from ..allocator import BufferAllocator
from ..bucket import BucketBuffer
from ..buffer import EPBuffer
from ..comm import barrier
from ..engram import EngramBuffer
from ..pp import PPBuffer
from ..sizing import ALLOCATION_ALIGNMENT, align
from ..testing import RankFailure, WatchdogTimeout, WorkerPool
from .cli import resolve_ranks
from .options import check_output_path, split_list
from .runner import PEER_COPY_BYTES, device_info, first_mismatch, measure_peer_copy
from .timing import Timer, combine_ranks, quantile

OPS = ("barrier", "all_gather", "reduce_scatter", "all_reduce", "pp", "engram", "lb_prefetch", "lb_reduce")
CPU_DEFAULTS = dict(ranks=2, size_mib=4.0, iters=10, warmup=2)
GPU_DEFAULTS = dict(size_mib=256.0, iters=30, warmup=5)
ENGRAM_HIDDEN, ENGRAM_ENTRIES = 256, 8  # bf16 rows of 512 B, 8 rows per token
TASK_TIMEOUT_S = 600.0
LB_SLOTS = 8  # redundant slots per rank, and local experts per rank
LB_DSV3_PARAMS = 3 * 7168 * 2048  # one DeepSeek-V3 routed expert: gate, up and down projections


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epcomm-bench --suite collectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="collectives", choices=("collectives",), help="this suite (collectives)")
    p.add_argument("--ranks", type=int, default=None, help="ranks to spawn; default one per visible GPU, else 2")
    p.add_argument("--size-mib", type=float, default=None, help="bytes per op in MiB (default 4 CPU, 256 GPU)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 10 CPU, 30 GPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2 CPU, 5 GPU)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--json", metavar="FILE", default=None, help="write every figure and the environment")
    return p


def _device() -> torch.device:
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _small_ints(n: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, (n,), generator=gen).float().to(device)


# ----------------------------------------------------------------------------------------------------------
# rank side: one task per op, returning {"check": mismatch or None, "times": {provider: [s]}, "bytes": int}
# ----------------------------------------------------------------------------------------------------------
def measure_op(rank: int, world: int, op: str, size: int, iters: int, warmup: int) -> dict:
    """Check then time one op and its equivalent on this rank (collective: every rank runs the same op). `size`:
    bytes per op, or parameters per expert for the LB ops."""
    device = _device()
    timer = Timer(dist.group.WORLD, device, iters, warmup)
    n = max(world * 8, size // 4 // (world * 8) * (world * 8))  # fp32 elements, a multiple of R * 8
    if op in ("barrier", "all_gather", "reduce_scatter", "all_reduce"):
        return _bucket_op(rank, world, op, n, device, timer)
    if op == "pp":
        return _pp_op(rank, world, n, device, timer)
    if op.startswith("lb_"):
        return _lb_op(rank, world, op, size, device, timer)
    return _engram_op(rank, world, size, device, timer)


def _timed(timer: Timer, epcomm_fn: Callable, torch_fn: Callable) -> dict:
    return {"epcomm": timer.measure(epcomm_fn), "torch": timer.measure(torch_fn)}


def _bucket_op(rank: int, world: int, op: str, n: int, device, timer: Timer) -> dict:
    buf = BucketBuffer(None, align(max(n * 4, 1), ALLOCATION_ALIGNMENT), explicitly_destroy=True)
    try:
        if op == "barrier":
            kw = dict(device_ids=[device.index]) if device.type == "cuda" else {}
            return dict(check=None, bytes=0, times=_timed(timer, lambda: barrier(buf),
                                                          lambda: dist.barrier(**kw)))
        data = _small_ints(n, rank, device)
        bucket = buf.storage[:n * 4].view(torch.float32)
        shard = bucket[rank * (n // world):(rank + 1) * (n // world)]
        if op == "all_gather":
            src = data[:n // world].contiguous()
            shard.copy_(src)
            want = torch.empty(n, device=device)
            dist.all_gather_into_tensor(want, src)
            check = first_mismatch(op, buf.all_gather(shard).wait().reshape(-1), want)
            out = torch.empty(n, device=device)
            times = _timed(timer, lambda: buf.all_gather(shard).wait(),
                           lambda: dist.all_gather_into_tensor(out, src))
        elif op == "reduce_scatter":
            bucket.copy_(data)
            want = torch.empty(n // world, device=device)
            dist.reduce_scatter_tensor(want, data.clone())
            check = first_mismatch(op, buf.reduce_scatter(bucket).wait(), want)
            out = torch.empty(n // world, device=device)
            times = _timed(timer, lambda: buf.reduce_scatter(bucket).wait(),
                           lambda: dist.reduce_scatter_tensor(out, data))
        else:
            bucket.copy_(data)
            want = data.clone()
            dist.all_reduce(want)
            check = first_mismatch(op, buf.all_reduce(bucket).wait().reshape(-1), want)
            other = data.clone()
            times = _timed(timer, lambda: buf.all_reduce(bucket).wait(), lambda: dist.all_reduce(other))
        return dict(check=check, bytes=n * 4, times=times)
    finally:
        buf.destroy()


def _pp_op(rank: int, world: int, n: int, device, timer: Timer) -> dict:
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    pp = PPBuffer(None, n * 4, 2, explicitly_destroy=True)
    try:
        x, y = _small_ints(n, rank, device), torch.empty(n, device=device)
        pp.send(x, nxt)
        pp.recv(y, prv)
        check = first_mismatch("pp recv", y, _small_ints(n, prv, device))

        def ours():
            pp.send(x, nxt)
            pp.recv(y, prv)

        def theirs():
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, y, prv)]):
                work.wait()
        return dict(check=check, bytes=n * 4, times=_timed(timer, ours, theirs))
    finally:
        pp.destroy()


def _engram_op(rank: int, world: int, size: int, device, timer: Timer) -> dict:
    row = ENGRAM_HIDDEN * 2
    tokens = max(1, size // row // ENGRAM_ENTRIES)
    entries = max(1024, tokens * ENGRAM_ENTRIES // world)
    gpu, storage = EngramBuffer.get_storage_size_hint(world, [entries], ENGRAM_HIDDEN, tokens, ENGRAM_ENTRIES)
    shard = torch.arange(entries * ENGRAM_HIDDEN, device=device).view(entries, -1).add_(rank * entries * ENGRAM_HIDDEN)
    shard = (shard % 251).bfloat16()  # every rank rebuilds the global table from the row id
    gen = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, world * entries, (1, tokens, ENGRAM_ENTRIES), generator=gen).to(device)
    want = ((idx.reshape(-1, 1) * ENGRAM_HIDDEN + torch.arange(ENGRAM_HIDDEN, device=device)) % 251).bfloat16()
    want = want.view(tokens, -1)
    out = dict(check=None, bytes=tokens * ENGRAM_ENTRIES * row, times={}, transport=None)
    for provider, transport in (("epcomm", "auto"), ("epcomm-collective", "collective")):
        buf = EngramBuffer(None, gpu, storage, explicitly_destroy=True, transport=transport)
        try:
            out["transport"] = out["transport"] or buf.transport
            buf.set_config([entries], ENGRAM_HIDDEN, tokens, ENGRAM_ENTRIES)
            buf.write([shard])
            out["check"] = out["check"] or first_mismatch(f"engram rows ({buf.transport})", buf.fetch(idx)[0](),
                                                          want)
            out["times"][provider] = timer.measure(lambda: buf.fetch(idx)[0]())
        finally:
            buf.destroy()
        if out["transport"] == "collective":  # the default already is the collective transport
            break
    # The same rows in near-equal splits (gloo's equal-split all-to-all needs a multiple of the group size).
    num_rows = tokens * ENGRAM_ENTRIES
    splits = [num_rows // world + (r < num_rows % world) for r in range(world)]
    send = torch.empty(num_rows, row, dtype=torch.uint8, device=device)
    recv = torch.empty(splits[rank] * world, row, dtype=torch.uint8, device=device)
    out["times"]["torch"] = timer.measure(lambda: dist.all_to_all_single(recv, send, [splits[rank]] * world, splits))
    return out


def _expert_ints(tag: int, rows: int, params: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[rows, params] small integers (exact in BF16 and in FP32 sums), different for every tag and row."""
    out = torch.empty(rows, params, dtype=dtype, device=device)
    col = torch.arange(params, dtype=torch.int32, device=device) * 3
    for i in range(rows):  # one row at a time: a dsv3 expert's int32 ramp is 176 MB
        out[i] = ((col + (tag * 131 + i * 7)) % 17 - 8).to(dtype)
    return out


def _lb_op(rank: int, world: int, op: str, params: int, device, timer: Timer) -> dict:
    """LB_SLOTS experts of `params` parameters pushed (BF16 weights) or pulled and summed (FP32 gradients) between
    ring neighbours through the LB region, against `all_to_all_single` of the same bytes (+ the sum)."""
    prefetch = op == "lb_prefetch"
    dtype = torch.bfloat16 if prefetch else torch.float32
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    mapping = torch.tensor([[(r + 1) % world * LB_SLOTS + c for c in range(LB_SLOTS)] for r in range(world)],
                           dtype=torch.int32)  # on the host: no device read per call
    plan = BufferAllocator()
    red = plan.allocate((LB_SLOTS, params), dtype)
    buf = EPBuffer(None, num_bytes=ALLOCATION_ALIGNMENT, lb_allocation_plan_or_num_bytes=plan,
                   explicitly_destroy=True, num_cpu_timeout_secs=120)
    try:
        nbytes = LB_SLOTS * params * dtype.itemsize
        recv = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def splits(peer: int) -> list:
            return [nbytes if r == peer else 0 for r in range(world)]
        if prefetch:  # rank r's slots host rank r+1's experts: push to prv, receive from nxt
            weights = _expert_ints(rank, LB_SLOTS, params, dtype, device)
            send = weights.view(torch.uint8).view(-1)
            buf.lb_prefetch_weights(red, weights, mapping).current_stream_wait()
            check = first_mismatch("lb_prefetch slots", red, _expert_ints(nxt, LB_SLOTS, params, dtype, device))
            return dict(check=check, bytes=nbytes, times=_timed(
                timer, lambda: buf.lb_prefetch_weights(red, weights, mapping).current_stream_wait(),
                lambda: dist.all_to_all_single(recv, send, splits(nxt), splits(prv))))
        red.copy_(_expert_ints(world + rank, LB_SLOTS, params, dtype, device))  # gradients of nxt's experts
        grads = _expert_ints(2 * world + rank, LB_SLOTS, params, dtype, device)
        want = grads + _expert_ints(world + prv, LB_SLOTS, params, dtype, device)  # a fresh tensor
        buf.lb_reduce_grads(red, grads, mapping).current_stream_wait()
        check = first_mismatch("lb_reduce grads", grads, want)
        send, target = red.view(torch.uint8).view(-1), want

        def theirs():
            dist.all_to_all_single(recv, send, splits(prv), splits(nxt))
            target.add_(recv.view(dtype).view(LB_SLOTS, params))
        return dict(check=check, bytes=nbytes, times=_timed(
            timer, lambda: buf.lb_reduce_grads(red, grads, mapping).current_stream_wait(), theirs))
    finally:
        buf.destroy()


# ----------------------------------------------------------------------------------------------------------
# parent: plan, run, table
# ----------------------------------------------------------------------------------------------------------
def _plan(opts) -> dict:
    ranks, num_gpus = resolve_ranks(opts.ranks, 2, " (collectives need peers)")
    defaults = GPU_DEFAULTS if num_gpus else CPU_DEFAULTS
    ops = split_list(opts.ops, "--ops")
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"--ops: unknown {bad}; valid: {','.join(OPS)}")
    check_output_path("--json", opts.json)  # before the run, not after it
    size_mib = opts.size_mib if opts.size_mib is not None else defaults["size_mib"]
    iters = opts.iters if opts.iters is not None else defaults["iters"]
    warmup = opts.warmup if opts.warmup is not None else defaults["warmup"]
    if not 0 < size_mib < float("inf") or iters < 1 or warmup < 0:
        raise ValueError(f"--size-mib must be > 0, --iters >= 1, --warmup >= 0; got {size_mib}, {iters}, {warmup}")
    size = int(size_mib * (1 << 20))
    lb_params = LB_DSV3_PARAMS if num_gpus and opts.size_mib is None else max(16, size // LB_SLOTS // 2 // 16 * 16)
    return dict(backend="nccl" if num_gpus else "gloo", ranks=ranks, ops=ops, size=size, lb_params=lb_params,
                iters=iters, warmup=warmup, json=opts.json, ceiling=num_gpus >= 2 and any(
                    o.startswith("lb_") for o in ops))


def _row(op: str, provider: str, times: list, nbytes: int, base: Optional[float],
         ceiling_gbps: Optional[float] = None) -> dict:
    p50 = quantile(times, 0.5)
    gbps = nbytes / p50 / 1e9 if nbytes and p50 > 0 else None
    return dict(op=op, provider=provider, bytes=nbytes, p20_us=quantile(times, 0.2) * 1e6, p50_us=p50 * 1e6,
                p80_us=quantile(times, 0.8) * 1e6, gbps=gbps, vs_torch=p50 / base if base else None,
                vs_ceiling=gbps / ceiling_gbps if gbps and ceiling_gbps and op.startswith("lb_") else None)


def _table(rows: list) -> str:
    head = ["op", "MiB", "provider", "p50 us", "p20 us", "p80 us", "GB/s", "vs torch", "vs ceiling"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["op"], f"{r['bytes'] / (1 << 20):.2f}" if r["bytes"] else "-", r["provider"],
                 f"{r['p50_us']:.1f}", f"{r['p20_us']:.1f}", f"{r['p80_us']:.1f}",
                 f"{r['gbps']:.2f}" if r["gbps"] else "-", f"{r['vs_torch']:.2f}" if r["vs_torch"] else "-",
                 f"{r['vs_ceiling']:.2f}" if r.get("vs_ceiling") else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _verdict(ops: list, failures: list, aborted: Optional[str]) -> list:
    """The correctness line under the header, worded as the main `epcomm-bench`'s: printed when every op passed its
    bitwise check (a failed op has its FAILED line instead, an aborted run its ABORTED line)."""
    if failures or aborted:
        return []
    return ["  correctness: every op below matched its torch.distributed equivalent bitwise on small-integer data "
            "before it was timed" + (" (barrier: no data to check)" if "barrier" in ops else "")]


def run_suite(argv: Optional[list] = None, *, pool: Optional[WorkerPool] = None) -> int:
    """Run the collectives suite; returns the exit status (0 ok, 1 a check failed or the run aborted, 2 usage).

    Args:
        argv: command-line arguments after `epcomm-bench` (a `--suite collectives` among them is accepted).
        pool: an existing `WorkerPool` of the right size and backend (tests); default: spawn one.
    """
    parser = build_parser()
    try:
        opts = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # argparse printed the usage error (or --help)
        return int(exc.code or 0)
    try:
        plan = _plan(opts)
    except ValueError as exc:
        print(f"epcomm-bench --suite collectives: error: {exc}", file=sys.stderr)
        return 2
    own = pool is None
    pool = pool or WorkerPool(plan["ranks"], plan["backend"], start_timeout=300.0)
    rows, failures, aborted = [], [], None
    try:
        info = pool.run(device_info, timeout=TASK_TIMEOUT_S)[0]
        ceiling_gbps = None
        if plan["ceiling"]:
            print("epcomm-bench: copy-engine ceiling", file=sys.stderr)
            times = pool.run(measure_peer_copy, plan["iters"], plan["warmup"], timeout=TASK_TIMEOUT_S)[0]
            rows.append(_row("peer-copy", "copy-engine", times, PEER_COPY_BYTES, None))
            ceiling_gbps = rows[-1]["gbps"]
        for op in plan["ops"]:
            print(f"epcomm-bench: {op}", file=sys.stderr)
            size = plan["lb_params"] if op.startswith("lb_") else plan["size"]
            per_rank = pool.run(measure_op, op, size, plan["iters"], plan["warmup"], timeout=TASK_TIMEOUT_S)
            msg = next((f"rank {r}: {p['check']}" for r, p in enumerate(per_rank) if p["check"]), None)
            if msg:
                failures.append(f"FAILED {op}: {msg}")
                continue
            times = {k: combine_ranks([p["times"][k] for p in per_rank]) for k in per_rank[0]["times"]}
            base = quantile(times["torch"], 0.5)
            for provider in ["epcomm"] + [k for k in times if k not in ("epcomm", "torch")]:
                rows.append(_row(op, provider, times[provider], per_rank[0]["bytes"], base, ceiling_gbps))
                if provider == "epcomm" and per_rank[0].get("transport"):
                    rows[-1]["transport"] = per_rank[0]["transport"]
            rows.append(_row(op, f"torch-{plan['backend']}", times["torch"], per_rank[0]["bytes"], None, ceiling_gbps))
    except (RankFailure, WatchdogTimeout) as exc:
        lines = str(exc).splitlines()  # the headline and the first rank's error (the tracebacks stay out)
        aborted = " ".join(lines[:1] + [line for line in lines if line.startswith("--- rank")][:1])
        info = locals().get("info", {})
    finally:
        if own:
            pool.close()
    env = dict(epcomm=__version__, torch=torch.__version__, python=platform.python_version(),
               backend=plan["backend"], ranks=plan["ranks"], **info)
    if plan["json"]:
        with open(plan["json"], "w") as f:
            json.dump(dict(schema="epcomm-bench-collectives/1", environment=env, records=rows, failures=failures,
                           aborted=aborted), f, indent=1)
    print(f"epcomm-bench {__version__} --suite collectives: {plan['ranks']} {plan['backend']} ranks on "
          f"{env.get('device', '?')}, torch {torch.__version__}; {plan['iters']} timed calls after {plan['warmup']} "
          f"warm-up; times are the slowest rank's per call; vs torch = p50 / torch p50 (below 1: faster)"
          + ("; vs ceiling = GB/s / copy-engine peer-copy GB/s (LB rows: bytes one rank receives)"
             if plan["ceiling"] else ""))
    for line in failures + ([f"ABORTED: {aborted}"] if aborted else []) + _verdict(plan["ops"], failures, aborted):
        print(line)
    print()
    print(_table(rows), flush=True)
    return 1 if failures or aborted else 0


if __name__ == "__main__":
    sys.exit(run_suite())
