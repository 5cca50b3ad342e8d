"""The canonical reduction kernel's twin: the docstring's worked example first (STYLE rule 9), then random."""

import torch

from epcomm.kernels import canonical_reduce, canonical_reduce_torch


def test_worked_example():
    rows = torch.tensor([[1.0], [2.0], [4.0]])
    item_row = torch.tensor([[2, -1, 0], [-1, -1, -1]])
    assert torch.equal(canonical_reduce_torch(rows, item_row), torch.tensor([[5.0], [0.0]]))


def test_order_is_bias_then_ascending_position():
    # fp32 sums are order-dependent: build values where the order changes the bf16 result.
    gen = torch.Generator().manual_seed(0)
    rows = (torch.randn(50, 64, generator=gen) * torch.logspace(-4, 4, 64)).bfloat16()
    item_row = torch.randint(-1, 50, (30, 8), generator=gen)
    bias = torch.randn(30, 64, generator=gen).bfloat16()
    out = canonical_reduce(rows, item_row, bias, None)
    acc = bias.float()
    for p in range(8):
        has = item_row[:, p] >= 0
        acc[has] += rows[item_row[has, p]].float()
    assert torch.equal(out, acc.bfloat16())


def test_fp64_accumulates_in_fp64_and_empty_rows():
    rows = torch.randn(0, 5, dtype=torch.float64)
    out = canonical_reduce(rows, torch.full((3, 2), -1), torch.ones(3, 5, dtype=torch.float64), None)
    assert out.dtype == torch.float64 and torch.equal(out, torch.ones(3, 5, dtype=torch.float64))
