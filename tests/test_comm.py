"""`epcomm.comm.barrier` / `get_comm_stream` on every buffer kind (reference §17.1), and the public docstrings of
the collectives API."""

import inspect
import re

import pytest

import collective_cases as cc
from epcomm import bucket, comm, engram, pp


def test_barrier_on_every_buffer(run_ranks):
    for rank, errors in enumerate(run_ranks(2, cc.barriers)):
        assert errors["ep_context"][0] == "ValueError" and "context_idx must be None or 0, got 1" in \
            errors["ep_context"][1]
        assert re.search(r"context_idx must be None or in \[0, 2\) \(the BucketBuffer has 2 contexts\), got 2",
                         errors["bucket_context"][1])
        assert errors["not_buffer"][0] == "TypeError" and "must be an epcomm buffer" in errors["not_buffer"][1]
        assert f"rank {rank}: group=None is ambiguous" in errors["ambiguous_group"][1]
        assert "the BucketBuffer was destroyed" in errors["destroyed"][1]


PUBLIC = [
    comm.barrier, comm.get_comm_stream, comm.CommContext.__init__, comm.get_physical_domain_size,
    bucket.BucketBuffer.__init__, bucket.BucketBuffer.all_gather, bucket.BucketBuffer.reduce_scatter,
    bucket.BucketBuffer.all_reduce, bucket.BucketBuffer.get_theoretical_num_sms, bucket.BucketSession.allocate,
    pp.PPBuffer.__init__, pp.PPBuffer.send, pp.PPBuffer.recv,
    engram.EngramBuffer.__init__, engram.EngramBuffer.get_storage_size_hint,
    engram.EngramBuffer.get_theoretical_config, engram.EngramBuffer.write, engram.EngramBuffer.fetch,
]


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__qualname__)
def test_docstring_names_every_argument(fn):
    owner = fn.__qualname__.split(".")[0]
    module = inspect.getmodule(fn)
    doc = inspect.getdoc(getattr(module, owner) if fn.__name__ == "__init__" else fn) or ""
    params = [p for p in inspect.signature(fn).parameters if p not in ("self", "args", "kwargs")]
    missing = [p for p in params if not re.search(rf"\b{re.escape(p)}\b", doc)]
    assert not missing, f"{fn.__qualname__}: docstring does not describe {missing}"
    assert "Raises" in doc, f"{fn.__qualname__}: no Raises section"
    if fn.__name__ != "__init__" and fn not in (engram.EngramBuffer.write,):
        assert "Returns" in doc, f"{fn.__qualname__}: no Returns section"


@pytest.mark.multigpu
@pytest.mark.skipif(__import__("torch").cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_barrier_on_every_buffer_on_gpu(pools):
    pools.get(2, "nccl").run(cc.barriers, device="cuda")


def test_bench_suite_collectives(pools, capsys, tmp_path, monkeypatch):
    """`epcomm-bench --suite collectives` end to end on the session's gloo pool: gate, table, JSON, ratios."""
    import json

    import torch

    from epcomm.bench.collectives import OPS, run_suite
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # plan for CPU even where CUDA is present
    out_json = tmp_path / "collectives.json"
    rc = run_suite(["--suite", "collectives", "--size-mib", "0.25", "--iters", "2", "--warmup", "0",
                    "--json", str(out_json)], pool=pools.get(2))
    out = capsys.readouterr().out
    assert rc == 0 and "FAILED" not in out, out
    for op in OPS:
        for provider in ("epcomm", "torch-gloo"):
            assert re.search(rf"\| {op} \| [-\d.]+ \| {provider} \|", out), out
    records = json.loads(out_json.read_text())["records"]
    assert {r["op"] for r in records} == set(OPS)
    assert all(r["vs_torch"] > 0 for r in records if r["provider"] == "epcomm")
    assert all(r["gbps"] > 0 for r in records if r["op"] != "barrier")
    assert run_suite(["--ops", "broadcast"]) == 2
    assert "unknown ['broadcast']" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["bucket", "pp", "engram"])
def test_constructor_error_on_one_rank_raises_everywhere(run_ranks, kind):
    """A bad size on one rank: that rank raises its own error, the peer raises the same class naming it, both at
    once (the construction exchange carries the status; nobody waits out the 60 s timeout)."""
    (cls0, msg0, t0), (cls1, msg1, t1) = run_ranks(2, cc.construct_one_bad, kind)
    assert cls0 == cls1 and cls1 in ("TypeError", "ValueError"), (cls0, cls1)
    assert "rank 1:" in msg1 and "group rank 1 rejected the construction" in msg0, (msg0, msg1)
    assert max(t0, t1) < 30, (t0, t1)


def test_barriers_of_two_buffers_of_a_group_raise(run_ranks):
    outs = run_ranks(2, cc.barriers_of_two_buffers)
    for name in ("BucketBuffer", "EngramBuffer"):  # the mismatched exchange took no number: the ranks stay in step
        assert outs[0][name + " waits"] == outs[1][name + " waits"], [out[name + " waits"] for out in outs]
    for rank, out in enumerate(outs):
        for name in ("BucketBuffer", "EngramBuffer"):
            cls, msg = out[name]
            assert cls == "ValueError" and re.search(rf"^{name}.barrier: rank {rank}: ranks are in barriers of "
                                                     rf"different {name}s on this group", msg), (name, msg)


def _lifecycle_names(rank, world):
    """Reference §1, §2, §5: the package's helpers and every buffer's lifecycle names."""
    import contextlib
    import io

    import epcomm
    out = dict(alignments=(epcomm.get_num_allocation_alignment(), epcomm.get_num_rdma_alignment(),
                           epcomm.get_num_tma_alignment()),
               nccl=epcomm.destroy_all_managed_nccl_comm(),
               group=(epcomm.get_physical_domain_size(None), epcomm.get_logical_domain_size(None, True)))
    gpu, storage = engram.EngramBuffer.get_storage_size_hint(None, [16], 64, 4, 2)
    buffers = dict(bucket=bucket.BucketBuffer(None, 2 << 20), pp=pp.PPBuffer(None, 256, 2),
                   engram=engram.EngramBuffer(None, gpu, storage),
                   ep=epcomm.EPBuffer(None, num_max_tokens_per_rank=4, hidden=16))
    for name, buf in buffers.items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            buf.print_memory_usage()
        out[name] = dict(domains=(comm.get_physical_domain_size(buf), comm.get_logical_domain_size(buf)),
                         context=None if name == "ep" else buf.main_context is buf.contexts[0],
                         printed=printed.getvalue().strip())
        buf.destroy()
        out[name]["after"] = None if name == "ep" else buf.main_context
        if name != "ep":
            out[name]["destroyed"] = cc.outcome(buf.get_logical_domain_size)
    out["type_error"] = cc.outcome(comm.get_logical_domain_size, "x")
    out["physical_type_error"] = cc.outcome(comm.get_physical_domain_size, "x")
    # a bad timeout on one rank: every rank raises (the group stays usable: a buffer is built after it)
    out["bad_timeout"] = cc.outcome(comm.get_physical_domain_size, None,
                                    num_cpu_timeout_secs=float("nan") if rank == 1 else 30)
    epcomm.PPBuffer(None, 256, 2).destroy()
    return out


def test_package_helpers_and_lifecycle_names(run_ranks):
    for rank, out in enumerate(run_ranks(2, _lifecycle_names)):
        assert out["alignments"] == (2 << 20, 64, 32) and out["nccl"] is None
        assert out["group"] == ((1, 2), (1, 2))
        for name in ("bucket", "pp", "engram", "ep"):
            got = out[name]
            assert got["domains"] == ((1, 2), (1, 2)) and got["context"] in (True, None) and got["after"] is None, \
                (name, got)
            assert re.match(rf"\w+Buffer rank {rank}: .*GiB", got["printed"]), got["printed"]
        for key in ("type_error", "physical_type_error"):
            assert out[key][0] == "TypeError" and "must be an epcomm buffer or a ProcessGroup" in out[key][1], out
        for name in ("bucket", "pp", "engram"):
            assert out[name]["destroyed"][0] == "ValueError" and "was destroyed" in out[name]["destroyed"][1], out
        cls, msg = out["bad_timeout"]
        assert cls == "ValueError" and (("num_cpu_timeout_secs must be > 0 seconds, got nan" in msg) if rank == 1 else
                                        "group rank 1 rejected the construction" in msg), out["bad_timeout"]
