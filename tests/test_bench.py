"""`epcomm-bench` end to end (table, JSON, exit status, the correctness gate) and the baselines it measures.

Rank-side bodies are module-level so the spawned workers can import them (conftest.py puts tests/ on sys.path).
"""

import json
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

from epcomm.baselines import TorchNativeDispatcher, payload_row_bytes, raw_all_to_all
from epcomm.bench import cli
from epcomm.bench.runner import first_mismatch
from epcomm.fp8 import per_token_cast_to_fp8

SMALL = ["--tokens", "32", "--iters", "2", "--warmup", "1"]
TABLE_HEAD = ["preset", "T/rank", "layout", "dtype", "op", "provider", "mode", "SMs", "p50 us", "p20 us", "p80 us",
              "DeepEP GB/s", "vs native", "vs a2a", "vs cached"]


@pytest.fixture(autouse=True)
def cpu_plan(monkeypatch):
    """The in-process runs use the gloo pool of the test session: plan for CPU even where CUDA is present."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _table(stdout: str) -> list:
    """The trailing Markdown table of the output, as lists of cells (header first, separator dropped)."""
    lines = stdout.rstrip("\n").splitlines()
    start = len(lines)
    while start > 0 and lines[start - 1].startswith("|"):
        start -= 1
    assert start < len(lines), f"no table at the end of the output:\n{stdout}"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[start:]]
    return [rows[0]] + rows[2:]


def test_bench_subprocess_table_json_plot(tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = [sys.executable, "-m", "epcomm.bench", *SMALL, "--json", str(out_json), "--seed", "7"]
    args += ["--plot", str(out_png)]  # matplotlib is a test dependency: the plot is always drawn here
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAILED" not in proc.stdout

    table = _table(proc.stdout)
    assert table[0] == TABLE_HEAD
    rows = table[1:]
    seen = {(r[2], r[3], r[4], r[5], r[6]) for r in rows}
    for dtype in ("bf16", "fp8"):
        for layout in ("non-expand", "expand"):
            assert (layout, dtype, "dispatch", "epcomm-collective", "full") in seen
            assert (layout, dtype, "dispatch", "epcomm-collective", "cached") in seen
        assert ("-", dtype, "dispatch", "torch-native", "full") in seen
        assert ("-", dtype, "a2a", "gloo-a2a", "payload") in seen
    for layout in ("non-expand", "expand"):  # combine is BF16: measured in the bf16 case only
        assert (layout, "bf16", "combine", "epcomm-collective", "full") in seen
        assert (layout, "fp8", "combine", "epcomm-collective", "full") not in seen
    for r in rows:
        assert r[0] == "dsv3" and r[1] == "32"
        assert float(r[8].replace(",", "")) > 0
        if r[5].startswith("epcomm"):
            assert r[12].endswith("x") and r[13].endswith("x"), r

    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "epcomm-bench/1"
    assert doc["key"] == ["op", "provider", "mode", "metric", "preset", "sms", "device"]
    environment = doc["environment"]
    for key in ("torch", "python", "epcomm", "git_commit", "timestamp", "device", "backend", "ranks", "seed"):
        assert key in environment, key
    assert environment["device"] == "cpu" and environment["backend"] == "gloo" and environment["ranks"] == 2
    assert environment["seed"] == 7
    assert doc["failures"] == []
    recs = doc["records"]
    for rec in recs:
        for key in doc["key"] + ["tokens_per_rank", "layout", "dtype", "value", "unit"]:
            assert key in rec, (key, rec)
    keyed = {(r["op"], r["provider"], r["mode"], r["metric"], r["layout"], r["dtype"]): r["value"] for r in recs}
    metrics = {r["metric"] for r in recs}
    assert {"time_p50_us", "time_p20_us", "time_p80_us", "deepep_gbps", "vs_torch_native", "vs_raw_a2a"} <= metrics
    assert "link_gbps" not in metrics  # no GPU link on CPU
    # The ratios are the quotients of the medians in the same file.
    p50 = keyed[("dispatch", "epcomm-collective", "full", "time_p50_us", "expand", "bf16")]
    native = keyed[("dispatch", "torch-native", "full", "time_p50_us", None, "bf16")]
    ratio = keyed[("dispatch", "epcomm-collective", "full", "vs_torch_native", "expand", "bf16")]
    assert ratio == pytest.approx(p50 / native)
    cached = keyed[("dispatch", "epcomm-collective", "cached", "time_p50_us", "expand", "bf16")]
    ratio = keyed[("dispatch", "epcomm-collective", "full", "vs_cached", "expand", "bf16")]
    assert ratio == pytest.approx(p50 / cached)
    for r in recs:
        if r["metric"] == "time_p50_us":
            assert keyed[(r["op"], r["provider"], r["mode"], "time_p20_us", r["layout"], r["dtype"])] <= r["value"]
            assert keyed[(r["op"], r["provider"], r["mode"], "time_p80_us", r["layout"], r["dtype"])] >= r["value"]
    # Bytes: every provider of a case is credited with the same (rank-dedup) bytes.
    recv = {r["provider"]: r["value"] for r in recs if r["metric"] == "recv_bytes" and r["dtype"] == "bf16"}
    assert len(set(recv.values())) == 1 and next(iter(recv.values())) > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("fault", ["dispatch", "cached", "combine"])
def test_bench_refuses_a_failing_configuration(pools, capsys, fault):
    status = cli.main([*SMALL, "--layout", "expand", "--dtype", "bf16", "--iters", "1", "--warmup", "0",
                       "--inject-fault", fault], pool=pools.get(2, "gloo"))
    out = capsys.readouterr().out
    assert status == 1
    what = {"dispatch": "dispatch recv_x", "cached": "cached dispatch recv_x", "combine": "combine combined_x"}[fault]
    assert f"FAILED dsv3 T=32 bf16 expand epcomm-collective: rank 0: {what}: 1 of" in out
    rows = _table(out)[1:]
    epcomm_rows = [r for r in rows if r[5] == "epcomm-collective"]
    assert len(epcomm_rows) == 1 and epcomm_rows[0][8] == "FAILED"
    assert all(cell in ("", "-") for cell in epcomm_rows[0][9:]), epcomm_rows  # no number printed
    assert {r[5] for r in rows if r[8] != "FAILED"} == {"torch-native", "gloo-a2a"}  # the rest still runs


def test_bench_refuses_a_failing_baseline(pools, capsys):
    status = cli.main([*SMALL, "--layout", "non-expand", "--dtype", "fp8", "--iters", "1", "--warmup", "0",
                       "--inject-fault", "torch-native"], pool=pools.get(2, "gloo"))
    out = capsys.readouterr().out
    assert status == 1
    assert "FAILED dsv3 T=32 fp8 torch-native: rank 0: torch-native round trip: 1 of" in out
    rows = _table(out)[1:]
    assert [r[8] for r in rows if r[5] == "torch-native"] == ["FAILED"]
    # Without the baseline there is no ratio to it, but epcomm's own figures stand.
    assert all(r[12] == "-" for r in rows if r[5] == "epcomm-collective")


def test_bench_check_delegates_remaining_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("epcomm.check")
    fake.main = lambda argv, prog=None: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "epcomm.check", fake)
    assert cli.main(["--check", "--ranks", "8", "--experts", "256", "--hidden", "7168"]) == 3
    assert seen == [["--ranks", "8", "--experts", "256", "--hidden", "7168"]]


def test_bench_check_missing_module(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "epcomm.check", None)  # import fails with ModuleNotFoundError
    assert cli.main(["--check", "--ranks", "2"]) == 2
    assert "epcomm.check" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--tokens", "0"], "--tokens must be distinct counts >= 1"),
    (["--ranks", "3"], "not a multiple of 3 ranks"),
    (["--transport", "carrier-pigeon"], "is not available here"),
    (["--num-sms", "many"], "--num-sms takes integers"),
    # empty or repeated list items measured nothing, or compared a block against a copy of itself
    (["--preset", ""], "--preset needs at least one value, got ''"),
    (["--transport", ","], "--transport needs at least one value"),
    (["--num-sms", "1,,2"], "--num-sms has an empty item in '1,,2'"),
    (["--tokens", "8,8"], "--tokens lists 8 more than once"),
    (["--tokens", "8,08"], "--tokens must be distinct counts >= 1, got '8,08'"),
    (["--transport", "collective,collective"], "--transport lists collective more than once"),
    (["--ranks", "100"], "at most 64 CPU ranks"),
    # output files are checked before the run (their errors came after it, as tracebacks, and the figures were lost)
    (["--json", "{tmp}"], "is a folder; name a file in it"),
    (["--json", "{tmp}/missing/x.json"], "the folder"),
    (["--plot", "{tmp}/p.txt"], "matplotlib writes"),
])
def test_bench_rejects_bad_options(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main([a.format(tmp=tmp_path) for a in argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # the checks leave nothing behind


def test_bench_plot_without_matplotlib_says_so_before_running(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as where matplotlib is missing
    with pytest.raises(SystemExit) as exc:
        cli.main(["--plot", str(tmp_path / "p.png")])
    assert exc.value.code == 2
    assert "--plot needs matplotlib (pip install matplotlib)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_bench_suites_check_their_options_before_running(capsys, tmp_path):
    from epcomm.bench.collectives import run_suite
    from epcomm.bench.eplb import run_eplb
    assert run_suite(["--suite", "collectives", "--size-mib", "inf"]) == 2
    assert "--size-mib must be > 0" in capsys.readouterr().err
    assert run_suite(["--suite", "collectives", "--ops", "barrier,barrier"]) == 2
    assert "--ops lists barrier more than once" in capsys.readouterr().err
    assert run_suite(["--suite", "collectives", "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        run_eplb(["--json", str(tmp_path / "missing" / "x.json")])
    assert exc.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_bench_defaults_on_cpu():
    plan = cli.make_plan(cli.build_parser().parse_args([]))
    assert (plan.backend, plan.ranks, plan.iters) == ("gloo", 2, 10)
    assert [(c.preset, c.tokens, c.dtype) for c in plan.cases] == [("dsv3", 256, "bf16"), ("dsv3", 256, "fp8")]
    assert plan.layouts == ("non-expand", "expand")
    plan = cli.make_plan(cli.build_parser().parse_args(["--preset", "all", "--tokens", "64,128", "--dtype", "bf16"]))
    assert len(plan.cases) == 5 * 2


def test_first_mismatch_reports_the_first_difference():
    a = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert first_mismatch("t", a, a.clone()) is None
    b = a.clone()
    b[1, 2] = -0.0 if a[1, 2] == 0 else 100.0
    b[2, 0] = 7.5
    assert first_mismatch("t", b, a) == "t: 2 of 12 elements differ; first at [1, 2]: got 100.0, expected 6.0"
    zero = torch.zeros(2)
    assert first_mismatch("z", -zero, zero).startswith("z: 2 of 2 elements differ")  # bitwise: -0.0 != 0.0
    assert "shape" in first_mismatch("s", a, a[:2])
    assert "dtype" in first_mismatch("d", a, a.double())


# ----------------------------------------------------------------------------------------------------------
# baselines
# ----------------------------------------------------------------------------------------------------------
HIDDEN, EXPERTS, TOPK = 256, 16, 4


def _routing(rank: int, num_tokens: int):
    gen = torch.Generator().manual_seed(1234 + rank)
    topk_idx = torch.rand(num_tokens, EXPERTS, generator=gen).topk(TOPK, dim=1).indices
    topk_idx[torch.rand(num_tokens, TOPK, generator=gen) < 0.2] = -1  # some selections empty
    weights = torch.rand(num_tokens, TOPK, generator=gen)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    return x, topk_idx, weights


def _expert_fn(rows: torch.Tensor, expert: int) -> torch.Tensor:
    """A different elementwise map per global expert, so rows sent to the wrong expert show."""
    return (rows.float() * (expert + 1) - expert).to(torch.bfloat16)


def torch_native_round_trip(rank: int, world_size: int, fp8: bool):
    num_tokens = (37, 20)[rank % 2]
    x, topk_idx, weights = _routing(rank, num_tokens)
    num_local = EXPERTS // world_size
    # Every rank's inputs, to know which rows each expert must receive (expert-major, then source rank, token).
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (x, topk_idx))
    native = TorchNativeDispatcher(None, EXPERTS)
    xin = per_token_cast_to_fp8(x) if fp8 else x
    expert_x, tokens_per_expert, state = native.dispatch(xin, topk_idx, weights)

    expected_rows, counts = [], []
    for e in range(rank * num_local, (rank + 1) * num_local):
        rows = [per_token_cast_to_fp8(gx) if fp8 else gx for gx, _ in gathered]
        picked = [(r[0][(gi == e).any(1)], r[1][(gi == e).any(1)]) if fp8 else r[(gi == e).any(1)]
                  for r, (_, gi) in zip(rows, gathered)]
        counts.append(sum(int((gi == e).any(1).sum()) for _, gi in gathered))
        expected_rows += picked
    assert tokens_per_expert.tolist() == counts
    if fp8:
        assert torch.equal(expert_x[0].view(torch.uint8), torch.cat([p[0] for p in expected_rows]).view(torch.uint8))
        assert torch.equal(expert_x[1], torch.cat([p[1] for p in expected_rows]))
        expert_x = expert_x[0].float().to(torch.bfloat16)  # any bf16 rows will do for the combine check
        source = xin[0].float().to(torch.bfloat16)
    else:
        assert torch.equal(expert_x, torch.cat(expected_rows))
        source = x

    # Experts: a distinct map per expert, applied segment by segment.
    out = torch.cat([_expert_fn(seg, rank * num_local + e)
                     for e, seg in enumerate(expert_x.split(tokens_per_expert.tolist()))])
    combined = native.combine(out, state)
    # Directly: sum_k w_k * f_{e_k}(x) in fp32 over the top-k axis, 0 for empty selections, one rounding.
    terms = torch.zeros(num_tokens, TOPK, HIDDEN, dtype=torch.float32)
    for t in range(num_tokens):
        for k in range(TOPK):
            e = int(topk_idx[t, k])
            if e >= 0:
                terms[t, k] = _expert_fn(source[t:t + 1], e)[0].float() * weights[t, k]
    expected = terms.sum(dim=1).to(torch.bfloat16)
    assert torch.equal(combined, expected)
    return int(expert_x.shape[0])


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_torch_native_round_trip(run_ranks, fp8):
    received = run_ranks(2, torch_native_round_trip, fp8)
    assert all(r > 0 for r in received)


def raw_all_to_all_rows(rank: int, world_size: int):
    send = [3 + rank, 5 + 2 * rank]
    call = raw_all_to_all(send, 200, torch.float8_e4m3fn)
    recv = call()
    expected_rows = sum([3 + r, 5 + 2 * r][rank] for r in range(world_size))
    assert recv.dtype == torch.uint8
    assert tuple(recv.shape) == (expected_rows, payload_row_bytes(200, torch.float8_e4m3fn))
    return expected_rows


def test_raw_all_to_all(run_ranks):
    assert run_ranks(2, raw_all_to_all_rows) == [3 + 4, 5 + 7]
    assert payload_row_bytes(7168, torch.bfloat16) == 14336
    assert payload_row_bytes(7168, torch.float8_e4m3fn) == 7168 + 4 * 56


class _FakeCollectivesPool:
    """Stands in for the worker pool of `epcomm-bench --suite collectives`: every op's check passes, but for
    `bad` on rank 1, with fixed times."""

    def __init__(self, bad=None):
        self.bad = bad

    def run(self, fn, *args, timeout=None):
        if fn.__name__ == "device_info":
            return [dict(device="cpu")] * 2
        op = args[0]
        return [dict(check=f"{op} out: 1 of 64 differ" if op == self.bad and rank == 1 else None, bytes=256,
                     times={"epcomm": [1e-5, 2e-5], "torch": [2e-5, 3e-5]}) for rank in range(2)]


@pytest.mark.parametrize("bad", [None, "all_reduce"])
def test_bench_collectives_prints_its_verdict(capsys, bad):
    """Like the main suite, `--suite collectives` says under its header that every op matched bitwise; a failed
    check prints FAILED instead (and exits 1)."""
    from epcomm.bench.collectives import run_suite

    status = run_suite(["--suite", "collectives", "--ops", "barrier,all_reduce", "--iters", "2", "--warmup", "0"],
                       pool=_FakeCollectivesPool(bad))
    out = capsys.readouterr().out
    header = out.split("\n\n")[0]
    verdict = ("  correctness: every op below matched its torch.distributed equivalent bitwise on small-integer "
               "data before it was timed (barrier: no data to check)")
    if bad is None:
        assert status == 0 and verdict in header.splitlines() and "FAILED" not in out, out
    else:
        assert status == 1 and "correctness" not in out, out
        assert "FAILED all_reduce: rank 1: all_reduce out: 1 of 64 differ" in header.splitlines(), out


def test_check_output_path_creates_and_deletes_nothing_but_its_probe(tmp_path):
    """(a dangling link was deleted and its target created; a pipe blocked the check)"""
    import os

    from epcomm.bench.options import check_output_path
    link = tmp_path / "link.json"
    os.symlink(tmp_path / "target.json", link)
    with pytest.raises(ValueError, match="is a link to a missing file"):
        check_output_path("--json", str(link))
    assert os.path.islink(link) and not (tmp_path / "target.json").exists()
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is not a regular file"):
        check_output_path("--json", str(fifo))
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    check_output_path("--json", str(kept))
    assert kept.read_text() == "old"
    check_output_path("--json", str(tmp_path / "new.json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json", "link.json", "pipe.json"]
