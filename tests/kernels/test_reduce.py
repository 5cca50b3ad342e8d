"""The canonical reduction kernel's twin: the docstring's worked example first, then random; and the chunked
combine's schedule (`pipeline._token_chunks`)."""

import pytest
import torch
from interpreter import run_sim

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


def _run_triton_interpreted(calls):
    """The Triton kernel under TRITON_INTERPRET=1 on CPU, one output per `(rows, item, b0, b1, out_dtype, num_sms)`
    call (one subprocess for all: the flag is read at import, and each start costs seconds)."""
    import pickle
    import subprocess
    import sys

    code = (
        "import pickle, sys, torch\n"
        "from epcomm.kernels import canonical_reduce\n"
        "outs = [canonical_reduce(rows, item, b0, b1, out_dtype, use_triton=True, num_sms=num_sms)\n"
        "        for rows, item, b0, b1, out_dtype, num_sms in pickle.load(sys.stdin.buffer)]\n"
        "sys.stdout.buffer.write(pickle.dumps(outs))\n"
    )
    env = dict(__import__("os").environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(calls), capture_output=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    return pickle.loads(res.stdout)


def test_triton_kernel_matches_twin_interpreted():
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(1)
    cases = [
        (torch.tensor([[1.0], [2.0], [4.0]]), torch.tensor([[2, -1, 0], [-1, -1, -1]]), None, None),  # worked example
        ((torch.randn(40, 37, generator=gen) * 100).bfloat16(), torch.randint(-1, 40, (9, 5), generator=gen),
         torch.randn(9, 37, generator=gen).bfloat16(), torch.randn(9, 37, generator=gen).bfloat16()),
        (torch.randn(12, 2000, generator=gen, dtype=torch.float64), torch.randint(-1, 12, (3, 4), generator=gen),
         torch.randn(3, 2000, generator=gen, dtype=torch.float64), None),
        (torch.randn(8, 64, generator=gen).half(), torch.randint(-1, 8, (5, 2), generator=gen), None,
         torch.randn(5, 64, generator=gen).half()),
    ]
    # The interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even, pinned bitwise by the
    # GPU suite), so bf16 rows are compared on the fp32 sum here.
    calls = [(rows, item, b0, b1, torch.float32 if rows.dtype == torch.bfloat16 else rows.dtype, num_sms)
             for rows, item, b0, b1 in cases
             for num_sms in (0, 3)]  # one program per work item; a persistent grid of 3 programs
    for (rows, item, b0, b1, out_dtype, num_sms), got in zip(calls, _run_triton_interpreted(calls), strict=True):
        want = canonical_reduce_torch(rows, item, b0, b1, out_dtype)
        assert torch.equal(got, want), (rows.shape, num_sms, (got - want).abs().max())


@pytest.mark.parametrize("case", ["small", "many-tokens"])
def test_token_chunks_group_each_token_by_its_last_row(case):
    """pipeline._token_chunks (two Triton launches, interpreted) against a plain Python count: each token in the
    chunk of the return push that brings its last returned row, tokens grouped by chunk (token_chunks_sim.py)."""
    run_sim("token_chunks_sim.py", case, batch=["small", "many-tokens"])


def test_triton_kernel_token_list_and_own_rows_interpreted():
    """The reduction kernel over one chunk of tokens at a time (`TOKEN_LIST`, as the chunked combine launches it):
    after every chunk each token is written once, with the twin's bits; a persistent grid smaller than a chunk.
    Also with rows 11..18 read from a separate `own` tensor (the rows a rank keeps for itself), whole and chunked."""
    pytest.importorskip("triton")
    import pickle
    import subprocess
    import sys

    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(30, 50, generator=gen)
    item = torch.randint(-1, 30, (23, 3), generator=gen)
    bias = torch.randn(23, 50, generator=gen)
    tokens = torch.randperm(23, generator=gen)
    bounds = torch.tensor([0, 0, 9, 20, 23])  # an empty chunk, then uneven ones
    own_rows = torch.randn(8, 50, generator=gen)
    code = (
        "import pickle, sys, torch\n"
        "from epcomm.kernels import _reduce_triton, reduce\n"
        "rows, item, bias, tokens, bounds, own_rows = pickle.load(sys.stdin.buffer)\n"
        "outs = []\n"
        "for own in ({}, dict(own=own_rows, own_lo=11)):\n"
        "    for num_sms in (0, 2):\n"
        "        r, i, b0, b1, out, cap, tile = reduce._kernel_args(rows, item, bias, None, torch.float32, num_sms)\n"
        "        out.fill_(float('nan'))\n"
        "        for c in range(4):\n"
        "            _reduce_triton.launch(r, i, b0, b1, out, num_programs=cap, tokens=tokens, bounds=bounds,\n"
        "                                  chunk=c, num_chunks=4, **tile, **own)\n"
        "        outs.append(out)\n"
        "    outs.append(reduce.canonical_reduce(rows, item, bias, None, torch.float32, use_triton=True,\n"
        "                                        own=(own['own'], 11) if own else None))\n"
        "sys.stdout.buffer.write(pickle.dumps(outs))\n"
    )
    env = dict(__import__("os").environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code],
                         input=pickle.dumps((rows, item, bias, tokens, bounds, own_rows)),
                         capture_output=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    outs = pickle.loads(res.stdout)
    patched = rows.clone()
    patched[11:19] = own_rows
    assert not torch.equal(canonical_reduce_torch(patched, item, bias, None), canonical_reduce_torch(rows, item, bias))
    for k, got in enumerate(outs):
        want = canonical_reduce_torch(rows if k < 3 else patched, item, bias, None)
        assert torch.equal(got, want), (k, (got - want).abs().max())
    assert torch.equal(canonical_reduce_torch(rows, item, bias, None, own=(own_rows, 11)), outs[3])
