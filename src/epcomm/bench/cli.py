"""`epcomm-bench`: measure epcomm against the torch-native dispatcher and the raw all-to-all (docs/benchmarks.md).

Bare `epcomm-bench` runs the embedded default: on CPU, dsv3 at 256 tokens per rank on 2 gloo ranks, both
layouts, BF16 and FP8, 10 timed calls each; with CUDA, one rank per visible GPU over NCCL, dsv3 at full size,
30 timed calls after warm-up. Every configuration is first checked bitwise against `epcomm.reference` on fresh
random inputs; a configuration that fails prints FAILED with its first mismatch instead of numbers, and the
exit status is 1. The table is the last thing printed on stdout; progress goes to stderr.

`epcomm-bench --check ARGS...` hands ARGS to `epcomm.check` (the planning check) instead.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from .. import __version__
from ..routing import PRESETS
from ..testing import RankFailure, WatchdogTimeout, WorkerPool
from ..transport import available_transports
from . import report, runner
from .options import check_output_path, split_list
from .cases import DTYPES, LAYOUTS, PEER_COPY, TORCH_NATIVE, Case, EpcommConfig, epcomm_provider, raw_provider
from .report import Failure, Measurement
from .timing import combine_ranks

CPU_DEFAULTS = dict(ranks=2, tokens=256, iters=10, warmup=1)
GPU_DEFAULTS = dict(iters=30, warmup=5)
TASK_TIMEOUT_S = 600.0
MAX_CPU_RANKS = 64  # gloo ranks are processes on this host


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epcomm-bench", description=__doc__.split("\n\n")[0],
        epilog="epcomm-bench --check ARGS... runs epcomm.check with ARGS instead; epcomm-bench --eplb ARGS... the "
               "load-balancing benchmark; epcomm-bench --suite collectives [--help] the barrier, bucket, PP, Engram "
               "and LB calls against their NCCL equivalents (docs/collectives.md). Method: docs/benchmarks.md.")
    p.add_argument("--preset", default="dsv3",
                   help=f"preset name(s), comma-separated, or 'all' ({', '.join(PRESETS)}); default dsv3")
    p.add_argument("--tokens", default=None,
                   help="tokens per rank, comma-separated to sweep (e.g. 64,128,256); default 256 on CPU, the "
                        "preset's size on GPU")
    p.add_argument("--ranks", type=int, default=None,
                   help="ranks to spawn; default one per visible GPU (NCCL), else 2 (gloo); must divide the "
                        "preset's experts (powers of 2 in every preset)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 10 CPU, 30 GPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 1 CPU, 5 GPU)")
    p.add_argument("--layout", choices=("non-expand", "expand", "both"), default="both")
    p.add_argument("--dtype", choices=("bf16", "fp8", "both"), default="both",
                   help="dispatch payload; combine is always BF16 (measured in the bf16 case)")
    p.add_argument("--skew", choices=("none", "zipf"), default="none",
                   help="expert popularity: the preset's routing, or Zipf(1.2)")
    p.add_argument("--num-sms", default="0",
                   help="num_sms passed to dispatch/combine, comma-separated to sweep; 0 = epcomm's default, "
                        "'all' = every SM of the GPU (no effect on CPU)")
    p.add_argument("--transport", default="auto",
                   help="epcomm transport(s), comma-separated; 'auto' = every transport available here")
    p.add_argument("--seed", type=int, default=None, help="input seed (default: fresh, recorded in --json)")
    p.add_argument("--json", metavar="FILE", default=None, help="write every figure and the environment")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="plot median time against tokens per rank (sweep with --tokens a,b,c); needs matplotlib")
    p.add_argument("--check", action="store_true", help="run epcomm.check with the remaining arguments")
    p.add_argument("--eplb", action="store_true",
                   help="load per rank and dispatch+combine time before/after redundant-expert balancing "
                        "(epcomm-bench --eplb --help for its options)")
    p.add_argument("--inject-fault", choices=runner.FAULTS, default=None, help=argparse.SUPPRESS)  # gate self-test
    return p


@dataclass
class Plan:
    """Everything a run does, resolved from the options and the machine."""

    backend: str
    ranks: int
    cases: list
    layouts: tuple
    transports: list
    num_sms: list  # ints, or "all"
    iters: int
    warmup: int
    seed: int
    json: Optional[str]
    plot: Optional[str]
    fault: Optional[str]

    @property
    def cuda(self) -> bool:
        return self.backend == "nccl"


def resolve_ranks(requested: Optional[int], minimum: int = 1, why: str = "") -> tuple:
    """`(ranks, num_gpus)`: one rank per visible GPU by default (NCCL), else `CPU_DEFAULTS["ranks"]` gloo ranks.

    Raises:
        ValueError: fewer than `minimum` ranks (`why` says why), or more ranks than visible GPUs.
    """
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = requested if requested is not None else (num_gpus or CPU_DEFAULTS["ranks"])
    if ranks < minimum:
        raise ValueError(f"--ranks must be >= {minimum}{why}, got {ranks}")
    if num_gpus and ranks > num_gpus:
        raise ValueError(f"--ranks {ranks}: only {num_gpus} GPUs are visible (one rank per GPU)")
    if not num_gpus and ranks > MAX_CPU_RANKS:
        raise ValueError(f"--ranks {ranks}: at most {MAX_CPU_RANKS} CPU ranks (each is a process)")
    return ranks, num_gpus


def make_plan(opts: argparse.Namespace) -> Plan:
    """Resolve defaults against the machine (GPUs present or not).

    Raises:
        ValueError: an option that cannot run here (unknown preset, too many ranks, bad counts).
    """
    ranks, num_gpus = resolve_ranks(opts.ranks)
    backend = "nccl" if num_gpus else "gloo"
    defaults = GPU_DEFAULTS if num_gpus else CPU_DEFAULTS
    names = list(PRESETS) if opts.preset == "all" else split_list(opts.preset, "--preset")
    for name in names:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)} or 'all'")
        if PRESETS[name].num_experts % ranks:
            raise ValueError(f"preset {name} has {PRESETS[name].num_experts} experts, not a multiple of {ranks} ranks")
    tokens = None
    if opts.tokens is not None:
        items = split_list(opts.tokens, "--tokens")
        try:
            tokens = [int(t) for t in items]
        except ValueError:
            raise ValueError(f"--tokens must be integers separated by commas, got {opts.tokens!r}") from None
        if not tokens or min(tokens) < 1 or len(set(tokens)) < len(tokens):
            raise ValueError(f"--tokens must be distinct counts >= 1, got {opts.tokens!r}")
    iters = opts.iters if opts.iters is not None else defaults["iters"]
    warmup = opts.warmup if opts.warmup is not None else defaults["warmup"]
    if iters < 1 or warmup < 0:
        raise ValueError(f"--iters must be >= 1 and --warmup >= 0, got {iters} and {warmup}")
    available = available_transports(torch.device("cuda" if num_gpus else "cpu"))
    transports = available if opts.transport == "auto" else split_list(opts.transport, "--transport")
    for t in transports:
        if t not in available:
            raise ValueError(f"--transport {t!r} is not available here; available: {', '.join(available)}")
    num_sms = []
    for v in split_list(opts.num_sms, "--num-sms"):
        if v == "all":
            num_sms.append("all")
            continue
        try:
            num_sms.append(int(v))
        except ValueError:
            raise ValueError(f"--num-sms takes integers >= 0 or 'all', got {v!r}") from None
        if num_sms[-1] < 0:
            raise ValueError(f"--num-sms takes integers >= 0 (0 = epcomm's default) or 'all', got {v!r}")
        if num_sms.count(num_sms[-1]) > 1:
            raise ValueError(f"--num-sms lists {num_sms[-1]} more than once in {opts.num_sms!r}; list each value once")
    check_output_path("--json", opts.json)  # before the run, not after it
    check_output_path("--plot", opts.plot, plot=True)
    seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(4), "little")
    skew = None if opts.skew == "none" else opts.skew
    dtypes = DTYPES if opts.dtype == "both" else (opts.dtype,)
    cases = [Case(name, t, dtype, skew, seed)
             for name in names
             for t in (tokens or [CPU_DEFAULTS["tokens"] if not num_gpus else PRESETS[name].num_tokens])
             for dtype in dtypes]
    layouts = LAYOUTS if opts.layout == "both" else (opts.layout,)
    return Plan(backend=backend, ranks=ranks, cases=cases, layouts=layouts, transports=transports,
                num_sms=num_sms or [0], iters=iters, warmup=warmup, seed=seed, json=opts.json, plot=opts.plot,
                fault=opts.inject_fault)


# ----------------------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------------------
def _git_commit() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return dict(git_commit=None)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return dict(git_commit=commit.stdout.strip(), git_dirty=bool(dirty.stdout.strip()))
    except (OSError, subprocess.SubprocessError):
        return dict(git_commit=None)


def environment(plan: Plan, info: dict) -> dict:
    """Versions and machine of the run (docs/benchmarks.md "Output")."""
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # not installed (CPU machines) or broken
        triton_version = None
    env = dict(timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               epcomm=__version__, torch=torch.__version__, triton=triton_version, python=platform.python_version(),
               platform=platform.platform(), backend=plan.backend, ranks=plan.ranks, seed=plan.seed)
    env.update(info)
    env.update(_git_commit())
    return env


class _Run:
    """State of one run in the parent: the pool, the progress bar, and what came back."""

    def __init__(self, plan: Plan, pool: WorkerPool, bar):
        self.plan, self.pool, self.bar = plan, pool, bar
        self.entries: list = []  # Measurement and Failure objects, in run order (the table's order)

    @property
    def measurements(self) -> list:
        return [e for e in self.entries if isinstance(e, Measurement)]

    @property
    def failures(self) -> list:
        return [e for e in self.entries if isinstance(e, Failure)]

    def task(self, label: str, fn, *args):
        self.bar.set_postfix_str(label, refresh=False)
        try:
            return self.pool.run(fn, *args, timeout=TASK_TIMEOUT_S)
        finally:
            self.bar.update(1)

    def gate(self, label: str, case: Case, layout: Optional[str], provider: str, fn, *args) -> bool:
        try:
            messages = self.task(f"check {label}", fn, *args, self.plan.fault)
        except RankFailure as exc:  # a rank raised outside the comparisons: the configuration fails
            if not self.pool.alive:
                raise
            messages = [_first_line(exc)]
        message = next((m for m in messages if m), None)
        if message is not None:
            self.entries.append(Failure(case, layout, provider, message))
        return message is None

    def measure(self, label: str, case: Case, layout: Optional[str], provider: str, fn, *args) -> None:
        try:
            per_rank = self.task(label, fn, *args)
        except RankFailure as exc:
            if not self.pool.alive:
                raise
            self.entries.append(Failure(case, layout, provider, f"raised while timing: {_first_line(exc)}"))
            return
        for (op, mode), _ in per_rank[0]["times"].items():
            recv, link = zip(*(report.bytes_of(case, r["recv_rows"], r["own_rows"]) for r in per_rank))
            self.entries.append(Measurement(
                case=case, layout=layout, op=op, provider=provider, mode=mode, sms=per_rank[0]["sms"],
                times=combine_ranks([r["times"][(op, mode)] for r in per_rank]),
                recv_bytes=sum(recv) / len(recv), link_bytes=sum(link) / len(link)))


def _first_line(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if failures:
        rank, first = sorted(failures.items())[0]
        return f"rank {rank}: {type(first).__name__}: {first}"
    return str(exc).splitlines()[0]


def _is_decode(plan: Plan, case: Case) -> bool:
    """Decode-sized GPU cases (<= 256 tokens per rank, BF16 activations) also time the low-latency calls."""
    return plan.cuda and case.tokens <= 256 and case.dtype == "bf16"


def _count_tasks(plan: Plan, with_ceiling: bool, num_sms: list) -> int:
    per_case = len(plan.layouts) * len(plan.transports) * (1 + len(num_sms)) + 3
    decode = sum(len(plan.transports) for c in plan.cases if _is_decode(plan, c))
    return len(plan.cases) * per_case + decode + int(with_ceiling)


def run(plan: Plan, pool: Optional[WorkerPool] = None) -> int:
    """Run the plan on `pool` (or a new pool of `plan.ranks`), print the table, write the files; exit status."""
    from tqdm import tqdm

    own_pool = pool is None
    if own_pool:
        pool = WorkerPool(plan.ranks, plan.backend, start_timeout=300.0)
    elif pool.world_size != plan.ranks or pool.backend != plan.backend:
        raise ValueError(f"run: the pool is {pool!r} but the plan needs {plan.ranks} {plan.backend} ranks")
    aborted = None
    try:
        info = pool.run(runner.device_info, timeout=TASK_TIMEOUT_S)[0]
        num_sms = sorted({info.get("num_sms", 0) if s == "all" else s for s in plan.num_sms})
        with_ceiling = plan.cuda and plan.ranks >= 2 and info.get("num_gpus", 0) >= 2
        bar = tqdm(total=_count_tasks(plan, with_ceiling, num_sms), desc="epcomm-bench", unit="task",
                   file=sys.stderr, dynamic_ncols=True)
        state = _Run(plan, pool, bar)
        try:
            _run_cases(state, plan, num_sms, with_ceiling)
        except (RankFailure, WatchdogTimeout) as exc:
            aborted = str(exc)
        finally:
            bar.close()
    finally:
        if own_pool:
            pool.close()
    report.add_ratios(state.measurements)
    env = environment(plan, info)
    gpu_link = plan.cuda and plan.ranks >= 2
    recs = report.records(state.measurements, info["device"], plan.ranks, gpu_link)
    if plan.json:
        report.write_json(plan.json, env, _options(plan), recs, state.failures)
        print(f"epcomm-bench: wrote {plan.json}", file=sys.stderr)
    if plan.plot:
        report.plot(recs, plan.plot)
        print(f"epcomm-bench: wrote {plan.plot}", file=sys.stderr)
    _print_report(plan, env, state, gpu_link, aborted)
    return 1 if state.failures or aborted else 0


def _run_cases(state: _Run, plan: Plan, num_sms: list, with_ceiling: bool) -> None:
    if with_ceiling:
        times = state.task("copy-engine ceiling", runner.measure_peer_copy, plan.iters, plan.warmup)[0]
        state.entries.append(Measurement(case=None, layout=None, op="peer-copy", provider=PEER_COPY, mode="ceiling",
                                         sms=None, times=times, recv_bytes=float(runner.PEER_COPY_BYTES)))
    for case in plan.cases:
        for layout in plan.layouts:
            for transport in plan.transports:
                provider = epcomm_provider(transport)
                gate_cfg = EpcommConfig(case, layout, transport, num_sms[0])
                if not state.gate(gate_cfg.label, case, layout, provider, runner.gate_epcomm, gate_cfg):
                    state.bar.update(len(num_sms))
                    continue
                for sms in num_sms:
                    cfg = EpcommConfig(case, layout, transport, sms)
                    state.measure(cfg.label, case, layout, provider, runner.measure_epcomm, cfg, plan.iters,
                                  plan.warmup)
                if _is_decode(plan, case) and layout == LAYOUTS[0]:
                    cfg = EpcommConfig(case, "expand", transport, num_sms[0])
                    state.measure(f"{cfg.label} low-latency", case, "expand", provider, runner.measure_low_latency,
                                  cfg, plan.iters, plan.warmup)
        label = f"{case.label} {TORCH_NATIVE}"
        if state.gate(label, case, None, TORCH_NATIVE, runner.gate_torch_native, case):
            state.measure(label, case, None, TORCH_NATIVE, runner.measure_torch_native, case, plan.iters,
                          plan.warmup)
        else:
            state.bar.update(1)
        state.measure(f"{case.label} raw all-to-all", case, None, raw_provider(plan.backend), runner.measure_raw_a2a,
                      case, plan.iters, plan.warmup)


def _options(plan: Plan) -> dict:
    return dict(presets=sorted({c.preset for c in plan.cases}), tokens=sorted({c.tokens for c in plan.cases}),
                dtypes=sorted({c.dtype for c in plan.cases}), skew=plan.cases[0].skew if plan.cases else None,
                layouts=list(plan.layouts), transports=plan.transports, num_sms=plan.num_sms, iters=plan.iters,
                warmup=plan.warmup, seed=plan.seed)


def _print_report(plan: Plan, env: dict, state: _Run, gpu_link: bool, aborted: Optional[str]) -> None:
    device = env.get("device", "?")
    where = f"{plan.ranks} {plan.backend} ranks on {device}"
    if plan.cuda:
        where += f" (driver {env.get('driver')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')})"
    commit = env.get("git_commit")
    commit = f", commit {commit[:10]}{'+dirty' if env.get('git_dirty') else ''}" if commit else ""
    lines = [f"epcomm-bench {env['epcomm']}: {where}, torch {env['torch']}{commit}"]
    for name in sorted({c.preset for c in plan.cases}):
        p = PRESETS[name]
        skewed = {c.skew for c in plan.cases if c.preset == name} - {None}
        routing = f"{p.routing} routing" + (f" with {', '.join(sorted(skewed))} (Zipf(1.2)) expert popularity"
                                            if skewed else "")
        lines.append(f"  {name}: hidden {p.hidden}, {p.num_experts} experts, top-{p.num_topk}, {routing}")
    lines.append(f"  seed {plan.seed}; {plan.iters} timed calls after {plan.warmup} warm-up; times are the slowest "
                 f"rank's per call" + ("; L2 flushed and a barrier before each call" if plan.cuda
                                       else "; a barrier before each call"))
    lines.append("  DeepEP GB/s = rank-dedup rows received (own share included) x row bytes / p50, the same bytes "
                 "for every provider; vs X = p50 / X's p50 (below 1: faster)")
    ceiling = next((m for m in state.measurements if m.provider == PEER_COPY), None)
    if ceiling is not None:
        lines.append(f"  link ceiling (copy-engine peer copy, 256 MiB, cuda:0 -> cuda:1): "
                     f"{ceiling.recv_bytes / ceiling.p50 / 1e9:.0f} GB/s; vs floor = p50 / (link bytes / ceiling)")
    for f in state.failures:
        layout = f" {f.layout}" if f.layout else ""
        lines.append(f"FAILED {f.case.label}{layout} {f.provider}: {f.message}")
    if not state.failures and not aborted:
        lines.append("  correctness: every configuration below matched epcomm.reference bitwise on fresh random "
                     "inputs before it was timed")
    if aborted:
        lines.append(f"ABORTED: the worker pool failed; results below are partial:\n{aborted}")
    print("\n".join(lines))
    print()
    print(report.table(state.entries, gpu_link), flush=True)


def _run_check(rest: list) -> int:
    try:
        from ..check import main as check_main
    except ModuleNotFoundError as exc:
        if exc.name != "epcomm.check":
            raise
        print("epcomm-bench --check: the planning check epcomm.check is not part of this installation "
              "(module epcomm.check not found); update epcomm, or run the test suite (pytest) instead",
              file=sys.stderr)
        return 2
    return check_main(rest, prog="epcomm-bench --check")


def main(argv: Optional[list] = None, *, pool: Optional[WorkerPool] = None) -> int:
    """Entry point of `epcomm-bench` and `python -m epcomm.bench`; returns the exit status.

    Args:
        argv: command-line arguments (default `sys.argv[1:]`).
        pool: an existing gloo/NCCL `WorkerPool` of the right size to run on (tests); default: spawn one.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--check" in argv:
        rest = list(argv)
        rest.remove("--check")
        return _run_check(rest)
    if "--eplb" in argv:
        from .eplb import run_eplb

        rest = list(argv)
        rest.remove("--eplb")
        return run_eplb(rest, pool=pool)
    if "--suite" in argv or any(a.startswith("--suite=") for a in argv):
        from .collectives import run_suite  # checks --suite itself (only "collectives"); 2 on usage errors

        return run_suite(argv, pool=pool)
    parser = build_parser()
    opts = parser.parse_args(argv)
    try:
        plan = make_plan(opts)
    except ValueError as exc:
        parser.error(str(exc))
    return run(plan, pool)
