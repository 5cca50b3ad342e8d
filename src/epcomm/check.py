"""Planning check: every constraint epcomm enforces for a planned MoE configuration, with no GPU or process group.

    python -m epcomm.check --ranks 8 --experts 256 --topk 6 --hidden 7168 --tokens 16384 --fp8
    epcomm-bench --check ...            # the same, through the benchmark command

Prints one line per constraint, `PASS`, `FAIL`, `UNCHECKED` (a requirement only the target machine can confirm)
or `NOTE` (a rule the data or the call must follow, checked at run time), each with its reason; then the buffer
size hint per transport, the bytes one dispatch moves per rank, the worst-case sync-free output rows and the SM
hint; then an annotated listing of the calls one MoE layer makes, with this configuration's numbers.

Conventions: `--tokens` is tokens per rank per call, i.e. `num_max_tokens_per_rank` N (the example's 16384 tokens
on 8 ranks is 16384 on every rank), and every call is assumed to carry the full N tokens. `--dtype` is the element
type of `x` (of the expert outputs with `--fp8`) and the type the buffer is sized for. `--device` is the device of
the planned run: `cuda` with `--transport nvlink`, else `cpu`. `--num-bytes` defaults to what `EPBuffer(...,
num_bytes=None)` allocates. `--ranks-per-host` (default: all on one host) feeds `LOCAL_WORLD_SIZE` into the size
formula. The constraints are the checks of `EPBuffer.__init__`, `resolve.resolve_dispatch` and
`resolve.resolve_combine` (with validate.py's helpers), evaluated through the same functions where they are
shape-only.

Exit status: 0 when nothing FAILs, 1 otherwise, 2 for bad command-line arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace
from typing import Optional
from unittest import mock

import torch

from . import exact_nvlink, envs, fp8, layout, pipeline, sizing
from .records import Field, RecordSpec
from .transport import base as transport_base
from .transport.nvlink import NVLinkTransport
from .validate import Checker, XSpec, check_capacity

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
H200_SMS, H200_NVLINK_GBS = 132, 0.9 * 18 * 26.5625  # what EPBuffer.get_theoretical_num_sms assumes off-GPU
H200_MEMORY_GIB = 141


def _positive(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return int(text)


def _gib(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of GiB > 0, got {text}")
    return value


def _size_kw(a) -> dict:
    """Keyword arguments of `sizing.buffer_size_hint` for the plan (what `EPBuffer(num_bytes=None)` passes)."""
    return dict(num_topk=a.topk, use_fp8_dispatch=a.fp8, allow_multiple_reduction=a.allow_multiple_reduction,
                elem_size=DTYPES[a.dtype].itemsize)


def build_parser(prog: str = "python -m epcomm.check") -> argparse.ArgumentParser:
    """The command-line flags (see the module docstring for their conventions)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=_positive, required=True, help="EP group size R")
    p.add_argument("--experts", type=int, required=True, help="num_experts E (all ranks)")
    p.add_argument("--topk", type=int, required=True, help="num_topk K")
    p.add_argument("--hidden", type=int, required=True, help="hidden size H")
    p.add_argument("--tokens", type=int, required=True, help="tokens per rank per call = num_max_tokens_per_rank N")
    p.add_argument("--fp8", action="store_true", help="dispatch FP8 data + 1x128 block scales")
    p.add_argument("--layout", choices=("non-expand", "expand"), default="non-expand")
    p.add_argument("--alignment", type=int, default=1, help="expert_alignment (default 1)")
    p.add_argument("--transport", choices=("auto", "collective", "nvlink"), default="auto")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="x / expert-output dtype (default bf16)")
    p.add_argument("--num-bytes", type=int, default=None, help="explicit EPBuffer num_bytes (default: the hint)")
    p.add_argument("--allow-multiple-reduction", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="device of the planned run (default: cuda with --transport nvlink, else cpu)")
    p.add_argument("--ranks-per-host", type=_positive, default=None, help="default: every rank on one host")
    p.add_argument("--device-memory-gib", type=_gib, default=None,
                   help="memory of one device in GiB: the buffer must fit in it (default: only a note when the "
                        "buffer exceeds an H200's 141 GiB)")
    return p


class Report:
    """Collects status lines; `failed` is True once any line FAILs."""

    def __init__(self, out):
        self.out, self.failed = out, False

    def head(self, title: str) -> None:
        print(f"\n{title}", file=self.out)

    def info(self, text: str) -> None:
        print(f"  {text}", file=self.out)

    def line(self, status: str, text: str) -> None:
        self.failed |= status == "FAIL"
        print(f"  {status:<9} {text}", file=self.out)

    def check(self, ok: bool, text: str, fix: str = "") -> bool:
        self.line("PASS" if ok else "FAIL", text + ("" if ok or not fix else f" -- {fix}"))
        return ok


def _local_world_size(n: Optional[int]):
    """Let `sizing.num_nvlink_ranks` see `n` ranks per host (None: the environment as it is); restores it."""
    return mock.patch.dict(os.environ, {} if n is None else {"LOCAL_WORLD_SIZE": str(n)})


def _b(n: float) -> str:
    return f"{int(n):,} B ({n / (1 << 20):,.1f} MiB)" if n < 1 << 30 else f"{int(n):,} B ({n / (1 << 30):,.2f} GiB)"


def _capacity(r: Report, call: str, a, nb: int, *, is_fp8: bool, elem: int) -> None:
    """`validate.check_capacity` on a stand-in buffer: the verdict epcomm gives at run time."""
    which = "combine" if call.endswith("combine") else "dispatch"
    kw = dict(num_topk=a.topk, use_fp8_dispatch=is_fp8, allow_multiple_reduction=a.allow_multiple_reduction,
              elem_size=elem)
    need = sizing.required_bytes(a.ranks, a.tokens, a.hidden, which=which, **kw)
    stub = SimpleNamespace(num_ranks=a.ranks, num_bytes=nb, allow_multiple_reduction=a.allow_multiple_reduction)
    msg = ""
    try:
        check_capacity(Checker(call, 0, torch.device("cpu")), stub, num_tokens=a.tokens, hidden=a.hidden,
                       num_topk=a.topk, is_fp8=is_fp8, elem_size=elem, n=a.tokens, which=which)
    except ValueError as e:
        msg = str(e).split("; ", 1)[-1]
    r.check(not msg, f"{call}: num_bytes fits the call (needs {need:,} bytes, buffer has {nb:,})", msg)


def check_constraints(r: Report, a) -> tuple:
    """Print every constraint of the plan to `r`.

    Args:
        r: the report.
        a: the parsed flags plus `nb` (the buffer's num_bytes); sets `a.chosen` (the transport name).

    Returns:
        `(sized, routable)`: whether sizes can be computed, and whether experts split evenly over the ranks.
    """
    R, E, K, H, N, dt = a.ranks, a.experts, a.topk, a.hidden, a.tokens, DTYPES[a.dtype]
    r.head("EPBuffer construction (collective: every rank)")
    shape_ok = r.check(N > 0 and H > 0, f"num_max_tokens_per_rank > 0 and hidden > 0: N = {N}, H = {H}",
                       "num_bytes=None sizes the buffer from them")
    if a.num_bytes is None:
        r.line("PASS", "num_bytes=None: sized by EPBuffer.get_buffer_size_hint (below), a multiple of 2 MiB")
    else:
        r.check(a.num_bytes > 0 and a.num_bytes % sizing.ALLOCATION_ALIGNMENT == 0,
                f"num_bytes is a positive multiple of 2 MiB: {a.num_bytes:,}"
                + (f" % {sizing.ALLOCATION_ALIGNMENT:,} = {a.num_bytes % sizing.ALLOCATION_ALIGNMENT:,}"
                   if a.num_bytes > 0 else " is not > 0"), "round it up or pass num_bytes=None")
    dev = torch.device(a.device)
    names = transport_base.available_transports(dev)
    auto = [n for n, (devs, use) in transport_base._REGISTRY.items() if use and dev.type in devs]
    chosen = (auto[:1] or ["(none)"])[0] if a.transport == "auto" else a.transport
    how = f"resolves to {chosen!r}" if a.transport == "auto" else "is available"
    r.check(chosen in names, f"transport={a.transport!r} on {dev.type} {how} (this build has for {dev.type}: "
            f"{', '.join(names) or 'none'})",
            "this epcomm build cannot construct it; EPBuffer raises ValueError")
    a.chosen = chosen

    r.head("dispatch (reference §9.2 as amended by docs/decisions.md)")
    ok_e = r.check(0 < E <= sizing.MAX_EXPERTS, f"0 < num_experts <= {sizing.MAX_EXPERTS}: {E}",
                   "epcomm's layouts keep per-expert tables (DeepEP allows 2048)")
    ok_div = ok_e and r.check(E % R == 0, f"num_experts % ranks == 0: {E} % {R} = {E % R}"
                              + (f" ({E // R} experts per rank)" if E % R == 0 else ""),
                              f"use a multiple of {R}, e.g. {E - E % R or R} or {E - E % R + R}")
    ok_k = r.check(1 <= K <= sizing.MAX_TOPK, f"1 <= num_topk <= {sizing.MAX_TOPK}: num_topk = {K}",
                   f"topk_idx has 1 to {sizing.MAX_TOPK} columns (--topk)")
    if ok_e and ok_k and K > E:
        r.line("NOTE", f"num_topk {K} > num_experts {E}: ids in a row are distinct, so >= {K - E} columns are -1")
    rows_ok, a.worst_rows = True, R * N  # received rows of a dispatch at most (non-expand)
    if r.check(a.alignment >= 1, f"expert_alignment >= 1: {a.alignment}") and ok_div and ok_k:
        rows = layout.worst_case_expanded_rows(R, N, K, E // R, a.alignment)
        a.worst_rows = rows if a.layout == "expand" else a.worst_rows
        rows_ok = r.check(rows < 2 ** 31, f"aligned rows < 2^31 (int32 row indices): at most {rows:,}",
                          "use a smaller expert_alignment or num_max_tokens_per_rank")
    r.line("PASS", f"tokens <= num_max_tokens_per_rank: {N} <= {N} (every call of this plan carries N tokens)")
    if a.fp8:
        p, q = fp8.num_sf_packs(max(H, 0)), fp8.num_sf_packs(max(H, 0), use_ue8m0=True)
        r.line("PASS", f"x = (data [T, {H}] float8_e4m3fn, scales [T, P] fp32 or int32): 1x128 blocks give "
                       f"P = {p} fp32 scales, or P = {q} int32 UE8M0 packs")
        r.line("NOTE", f"hidden % 128 == 0 is NOT required by epcomm: {H} % 128 = {H % 128}"
                       + (" (whole blocks)" if H % 128 == 0 else f" (the last block holds {H % 128} columns)"))
    else:
        r.line("PASS", f"x dtype {a.dtype} is one of bf16, fp16, fp32, fp64 (docs/decisions.md decision 3)")
    r.line("NOTE", f"topk_weights [T, {K}] {'float64' if dt == torch.float64 and not a.fp8 else 'float32'}; "
                   f"topk_idx [T, {K}] int64 or int32, ids in [-1, {E}), no expert twice in a row (checked on data)")
    r.line("PASS", "defer_epilogue=True with async_with_compute_stream=True (as in the walkthrough)")
    if a.layout == "non-expand":
        r.line("NOTE", "do_zero_padding=True and emit_expert_ids=True need --layout expand")
    if shape_ok and ok_k:
        _capacity(r, "EPBuffer.dispatch", a, a.nb, is_fp8=a.fp8, elem=2 if a.fp8 else dt.itemsize)

    r.head("combine (reference §11.1 as amended by docs/decisions.md)")
    r.line("PASS", f"x [{'S' if a.layout == 'expand' else 'M'}, {H}] {a.dtype} (combine takes no FP8)"
                   + ("; expert outputs go back in " + a.dtype if a.fp8 else ""))
    r.line("NOTE", f"bias (e.g. the shared-expert output) is [T, {H}] {a.dtype}, or a pair of them")
    if not a.allow_multiple_reduction:
        r.line("NOTE", "allow_multiple_reduction=False: epcomm.TokenDispatcher (training) rejects the buffer"
                       + ("; combine(topk_weights=...) is rejected in the expand layout" if a.layout == "expand"
                          else ""))
    if shape_ok and ok_k:
        _capacity(r, "EPBuffer.combine", a, a.nb, is_fp8=False, elem=dt.itemsize)

    r.head(f"transport {chosen!r} on {dev.type}")
    elem_d, elem_c = (1 if a.fp8 else dt.itemsize), dt.itemsize
    recv_x = a.worst_rows * max(H, 0) * elem_d  # a dispatch's output at most (without CPU sync: always)
    need = f"the buffer ({_b(a.nb)}) and a dispatch's worst-case recv_x ({a.worst_rows:,} rows: {_b(recv_x)})"
    if a.device_memory_gib is not None:
        r.check(a.nb + recv_x <= a.device_memory_gib * (1 << 30), f"{need} fit one device's memory: "
                f"{_b(a.nb + recv_x)} <= {a.device_memory_gib:g} GiB",
                "lower num_max_tokens_per_rank (--tokens), hidden or expert_alignment, or use FP8")
    elif a.nb + recv_x > H200_MEMORY_GIB * (1 << 30):
        r.line("NOTE", f"{need} take {_b(a.nb + recv_x)} per rank, more than an H200 holds ({H200_MEMORY_GIB} "
                       "GiB); --device-memory-gib checks it against your device")
    if chosen == "nvlink":
        r.check(dev.type == "cuda", f"nvlink runs on CUDA devices: --device {dev.type}", "use --device cuda")
        r.line("UNCHECKED", "(needs hardware) CUDA GPUs on one host with peer access over NVLink")
        r.line("UNCHECKED", f"(needs hardware) ranks <= GPUs per host: {R} ranks need {R} GPUs on one host")
        r.check(a.ranks_per_host in (None, R), f"nvlink spans one host: ranks per host = "
                f"{a.ranks_per_host or R} of {R}", "use the collective transport across hosts")
        r.line("UNCHECKED", f"(needs hardware) a CUDA build of torch >= 2.11 with symmetric memory on the GPU "
                            f"host (here: torch {torch.__version__})")
        for what, e in (("dispatch", elem_d), ("combine", elem_c)):
            words = H * e % 4 == 0
            r.line("NOTE", f"nvlink {what} rows are {H * e} bytes: "
                   + ("whole 4-byte words, so sync-free calls at decode sizes take the fused kernels"
                      if words else "not whole 4-byte words, so sync-free calls take the generic path"))
        rows = R * a.tokens
        r.line("NOTE", f"nvlink sync-free dispatch: R * num_max_tokens_per_rank = {rows} "
               + ("<=" if rows <= envs.fused_sync_free_rows() else ">")
               + f" EPCOMM_FUSED_SYNC_FREE_ROWS ({envs.fused_sync_free_rows()}): "
               + ("the fused kernels" if rows <= envs.fused_sync_free_rows() else "the generic path"))
        local = E // R if R and E % R == 0 else 0
        fused = (envs.fused_exact() and H * elem_d % 4 == 0
                 and exact_nvlink.rows_fit(R, local, NVLinkTransport.header_cols))
        r.line("NOTE", "nvlink CPU-synced dispatch: "
               + ("the fused kernels (layouts and topk_idx checks on the device, one host read)" if fused else
                  "the generic path (" + ("EPCOMM_FUSED_EXACT=0" if not envs.fused_exact() else
                                          f"needs rows of whole 4-byte words and 1-{exact_nvlink.MAX_LOCAL_EXPERTS} "
                                          "local experts in the header row") + ")"))
    else:
        r.line("PASS", "collective needs no hidden-size alignment and no peer access (docs/decisions.md)")
        if dev.type == "cuda":
            r.line("UNCHECKED", f"(needs hardware) an NCCL process group with one CUDA GPU per rank ({R} GPUs)")
            r.line("UNCHECKED", "(needs hardware) an explicit num_sms must be in [1, the GPU's SM count]")
        else:
            r.line("NOTE", f"gloo process group, {R} CPU processes; num_sms/num_qps are ignored on CPU")
    return shape_ok and ok_k, ok_div and a.alignment >= 1 and rows_ok


def report_numbers(r: Report, a, routable: bool) -> None:
    """Print the size hints and, when `routable`, traffic per dispatch, worst-case sync-free rows and SM hint."""
    R, E, K, H, N, dt = a.ranks, a.experts, a.topk, a.hidden, a.tokens, DTYPES[a.dtype]
    kw = _size_kw(a)
    r.head(f"buffer size hint: EPBuffer.get_buffer_size_hint({R}, {N}, {H}, {K}, use_fp8_dispatch={a.fp8}, "
           f"allow_multiple_reduction={a.allow_multiple_reduction}, dtype=torch.{str(dt)[6:]})")
    with _local_world_size(R):
        one_host = sizing.buffer_size_hint(R, N, H, **kw)
    with _local_world_size(1):
        r.info(f"collective, all {R} ranks on one host: {_b(one_host)}; over several hosts (LOCAL_WORLD_SIZE < "
               f"{R}): {_b(sizing.buffer_size_hint(R, N, H, **kw))}" if R > 1 else f"collective: {_b(one_host)}")
    r.info(f"nvlink (one host): {_b(one_host)}")
    r.info(f"this plan's buffer: num_bytes = {_b(a.nb)}; fits num_max_tokens_per_rank <= "
           f"{sizing.max_tokens_that_fit(a.nb, R, H, **kw):,} for dispatch")
    if not routable:
        return

    L = E // R
    t = sizing._expected_distinct_groups(E, min(K, E), R)  # noqa: SLF001 -- the SM model's routing model
    data = torch.empty(0, H, dtype=torch.float8_e4m3fn if a.fp8 else dt, device="meta")
    sf = torch.empty(0, fp8.num_sf_packs(H), dtype=torch.float32, device="meta") if a.fp8 else None
    wdt = torch.float64 if dt == torch.float64 and not a.fp8 else torch.float32
    rec = pipeline.dispatch_record_spec(XSpec(data, sf), K, wdt, with_routing=True).nbytes
    back = RecordSpec([Field("x", dt, (H,))]).nbytes
    rows = N * t
    r.head("traffic per rank per dispatch (uniform routing, collective records)")
    r.info(f"expected distinct ranks per token t = {t:.3f} of {R} (top-{K} of {E} experts, {L} per rank)")
    r.info(f"rows sent = rows received = N * t = {rows:,.0f}, of which {rows * (R - 1) / R:,.0f} cross ranks "
           f"(one row per token and destination rank, in both layouts)")
    r.info(f"dispatch record {rec:,} B (x{' + scales' if a.fp8 else ''} + topk_idx + key + weights): "
           f"{_b(rows * rec)} per dispatch, {_b(rows * (R - 1) / R * rec)} over links")
    per_pair = a.layout == "expand" and not a.allow_multiple_reduction
    back_rows = N * min(K, E) if per_pair else rows
    unit = "one per (token, expert) pair" if per_pair else "one per token and rank"
    r.info(f"combine sends {back_rows:,.0f} rows back ({unit}), record {back:,} B ({a.dtype} row): "
           f"{_b(back_rows * back)} per combine")
    r.info(f"sync-free (do_cpu_sync=False) on collective: N rows to every peer = {R * N:,} rows, {_b(R * N * rec)}")
    if a.layout == "expand":
        r.info(f"expanded rows per rank: N * K = {N * min(K, E):,} expected, ~{N * min(K, E) / L:,.0f} per local "
               f"expert (+ up to {a.alignment - 1} padding rows each)")
    s = layout.worst_case_expanded_rows(R, N, K, L, a.alignment)
    r.head("worst-case sync-free output rows (reference §9.4, §9.5)")
    r.info(f"non-expand: M = R * N = {R * N:,} rows ({_b(R * N * H * (1 if a.fp8 else dt.itemsize))} of recv_x)")
    r.info(f"expand: S = align(R*N*min(K, L) + (alignment-1)*L, alignment) = {s:,} rows")
    sms = sizing.theoretical_num_sms(R, E, K, H200_NVLINK_GBS, H200_SMS)
    r.head(f"get_theoretical_num_sms({E}, {K}) = {sms} (H200-class: {H200_SMS} SMs, {H200_NVLINK_GBS:.0f} GB/s "
           f"NVLink; a hint: the collective transport runs no SM-limited kernels)")


def walkthrough(a) -> str:
    """An annotated listing of one MoE layer's epcomm calls, filled with the plan's numbers.

    Args:
        a: the parsed flags plus `hint` and `chosen` (set by `main` and `check_constraints`).

    Returns:
        The listing: Python, one comment per line where there is something to say.
    """
    R, E, K, H, N, L = a.ranks, a.experts, a.topk, a.hidden, a.tokens, a.experts // a.ranks
    expand, amr, d = a.layout == "expand", a.allow_multiple_reduction, a.dtype
    rows = N * min(K, E) if expand else N * sizing._expected_distinct_groups(E, min(K, E), R)  # noqa: SLF001
    worst = layout.worst_case_expanded_rows(R, N, K, L, a.alignment) if expand else R * N
    size = (f"num_bytes=None: get_buffer_size_hint = {_b(a.hint)}" if a.num_bytes is None
            else f"num_bytes given (the hint is {_b(a.hint)})")
    nb = "" if a.num_bytes is None else f"num_bytes={a.num_bytes}, "
    xin = "x_fp8" if a.fp8 else "x"
    code = [  # (code, comment)
        ("", f"One MoE layer: {R} ranks, {E} experts ({L} per rank), top-{K}, hidden {H}, {N:,} tokens per rank, "
             f"{'FP8' if a.fp8 else d} dispatch, {d} combine, {a.layout} layout"),
        ("import torch, epcomm", ""),
        ("from epcomm.fp8 import per_token_cast_to_fp8, per_token_cast_back", ""), ("", ""),
        ("", f"Once, on every rank (collective); one buffer serves every layer. {size}"),
        (f"buffer = epcomm.EPBuffer(group, {nb}num_max_tokens_per_rank={N}, hidden={H}, num_topk={K},", ""),
        (f"    use_fp8_dispatch={a.fp8}, allow_multiple_reduction={amr}, transport={a.transport!r},", ""),
        (f"    dtype=torch.{str(DTYPES[d])[6:]})", f"-> transport {a.chosen!r} on {a.device}"), ("", ""),
        ("", f"Router: x [T <= {N}, {H}] {d} -> scores [T, {E}] -> top-{K}"),
        ("torch.set_grad_enabled(False)", "inference: EPBuffer calls are not recorded by autograd (training: "
                                          "epcomm.TokenDispatcher, below)"),
        (f"topk_weights, topk_idx = router(x).float().softmax(-1).topk({K}, dim=-1)",
         f"[T, {K}] fp32, [T, {K}] int64"),
        *([("x_fp8 = per_token_cast_to_fp8(x)", f"(data [T, {H}] e4m3, scales [T, {fp8.num_sf_packs(H)}] fp32)")]
          if a.fp8 else []),
        (f"event = buffer.dispatch({xin}, topk_idx, topk_weights, num_experts={E},", "returns an EventOverlap"),
        (f"    expert_alignment={a.alignment}, do_expand={expand},", ""),
        ("    async_with_compute_stream=True, defer_epilogue=True)", ""),
        ("shared_out = shared_experts(x)", f"[T, {H}] {d}: runs while the dispatch is in flight"),
        ("recv_x, recv_topk_idx, recv_topk_weights, handle = event.wait()", "first wait places rows, returns"),
        ("", f"recv_x [{'S' if expand else 'M'}, {H}]: ~{rows:,.0f} rows with CPU sync under uniform routing, "
             f"{worst:,} allocated without it"),
        ("xs = per_token_cast_back(*recv_x).to(x.dtype)" if a.fp8 else "xs = recv_x",
         "or give (data, scales) to an FP8 GEMM" if a.fp8 else ""),
        ("expert_out = torch.zeros_like(xs)", f"[{'S' if expand else 'M'}, {H}]"),
    ]
    if expand:
        code += [("start = 0", ""),
                 ("for i, a_i in enumerate(handle.num_recv_tokens_per_expert_list):", f"{L} aligned counts"),
                 ("    seg = slice(start, start + a_i); start += a_i", f"~{rows / L:,.0f} rows each (uniform)"),
                 ("    w = recv_topk_weights[seg, None].to(xs.dtype)", "[S] fp32; padding rows hold 0"),
                 ("    expert_out[seg] = experts[i](xs[seg]) * w", "combine does not weight: do it here"),
                 ("", "sync-free: the counts are on the device, handle.psum_num_recv_tokens_per_expert")]
    else:
        code += [(f"for i in range({L}):", "local experts; recv_topk_idx holds -1 in non-local columns"),
                 ("    rows, cols = (recv_topk_idx == i).nonzero(as_tuple=True)", ""),
                 ("    w = recv_topk_weights[rows, cols, None].to(xs.dtype)", ""),
                 ("    expert_out.index_add_(0, rows, experts[i](xs[rows]) * w)", "combine does not weight"),
                 ("", "grouped GEMMs: sizes from handle.num_recv_tokens_per_expert_list / psum")]
    code += [
        ("", ""), ("y, _, _ = buffer.combine(expert_out, handle, bias=shared_out)", f"[T, {H}] {d}, fp32 sum, bias first"),
        ("", ""), ("torch.set_grad_enabled(True)", ""),
        ("", "Training: dispatch backward = combine(grad, handle, topk_weights=grad_w); combine backward ="),
        ("", "cached dispatch(grad_y, handle=handle). epcomm.TokenDispatcher wires both into autograd"
             + ("" if amr else " (needs allow_multiple_reduction=True)")),
        (f"dispatcher = epcomm.TokenDispatcher(buffer, {E}, expert_alignment={a.alignment}, do_expand={expand})", ""),
        ("recv_x, recv_topk_weights, handle = dispatcher.dispatch(x, topk_idx, topk_weights)", ""),
        ("y = dispatcher.combine(expert_out, handle, bias=shared_out)", ""),
        ("", ""), ("buffer.destroy()", "collective, after the last layer (or: with epcomm.EPBuffer(...) as buffer:)"),
    ]
    return "\n".join(f"{c:<63} # {m}" if c and m else c or (f"# {m}" if m else "") for c, m in code)


def main(argv: Optional[list] = None, prog: str = "python -m epcomm.check") -> int:
    """Run the planning check.

    Args:
        argv: command-line arguments without the program name; None reads `sys.argv[1:]`.
        prog: the program name its usage errors give (`epcomm-bench --check` passes its own).

    Returns:
        0 when no constraint FAILs, 1 otherwise (argparse exits with 2 on bad flags).
    """
    parser = build_parser(prog)
    a = parser.parse_args(argv)
    if a.ranks_per_host is not None and a.ranks > 0 and a.ranks % a.ranks_per_host:
        parser.error(f"--ranks-per-host {a.ranks_per_host} must divide --ranks {a.ranks} (every host holds as many "
                     "ranks)")
    a.device = a.device or ("cuda" if a.transport == "nvlink" else "cpu")
    r = Report(sys.stdout)
    with _local_world_size(a.ranks_per_host):
        sane = a.tokens > 0 and a.hidden > 0
        a.hint = sizing.buffer_size_hint(a.ranks, a.tokens, a.hidden, **_size_kw(a)) if sane else 0
        a.nb = a.hint if a.num_bytes is None else a.num_bytes
        print(f"epcomm planning check: {a.ranks} ranks, {a.experts} experts, top-{a.topk}, hidden {a.hidden}, "
              f"{a.tokens} tokens per rank, {'FP8' if a.fp8 else a.dtype} dispatch, {a.layout}, "
              f"transport {a.transport}, device {a.device}")
        sized, routable = check_constraints(r, a)
        if sized:
            report_numbers(r, a, routable)
    print("\nRESULT: " + ("FAIL (see the FAIL lines)" if r.failed else "PASS"))
    if sized and routable:
        print("\nWalkthrough: the calls of one MoE layer\n")
        print(walkthrough(a))
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())
