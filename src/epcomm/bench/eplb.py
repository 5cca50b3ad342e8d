"""`epcomm-bench --eplb`: load per rank and dispatch+combine time before and after redundant-expert balancing.

One run, on a Zipf-skewed routing: the group's routing is drawn from one popularity law (every rank sees the
same hot experts; tokens differ per rank). A calibration batch gives the per-expert load, `epcomm.eplb.
plan_redundant_experts` fills C redundant slots per rank, and a second batch is measured twice: with logical
expert ids (`num_experts = E`, "before") and with physical ids (`plan.map_topk_idx`, `num_experts = R * (L + C)`,
"after"). Reported: max/mean selections per rank (the expert-compute load) and the dispatch+combine time (p20/
p50/p80 of the slowest rank per call). A correctness gate checks first, bitwise, that the combined output of
small-integer expert outputs is the same both ways; a failure prints FAILED and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from ..buffer import EPBuffer
from ..eplb import plan_redundant_experts
from ..routing import PRESETS, topk_from_scores, zipf_scores
from ..testing import RankFailure, WatchdogTimeout, WorkerPool
from .options import check_output_path
from .timing import Timer, combine_ranks, quantile

TASK_TIMEOUT_S = 600.0
BUFFER_TIMEOUT_S = 120


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epcomm-bench --eplb", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="dsv3", help=f"MoE shape ({', '.join(PRESETS)}); default dsv3")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank; default 256 on CPU, the preset's on GPU")
    p.add_argument("--ranks", type=int, default=None, help="ranks; default one per visible GPU (NCCL), else 2")
    p.add_argument("--slots", type=int, default=None, help="redundant slots per rank (C); default max(1, L // 8)")
    p.add_argument("--exponent", type=float, default=1.2, help="Zipf exponent of expert popularity; default 1.2")
    p.add_argument("--layout", choices=("non-expand", "expand"), default="expand")
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 10 CPU, 30 GPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 1 CPU, 5 GPU)")
    p.add_argument("--seed", type=int, default=None, help="routing seed (default: fresh, printed)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the figures as JSON")
    return p


def make_config(opts: argparse.Namespace) -> dict:
    """Resolve defaults against the machine.

    Raises:
        ValueError: an option that cannot run here.
    """
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if opts.preset not in PRESETS:
        raise ValueError(f"unknown preset {opts.preset!r}; valid: {', '.join(PRESETS)}")
    moe = PRESETS[opts.preset]
    ranks = opts.ranks if opts.ranks is not None else (num_gpus or 2)
    if ranks < 2:
        raise ValueError(f"--ranks must be >= 2 (replicas live on other ranks), got {ranks}")
    if num_gpus and ranks > num_gpus:
        raise ValueError(f"--ranks {ranks}: only {num_gpus} GPUs are visible (one rank per GPU)")
    if moe.num_experts % ranks:
        raise ValueError(f"preset {moe.name} has {moe.num_experts} experts, not a multiple of {ranks} ranks")
    num_local = moe.num_experts // ranks
    slots = opts.slots if opts.slots is not None else max(1, num_local // 8)
    if not 1 <= slots <= (ranks - 1) * num_local:
        raise ValueError(f"--slots must be in [1, {(ranks - 1) * num_local}], got {slots}")
    tokens = opts.tokens if opts.tokens is not None else (moe.num_tokens if num_gpus else 256)
    iters = opts.iters if opts.iters is not None else (30 if num_gpus else 10)
    warmup = opts.warmup if opts.warmup is not None else (5 if num_gpus else 1)
    if tokens < 1 or iters < 1 or warmup < 0 or not opts.exponent >= 0:
        raise ValueError(f"--tokens and --iters must be >= 1, --warmup and --exponent >= 0; got {tokens}, {iters}, "
                         f"{warmup}, {opts.exponent}")
    check_output_path("--json", opts.json)  # before the run, not after it
    seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(4), "little")
    return dict(backend="nccl" if num_gpus else "gloo", ranks=ranks, preset=moe.name, tokens=tokens, slots=slots,
                exponent=opts.exponent, do_expand=opts.layout == "expand", iters=iters, warmup=warmup, seed=seed)


# ----------------------------------------------------------------------------------------------------------
# the rank-side task
# ----------------------------------------------------------------------------------------------------------
def _routing(cfg: dict, rank: int, world: int):
    """(calibration topk_idx of the whole group, this rank's measured topk_idx): one Zipf law for all ranks."""
    moe = PRESETS[cfg["preset"]]
    gen = torch.Generator().manual_seed(cfg["seed"])
    total = world * cfg["tokens"]
    scores = zipf_scores(2 * total, moe.num_experts, exponent=cfg["exponent"], generator=gen)
    topk_idx = topk_from_scores(scores, moe.num_topk)[0]
    mine = topk_idx[total + rank * cfg["tokens"]: total + (rank + 1) * cfg["tokens"]]
    return topk_idx[:total], mine


def _expert_out(buf, recv_x, recv_idx, handle, to_logical, rank: int, per_rank: int, do_expand: bool):
    """Small-integer expert outputs `x * (e % 3 + 1)` summed over this rank's experts of each row (e logical)."""
    factor = (to_logical(rank * per_rank + torch.arange(per_rank, device=recv_x.device)) % 3 + 1).to(recv_x.dtype)
    if do_expand:
        seg = torch.tensor(handle.num_recv_tokens_per_expert_list, dtype=torch.int64, device=recv_x.device)
        return recv_x * torch.repeat_interleave(factor, seg)[:, None]
    local = recv_idx.long()
    f = torch.where(local >= 0, factor[local.clamp(min=0)], torch.zeros((), dtype=recv_x.dtype,
                                                                        device=recv_x.device))
    return recv_x * f.sum(1, keepdim=True)


def eplb_task(rank: int, world: int, cfg: dict) -> dict:
    """Plan, gate and time on this rank; returns plain data (loads, times, a mismatch message or None)."""
    moe = PRESETS[cfg["preset"]]
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()).lower() \
        else torch.device("cpu")
    calib, topk_idx = _routing(cfg, rank, world)
    load = torch.bincount(calib.reshape(-1), minlength=moe.num_experts)
    plan = plan_redundant_experts(load[None], world, cfg["slots"])
    num_local = moe.num_experts // world
    p2l = plan.physical_to_logical[0].to(device)
    routes = {"before": (topk_idx.to(device), moe.num_experts, num_local, lambda e: e),
              "after": (plan.map_topk_idx(topk_idx, rank=rank).to(device), plan.num_physical_experts,
                        num_local + cfg["slots"], lambda p: p2l[p])}
    gen = torch.Generator().manual_seed(cfg["seed"] + 1 + rank)
    x_int = torch.randint(-2, 3, (cfg["tokens"], moe.hidden), generator=gen).to(device, torch.bfloat16)
    x = torch.randn(cfg["tokens"], moe.hidden, generator=gen).to(device, torch.bfloat16)
    buf = EPBuffer(None, num_max_tokens_per_rank=cfg["tokens"], hidden=moe.hidden, num_topk=moe.num_topk,
                   explicitly_destroy=True, num_cpu_timeout_secs=BUFFER_TIMEOUT_S)
    timer = Timer(dist.group.WORLD, device, cfg["iters"], cfg["warmup"])
    out, combined = {}, {}
    try:
        for name, (idx, num_experts, per_rank, to_logical) in routes.items():
            recv_x, recv_idx, _, handle, _ = buf.dispatch(x_int, idx, num_experts=num_experts,
                                                          do_expand=cfg["do_expand"])
            y = _expert_out(buf, recv_x, recv_idx, handle, to_logical, rank, per_rank, cfg["do_expand"])
            combined[name] = buf.combine(y, handle)[0].cpu()

            def step(idx=idx, num_experts=num_experts):
                recv, _, _, h, _ = buf.dispatch(x, idx, num_experts=num_experts, do_expand=cfg["do_expand"])
                return buf.combine(recv, h)
            times = timer.measure(step)
            loads = torch.bincount(idx[idx >= 0] // per_rank, minlength=world).double()
            dist.all_reduce(loads)
            out[name] = dict(times=times, loads=loads.tolist())
    finally:
        buf.destroy()
    mismatch = None
    if not torch.equal(combined["before"], combined["after"]):
        bad = (combined["before"] != combined["after"]).nonzero()[0].tolist()
        mismatch = (f"rank {rank}: combined output through physical ids differs from logical ids at {bad}: "
                    f"{combined['after'][tuple(bad)].item()} vs {combined['before'][tuple(bad)].item()}")
    planned = plan.rank_load[0]
    out.update(mismatch=mismatch, device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(),
               planned_before=float(plan.baseline_rank_load[0].max() / plan.baseline_rank_load[0].mean()),
               planned_after=float(planned.max() / planned.mean()))
    return out


# ----------------------------------------------------------------------------------------------------------
# the parent
# ----------------------------------------------------------------------------------------------------------
def _ratio(loads: list) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def report(cfg: dict, per_rank: list) -> tuple:
    """(text, record): the table and the JSON record of one run."""
    moe = PRESETS[cfg["preset"]]
    num_local = moe.num_experts // cfg["ranks"]
    lines = [f"epcomm-bench --eplb: {moe.name} (hidden {moe.hidden}, {moe.num_experts} experts, top-{moe.num_topk}),"
             f" Zipf({cfg['exponent']:g}) routing, {cfg['ranks']} {cfg['backend']} ranks on {per_rank[0]['device']},"
             f" {cfg['tokens']} tokens per rank, {'expand' if cfg['do_expand'] else 'non-expand'} layout",
             f"  {cfg['slots']} redundant slots per rank ({num_local} + {cfg['slots']} physical experts per rank); "
             f"plan from a calibration batch, measured on a fresh batch; seed {cfg['seed']}; {cfg['iters']} timed "
             f"calls after {cfg['warmup']} warm-up, slowest rank per call"]
    record = dict(config=cfg, device=per_rank[0]["device"])
    failures = [r["mismatch"] for r in per_rank if r["mismatch"]]
    if failures:
        lines.append(f"FAILED correctness gate: {failures[0]}")
    else:
        lines.append("  gate: combined outputs through physical ids equal those through logical ids (bitwise)")
    header = f"  {'routing':<18} {'max/mean load':>14} {'planned':>8} {'p20 ms':>9} {'p50 ms':>9} {'p80 ms':>9}"
    lines += ["", header]
    for name, label in (("before", "logical (before)"), ("after", "physical (EPLB)")):
        times = combine_ranks([r[name]["times"] for r in per_rank])
        q = [quantile(times, f) * 1e3 for f in (0.2, 0.5, 0.8)]
        ratio = _ratio(per_rank[0][name]["loads"])
        planned = per_rank[0]["planned_" + name]
        lines.append(f"  {label:<18} {ratio:>14.3f} {planned:>8.3f} {q[0]:>9.3f} {q[1]:>9.3f} {q[2]:>9.3f}")
        record[name] = dict(max_over_mean_load=ratio, planned_max_over_mean=planned, loads=per_rank[0][name]["loads"],
                            p20_s=q[0] / 1e3, p50_s=q[1] / 1e3, p80_s=q[2] / 1e3)
    record["failures"] = failures
    return "\n".join(lines), record


def run_eplb(argv: Optional[list] = None, *, pool: Optional[WorkerPool] = None) -> int:
    """Entry point of `epcomm-bench --eplb ARGS`; prints the table last on stdout, returns the exit status.

    Args:
        argv: the arguments after `--eplb` (default `sys.argv[1:]`).
        pool: an existing `WorkerPool` of the right size and backend (tests); default: spawn one.

    Returns:
        int -- 0, or 1 when the correctness gate failed or the ranks failed.
    """
    parser = build_parser()
    opts = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = make_config(opts)
    except ValueError as exc:
        parser.error(str(exc))
    own = pool is None
    if own:
        pool = WorkerPool(cfg["ranks"], cfg["backend"], start_timeout=300.0)
    elif pool.world_size != cfg["ranks"] or pool.backend != cfg["backend"]:
        raise ValueError(f"run_eplb: the pool is {pool!r} but the run needs {cfg['ranks']} {cfg['backend']} ranks")
    try:
        print(f"epcomm-bench --eplb: planning and timing on {cfg['ranks']} ranks ...", file=sys.stderr)
        per_rank = pool.run(eplb_task, cfg, timeout=TASK_TIMEOUT_S)
    except (RankFailure, WatchdogTimeout) as exc:
        print(f"epcomm-bench --eplb: ABORTED: {exc}", file=sys.stderr)
        return 1
    finally:
        if own:
            pool.close()
    text, record = report(cfg, per_rank)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(record, f, indent=2)
        print(f"epcomm-bench --eplb: wrote {opts.json}", file=sys.stderr)
    print(text, flush=True)
    return 1 if record["failures"] else 0
