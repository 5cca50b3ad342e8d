"""Calls that read no expert ids on the host (that would synchronise) check them in their send kernels: a token whose
id is outside [-1, num_experts) is named and the kernel traps, instead of dropping the pick (docs/decisions.md,
"Errors and timeouts"). Each case runs `device_timeout_script.py` in a fresh interpreter (a trap takes its process
down), on one GPU or two. The same check under the interpreter: tests/kernels/test_lowlatency_kernels.py."""

import pytest
import torch

import device_timeout_script

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("call,port,what", [
    ("sync-free-bad-id", 29563, "epcomm sync-free dispatch"),  # the fused sync-free dispatch (decode sizes)
    ("low-latency-bad-id", 29564, "epcomm low-latency dispatch"),
])
def test_send_kernel_names_a_bad_expert_id(call, port, what):
    out = device_timeout_script.run_aborting(call, port)
    assert f"{what}: topk_idx has an expert id outside [-1, num_experts) in token: 3" in out, out[-3000:]
