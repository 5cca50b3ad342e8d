"""kernels/launch.py: a direct launch of a compiled Triton kernel gives what `kernel[grid](...)` gives, takes the
direct path on a GPU (no silent fallback), and keys its variants by the specialisation Triton computes (an input
off 16-byte alignment gets a variant of its own). On CPU every launch goes the usual way."""

import pytest
import torch

from epcomm.kernels import launch as launch_mod
from epcomm.kernels.reduce import canonical_reduce, canonical_reduce_torch




@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_direct_launch_matches_torch_and_keys_alignment():
    pytest.importorskip("triton")
    from epcomm.kernels import _reduce_triton

    gen = torch.Generator().manual_seed(3)
    kernel = _reduce_triton._canonical_reduce_kernel
    for offset in (0, 1, 0):  # aligned, misaligned by 4 bytes, aligned again (a cache hit)
        rows = (torch.randn(64 * 300 + 8, generator=gen) * 10).cuda()[offset: offset + 64 * 300].view(64, 300)
        item = torch.randint(-1, 64, (24, 5), generator=gen).cuda()
        bias = torch.randn(24, 300, generator=gen).cuda()
        got = canonical_reduce(rows, item, bias)
        assert torch.equal(got, canonical_reduce_torch(rows, item, bias))
    assert kernel not in launch_mod._usual_way
    variants = [key for key in launch_mod._compiled if key[0] is kernel]
    aligned = {("D" in str(spec_rows)) for (_, _, spec, _) in variants for spec_rows in spec[:1]}
    assert len(variants) >= 2 and aligned == {True, False}, variants


def test_cpu_launches_go_the_usual_way():
    """Without CUDA the preparation fails and the kernel is launched as `kernel[grid](...)`."""
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine prepares direct launches")
    k = Kernel()
    launch_mod.launch(k, (3,), 1, 2, A=4)
    assert calls == [((3,), (1, 2), {"A": 4})] and k in launch_mod._usual_way
