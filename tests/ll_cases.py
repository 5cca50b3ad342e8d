"""Rank-side bodies of the low-latency API tests (importable by the worker processes)."""

import time

import torch

import epcomm
from epcomm import reference as ref
from epcomm.fp8 import num_sf_packs, per_token_cast_to_fp8, unpack_ue8m0
from ep_cases import assert_equal, captured, random_routing


def check_low_latency(rank: int, world: int, *, seed: int = 0, tokens=(9, 5), hidden: int = 256,
                      num_experts: int = 8, num_topk: int = 3, use_fp8: bool = False, use_ue8m0: bool = False):
    """low_latency_dispatch rows per expert = the reference's expand segments; combine = the weighted sum."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    num_tokens, n = tokens[rank], max(tokens)
    idx, w = random_routing(gen, num_tokens, num_experts, num_topk, masked_ratio=0.2)
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    num_local = num_experts // world
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=n, hidden=hidden)
    stats = torch.zeros(num_local, dtype=torch.int32)
    recv_x, count, handle, event, hook = buf.low_latency_dispatch(
        x, idx, n, num_experts, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8, use_ue8m0=use_ue8m0,
        return_recv_hook=True)
    assert hook() is None and event.event is None
    sent = per_token_cast_to_fp8(x, use_ue8m0=use_ue8m0) if use_fp8 else x
    r_x, _, _, r_handle = ref.dispatch(sent, idx, None, num_experts, num_max_tokens_per_rank=n, do_expand=True)
    assert_equal(count, torch.tensor(r_handle.num_recv_per_expert, dtype=torch.int32), "recv_count")
    assert_equal(stats, count, "cumulative_local_expert_recv_stats")
    start = 0
    for e, c in enumerate(r_handle.num_recv_per_expert):
        if use_fp8:
            assert_equal(recv_x[0][e, :c], r_x[0][start: start + c], f"expert {e} data")
            assert_equal(recv_x[1][e, :c], r_x[1][start: start + c], f"expert {e} scales")
            assert recv_x[1].stride(1) == 1, recv_x[1].stride()  # token-contiguous scales
        else:
            assert_equal(recv_x[e, :c], r_x[start: start + c], f"expert {e}")
        start += c
    if use_fp8:
        buf.destroy()
        return True
    # Expert e multiplies by (1 + e); the combine weights and sums at the origin.
    factor = (1 + torch.arange(num_local, dtype=torch.float32)).view(-1, 1, 1)
    y = (recv_x.float() * factor).bfloat16()
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16)
    combined, event, hook = buf.low_latency_combine(y, idx, w, handle, out=out)
    assert combined is out
    acc = torch.zeros(num_tokens, hidden)
    for j in range(num_topk):
        for t in range(num_tokens):
            e = int(idx[t, j])
            if e >= 0:
                y_tj = (x[t].float() * (1 + e % num_local)).bfloat16().float()
                acc[t] += w[t, j] * y_tj
    assert_equal(combined, acc.bfloat16(), "low_latency_combine")
    # Zero-copy (DeepEP V1): the outputs written into the registered buffer are what the combine reads; x is only
    # checked (zeros here).
    registered = buf.get_next_low_latency_combine_buffer(handle)
    assert registered.shape == y.shape and registered.dtype == torch.bfloat16, registered.shape
    assert buf.get_next_low_latency_combine_buffer(handle) is registered  # one buffer per call shape
    registered.copy_(y)
    zero_copied, _, _ = buf.low_latency_combine(torch.zeros_like(y), idx, w, handle, zero_copy=True)
    assert_equal(zero_copied, acc.bfloat16(), "low_latency_combine(zero_copy=True)")
    buf.destroy()
    return True


def low_latency_wait_costs(rank: int, world: int, late_s: float, device: str = "cpu", late_keeps_none: bool = False):
    """Two low-latency dispatches and combines with `*_wait_recv_cost_stats`; the last rank reaches each call
    `late_s` late (and, with `late_keeps_none`, passes no statistics: they are per rank). Returns the two stats
    as lists (None where not kept)."""
    import time

    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=4, hidden=128)
    gen = torch.Generator().manual_seed(rank)
    idx, w = random_routing(gen, 4, 4, 2, masked_ratio=0.0)
    x = torch.randn(4, 128, generator=gen).bfloat16().to(device)
    idx, w = idx.to(device), w.to(device)
    dispatch_cost = torch.zeros(world, dtype=torch.int64, device=device)
    combine_cost = torch.zeros(world, dtype=torch.int64, device=device)
    for _ in range(2):
        if rank == world - 1:
            time.sleep(late_s)
        keep = not (late_keeps_none and rank == world - 1)
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False,
                                                            dispatch_wait_recv_cost_stats=dispatch_cost if keep else None)
        if rank == world - 1:
            time.sleep(late_s)
        buf.low_latency_combine(recv_x, idx, w, handle, combine_wait_recv_cost_stats=combine_cost if keep else None)
    buf.destroy()
    return (dispatch_cost.tolist(), combine_cost.tolist()) if keep else (None, None)


def low_latency_collective_refuses_wait_costs(rank: int, world: int):
    """The collective transport on GPU exchanges no header to time the ranks by: `*_wait_recv_cost_stats` are refused
    on every rank before anything moves (the statistics stay untouched), and the buffer works afterwards (the same
    combine, bitwise). Returns the two messages."""
    device = torch.device("cuda", torch.cuda.current_device())
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=8, hidden=256, transport="collective", explicitly_destroy=True)
    gen = torch.Generator().manual_seed(30 + rank)
    idx, w = random_routing(gen, 8, 4 * world, 2, masked_ratio=0.2)
    x = torch.randn(8, 256, generator=gen).bfloat16()
    x, idx, w = x.to(device), idx.to(device), w.to(device)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 8, 4 * world, use_fp8=False)
    first, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    cost = torch.randint(0, 1000, (world,), generator=gen).to(device)
    before = cost.clone()
    msgs = []
    for call in (lambda: buf.low_latency_dispatch(x, idx, 8, 4 * world, use_fp8=False,
                                                  dispatch_wait_recv_cost_stats=cost),
                 lambda: buf.low_latency_combine(recv_x, idx, w, handle, combine_wait_recv_cost_stats=cost)):
        try:
            call()
        except ValueError as e:
            msgs.append(str(e))
        else:
            msgs.append("")
    assert_equal(cost, before, "wait-cost statistics after the refused calls")
    recv_again, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 8, 4 * world, use_fp8=False)
    again, _, _ = buf.low_latency_combine(recv_again, idx, w, handle)
    assert_equal(again, first, "combine after the refused calls")
    buf.destroy()
    return msgs


def low_latency_errors(rank: int, world: int):
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=4, hidden=128)
    gen = torch.Generator().manual_seed(rank)
    idx, w = random_routing(gen, 4, 4, 2, masked_ratio=0.0)
    x = torch.randn(4, 128, generator=gen).bfloat16()
    msgs = []
    bad_x = x.float() if rank == 1 else x  # rank 1 alone is wrong: both ranks must raise
    for call in (lambda: buf.low_latency_dispatch(bad_x, idx, 4, 4),
                 lambda: buf.low_latency_dispatch(x, idx, 4, 4, dispatch_wait_recv_cost_stats=torch.zeros(2))):
        try:
            call()
        except (TypeError, ValueError) as e:
            msgs.append(str(e))
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False)
    for kw in (dict(use_logfmt=True), dict(zero_copy=True), dict(out=torch.empty(4, 128)),
               dict(out=torch.empty(3, 128, dtype=torch.bfloat16))):
        try:
            buf.low_latency_combine(recv_x, idx, w, handle, **(kw if rank == 1 else {}))
        except (TypeError, ValueError) as e:
            msgs.append(str(e))
    buf.low_latency_combine(recv_x, idx, w, handle)  # the buffer still works after local rejections
    return msgs


def low_latency_graph_replay(rank: int, world: int, *, replays: int = 3, num_tokens: int = 32, hidden: int = 512,
                             num_experts: int = 16, num_topk: int = 4, use_fp8: bool = True,
                             wait_costs: bool = False, zero_copy: bool = False):
    """Issue 4 item 3: low_latency_dispatch + low_latency_combine captured in one CUDA graph and replayed with new
    inputs and new routings copied into the static inputs; dispatch bitwise against the reference, combine against
    the weighted sum, on every replay. With `wait_costs`, the calls also add to `*_wait_recv_cost_stats`, which
    must not change the results and must only grow; with `zero_copy`, the expert outputs go through
    `get_next_low_latency_combine_buffer` (and the `x` passed is zeros)."""
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(300 + rank)
    num_local = num_experts // world
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=num_tokens, hidden=hidden, explicitly_destroy=True)

    def inputs():
        idx, w = random_routing(gen, num_tokens, num_experts, num_topk, masked_ratio=0.2)
        return torch.randn(num_tokens, hidden, generator=gen).bfloat16().to(device), idx.to(device), w.to(device)
    x_s, idx_s, w_s = inputs()
    factor = (1 + torch.arange(num_local, dtype=torch.float32, device=device)).view(-1, 1, 1)
    costs = [torch.zeros(world, dtype=torch.int64, device=device) for _ in range(2)] if wait_costs else [None, None]
    seen = [torch.zeros(world, dtype=torch.int64, device=device) for _ in range(2)]

    def step():
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x_s, idx_s, num_tokens, num_experts, use_fp8=use_fp8,
                                                                dispatch_wait_recv_cost_stats=costs[0])
        data = recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=2)[..., :hidden] if use_fp8 \
            else recv_x.float()
        y = (data * factor).bfloat16()  # a stand-in expert: expert e multiplies by 1 + e
        if zero_copy:
            buf.get_next_low_latency_combine_buffer(handle).copy_(y)
        combined, _, _ = buf.low_latency_combine(torch.zeros_like(y) if zero_copy else y, idx_s, w_s, handle,
                                                 zero_copy=zero_copy, combine_wait_recv_cost_stats=costs[1])
        return recv_x, count, y, combined

    graph, outs = captured(step)
    for i in range(replays):
        x, idx, w = inputs()
        x_s.copy_(x)
        idx_s.copy_(idx)
        w_s.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        recv_x, count, y, combined = outs
        sent = per_token_cast_to_fp8(x) if use_fp8 else x
        r_x, _, _, r_handle = ref.dispatch(sent, idx, None, num_experts, num_max_tokens_per_rank=num_tokens,
                                           do_expand=True)
        assert_equal(count, torch.tensor(r_handle.num_recv_per_expert, dtype=torch.int32, device=device),
                     f"replay {i}: recv_count")
        start = 0
        for e, c in enumerate(r_handle.num_recv_per_expert):
            got = (recv_x[0][e, :c], recv_x[1][e, :c]) if use_fp8 else recv_x[e, :c]
            want = (r_x[0][start: start + c], r_x[1][start: start + c]) if use_fp8 else r_x[start: start + c]
            if use_fp8:
                assert_equal(got[0], want[0], f"replay {i}: expert {e} data")
                assert_equal(got[1], want[1], f"replay {i}: expert {e} scales")
            else:
                assert_equal(got, want, f"replay {i}: expert {e}")
            start += c
        # The combine's order (docs/decisions.md): fp32 products and sums in ascending top-k position, one
        # rounding; the stand-in expert's output for (t, j) is rebuilt from token t's own (cast) row.
        acc = torch.zeros(num_tokens, hidden, device=device)
        for j in range(num_topk):
            for t in range(num_tokens):
                e = int(idx[t, j])
                if e >= 0:
                    row = x[t].float()
                    if use_fp8:
                        d, s = per_token_cast_to_fp8(x[t: t + 1])
                        row = (d.float() * s.repeat_interleave(128, dim=1)[:, :hidden])[0]
                    acc[t] += w[t, j] * (row * (1 + e % num_local)).bfloat16().float()
        assert_equal(combined, acc.bfloat16(), f"replay {i}: low_latency_combine")
        for cost, before in zip(costs, seen):
            if cost is not None:
                assert bool((cost >= before).all()), (i, cost, before)
                before.copy_(cost)
    buf.destroy()
    return replays


def low_latency_paths_agree(rank: int, world: int, *, rounds: int = 12, back_to_back: int = 1000,
                            num_max: int = 64, hidden: int = 7168, num_experts: int = 64, num_topk: int = 8):
    """Issue 4 item 1: the nvlink kernels give the portable path's results bitwise (valid rows, counts, stats,
    combine) on random token counts (an empty rank included), skewed and uniform routings, every scale format,
    hooks issued two calls deep; then `back_to_back` dispatch+combine pairs without a host wait, checked at the
    end."""
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(500 + rank)
    pick = torch.Generator().manual_seed(77)  # the same on every rank: options and shapes agree
    fast = epcomm.EPBuffer(None, num_max_tokens_per_rank=num_max, hidden=hidden, explicitly_destroy=True)
    slow = epcomm.EPBuffer(None, num_max_tokens_per_rank=num_max, hidden=hidden, explicitly_destroy=True,
                           transport="collective")
    assert fast.transport.name == "nvlink", fast.transport.name
    num_local = num_experts // world
    factor = (1 + torch.arange(num_local, dtype=torch.float32, device=device)).view(-1, 1, 1)

    def case(i):
        num_tokens = int(torch.randint(0, num_max + 1, (1,), generator=gen))
        if i == 1 and rank == 1:
            num_tokens = 0
        idx, w = random_routing(gen, num_tokens, num_experts, num_topk, masked_ratio=0.1)
        if i % 3 == 2 and num_tokens:  # skewed: most tokens pick the first experts of rank 0
            hot = torch.stack([torch.randperm(min(num_local + num_topk, num_experts), generator=gen)[:num_topk]
                               for _ in range(num_tokens)])
            idx = torch.where(idx >= 0, hot, idx)
        x = (torch.randn(num_tokens, hidden, generator=gen) * (1 + 10 * torch.rand(num_tokens, 1, generator=gen)))
        return x.bfloat16().to(device), idx.to(device), w.to(device)

    def run(buf, x, idx, w, opts, hook):
        stats = torch.zeros(num_local, dtype=torch.int32, device=device)
        recv_x, count, handle, _, h = buf.low_latency_dispatch(x, idx, num_max, num_experts,
                                                               cumulative_local_expert_recv_stats=stats,
                                                               return_recv_hook=hook, **opts)
        return recv_x, count, handle, stats, h

    for i in range(rounds):
        opts = [dict(use_fp8=False), dict(use_fp8=True), dict(use_fp8=True, round_scale=True),
                dict(use_fp8=True, use_ue8m0=True)][int(torch.randint(0, 4, (1,), generator=pick))]
        a, b = case(i), case(i + 100)
        # Two dispatches in flight on the fast buffer (both parities), received in issue order.
        fa, fb = run(fast, *a, opts, True), run(fast, *b, opts, True)
        fa[4]()
        fb[4]()
        for (x, idx, w), got in ((a, fa), (b, fb)):
            want = run(slow, x, idx, w, opts, False)
            assert_equal(got[1], want[1], f"round {i}: recv_count")
            assert_equal(got[3], want[3], f"round {i}: stats")
            for e, c in enumerate(want[1].tolist()):
                if opts["use_fp8"]:
                    assert_equal(got[0][0][e, :c], want[0][0][e, :c], f"round {i}: expert {e} data")
                    assert_equal(got[0][1][e, :c], want[0][1][e, :c], f"round {i}: expert {e} scales")
                else:
                    assert_equal(got[0][e, :c], want[0][e, :c], f"round {i}: expert {e}")
            if opts["use_fp8"]:
                continue
            y = (got[0].float() * factor).bfloat16()
            out_fast, _, hook = fast.low_latency_combine(y, idx, w, got[2], return_recv_hook=True)
            hook()
            out_slow, _, _ = slow.low_latency_combine(y, idx, w, want[2])
            assert_equal(out_fast, out_slow, f"round {i}: combine")
    x, idx, w = case(999)
    for _ in range(back_to_back):
        recv_x, count, handle, _, _ = fast.low_latency_dispatch(x, idx, num_max, num_experts, use_fp8=False)
        out, _, _ = fast.low_latency_combine((recv_x.float() * factor).bfloat16(), idx, w, handle)
    want = run(slow, x, idx, w, dict(use_fp8=False), False)
    out_slow, _, _ = slow.low_latency_combine((want[0].float() * factor).bfloat16(), idx, w, want[2])
    assert_equal(out, out_slow, f"after {back_to_back} back-to-back calls: combine")
    fast.destroy()
    slow.destroy()
    return rounds


def low_latency_shape_disagreement(rank: int, world: int):
    """Ranks that pass different shapes, or different `use_fp8`, to their first low-latency call of a shape raise on
    every rank (the region's collective allocation agrees on the shape and row format first), and the buffer works
    afterwards."""
    device = torch.device("cuda", torch.cuda.current_device())
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=16, hidden=256, explicitly_destroy=True)
    x = torch.randn(8, 256, device=device).bfloat16()
    idx = torch.rand(8, 8).topk(2, dim=1).indices.to(device)
    msgs = []
    for kwargs in (dict(num_max_dispatch_tokens_per_rank=8 if rank == 0 else 16),  # shape
                   dict(num_max_dispatch_tokens_per_rank=8, use_fp8=rank == 0)):  # row format
        try:
            buf.low_latency_dispatch(x, idx, num_experts=8, **kwargs)
        except ValueError as e:
            msgs.append(str(e))
        else:
            msgs.append("")
    recv_x, count, _, _, _ = buf.low_latency_dispatch(x, idx, 8, 8, use_fp8=False)
    # Every (token, expert) item arrives once: the group's received rows equal the group's items.
    totals = torch.stack([count.sum().long(), (idx >= 0).sum().long()])
    torch.distributed.all_reduce(totals)
    assert totals[0] == totals[1], totals.tolist()
    buf.destroy()
    return msgs


def _small_call(rank: int) -> tuple:
    """`(buffer, topk_idx, topk_weights, x)`: 4 tokens of hidden 128, 4 experts, top-2, for the error cases."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=4, hidden=128)
    gen = torch.Generator().manual_seed(rank)
    idx, w = random_routing(gen, 4, 4, 2, masked_ratio=0.0)
    return buf, idx, w, torch.randn(4, 128, generator=gen).bfloat16()


def _expecter(msgs: list):
    """`expect(call)`: runs call and appends its TypeError/ValueError message to msgs, or "no error"."""
    def expect(call):
        try:
            call()
        except (TypeError, ValueError) as e:
            msgs.append(str(e))
        else:
            msgs.append("no error")
    return expect


def low_latency_more_errors(rank: int, world: int):
    """Malformed arguments raise TypeError/ValueError naming the low-latency call on every rank (rank 1 alone is
    wrong where marked), never a foreign exception on one rank and a hang on the other."""
    buf, idx, w, x = _small_call(rank)
    other = epcomm.EPBuffer(None, num_max_tokens_per_rank=4, hidden=128)
    msgs = []
    expect = _expecter(msgs)
    one = rank == 1
    expect(lambda: buf.low_latency_dispatch(torch.tensor(1.0).bfloat16() if one else x, idx, 4, 4))
    expect(lambda: buf.low_latency_dispatch(x.view(4, 2, 64) if one else x, idx, 4, 4, use_fp8=True))
    expect(lambda: buf.low_latency_dispatch(x, idx, True, 4))
    expect(lambda: buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False, round_scale=True))
    expect(lambda: buf.low_latency_dispatch(x, idx, 4, 4, async_finish=True, return_recv_hook=True))
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False)
    _, _, other_handle, _, _ = other.low_latency_dispatch(x, idx, 4, 4, use_fp8=False)
    expect(lambda: buf.low_latency_combine(recv_x, None if one else idx, w, handle))
    expect(lambda: buf.low_latency_combine(recv_x, idx.float() if one else idx, w, handle))
    expect(lambda: buf.low_latency_combine(recv_x, idx, w, other_handle))
    idx[0, 0] = -1  # an in-place edit after the dispatch, then a view of the edited tensor
    expect(lambda: buf.low_latency_combine(recv_x, idx[:, :], w, handle))
    expect(lambda: epcomm.EPBuffer.get_low_latency_rdma_size_hint(0, 128, 2, 4))
    expect(lambda: buf.low_latency_dispatch(x[:3], idx[:3], 3 if one else 4, 4))  # ranks disagree on N
    expect(lambda: buf.low_latency_dispatch(x, idx, 4, 4, use_ue8m0=one))  # same scale columns, other format
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False)
    moved = idx.clone()
    moved[2, 1] = -1 if int(idx[2, 1]) >= 0 else int(idx[2, 0] + 1) % 4  # another routing, by value
    expect(lambda: buf.low_latency_combine(recv_x, moved, w, handle))
    with torch.inference_mode():  # no version counter: an edit is caught by value (it used to shift other tokens)
        idx_i, w_i, x_i = idx.clone(), w.clone(), x.clone()
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x_i, idx_i, 4, 4, use_fp8=False)
        if one:
            idx_i[1, 0] = -1 if int(idx_i[1, 0]) >= 0 else int(idx_i[1, 1] + 1) % 4
        expect(lambda: buf.low_latency_combine(recv_x, idx_i, w_i, handle))
    other.destroy()
    buf.destroy()
    expect(lambda: buf.low_latency_combine(recv_x, idx, w, handle))
    return msgs


def low_latency_hook_order(rank: int, world: int):
    """Two calls of a shape and kind may be in flight on every transport (DeepEP V1's rule, which the nvlink areas
    need): a third call while the receive hook of the call two before is uncalled raises, and so does a combine of
    a dispatch whose hook is uncalled; on CPU every rank raises (rank 1 alone forgets a hook where marked). Returns
    the messages in order."""
    buf, idx, w, x = _small_call(rank)
    msgs = []
    expect = _expecter(msgs)

    def dispatch():
        return buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False, return_recv_hook=True)

    first, second = dispatch(), dispatch()
    expect(dispatch)  # every rank: the hook of the call two before is uncalled
    if rank == 0:
        first[4]()
    expect(dispatch)  # rank 1 alone
    if rank == 1:
        first[4]()
    third = dispatch()  # calls 1 and 2 in flight
    y = second[0] * 2
    expect(lambda: buf.low_latency_combine(y, idx, w, second[2]))  # its dispatch is not received yet
    second[4]()
    second[4]()  # a hook receives once; calling it again does nothing
    combines = [buf.low_latency_combine(y, idx, w, second[2], return_recv_hook=True) for _ in range(2)]
    expect(lambda: buf.low_latency_combine(y, idx, w, second[2]))
    combines[0][2]()
    got, _, hook = buf.low_latency_combine(y, idx, w, second[2], return_recv_hook=True)
    hook()
    assert torch.equal(got, combines[1][0])
    assert third[4] is not None
    buf.destroy()
    return msgs


def low_latency_handles_and_clean(rank: int, world: int):
    """Ranks that combine the handles of different dispatches raise on every rank (CPU); a shape whose receive hook
    was dropped refuses its next calls until `clean_low_latency_buffer` (collective, same shape on every rank)
    resets it; then the dropped hook and the handles from before the reset raise, and new calls give the right
    sums (identity experts: the fp32 sum of w_k * x in ascending k, rounded once). Returns the messages in order.
    On GPU (no header travels with a combine there) the handles' part is left out."""
    buf, idx, w, x = _small_call(rank)
    idx, w, x = idx.to(buf.device), w.to(buf.device), x.to(buf.device)
    msgs = []
    expect = _expecter(msgs)
    one = rank == 1
    want = torch.zeros(x.shape, dtype=torch.float32, device=buf.device)
    for k in range(idx.shape[1]):
        want = torch.where((idx[:, k] >= 0)[:, None], want + w[:, k:k + 1] * x.float(), want)
    want = want.bfloat16()
    first = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False)
    second = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False)
    if buf.device.type == "cpu":
        mine = second if one else first
        expect(lambda: buf.low_latency_combine(mine[0], idx, w, mine[2]))
    assert torch.equal(buf.low_latency_combine(first[0], idx, w, first[2])[0], want)  # the same handle everywhere
    lost = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False, return_recv_hook=True)  # its hook is dropped
    buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False)
    expect(lambda: buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False))
    expect(lambda: buf.clean_low_latency_buffer(4, 128, 8 if one else 4))
    expect(lambda: buf.clean_low_latency_buffer(4, 0 if one else 128, 4))
    buf.clean_low_latency_buffer(4, 128, 4)
    expect(lost[4])
    expect(lambda: buf.low_latency_combine(first[0], idx, w, first[2]))
    for _ in range(3):  # past the two calls a shape may have in flight
        recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False, return_recv_hook=True)
        hook()
        assert torch.equal(buf.low_latency_combine(recv_x, idx, w, handle)[0], want)
    buf.destroy()
    return msgs


def low_latency_vs_regular_calls(rank: int, world: int):
    """A low-latency call on rank 0 and the regular call its portable path is built on, of the same shape, on rank
    1 (a sync-free expand dispatch; a combine of the same handle) raise on every rank, and the buffer works
    afterwards. Returns the messages."""
    buf, idx, w, x = _small_call(rank)
    msgs = []
    expect = _expecter(msgs)
    if rank == 0:
        expect(lambda: buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False))
    else:
        expect(lambda: buf.dispatch(x, idx, None, num_experts=4, num_max_tokens_per_rank=4, do_cpu_sync=False,
                                    do_expand=True, emit_expert_ids=True))
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False)
    if rank == 0:
        expect(lambda: buf.low_latency_combine(recv_x, idx, w, handle))
    else:
        x_S = torch.zeros(handle.handle.num_expanded_tokens, 128, dtype=torch.bfloat16)
        expect(lambda: buf.combine(x_S, handle.handle))
    got, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)  # the buffer still works
    assert got.shape == x.shape
    buf.destroy()
    return msgs


def low_latency_option_disagreements(rank: int, world: int, *, hidden: int = 1024):
    """Ranks that disagree on use_fp8 or use_ue8m0 raise on every rank naming that argument (at hidden 1024 a
    UE8M0 row has 2 scale packs, an fp32 one 8); a buffer too small for num_max_dispatch_tokens_per_rank raises
    naming it and the low-latency size hint. Returns the messages."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=4, hidden=hidden)
    gen = torch.Generator().manual_seed(rank)
    idx, w = random_routing(gen, 4, 4, 2, masked_ratio=0.0)
    x = torch.randn(4, hidden, generator=gen).bfloat16()
    msgs = []
    expect = _expecter(msgs)
    expect(lambda: buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=rank == 0))
    expect(lambda: buf.low_latency_dispatch(x, idx, 4, 4, use_ue8m0=rank == 1))
    expect(lambda: buf.low_latency_dispatch(x, idx, 4096, 4))  # every rank: the buffer holds 4 tokens per rank
    expect(lambda: buf.low_latency_dispatch(x, idx, 4096 if rank == 1 else 4, 4))  # rank 1 alone
    buf.low_latency_dispatch(x, idx, 4, 4)  # the buffer still works
    buf.destroy()
    hint = epcomm.EPBuffer.get_low_latency_rdma_size_hint(4096, hidden, world, 4)
    with epcomm.EPBuffer(None, num_bytes=hint) as big:  # the size the message names is enough
        _, count, _, _, _ = big.low_latency_dispatch(x, idx, 4096, 4)
        assert int(count.sum()) > 0
    return msgs


def low_latency_per_rank_options(rank: int, world: int, *, hidden: int = 256, num_experts: int = 8):
    """The options docs/decisions.md lists as per rank may differ between ranks: the constructor's timeouts and
    other options that size nothing, round_scale, async_finish, return_recv_hook, cumulative_local_expert_recv_stats
    and out. Each rank's rows arrive in its own scale format; the combine is the weighted sum."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=8, hidden=hidden, num_cpu_timeout_secs=30 + rank,
                          num_gpu_timeout_secs=50 + rank, deterministic=rank == 0, allow_hybrid_mode=rank == 0,
                          prefer_overlap_with_compute=rank == 1, sl_idx=rank, num_allocated_qps=8 + rank,
                          explicitly_destroy=rank == 1)
    gen = torch.Generator().manual_seed(40 + rank)
    idx, w = random_routing(gen, 8, num_experts, 3, masked_ratio=0.2)
    x = torch.randn(8, hidden, generator=gen).bfloat16()
    num_local = num_experts // world
    round_scale, hook = rank == 1, rank == 0
    stats = torch.zeros(num_local, dtype=torch.int32) if rank == 0 else None
    recv_x, count, handle, event, receive = buf.low_latency_dispatch(
        x, idx, 8, num_experts, cumulative_local_expert_recv_stats=stats, round_scale=round_scale,
        async_finish=not hook, return_recv_hook=hook)
    if hook:
        receive()
    else:
        event.current_stream_wait()
    # Every rank's rows in the format its sender chose: rebuild the reference's expert segments from each rank's
    # own cast (rank 1 rounds its scales to powers of two).
    sent = per_token_cast_to_fp8(x, use_ue8m0=round_scale)
    if round_scale:
        sent = (sent[0], unpack_ue8m0(sent[1], num_sf_packs(hidden)))
    r_x, _, _, r_handle = ref.dispatch(sent, idx, None, num_experts, num_max_tokens_per_rank=8, do_expand=True)
    assert_equal(count, torch.tensor(r_handle.num_recv_per_expert, dtype=torch.int32), "recv_count")
    start = 0
    for e, c in enumerate(r_handle.num_recv_per_expert):
        assert_equal(recv_x[0][e, :c], r_x[0][start: start + c], f"expert {e} data")
        assert_equal(recv_x[1][e, :c], r_x[1][start: start + c], f"expert {e} scales")
        start += c
    # Expert e multiplies its (cast back) rows by 1 + e; the combine weights and sums at the origin.
    factor = (1 + torch.arange(num_local, dtype=torch.float32)).view(-1, 1, 1)
    y = (recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=2)[..., :hidden] * factor).bfloat16()
    out = torch.empty(8, hidden, dtype=torch.bfloat16) if rank == 1 else None
    combined, event, receive = buf.low_latency_combine(y, idx, w, handle, out=out, return_recv_hook=hook,
                                                       async_finish=not hook)
    if hook:
        receive()
    else:
        event.current_stream_wait()
    assert out is None or combined is out
    row_TH = sent[0].float() * sent[1].repeat_interleave(128, dim=1)[:, :hidden]
    acc = torch.zeros(8, hidden)
    for j in range(idx.shape[1]):
        for t in range(8):
            e = int(idx[t, j])
            if e >= 0:
                acc[t] += w[t, j] * (row_TH[t] * (1 + e % num_local)).bfloat16().float()
    assert_equal(combined, acc.bfloat16(), "low_latency_combine")
    buf.destroy()
    return True


def low_latency_missing_peer(rank: int, world: int, timeout_s: float, kind: str):
    """Rank 1 never makes the low-latency call (`kind`: "dispatch" or "combine"): rank 0 raises TimeoutError naming
    the call, and the buffer is unusable afterwards. Returns `(message, message of the next call)` on rank 0."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=4, hidden=128, num_cpu_timeout_secs=timeout_s)
    idx, w = random_routing(torch.Generator().manual_seed(rank), 4, 4, 2, masked_ratio=0.0)
    x = torch.randn(4, 128).bfloat16()
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False)
    if rank == 1:
        time.sleep(timeout_s + 4)
        return "skipped"
    call = {"dispatch": lambda: buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False),
            "combine": lambda: buf.low_latency_combine(recv_x, idx, w, handle)}[kind]
    try:
        call()
    except TimeoutError as e:
        msg = str(e)
    else:
        return None
    try:
        call()
    except ValueError as e:
        return msg, str(e)
    return msg, None


def low_latency_formats_count_apart(rank: int, world: int):
    """The two-calls-in-flight rule counts the calls of one row format (as nvlink's areas do): an FP8 dispatch
    after two BF16 ones whose hooks were not called goes ahead, a third BF16 one raises."""
    buf, idx, w, x = _small_call(rank)
    hooks = [buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False, return_recv_hook=True)[4] for _ in range(2)]
    fp8_hook = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=True, return_recv_hook=True)[4]
    msgs = []
    _expecter(msgs)(lambda: buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False, return_recv_hook=True))
    for hook in hooks + [fp8_hook]:
        hook()
    buf.destroy()
    return msgs


def low_latency_void_handles(rank: int, world: int):
    """A handle that clean_low_latency_buffer voided, and a receive hook called after destroy(), raise (the zero-copy
    buffer was handed out, and the portable path's hook returned None)."""
    buf, idx, w, x = _small_call(rank)
    msgs = []
    expect = _expecter(msgs)
    _, _, handle, _, hook = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False, return_recv_hook=True)
    hook()
    buf.clean_low_latency_buffer(4, 128, 4)
    expect(lambda: buf.get_next_low_latency_combine_buffer(handle))
    _, _, handle, _, hook = buf.low_latency_dispatch(x, idx, 4, 4, use_fp8=False, return_recv_hook=True)
    buf.destroy()
    expect(hook)
    return msgs
