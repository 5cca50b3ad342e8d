"""The fused CPU-synced dispatch (exact_nvlink.py) under TRITON_INTERPRET=1, field by field against the generic path.

Ranks are simulated one after another in one process. Every rank's `send_plan` runs (publishing from its last
program, as on GPU: up to the first barrier's arrival, all of it with one rank), then every rank's `publish_rows`
for the rest, into simulated regions (slices of one CPU tensor, addressed through 16-byte deltas as on GPU), then
each rank reads its headers as the host read would. The pull is replaced by its torch twin (each receiver
concatenates, per source rank, the source's rows in the route's send order), the same for both paths, so the two
paths meet at the same moved fields. The expected values come from `pipeline.dispatch_finish` on the generic
layout (layout.send_layout, pipeline.send_rows). Compared: recv_x (data, scales, strides), recv_topk_idx,
recv_topk_weights, every field of the handle and of its plan (route included), the stats. The bad-value cases
check the errors each rank raises from the published flags. Run as a script: `python exact_sim.py CASE` (the test
sets TRITON_INTERPRET=1).
"""

import sys
import types

import torch

from epcomm import agreement, exact_nvlink, layout, pipeline, recv_plan
from epcomm.moves import Route, offsets
from epcomm.sizing import next_pow2
from syncfree_sim import CASES as SYNC_FREE_CASES
from syncfree_sim import clone_call, make_call, same, want_stats

HDR_COLS = 1088


def fake_buf(rank, num_ranks, gathered=None):
    def agree(call, rows, err):
        agreement.check(call, rank, rows, err, lambda msg: gathered or [msg] * num_ranks)
    return types.SimpleNamespace(rank=rank, num_ranks=num_ranks, uid=7, device=torch.device("cpu"), agree=agree)


def twin_move(tensors, routes, me):
    """Receiver `me`'s fields: for each source s, its rows for `me` in s's send order."""
    out = {}
    for name in tensors[0]:
        if tensors[0][name] is None:
            continue
        parts = []
        for s, route in enumerate(routes):
            start = offsets(route.send_splits)[me]
            parts.append(tensors[s][name][route.src_X[start: start + route.send_splits[me]]])
        out[name] = torch.cat(parts)
    return out


def generic(calls, num_ranks, n):
    sends, routes, tensors = [], [], []
    counts = [layout.send_layout(c.topk_idx, num_ranks, c.num_experts // num_ranks).num_tokens_per_rank_R.tolist()
              for c in calls]
    for r, call in enumerate(calls):
        snd = layout.send_layout(call.topk_idx, num_ranks, call.num_experts // num_ranks)
        send_off = torch.tensor(offsets(counts[r]))
        row_TR, src_X = pipeline.send_rows(snd, send_off, sum(counts[r]))
        routes.append(Route(counts[r], [counts[s][r] for s in range(num_ranks)], src_X, counts))
        tensors.append(dict(x=call.x.data, sf=call.x.sf, w=call.topk_weights, topk=call.topk_idx.long(),
                            g=r * n + torch.arange(call.x.num_tokens)))
        sends.append((snd, row_TR, src_X))
    out = []
    for me, call in enumerate(calls):
        snd, row_TR, src_X = sends[me]
        route = routes[me]
        launched = dict(recv_counts_R=torch.tensor(route.recv_splits), send=snd, send_row_TR=row_TR,
                        send_src_X=src_X, send_splits=route.send_splits, recv_splits=route.recv_splits,
                        num_recv=route.num_recv, blocked=False, route=route, fields=twin_move(tensors, routes, me))
        out.append(pipeline.dispatch_finish(fake_buf(me, num_ranks), call, launched))
        if call.do_expand and route.num_recv:  # on a GPU `pipeline._place` takes the place kernel: the same rows
            fields = launched["fields"]
            got = recv_plan.place(call, out[-1][3]._plan, recv_plan.field_sources(fields), with_weights="w" in fields)
            same(out[-1][0], got[0], f"rank {me} expand place kernel recv_x")
            same(out[-1][2], got[1], f"rank {me} expand place kernel recv_topk_weights")
    return out


FLAGS_OFF = 0  # set by sim_regions: the barrier's flags follow the header area, as in SymmetricRegion


def sim_regions(num_ranks):
    """Every rank's region: header area, then the barrier's flags (zero); the header area starts as garbage."""
    global FLAGS_OFF
    FLAGS_OFF = num_ranks * HDR_COLS * 8
    size = FLAGS_OFF + 128
    whole = torch.full((num_ranks * size,), 0xAB, dtype=torch.uint8)
    for r in range(num_ranks):
        whole[r * size + FLAGS_OFF: (r + 1) * size] = 0
    return [types.SimpleNamespace(local=whole[r * size:(r + 1) * size], delta16=torch.tensor(
        [(s - r) * size // 16 for s in range(num_ranks)], dtype=torch.int64)) for r in range(num_ranks)]


CALL_ID = 5


def exchange(calls, num_ranks, in_send_plan=True):
    """Every rank's send_plan, then the publish kernel stage by stage over all ranks (the interpreter runs one rank
    at a time); returns (launched per rank, (header bytes, host rows [R, C] numpy) per rank). Checks that the
    publish kernel leaves every rank's table zero for the next call. `in_send_plan`: send_plan publishes (as on
    GPU); else publish_rows does all of it (the separate launch, also a rank's without tokens)."""
    from epcomm.kernels import _exact_triton as k

    regions = sim_regions(num_ranks)
    # ranks that disagree on num_experts publish other widths
    cols = [exact_nvlink._cols(num_ranks, call.num_experts // num_ranks) for call in calls]
    hosts = [torch.full((num_ranks * cols[r],), -7, dtype=torch.int64) for r in range(num_ranks)]
    status = [torch.zeros(1, dtype=torch.int64) for _ in range(num_ranks)]
    done = [torch.zeros(1, dtype=torch.int64) for _ in range(num_ranks)]
    # send_plan publishes in its last program, as on GPU: all of it with one rank; else the first barrier's arrival
    # (the interpreter runs one rank at a time), and for the last rank also the rows into the peers' headers once
    # every rank has arrived (when every rank has tokens: a rank without any launches no send_plan and arrives in
    # publish_rows later); publish_rows runs the rest.
    every = all(call.topk_idx.shape[0] > 0 for call in calls)
    stages = [7 if num_ranks == 1 else 3 if every and r == num_ranks - 1 else 1 for r in range(num_ranks)]
    launched, tables, published = [], [], []
    for r, call in enumerate(calls):
        tables.append(torch.zeros(num_ranks, HDR_COLS, dtype=torch.int64))
        head = exact_nvlink.header_row(call, 7, torch.device("cpu"))
        publish = dict(done_ptr=done[r], host_ptr=hosts[r].data_ptr(), local_ptr=regions[r].local,
                       delta16_ptr=regions[r].delta16, status_ptr=status[r].data_ptr(), timeout_ns=10 ** 10,
                       flags_off=FLAGS_OFF, hdr_off=0, EX_COLS=cols[r], C_POW2=next_pow2(cols[r]),
                       STAGES=stages[r], USE_TIMER=False)
        launched.append(exact_nvlink.send_plan(call, r, num_ranks, CALL_ID, head, tables[r],
                                               publish if in_send_plan else None))
        published.append(launched[-1].pop("published"))
        assert published[-1] == (in_send_plan and call.topk_idx.shape[0] > 0)
        assert int(done[r][0]) == 0, "send_plan left its counter of finished programs non-zero"
    for stage in (1, 2, 4):
        for r in range(num_ranks):
            if published[r] and stage & stages[r]:
                continue
            k.publish_rows[(1,)](tables[r], hosts[r].data_ptr(), regions[r].local, regions[r].delta16,
                                 status[r].data_ptr(), r, 10 ** 10, FLAGS_OFF, 0, R=num_ranks,
                                 R_POW2=next_pow2(num_ranks), EX_COLS=cols[r], HDR_COLS=HDR_COLS,
                                 C_POW2=next_pow2(cols[r]), STAGES=stage, USE_TIMER=False)
    recv = []
    for r in range(num_ranks):
        flags = regions[r].local[FLAGS_OFF:].view(torch.int64)[:num_ranks + 1].tolist()
        assert flags == [2] * (num_ranks + 1), f"rank {r}: two barriers, one arrival each from every rank: {flags}"
        assert not tables[r].any(), f"rank {r}: the publish kernel left its table non-zero"
        assert int(status[r][0]) == 0
        rows = hosts[r].view(num_ranks, cols[r]).numpy()
        assert (rows[:, 1] == CALL_ID).all(), rows[:, 1]
        mine = regions[r].local[:num_ranks * HDR_COLS * 8]
        assert (mine.view(torch.int64).view(num_ranks, HDR_COLS)[:, :cols[r]].numpy() == rows).all()
        recv.append((mine, rows))
    return launched, recv


def fused(calls, num_ranks, separate=False):
    """The fused path on simulated ranks; `separate`: the publish and the per-expert totals in launches of their
    own (`exact_nvlink._FUSED_PUBLISH`, `recv_plan._TOTALS_IN_ROWS` off: the kernels' plain variants)."""
    recv_plan._TOTALS_IN_ROWS = not separate
    launched, recv = exchange(calls, num_ranks, in_send_plan=not separate)
    routes, tensors = [], []
    for r, call in enumerate(calls):
        sizes = exact_nvlink.read_rows(fake_buf(r, num_ranks), call, recv[r][1])
        src = launched[r].pop("send_src")[:sum(sizes["send_splits"])]
        routes.append(Route(sizes["send_splits"], sizes["recv_splits"], src, sizes["matrix"]))
        launched[r].update(counts=(recv[r][0], HDR_COLS), num_unaligned=sizes["num_unaligned"],
                           done=torch.zeros(1, dtype=torch.int64))
        tensors.append(dict(x=call.x.data, sf=call.x.sf, routing=launched[r]["routing"]))
    out = []
    for r, call in enumerate(calls):
        launched[r].update(route=routes[r], fields=twin_move(tensors, routes, r))
        out.append(exact_nvlink.dispatch_finish(fake_buf(r, num_ranks), call, launched[r]))
        assert launched[r]["done"].item() == 0, "the plan kernel left its counter of finished programs non-zero"
    return out


def exact(call):
    call.do_cpu_sync = True
    return call


def check(c, tokens, seed=0):
    recv_plan._PLAN_ELEMS = c.get("plan_elems", 8)  # a few rows per plan program: prefix sums cross them
    # Few chunks of several blocks (the bound at many rows and local experts), unless the case says otherwise.
    recv_plan._SCAN_ELEMS = c.get("scan_elems", 64)
    exact_nvlink._TOKEN_ELEMS = c.get("token_elems", exact_nvlink._TOKEN_ELEMS)
    exact_nvlink._COUNT_ELEMS = c.get("count_elems", exact_nvlink._COUNT_ELEMS)
    gen = torch.Generator().manual_seed(seed)
    calls = [exact(make_call(gen, t, c, r)) for r, t in enumerate(tokens)]
    want = generic([clone_call(k) for k in calls], c["ranks"], c["n"])
    fused_calls = [clone_call(k) for k in calls]
    got = fused(fused_calls, c["ranks"], c.get("separate", False))
    for r in range(c["ranks"]):
        (wx, wi, ww, wh), (gx, gi, gw, gh) = want[r], got[r]
        same(wx, gx, f"rank {r} recv_x")
        same(wi, gi, f"rank {r} recv_topk_idx")
        same(ww, gw, f"rank {r} recv_topk_weights")
        for name in wh.__dataclass_fields__:
            if not name.startswith("_"):
                same(getattr(wh, name), getattr(gh, name), f"rank {r} handle.{name}")
        same(wh._plan, gh._plan, f"rank {r} plan")
        same(wh._plan.route.matrix, gh._plan.route.matrix, f"rank {r} route matrix")
        assert gh._topk_idx is fused_calls[r].topk_idx
        if calls[r].stats is not None:
            same(want_stats(calls[r], wh), fused_calls[r].stats, f"rank {r} stats")


# The sync-free cases (every dtype, both layouts, alignment, ids, stats, skew, empty ranks, top-k 1 and 32, one
# and five ranks, strided and misaligned inputs), plus token chunks small enough that the send plan's prefix
# counts cross programs and take several steps.
CASES = dict(SYNC_FREE_CASES)
CASES["many-tokens-small-chunks"] = (dict(ranks=3, n=40, hidden=16, dtype=torch.bfloat16, experts=12, topk=4,
                                          idx_dtype=torch.int64, w_dtype=torch.float32, expand=True, alignment=4,
                                          emit=True, stats=True, token_elems=64, count_elems=64),
                                     (40, 33, 17))
# One rank publishes from send_plan's last program all the way (both barriers with itself), over several programs.
CASES["one-rank-small-chunks"] = (dict(ranks=1, n=40, hidden=16, dtype=torch.bfloat16, experts=6, topk=3,
                                       idx_dtype=torch.int64, w_dtype=torch.float32, expand=False, alignment=1,
                                       emit=False, stats=True, token_elems=64, count_elems=64), (37,))
# The publish and the per-expert totals in launches of their own (the variants behind the A/B switches).
CASES["separate-launches"] = (dict(ranks=3, n=20, hidden=16, dtype=torch.bfloat16, experts=6, topk=3,
                                   idx_dtype=torch.int64, w_dtype=torch.float32, stats=True, separate=True,
                                   token_elems=64, count_elems=64), (20, 13, 17))


def check_bad_values(kind):
    """A bad id or a duplicate on rank 1: rank 1 raises the host check's message, rank 0 names group rank 1."""
    c = dict(ranks=2, n=6, hidden=16, dtype=torch.bfloat16, experts=8, topk=3, idx_dtype=torch.int64)
    gen = torch.Generator().manual_seed(1)
    calls = [exact(make_call(gen, 6, c, r)) for r in range(2)]
    topk = calls[1].topk_idx
    if kind == "bad-id":
        topk[4, 2] = c["experts"]
        want = f"topk_idx holds {c['experts']} (token 4)"
    elif kind == "negative-id":
        topk[2, 0] = -3
        want = "topk_idx holds -3 (token 2)"
    else:
        topk[3, 0], topk[3, 2] = 5, 5
        want = "topk_idx row 3 names expert 5 more than once"
    _, recv = exchange(calls, 2)
    messages = []
    for r in (1, 0):
        try:
            exact_nvlink.read_rows(fake_buf(r, 2, gathered=["", messages[0] if messages else ""]), calls[r],
                                   recv[r][1])
        except ValueError as e:
            messages.append(str(e))
        else:
            raise AssertionError(f"rank {r} did not raise")
    assert want in messages[0], messages
    assert "group rank 1 rejected the call" in messages[1] and want in messages[1], messages


def check_bad_value_and_disagreement():
    """Rank 1 holds a bad id and rank 0 passes another expert_alignment: both ranks raise the disagreement and
    neither gathers messages (a gather that only one rank joins would hang)."""
    c = dict(ranks=2, n=6, hidden=16, dtype=torch.bfloat16, experts=8, topk=3, idx_dtype=torch.int64)
    gen = torch.Generator().manual_seed(3)
    calls = [exact(make_call(gen, 6, c, r)) for r in range(2)]
    calls[1].topk_idx[4, 2] = c["experts"]
    calls[0].expert_alignment = 4
    every_rank_raises_alone(calls, "ranks disagree on expert_alignment (rank 0: 4, rank 1: 1)")


def check_num_experts_disagreement():
    """num_experts 8 on rank 0, 16 on rank 1: the flag columns of one rank's row are per-expert counts in the
    other's view; both ranks raise the disagreement and neither gathers messages."""
    calls = []
    for r, experts in enumerate((8, 16)):
        c = dict(ranks=2, n=6, hidden=16, dtype=torch.bfloat16, experts=experts, topk=3, idx_dtype=torch.int64)
        calls.append(exact(make_call(torch.Generator().manual_seed(r), 6, c, r)))
    every_rank_raises_alone(calls, "ranks disagree on num_experts (rank 0: 8, rank 1: 16)")


def every_rank_raises_alone(calls, want):
    """Every rank's read_rows raises `want`, and no rank gathers messages (a gather one rank joins alone hangs)."""
    _, recv = exchange(calls, 2)
    for r in range(2):
        gathered = []

        def agree(call, rows, err, r=r):
            agreement.check(call, r, rows, err, lambda msg: gathered.append(msg) or [msg] * 2)
        buf = types.SimpleNamespace(rank=r, num_ranks=2, uid=7, device=torch.device("cpu"), agree=agree)
        try:
            exact_nvlink.read_rows(buf, calls[r], recv[r][1])
        except ValueError as e:
            assert want in str(e), (r, str(e))
        else:
            raise AssertionError(f"rank {r} accepted the call")
        assert not gathered, f"rank {r} gathered messages alone"


def check_generic_peer():
    """Rank 1 took the generic path (another EPCOMM_FUSED_EXACT): its row is the generic header and counts, and
    stale columns after them (here: raised flags). Rank 0 names the disagreement, not a bad value."""
    c = dict(ranks=2, n=6, hidden=16, dtype=torch.bfloat16, experts=8, topk=3, idx_dtype=torch.int64)
    gen = torch.Generator().manual_seed(2)
    calls = [exact(make_call(gen, 6, c, r)) for r in range(2)]
    _, recv = exchange(calls, 2)
    rows = recv[0][1].copy()
    generic = agreement.header(agreement.STATUS_OK, CALL_ID, calls[1].signature(1), 7)
    rows[1, :len(generic)] = generic
    rows[1, -2:] = [1, 1]
    try:
        exact_nvlink.read_rows(fake_buf(0, 2), calls[0], rows)
    except ValueError as e:
        assert "ranks disagree on fused_exact (rank 0: True, rank 1: False)" in str(e), str(e)
        assert "EPCOMM_FUSED_EXACT" in str(e), str(e)
    else:
        raise AssertionError("a peer on the generic path was accepted")


if __name__ == "__main__":
    bad = ("bad-id", "negative-id", "duplicate")
    names = sys.argv[1:] or list(CASES) + list(bad) + ["generic-peer", "bad-value-and-disagreement",
                                                         "num-experts-disagreement"]
    for name in names:
        if name == "generic-peer":
            check_generic_peer()
        elif name == "bad-value-and-disagreement":
            check_bad_value_and_disagreement()
        elif name == "num-experts-disagreement":
            check_num_experts_disagreement()
        elif name in bad:
            check_bad_values(name)
        else:
            config, tokens = CASES[name]
            check(config, tokens, seed=len(name))
        print(name, "ok")
    print("ok")
