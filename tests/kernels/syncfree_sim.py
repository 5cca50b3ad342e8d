"""The fused sync-free dispatch kernels under TRITON_INTERPRET=1, field by field against the generic path.

Ranks are simulated one after another in one process: every rank's region is a slice of one CPU tensor, addressed
through the same 16-byte deltas as on GPU. Every rank's send kernel runs before any receive (what the barrier
enforces on GPU). The expected values come from `pipeline.dispatch_finish` on receive areas filled by the torch
twin of the push (`push_rows_torch`) with the generic send plan, so the two paths meet at the same records.
The plan kernels run with a few rows per program, so that the per-expert prefix sums cross programs. Compared: recv_x (data, scales and their strides), recv_topk_idx, recv_topk_weights, every field of the handle and
of its plan, and the stats; then a combine on every rank's handle (`combine_send` against the generic launch, both
reduced by `pipeline.combine_finish`) and a cached dispatch of new data on it (`cached_send` + `dispatch_place`
against `pipeline.cached_launch` / `cached_finish`). Run as a script: `python syncfree_sim.py CASE` (the test sets
TRITON_INTERPRET=1).
"""

import sys
import types
from dataclasses import fields

import torch

from epcomm import layout, pipeline
from epcomm.fp8 import per_token_cast_to_fp8
from epcomm.kernels.push import push_rows_torch
from epcomm import recv_plan, syncfree_nvlink
from epcomm.syncfree_nvlink import Areas, finish, send
from epcomm.validate import XSpec

HDR_COLS, HDR_OFF, ROWS_OFF = 64, 0, 4096


def routing(gen, num_tokens, num_experts, num_topk, skew_to=None):
    """Distinct experts per token, 20% of the selections -1; `skew_to`: every expert on that rank."""
    pool = num_experts if skew_to is None else num_experts // skew_to[1]
    idx = torch.stack([torch.randperm(pool, generator=gen)[:num_topk] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty(0, num_topk, dtype=torch.int64)
    if skew_to is not None:
        idx += skew_to[0] * pool
    idx[torch.rand(idx.shape, generator=gen) < 0.2] = -1
    return idx


def as_view(x, how):
    """x with the same values as a view the caller might pass: "misaligned" (a start 2 bytes past a word),
    "odd-stride" (rows of a wider buffer whose row stride is not a whole number of words), or x itself."""
    if how == "misaligned":
        flat = torch.empty(x.numel() + 1, dtype=x.dtype)
        out = flat[1:].view(x.shape)
    elif how == "odd-stride":
        out = torch.empty(x.shape[0], x.shape[1] + 1, dtype=x.dtype)[:, :x.shape[1]]
    else:
        return x
    return out.copy_(x)


def make_call(gen, num_tokens, c, rank):
    x = as_view(torch.randn(num_tokens, c["hidden"], generator=gen).to(c["dtype"]), c.get("x_view"))
    sf = None
    if c.get("fp8"):
        x, sf = per_token_cast_to_fp8(x.float(), use_ue8m0=c["fp8"] == "ue8m0")
        if c.get("sf_col_major_in"):  # scales with any strides
            sf = sf.t().contiguous().t()
    topk = routing(gen, num_tokens, c["experts"], c["topk"], c.get("skew") and (0, c["ranks"])).to(c["idx_dtype"])
    w = torch.rand(num_tokens, c["topk"], generator=gen).to(c["w_dtype"]) if c.get("w_dtype") else None
    stats = torch.randint(0, 100, (c["experts"] // c["ranks"] * 2,), generator=gen, dtype=torch.int32) \
        if c.get("stats") else None
    stats = stats[::2] if c.get("stats") == "strided" else (None if stats is None else stats[:stats.numel() // 2])
    return pipeline.DispatchCall(
        x=XSpec(x, sf), topk_idx=topk, topk_weights=w, stats=stats, num_experts=c["experts"], n=c["n"],
        expert_alignment=c.get("alignment", 1), do_cpu_sync=False, do_expand=c.get("expand", False),
        do_zero_padding=False, emit_expert_ids=c.get("emit", False), col_major_sf=c.get("col_major", False),
        num_sms=0)


def clone_call(call):
    # The same strides: a strided stats tensor stays strided.
    stats = None if call.stats is None else torch.empty_strided(call.stats.shape, call.stats.stride(),
                                                                dtype=call.stats.dtype).copy_(call.stats)
    return pipeline.DispatchCall(**{f.name: getattr(call, f.name) for f in fields(call)} | {"stats": stats})


def generic(calls, num_ranks, n):
    """pipeline.dispatch_finish per rank, after the torch twin pushed every rank's records (blocked layout)."""
    spec = pipeline.dispatch_record_spec(calls[0].x, calls[0].topk_idx.shape[1],
                                         None if calls[0].topk_weights is None else calls[0].topk_weights.dtype,
                                         with_routing=True)
    areas = [torch.zeros(num_ranks * n * spec.nbytes, dtype=torch.uint8) for _ in range(num_ranks)]
    sends = []
    for r, call in enumerate(calls):
        snd = layout.send_layout(call.topk_idx, num_ranks, call.num_experts // num_ranks)
        row_TR, src_X = pipeline.send_rows(snd, torch.arange(num_ranks) * n, num_ranks * n)
        tensors = dict(x=call.x.data, sf=call.x.sf, w=call.topk_weights, topk=call.topk_idx.long(),
                       g=r * n + torch.arange(call.x.num_tokens))
        push_rows_torch(areas, 0, spec, tensors, src_X, n, r)
        sends.append((snd, row_TR, src_X))
    out = []
    for me, call in enumerate(calls):
        snd, row_TR, src_X = sends[me]
        launched = dict(recv_counts_R=torch.stack([s[0].num_tokens_per_rank_R[me] for s in sends]), send=snd,
                        send_row_TR=row_TR, send_src_X=src_X, send_splits=None, recv_splits=None,
                        num_recv=num_ranks * n, blocked=True, route=None, spec=spec,
                        recv_XB=areas[me].view(num_ranks * n, spec.nbytes))
        buf = types.SimpleNamespace(rank=me, num_ranks=num_ranks, uid=7)
        out.append(pipeline.dispatch_finish(buf, call, launched))
    return out


def fused(calls, num_ranks, n):
    """The fused kernels on simulated ranks: every send, then every plan and place."""
    spec = pipeline.dispatch_record_spec(calls[0].x, calls[0].topk_idx.shape[1],
                                         None if calls[0].topk_weights is None else calls[0].topk_weights.dtype,
                                         with_routing=True)
    areas = sim_areas(num_ranks, n, spec.nbytes)
    launched = [send(areas[r], call, r, num_ranks, spec) for r, call in enumerate(calls)]
    out = []
    for me, call in enumerate(calls):
        buf = types.SimpleNamespace(rank=me, num_ranks=num_ranks, uid=7)
        out.append(finish(buf, areas[me], call, launched[me]))
        assert areas[me].done.item() == 0, "the plan kernel left its counter of finished programs non-zero"
    return out


class TwinTransport:
    """`push_rows` of the nvlink transport on simulated ranks: the torch twin writes into every rank's area."""

    def __init__(self, areas, rank):
        self.areas, self.rank = areas, rank

    def push_rows(self, spec, tensors, src_X, cap, *, call_id):
        num_ranks = len(self.areas)
        push_rows_torch(self.areas, 0, spec, tensors, src_X, cap, self.rank)
        return self.areas[self.rank][:num_ranks * cap * spec.nbytes].view(num_ranks * cap, spec.nbytes)


def check_combine(c, handles, gen):
    """combine on every rank's handle: the generic launch (records pushed by the torch twin) against combine_send,
    both finished by `pipeline.combine_finish` (the reduction reads the records in place)."""
    num_ranks, n = c["ranks"], c["n"]
    dtype = c["dtype"] if c["dtype"] in (torch.bfloat16, torch.float16, torch.float32, torch.float64) else torch.bfloat16
    calls = []
    for h in handles:
        rows = h.num_expanded_tokens if h.do_expand else h.num_recv_tokens
        x = as_view(torch.randn(rows, c["hidden"], generator=gen).to(dtype), c.get("x_view"))
        w = None
        if c.get("w_dtype"):
            w = torch.rand((rows,) if h.do_expand else (rows, h.num_topk), generator=gen).to(
                torch.float64 if dtype == torch.float64 else torch.float32)
        calls.append(pipeline.CombineCall(x=x, handle=h, topk_weights=w, bias_0=None, bias_1=None, per_pair=False))
    spec = pipeline.combine_record_spec(calls[0].x, calls[0].topk_weights, handles[0].num_topk)
    bufs, want, areas = both_paths(calls, spec, n, pipeline.combine_launch, pipeline.combine_finish,
                                   syncfree_nvlink.combine_send)
    for r in range(num_ranks):
        rows_XB = areas[r].local[ROWS_OFF: ROWS_OFF + num_ranks * n * spec.nbytes].view(num_ranks * n, spec.nbytes)
        got = pipeline.combine_finish(bufs[r], calls[r], dict(spec=spec, recv_XB=rows_XB))
        same(want[r], got, f"rank {r} combine")


def both_paths(calls, spec, n, generic_launch, generic_finish, fused_send):
    """Every rank's generic launch (records pushed by the torch twin) and finish, then every rank's fused send into
    simulated regions: `(fake buffers, generic results, regions)`; the caller finishes the fused side."""
    num_ranks = len(calls)
    twin_areas = [torch.zeros(num_ranks * n * spec.nbytes, dtype=torch.uint8) for _ in range(num_ranks)]
    bufs = [types.SimpleNamespace(rank=r, num_ranks=num_ranks, uid=7, device=torch.device("cpu"),
                                  transport=TwinTransport(twin_areas, r)) for r in range(num_ranks)]
    launched = [generic_launch(bufs[r], calls[r], 0) for r in range(num_ranks)]
    want = [generic_finish(bufs[r], calls[r], launched[r]) for r in range(num_ranks)]
    areas = sim_areas(num_ranks, n, spec.nbytes)
    for r in range(num_ranks):
        fused_send(areas[r], calls[r], r, num_ranks, spec)
    return bufs, want, areas


def check_cached(c, calls, handles, gen):
    """Cached dispatch of new data and weights on every rank's handle: the generic launch (torch twin) and finish
    against `cached_send` + `dispatch_place`."""
    num_ranks, n = c["ranks"], c["n"]
    cached = []
    for call, h in zip(calls, handles):
        fresh = make_call(gen, call.x.num_tokens, c, 0)  # new data and weights; the routing is the handle's
        cached.append(pipeline.DispatchCall(**{f.name: getattr(call, f.name) for f in fields(call)} | dict(
            x=fresh.x, topk_weights=fresh.topk_weights, stats=None, handle=h)))
    spec = syncfree_nvlink._spec(cached[0], with_routing=False)
    _, want, areas = both_paths(cached, spec, n, pipeline.cached_launch, pipeline.cached_finish,
                                syncfree_nvlink.cached_send)
    for r in range(num_ranks):
        got = syncfree_nvlink.cached_finish(areas[r], cached[r], spec)
        for i, what in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
            same(want[r][i], got[i], f"rank {r} cached dispatch {what}")
        assert got[3] is handles[r]


def sim_areas(num_ranks, n, rec_bytes):
    """Every rank's region as a slice of one tensor (garbage where nothing was written), and the deltas."""
    size = ROWS_OFF + num_ranks * n * rec_bytes
    size += -size % 16
    whole = torch.full((num_ranks * size,), 0xAB, dtype=torch.uint8)
    return [Areas(local=whole[r * size:(r + 1) * size], delta16=torch.tensor(
        [(s - r) * size // 16 for s in range(num_ranks)], dtype=torch.int64), rows_off=ROWS_OFF, hdr_off=HDR_OFF,
        hdr_cols=HDR_COLS, done=torch.zeros(1, dtype=torch.int64)) for r in range(num_ranks)]


def same(a, b, what):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{what}: tensor vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if "recv_x" in what:  # the caller sees these strides (column-major scales); plan tensors are internal
            assert a.stride() == b.stride() or a.numel() <= 1, f"{what}: strides {a.stride()} vs {b.stride()}"
        bits = (lambda t: t.contiguous().view(torch.uint8)) if a.dtype.is_floating_point else (lambda t: t)
        assert torch.equal(bits(a), bits(b)), f"{what}: values differ\n{a}\n{b}"
    elif isinstance(a, (tuple, list)) and a and isinstance(a[0], torch.Tensor):
        assert len(a) == len(b), what
        for i, (u, v) in enumerate(zip(a, b)):
            same(u, v, f"{what}[{i}]")
    elif hasattr(a, "__dataclass_fields__"):
        for f in fields(a):
            if f.name in ("cache",):
                continue
            same(getattr(a, f.name), getattr(b, f.name), f"{what}.{f.name}")
    else:
        assert a == b, f"{what}: {a!r} vs {b!r}"


def check(c, tokens, seed=0):
    # Rows per plan program: a few (many programs, prefix sums across them) unless the case says otherwise.
    recv_plan._PLAN_ELEMS = c.get("plan_elems", 8)
    # Few chunks of several blocks (the bound at many rows and local experts), unless the case says otherwise.
    recv_plan._SCAN_ELEMS = c.get("scan_elems", 64)
    gen = torch.Generator().manual_seed(seed)
    calls = [make_call(gen, t, c, r) for r, t in enumerate(tokens)]
    want = generic([clone_call(k) for k in calls], c["ranks"], c["n"])
    fused_calls = [clone_call(k) for k in calls]
    got = fused(fused_calls, c["ranks"], c["n"])
    for r in range(c["ranks"]):
        (wx, wi, ww, wh), (gx, gi, gw, gh) = want[r], got[r]
        same(wx, gx, f"rank {r} recv_x")
        same(wi, gi, f"rank {r} recv_topk_idx")
        same(ww, gw, f"rank {r} recv_topk_weights")
        for f in fields(wh):
            if f.name.startswith("_"):
                continue
            same(getattr(wh, f.name), getattr(gh, f.name), f"rank {r} handle.{f.name}")
        same(wh._plan, gh._plan, f"rank {r} plan")
        assert gh._topk_idx is fused_calls[r].topk_idx
        if calls[r].stats is not None:
            same(want_stats(calls[r], wh), fused_calls[r].stats, f"rank {r} stats")
    check_combine(c, [g[3] for g in got], gen)
    check_cached(c, fused_calls, [g[3] for g in got], gen)
    return want


def want_stats(call, handle):
    return call.stats + handle.num_unaligned_recv_tokens_per_expert


CASES = {
    # name: (config, tokens per rank)
    "bf16-non-expand": (dict(ranks=2, n=8, hidden=2112, dtype=torch.bfloat16, experts=8, topk=3,
                             idx_dtype=torch.int64, w_dtype=torch.float32, stats=True, plan_elems=2048), (6, 8)),
    "fp8-expand": (dict(ranks=3, n=5, hidden=256, dtype=torch.bfloat16, fp8="fp32", experts=12, topk=4,
                        idx_dtype=torch.int32, w_dtype=torch.float32, expand=True, alignment=4, emit=True,
                        col_major=True, stats=True, sf_col_major_in=True, scan_elems=1 << 25), (5, 0, 3)),
    "skewed-fp32": (dict(ranks=2, n=6, hidden=24, dtype=torch.float32, experts=6, topk=2, idx_dtype=torch.int64,
                         w_dtype=torch.float32, expand=True, skew=True), (6, 4)),
    "ue8m0-bf16": (dict(ranks=2, n=4, hidden=512, dtype=torch.bfloat16, fp8="ue8m0", experts=4, topk=2,
                        idx_dtype=torch.int64), (4, 3)),
    "fp16-odd-hidden": (dict(ranks=3, n=7, hidden=70, dtype=torch.float16, experts=9, topk=9, idx_dtype=torch.int64,
                             w_dtype=torch.float32, expand=True, alignment=3), (7, 2, 5)),
    "topk1-five-ranks": (dict(ranks=5, n=3, hidden=32, dtype=torch.bfloat16, experts=10, topk=1,
                              idx_dtype=torch.int64, w_dtype=torch.float32, expand=True, alignment=2),
                         (3, 1, 0, 2, 3)),
    "no-tokens": (dict(ranks=2, n=4, hidden=16, dtype=torch.bfloat16, experts=4, topk=2, idx_dtype=torch.int64,
                       expand=True, emit=True, stats=True), (0, 0)),
    "top32": (dict(ranks=2, n=3, hidden=8, dtype=torch.float32, experts=64, topk=32, idx_dtype=torch.int32,
                   w_dtype=torch.float32, expand=True, alignment=8), (3, 2)),
    "views": (dict(ranks=2, n=3, hidden=40, dtype=torch.bfloat16, experts=4, topk=2, idx_dtype=torch.int64,
                   w_dtype=torch.float32, stats="strided", x_view="misaligned"), (3, 2)),
    "one-token-odd-stride": (dict(ranks=2, n=1, hidden=40, dtype=torch.bfloat16, experts=4, topk=2,
                                  idx_dtype=torch.int64, w_dtype=torch.float32, expand=True, x_view="odd-stride"),
                             (1, 1)),
    "one-rank-fp64": (dict(ranks=1, n=9, hidden=16, dtype=torch.float64, experts=5, topk=2, idx_dtype=torch.int64,
                           w_dtype=torch.float64), (9,)),
}


def check_bad_expert_id():
    """An expert id >= num_experts (sync-free calls check no values on the host): the send kernel names the token
    (on GPU it then traps; the interpreter only prints)."""
    c = dict(ranks=2, n=4, hidden=16, dtype=torch.bfloat16, experts=4, topk=2, idx_dtype=torch.int64)
    call = make_call(torch.Generator().manual_seed(0), 3, c, 0)
    call.topk_idx[2, 1] = c["experts"]
    send(sim_areas(2, 4, 256)[0], call, 0, 2, syncfree_nvlink._spec(call))


if __name__ == "__main__":
    names = sys.argv[1:] or list(CASES) + ["bad-expert-id"]
    for name in names:
        if name == "bad-expert-id":
            check_bad_expert_id()
        else:
            config, tokens = CASES[name]
            check(config, tokens, seed=len(name))
        print(name, "ok")
    print("ok")
