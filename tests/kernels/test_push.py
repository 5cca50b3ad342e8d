"""The push kernel against its twin: the docstring's worked example, then random records (TRITON_INTERPRET=1)."""

import pickle
import subprocess
import sys

import pytest
import torch

from epcomm.kernels.push import push_rows_torch
from epcomm.records import Field, RecordSpec

_CODE = """
import pickle, sys, torch
from epcomm.kernels.push import push_rows, region_deltas
spec_fields, tensors, src_X, cap, rank, areas, off = pickle.load(sys.stdin.buffer)
tensors["x"] = tensors["x"].view(spec_fields[0].dtype)  # sent as bytes: FP8 tensors do not pickle
from epcomm.records import RecordSpec
spec = RecordSpec(spec_fields)
ptrs = torch.tensor([a.data_ptr() for a in areas], dtype=torch.int64)
push_rows(areas[rank], region_deltas(ptrs, rank), off, spec, tensors, src_X, cap, rank, num_programs=3)
sys.stdout.buffer.write(pickle.dumps(areas))
"""


def _interpreted(fields, tensors, src_X, cap, rank, areas, off):
    env = dict(__import__("os").environ, TRITON_INTERPRET="1")
    tensors = dict(tensors, x=tensors["x"].view(torch.uint8))
    res = subprocess.run([sys.executable, "-c", _CODE], input=pickle.dumps((fields, tensors, src_X, cap, rank,
                                                                             areas, off)),
                         capture_output=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    return pickle.loads(res.stdout)


def _case(gen, num_tokens, hidden, dtype, num_topk, cap, num_ranks, rank, with_w=True):
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    fields = [Field("x", dtype, (hidden,)), Field("topk", torch.int64, (num_topk,)), Field("g", torch.int64, ())]
    tensors = {"x": x, "topk": torch.randint(-1, 50, (num_tokens, num_topk), generator=gen),
               "g": torch.arange(num_tokens) + 1000}
    if with_w:
        fields.append(Field("w", torch.float32, (num_topk,)))
        tensors["w"] = torch.rand(num_tokens, num_topk, generator=gen)
    src_X = torch.randint(-1, num_tokens, (num_ranks * cap,), generator=gen)
    return fields, tensors, src_X


def test_worked_example():
    pytest.importorskip("triton")
    fields = [Field("x", torch.int32, (1,))]
    spec = RecordSpec(fields)  # one 4-byte word padded to a 16-byte record
    tensors = {"x": torch.tensor([[10], [11], [12]], dtype=torch.int32)}
    src_X = torch.tensor([0, -1, 2, 1])
    areas = [torch.zeros(4 * spec.nbytes, dtype=torch.uint8) for _ in range(2)]
    got = _interpreted(fields, tensors, src_X, 2, 1, [a.clone() for a in areas], 0)
    rows0 = got[0].view(4, spec.nbytes)[:, :4].view(torch.int32).flatten()
    rows1 = got[1].view(4, spec.nbytes)[:, :4].view(torch.int32).flatten()
    assert rows0.tolist() == [0, 0, 10, 0] and rows1.tolist() == [0, 0, 12, 11]


@pytest.mark.parametrize("hidden,dtype", [(64, torch.bfloat16), (200, torch.float32), (96, torch.float8_e4m3fn),
                                          (3000, torch.bfloat16)])
def test_matches_twin(hidden, dtype):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(hidden)
    num_ranks, cap, rank = 3, 5, 2
    fields, tensors, src_X = _case(gen, 7, hidden, torch.float32, 4, cap, num_ranks, rank)
    tensors["x"] = tensors["x"].to(dtype) if dtype != torch.float8_e4m3fn else tensors["x"].clamp(-4, 4).to(dtype)
    fields[0] = Field("x", dtype, (hidden,))
    spec = RecordSpec(fields)
    off = 64
    areas = [torch.randint(0, 255, (off + num_ranks * cap * spec.nbytes + 32,), generator=gen, dtype=torch.uint8)
             for _ in range(num_ranks)]
    want = [a.clone() for a in areas]
    push_rows_torch(want, off, spec, tensors, src_X, cap, rank)
    got = _interpreted(fields, tensors, src_X, cap, rank, [a.clone() for a in areas], off)
    # Field bytes are compared (padding between fields is unspecified); rows not pushed keep their old bytes.
    for g, w in zip(got, want):
        gv = g[off: off + num_ranks * cap * spec.nbytes].view(num_ranks * cap, spec.nbytes)
        wv = w[off: off + num_ranks * cap * spec.nbytes].view(num_ranks * cap, spec.nbytes)
        for f in spec.fields:
            o = spec.offsets[f.name]
            assert torch.equal(gv[:, o: o + f.nbytes], wv[:, o: o + f.nbytes]), f.name
        assert torch.equal(g[:off], w[:off]) and torch.equal(g[-32:], w[-32:])  # guard bytes untouched
