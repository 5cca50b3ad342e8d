"""The fused sync-free dispatch kernels on CPU (TRITON_INTERPRET=1), field by field against the generic path.

The cases run `syncfree_sim.py` under the interpreter (interpreter.py: one process for all, a failing case again
alone): BF16 / FP8 (fp32 and packed UE8M0 scales, column-major outputs) / FP16 / FP32 / FP64 rows, both layouts,
alignment, expert ids, stats, weights, skewed routing (a rank receives nothing), ranks with no tokens, top-k 1 and
32, one and five ranks; then a combine and a cached dispatch on every handle; strided stats, misaligned and odd-stride
inputs.
The GPU suite runs the same kernels on 2x H200 against the generic path (tests/test_gpu.py).
"""

import pytest

from interpreter import run_sim
from syncfree_sim import CASES


@pytest.mark.parametrize("case", sorted(CASES))
def test_syncfree_kernels(case):
    run_sim("syncfree_sim.py", case, batch=sorted(CASES))


def test_syncfree_send_names_a_bad_expert_id():
    out = run_sim("syncfree_sim.py", "bad-expert-id")
    assert "topk_idx has an expert id outside [-1, num_experts) in token" in out
