"""The fused CPU-synced dispatch kernels on CPU (TRITON_INTERPRET=1), field by field against the generic path.

The cases run `exact_sim.py` under the interpreter (interpreter.py: one process for all, a failing case again alone):
the sync-free cases' dtypes, layouts and options with `do_cpu_sync=True`, token chunks small enough that the send
plan's prefix counts cross programs, and the errors every rank raises from the value flags (an id too large, an id
below -1, an expert twice), the disagreement a rank on the generic path causes, and disagreements with stale or
foreign flag columns (a bad value beside another alignment; another num_experts): every rank raises the disagreement
and none gathers messages alone. The GPU suite runs the same path on 2x H200 against the generic one
(tests/test_gpu.py).
"""

import pytest

from exact_sim import CASES
from interpreter import run_sim


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_kernels(case):
    run_sim("exact_sim.py", case, batch=sorted(CASES))


BAD = ["bad-id", "negative-id", "duplicate", "generic-peer", "bad-value-and-disagreement", "num-experts-disagreement"]


@pytest.mark.parametrize("case", BAD)
def test_bad_values_raise_on_every_rank(case):
    run_sim("exact_sim.py", case, batch=BAD)
