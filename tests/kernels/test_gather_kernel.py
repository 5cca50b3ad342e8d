"""The pull's one-launch gather on CPU (TRITON_INTERPRET=1) against the per-field `index_select`s it replaces in
eager nvlink pulls (transport/pull.py). The GPU suite runs it in every eager CPU-synced and cached dispatch."""

import pytest

from gather_sim import BARRIER_CASES, CASES
from interpreter import run_sim


ALL = sorted(CASES) + sorted(BARRIER_CASES)


@pytest.mark.parametrize("case", ALL)
def test_gather_fields(case):
    run_sim("gather_sim.py", case, batch=ALL)
