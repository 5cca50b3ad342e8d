"""examples/train_moe.py: expert-parallel training on 2 ranks follows the 1-rank run step by step, and learns.

The parity test runs the example's `train` function in the shared worker pools (a short, tiny configuration);
the CLI test runs the script itself once, as a user would, and checks it prints and writes the same losses.
"""

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_moe.py"
TINY = dict(steps=5, batch=4, seq=16, dim=32, ffn=64, corpus_bytes=1 << 20, seed=1)


def _example():
    """The example as a module (examples/ is not a package); loaded once per process."""
    name = "_epcomm_example_train_moe"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules[name]


def _train(rank, world_size, overrides):
    example = _example()
    return example.train(rank, world_size, dataclasses.replace(example.Config(), **overrides), log=False)


def _assert_close(losses, expected, rel=1e-5):
    assert len(losses) == len(expected)
    for step, (got, want) in enumerate(zip(losses, expected)):
        assert got == pytest.approx(want, rel=rel), f"step {step + 1}: {got!r} vs {want!r}\n{losses}\n{expected}"


def test_two_ranks_match_one_rank_per_step(run_ranks):
    (one,) = run_ranks(1, _train, TINY, timeout=60)
    two = run_ranks(2, _train, TINY, timeout=60)
    assert two[0] == two[1]  # the reported loss is the global mean, the same on every rank
    _assert_close(two[0], one)
    assert one[-1] < one[0], f"loss did not fall: {one}"


def test_cli_prints_and_writes_losses(run_ranks, tmp_path):
    out = tmp_path / "losses.txt"
    args = ["--ranks", "2", "--steps", "3", "--batch", "4", "--seq", "16", "--seed", "1", "--out-losses", str(out)]
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = [line for line in proc.stdout.splitlines() if line.startswith("step")]
    assert [line.split()[1] for line in printed] == ["1", "2", "3"], proc.stdout
    losses = [float(line) for line in out.read_text().split()]
    assert [f"{loss:.6f}" for loss in losses] == [line.split()[3] for line in printed]
    # Same configuration through the worker pool (default model sizes, as the CLI uses).
    expected = run_ranks(2, _train, dict(steps=3, batch=4, seq=16, seed=1), timeout=60)[0]
    _assert_close(losses, expected)
