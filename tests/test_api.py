"""Public surface: exports, docstrings that name every argument, determinism (§24 item 13)."""

import inspect
import re
from pathlib import Path

import pytest
import torch

import epcomm
from epcomm import fp8, reference, routing

PUBLIC = [
    epcomm.EPBuffer.__init__, epcomm.EPBuffer.dispatch, epcomm.EPBuffer.combine,
    epcomm.EPBuffer.get_buffer_size_hint, epcomm.EPBuffer.get_theoretical_num_sms,
    epcomm.EventOverlap.current_stream_wait, epcomm.TokenDispatcher.__init__, epcomm.TokenDispatcher.dispatch,
    epcomm.TokenDispatcher.combine, reference.dispatch, reference.combine,
    fp8.per_token_cast_to_fp8, fp8.per_token_cast_back, routing.deepseek_v3_gate, routing.softmax_topk,
    routing.make_routing, epcomm.EPBuffer.low_latency_dispatch, epcomm.EPBuffer.low_latency_combine,
    epcomm.EPBuffer.barrier, epcomm.EPBuffer.lb_prefetch_weights, epcomm.EPBuffer.lb_reduce_grads,
]


def test_exports():
    assert epcomm.__version__ and epcomm.topk_idx_t is torch.int64
    for name in epcomm.__all__:
        assert hasattr(epcomm, name)
    assert (Path(epcomm.__file__).parent / "py.typed").exists()


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__qualname__)
def test_docstring_names_every_argument(fn):
    # A class documents its constructor arguments in the class docstring.
    owner = fn.__qualname__.split(".")[0]
    doc = inspect.getdoc(getattr(epcomm, owner) if fn.__name__ == "__init__" else fn) or ""
    params = [p for p in inspect.signature(fn).parameters if p not in ("self", "args", "kwargs")]
    missing = [p for p in params if not re.search(rf"\b{re.escape(p)}\b", doc)]
    assert not missing, f"{fn.__qualname__}: docstring does not describe {missing}"
    if fn.__name__ not in ("__init__",):
        assert "Returns" in doc or "Return" in doc, f"{fn.__qualname__}: no Returns section"


def _dispatch_twice(rank, world):
    gen = torch.Generator().manual_seed(rank)
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=40, hidden=48, deterministic=True)
    x = torch.randn(40, 48, generator=gen).bfloat16()
    idx = torch.rand(40, 16, generator=gen).topk(4, dim=1).indices
    w = torch.rand(40, 4, generator=gen)
    for expand in (False, True):
        a = buf.dispatch(x, idx, w, num_experts=16, do_expand=expand, expert_alignment=4)
        b = buf.dispatch(x, idx, w, num_experts=16, do_expand=expand, expert_alignment=4)
        for i in (0, 1, 2):
            assert (a[i] is None and b[i] is None) or torch.equal(a[i], b[i])
        assert torch.equal(a[3].recv_src_metadata, b[3].recv_src_metadata)
        ca = buf.combine(a[0], a[3], topk_weights=a[2])[0]
        cb = buf.combine(b[0], b[3], topk_weights=b[2])[0]
        assert torch.equal(ca, cb)
    return True


def test_dispatch_twice_is_bitwise_identical(run_ranks):
    assert all(run_ranks(2, _dispatch_twice))


def _deepep_v1_names(rank, world):
    """DeepEP V1 normal-mode names get pointers to their V2.5 calls (docs/porting.md); other missing names the
    usual AttributeError."""
    pointer = r"^module 'epcomm' has no attribute 'Buffer': DeepEP V1's normal-mode Buffer is not offered; use " \
              r"epcomm.EPBuffer\(.*\(docs/porting.md\)$"
    with pytest.raises(ImportError, match=pointer):  # as DeepEP code imports it (an AttributeError would be lost)
        from epcomm import Buffer  # noqa: F401
    with pytest.raises(ImportError, match=pointer):
        epcomm.Buffer
    with pytest.raises(AttributeError, match=r"^module 'epcomm' has no attribute 'Buffr'$"):
        epcomm.Buffr
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=4, hidden=8, num_topk=2)
    for name in ("get_dispatch_layout", "get_dispatch_config", "set_num_sms"):
        with pytest.raises(AttributeError, match=rf"^'EPBuffer' object has no attribute '{name}': DeepEP V1's "
                                                 r"normal-mode .*\(docs/porting.md\)$"):
            getattr(buf, name)
    assert not hasattr(buf, "no_such_thing") and getattr(buf, "_shapes_that_fit", None) is not None
    *_, handle, _ = buf.dispatch(torch.randn(4, 8), torch.tensor([[0, 1]] * 4), num_experts=2 * world)
    for unpack in (lambda h: h[1], lambda h: tuple(h), lambda h: [*h]):
        with pytest.raises(TypeError, match=r"EPHandle is not DeepEP V1's tuple handle .*docs/porting.md"):
            unpack(handle)
    buf.destroy()
    return True


def test_deepep_v1_names_point_to_porting(run_ranks):
    assert all(run_ranks(2, _deepep_v1_names))


def test_import_does_not_load_dynamo():
    """`compile_guard`: importing epcomm does not import torch._dynamo (with inductor, sympy and Triton: ~1 s and
    ~140 MB per process); the entry points run eagerly under torch.compile all the same (test_autograd)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import sys, epcomm; print('torch._dynamo' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", (out.stdout, out.stderr[-2000:])


def _combine_sms(rank, world):
    """The SM count each combine resolves to (a spy on `resolve.resolve_combine`)."""
    import warnings

    from epcomm import resolve
    seen, real = [], resolve.resolve_combine

    def spy(*args, **kwargs):
        call = real(*args, **kwargs)
        seen.append(call.num_sms)
        return call
    resolve.resolve_combine = spy
    try:
        buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=8, hidden=16, num_topk=2)
        gen = torch.Generator().manual_seed(rank)
        x, idx = torch.randn(8, 16, generator=gen), torch.rand(8, 4, generator=gen).topk(2, dim=1).indices
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "num_sms has no effect on CPU"
            recv_x, _, _, handle, _ = buf.dispatch(x, idx, num_experts=4, num_sms=24)
            buf.combine(recv_x, handle)
            buf.combine(recv_x, handle, num_sms=10)
        theoretical = buf.get_theoretical_num_sms(4, 2)
        buf.destroy()
    finally:
        resolve.resolve_combine = real
    return handle.num_sms, seen, theoretical


def test_combine_takes_the_handles_sm_count_by_default(run_ranks):
    """Reference §11.1: combine's num_sms=0 is the dispatch's (the handle's), not the model's value."""
    for handle_sms, seen, theoretical in run_ranks(2, _combine_sms):
        assert theoretical != 24 and handle_sms == 24 and seen == [24, 10], (handle_sms, seen, theoretical)
