"""Turn measured times into records, the table, the JSON file and the plot.

A record is one figure, keyed by (op, provider, mode, metric, preset, sms, device) plus the rest of the
configuration (tokens per rank, layout, dtype, skew, ranks); every record of a run shares one environment
(versions, git commit, timestamp) written beside them.

Metrics (docs/benchmarks.md):
    time_p50_us, time_p20_us, time_p80_us: quantiles of the per-call time (slowest rank of each call).
    deepep_gbps: bytes of all rank-dedup rows a rank receives (its own share included; BF16 rows hidden*2,
        FP8 rows hidden*(1+4/128) bytes) / median time. The same bytes for every provider of a case, so the
        figures compare work done, not bytes moved (the torch-native dispatcher moves one row per selection).
    link_gbps: the rows from other ranks in those bytes / median time (GPU only: a link exists).
    link_ceiling_ratio: link_gbps / the copy-engine peer-copy ceiling measured in the same run.
    floor_ratio: median time / (link bytes / ceiling); 1.0 is the physical limit.
    vs_torch_native, vs_raw_a2a: median time / the other provider's median time for the same work
        (below 1: faster than it).
    vs_cached: a full dispatch's median time / the cached dispatch's on its handle (same provider and SMs).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional

from .cases import PEER_COPY, TORCH_NATIVE, Case, deepep_row_bytes
from .timing import quantile

SCHEMA = "epcomm-bench/1"
KEY_FIELDS = ("op", "provider", "mode", "metric", "preset", "sms", "device")


@dataclass
class Measurement:
    """One timed operation of one provider in one configuration (times: the group's per-call seconds)."""

    case: Optional[Case]
    layout: Optional[str]  # None for providers without a layout (baselines)
    op: str
    provider: str
    mode: str
    sms: Optional[int]
    times: list
    recv_bytes: float = 0.0
    link_bytes: float = 0.0
    ratios: dict = field(default_factory=dict)

    @property
    def p50(self) -> float:
        return quantile(self.times, 0.5)


@dataclass
class Failure:
    """A configuration whose outputs did not match the reference: no number is reported for it."""

    case: Case
    layout: Optional[str]
    provider: str
    message: str


def bytes_of(case: Case, recv_rows: float, own_rows: float) -> tuple:
    """(DeepEP bytes, link bytes) of one rank from its rank-dedup received rows."""
    row = deepep_row_bytes(case.moe.hidden, case.dtype)
    return recv_rows * row, (recv_rows - own_rows) * row


def add_ratios(measurements: list) -> None:
    """Fill `ratios` of every measurement against the baselines of its case (and the link ceiling)."""
    ceiling = next((m for m in measurements if m.provider == PEER_COPY), None)
    ceiling_bps = ceiling.recv_bytes / ceiling.p50 if ceiling else None  # the peer copy's bytes / time
    by_case = {}
    cached = {}  # (case, layout, provider, SMs) -> the eager cached dispatch
    for m in measurements:
        if m.case is not None and m.layout is None:
            by_case[(m.case, m.provider, m.op)] = m
        if m.op == "dispatch" and m.mode == "cached":
            cached[(m.case, m.layout, m.provider, m.sms)] = m
    for m in measurements:
        if m.case is None:
            continue
        same_handle = cached.get((m.case, m.layout, m.provider, m.sms))
        if m.op == "dispatch" and m.mode == "full" and same_handle is not None:
            m.ratios["vs_cached"] = m.p50 / same_handle.p50  # what a CPU-synced dispatch costs over a cached one
        native = by_case.get((m.case, TORCH_NATIVE, m.op))
        raw = next((b for (c, p, _), b in by_case.items() if c == m.case and p.endswith("-a2a")), None)
        if native is not None and m.provider != TORCH_NATIVE:
            m.ratios["vs_torch_native"] = m.p50 / native.p50
        if raw is not None and m is not raw:
            m.ratios["vs_raw_a2a"] = m.p50 / raw.p50
        if ceiling_bps and m.link_bytes > 0:
            m.ratios["link_ceiling_ratio"] = m.link_bytes / m.p50 / ceiling_bps
            m.ratios["floor_ratio"] = m.p50 / (m.link_bytes / ceiling_bps)


def records(measurements: list, device: str, ranks: int, gpu_link: bool) -> list:
    """Every figure of the run as a flat record (see the module docstring for the metrics)."""
    out = []
    for m in measurements:
        base = dict(op=m.op, provider=m.provider, mode=m.mode, preset=m.case.preset if m.case else None,
                    sms=m.sms, device=device, tokens_per_rank=m.case.tokens if m.case else None,
                    layout=m.layout, dtype=m.case.dtype if m.case else None, skew=m.case.skew if m.case else None,
                    ranks=ranks)
        figures = [("time_p50_us", m.p50 * 1e6, "us"), ("time_p20_us", quantile(m.times, 0.2) * 1e6, "us"),
                   ("time_p80_us", quantile(m.times, 0.8) * 1e6, "us"), ("calls", len(m.times), "count"),
                   ("time_min_us", min(m.times) * 1e6, "us"), ("time_p5_us", quantile(m.times, 0.05) * 1e6, "us"),
                   ("time_p95_us", quantile(m.times, 0.95) * 1e6, "us"), ("time_max_us", max(m.times) * 1e6, "us"),
                   ("times_us", [round(t * 1e6, 2) for t in m.times], "us")]
        if m.provider == PEER_COPY:
            figures.append(("ceiling_gbps", m.recv_bytes / m.p50 / 1e9, "GB/s"))
        else:
            figures += [("deepep_gbps", m.recv_bytes / m.p50 / 1e9, "GB/s"), ("recv_bytes", m.recv_bytes, "B")]
            if gpu_link:
                figures += [("link_gbps", m.link_bytes / m.p50 / 1e9, "GB/s"), ("link_bytes", m.link_bytes, "B")]
        figures += [(k, v, "ratio") for k, v in m.ratios.items()]
        out += [dict(base, metric=k, value=v, unit=u) for k, v, u in figures]
    return out


def write_json(path: str, environment: dict, options: dict, recs: list, failures: list) -> None:
    doc = dict(schema=SCHEMA, key=list(KEY_FIELDS), environment=environment, options=options, records=recs,
               failures=[dict(case=f.case.as_dict(), layout=f.layout, provider=f.provider, message=f.message)
                         for f in failures])
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1, default=str)
        fh.write("\n")


# ----------------------------------------------------------------------------------------------------------
# table
# ----------------------------------------------------------------------------------------------------------
def _num(v: Optional[float], digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}" if abs(v) >= 1 else f"{v:.{digits + 1}f}"


def _ratio(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def table(entries: list, gpu_link: bool) -> str:
    """A Markdown table: one row per `Measurement`, and a FAILED row with no numbers per `Failure`, in order."""
    head = ["preset", "T/rank", "layout", "dtype", "op", "provider", "mode", "SMs", "p50 us", "p20 us", "p80 us",
            "DeepEP GB/s"]
    head += ["link GB/s", "of ceiling"] if gpu_link else []
    head += ["vs native", "vs a2a", "vs cached"] + (["vs floor"] if gpu_link else [])
    rows = []
    for m in entries:
        c = m.case
        if isinstance(m, Failure):
            row = [c.preset + (f" ({c.skew})" if c.skew else ""), str(c.tokens), m.layout or "-", c.dtype, "*",
                   m.provider, "*", "-", "FAILED"]
            rows.append(row + [""] * (len(head) - len(row)))
            continue
        preset = "-" if c is None else c.preset + (f" ({c.skew})" if c.skew else "")
        row = [preset, "-" if c is None else str(c.tokens), m.layout or "-", "-" if c is None else c.dtype, m.op,
               m.provider, m.mode, "-" if m.sms is None else str(m.sms), _num(m.p50 * 1e6),
               _num(quantile(m.times, 0.2) * 1e6), _num(quantile(m.times, 0.8) * 1e6),
               _num(m.recv_bytes / m.p50 / 1e9, 2)]
        if gpu_link:
            link = m.link_bytes / m.p50 / 1e9 if c is not None else None
            row += [_num(link, 2), _ratio(m.ratios.get("link_ceiling_ratio"))]
        row += [_ratio(m.ratios.get("vs_torch_native")), _ratio(m.ratios.get("vs_raw_a2a")),
                _ratio(m.ratios.get("vs_cached"))]
        row += [_ratio(m.ratios.get("floor_ratio"))] if gpu_link else []
        rows.append(row)
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    right = set(range(7, len(head)))

    def fmt(r):
        return "| " + " | ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in
                                  enumerate(zip(r, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 1) + (":" if i in right else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([fmt(head), sep] + [fmt(r) for r in rows])


# ----------------------------------------------------------------------------------------------------------
# plot
# ----------------------------------------------------------------------------------------------------------
def plot(recs: list, path: str) -> None:
    """Median time against tokens per rank, one panel per preset, with the link floor where it was measured.

    Works from records alone (e.g. those of a `--json` file). Needs matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [r for r in recs if r["metric"] == "time_p50_us" and r["preset"] is not None]
    ceiling = next((r["value"] for r in recs if r["metric"] == "ceiling_gbps"), None)
    presets = sorted({r["preset"] for r in times})
    fig, axes = plt.subplots(1, max(len(presets), 1), figsize=(6.5 * max(len(presets), 1), 4.8), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        lines: dict = {}
        floors: dict = {}
        for r in times:
            if r["preset"] != preset:
                continue
            label = " ".join(str(v) for v in (r["provider"], r["op"], r["mode"], r["layout"] or "", r["dtype"],
                                               r["skew"] or "", f"sms={r['sms']}" if r["sms"] else "") if v)
            lines.setdefault(label, []).append((r["tokens_per_rank"], r["value"]))
        if ceiling:
            for r in recs:
                if r["metric"] == "link_bytes" and r["preset"] == preset and r["provider"].startswith("epcomm"):
                    floors.setdefault(r["dtype"], {})[r["tokens_per_rank"]] = r["value"] / (ceiling * 1e9) * 1e6
        styles = ("-", "--", ":", "-.")  # past the colour cycle's 10 colours, lines differ by their style
        for i, (label, pts) in enumerate(sorted(lines.items())):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^D"[i // 10 % 4],
                    linestyle=styles[i // 10 % 4], label=label)
        for dtype, pts in sorted(floors.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], linestyle="--", color="black",
                    label=f"link floor {dtype} ({ceiling:.0f} GB/s)")
        ax.set_xscale("log", base=2)
        ticks = sorted({p[0] for pts in lines.values() for p in pts})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("median time (us)")
        ax.set_title(preset)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
