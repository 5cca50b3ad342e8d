"""`epcomm.TokenDispatcher`: gradcheck of dispatch -> expert -> combine round trips and the adjoint identity.

Every forward and backward of the dispatcher is collective, so the ranks run `torch.autograd.gradcheck` in
lockstep: fast mode, the same number of differentiable inputs and outputs on every rank (a dummy input and
output keep the counts equal when a rank has no tokens), and each rank's outputs depend only on its own inputs
(a round trip brings every token back to its owner).

Routings are reproducible from `(seed, rank)`, so any rank can rebuild any other rank's `topk_idx`; the
non-expand tests use that to find the local expert of each received column from its token key.
"""

import contextlib
import sys
import time

import pytest

import torch
import torch.distributed as dist

from epcomm import EPBuffer, TokenDispatcher, reference

HIDDEN, NUM_TOPK, NUM_EXPERTS = 3, 3, 6  # 3 local experts per rank with 2 ranks
TIMEOUT_S = 30  # a rank that falls out of lockstep surfaces as a TimeoutError, not a hang


def _routing(seed: int, rank: int, num_tokens: int):
    """Rank `rank`'s `(topk_idx [T, K] int64, with -1 entries)` and `topk_weights [T, K] fp64`."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    idx = torch.rand(num_tokens, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :NUM_TOPK]
    idx = torch.where(torch.rand(num_tokens, NUM_TOPK, generator=g) < 0.25, -1, idx)
    weights = torch.rand(num_tokens, NUM_TOPK, generator=g, dtype=torch.float64) + 0.5
    return idx, weights


def _buffer(num_tokens_per_rank, **kwargs) -> EPBuffer:
    return EPBuffer(None, num_max_tokens_per_rank=max(max(num_tokens_per_rank), 1), hidden=HIDDEN,
                    num_topk=NUM_TOPK, dtype=torch.float64, num_cpu_timeout_secs=TIMEOUT_S, **kwargs)


def _local_idx_of_rows(handle, rank, world_size, num_tokens_per_rank, seed):
    """[M, K] local expert of each received (row, column) in the non-expand layout, -1 where not local."""
    num_local = NUM_EXPERTS // world_size
    every = [_routing(seed, r, num_tokens_per_rank[r])[0] for r in range(world_size)]
    g = handle.recv_src_metadata[:, 0].long()
    n = handle.num_max_tokens_per_rank
    rows = [every[int(k) // n][int(k) % n] for k in g]
    idx = torch.stack(rows) if rows else torch.empty(0, NUM_TOPK, dtype=torch.int64)
    local = idx - rank * num_local
    return torch.where((idx >= 0) & (local >= 0) & (local < num_local), local, -1)


def _expert_of_rows(handle):
    """[S] local expert of each expanded row (padding rows included)."""
    counts = torch.tensor(handle.num_recv_tokens_per_expert_list, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(counts)), counts)


@contextlib.contextmanager
def _no_slow_mode_rerun():
    """gradcheck re-runs a failing check in slow mode (one collective call per element) on the failing rank only,
    which would stall its peer; report the fast-mode numbers instead."""
    gradcheck_module = sys.modules["torch.autograd.gradcheck"]  # the module (torch.autograd.gradcheck is the function)
    name = "_run_slow_mode_and_get_error"
    saved = getattr(gradcheck_module, name, None)
    if saved is not None:
        setattr(gradcheck_module, name, lambda *a, **k: "\n(slow-mode re-run skipped: its calls are collective)")
    try:
        yield
    finally:
        if saved is not None:
            setattr(gradcheck_module, name, saved)


# ------------------------------------------------------------------------------------------------------------
# gradcheck
# ------------------------------------------------------------------------------------------------------------
def _gradcheck_round_trip(rank, world_size, do_expand, alignment, num_tokens_per_rank, seed):
    torch.manual_seed(seed * 10 + rank)
    num_tokens = num_tokens_per_rank[rank]
    num_local = NUM_EXPERTS // world_size
    topk_idx, weights = _routing(seed, rank, num_tokens)
    x = torch.randn(num_tokens, HIDDEN, dtype=torch.float64, requires_grad=True)
    w = weights.requires_grad_()
    bias_0 = torch.randn(num_tokens, HIDDEN, dtype=torch.float64, requires_grad=True)
    bias_1 = torch.randn(num_tokens, HIDDEN, dtype=torch.float64, requires_grad=True)
    dummy = torch.ones(1, dtype=torch.float64, requires_grad=True)  # same input/output count on every rank
    # The expert: a fixed nonlinearity scaled by a per-expert scalar and the router weight.
    scale_L = 1.0 + 0.25 * torch.arange(rank * num_local, (rank + 1) * num_local, dtype=torch.float64)
    with _buffer(num_tokens_per_rank) as buffer:
        dispatcher = TokenDispatcher(buffer, NUM_EXPERTS, expert_alignment=alignment, do_expand=do_expand)

        def round_trip(x, w, bias_0, bias_1, dummy):
            recv_x, recv_w, handle = dispatcher.dispatch(x, topk_idx, w)
            if do_expand:
                coef = scale_L[_expert_of_rows(handle)] * recv_w
            else:
                local = _local_idx_of_rows(handle, rank, world_size, num_tokens_per_rank, seed)
                coef = (recv_w * torch.where(local >= 0, scale_L[local.clamp(min=0)], 0)).sum(dim=1)
            expert_out = torch.tanh(recv_x) * coef[:, None] + recv_x ** 2
            y = dispatcher.combine(expert_out, handle, bias=(bias_0, bias_1))
            return y, dummy * 2

        with _no_slow_mode_rerun():
            ok = torch.autograd.gradcheck(round_trip, (x, w, bias_0, bias_1, dummy), eps=1e-6, atol=1e-7,
                                          fast_mode=True)
    return ok


@pytest.mark.parametrize("num_tokens_per_rank", [(6, 4), (5, 0)], ids=["6+4_tokens", "rank1_no_tokens"])
@pytest.mark.parametrize("do_expand,alignment", [(False, 1), (True, 1), (True, 3)],
                         ids=["non_expand", "expand", "expand_align3"])
def test_gradcheck_round_trip(run_ranks, do_expand, alignment, num_tokens_per_rank):
    assert run_ranks(2, _gradcheck_round_trip, do_expand, alignment, num_tokens_per_rank, 3, timeout=60) == [True, True]


def _gradcheck_single_bias_and_unused_weights(rank, world_size, do_expand):
    """Bias as one tensor; router weights dispatched but unused (their gradient arrives undefined)."""
    torch.manual_seed(rank)
    num_tokens_per_rank = (4, 3)
    topk_idx, weights = _routing(5, rank, num_tokens_per_rank[rank])
    x = torch.randn(num_tokens_per_rank[rank], HIDDEN, dtype=torch.float64, requires_grad=True)
    bias = torch.randn_like(x, requires_grad=True)
    w = weights.requires_grad_()
    with _buffer(num_tokens_per_rank) as buffer:
        dispatcher = TokenDispatcher(buffer, NUM_EXPERTS, do_expand=do_expand)

        def round_trip(x, w, bias):
            recv_x, _, handle = dispatcher.dispatch(x, topk_idx, w)
            return dispatcher.combine(torch.sin(recv_x), handle, bias=bias)

        with _no_slow_mode_rerun():
            ok = torch.autograd.gradcheck(round_trip, (x, w, bias), eps=1e-6, atol=1e-7, fast_mode=True)
        # The unused weights get an all-zero gradient (the collective still ran on every rank).
        round_trip(x, w, bias).sum().backward()
    return ok and bool((w.grad == 0).all()) and torch.equal(bias.grad, torch.ones_like(bias))


@pytest.mark.parametrize("do_expand", [False, True], ids=["non_expand", "expand"])
def test_gradcheck_single_bias_unused_weights(run_ranks, do_expand):
    assert run_ranks(2, _gradcheck_single_bias_and_unused_weights, do_expand, timeout=60) == [True, True]


# ------------------------------------------------------------------------------------------------------------
# adjoint identity
# ------------------------------------------------------------------------------------------------------------
def _adjoint(rank, world_size, do_expand, alignment, num_tokens_per_rank, seed):
    torch.manual_seed(seed * 10 + rank)
    num_tokens = num_tokens_per_rank[rank]
    topk_idx, weights = _routing(seed, rank, num_tokens)
    x = torch.randn(num_tokens, HIDDEN, dtype=torch.float64, requires_grad=True)
    w = weights.clone().requires_grad_()
    with _buffer(num_tokens_per_rank) as buffer:
        dispatcher = TokenDispatcher(buffer, NUM_EXPERTS, expert_alignment=alignment, do_expand=do_expand)
        # dispatch: <dispatch(x), gy> = <x, combine(gy)>, and the same for the router weights.
        recv_x, recv_w, handle = dispatcher.dispatch(x, topk_idx, w)
        gy, gw = torch.randn_like(recv_x), torch.randn_like(recv_w)
        ((recv_x * gy).sum() + (recv_w * gw).sum()).backward()
        # combine: <combine(e) - bias, z> = <e, dispatch(z)>; the bias gets z.
        e = torch.randn_like(recv_x, requires_grad=True)
        bias = torch.randn(num_tokens, HIDDEN, dtype=torch.float64, requires_grad=True)
        z = torch.randn(num_tokens, HIDDEN, dtype=torch.float64)
        y = dispatcher.combine(e, handle, bias=bias)
        (y * z).sum().backward()
        # The gradients are the reference's combine / dispatch of the same cotangents, bitwise. (Skipped when a rank
        # has no tokens: reference._all_to_all cannot reshape a 0-row tensor; every rank skips together.)
        if min(num_tokens_per_rank) > 0:
            n = handle.num_max_tokens_per_rank
            ref_recv_x, _, ref_recv_w, ref_handle = reference.dispatch(
                x.detach(), topk_idx, weights, NUM_EXPERTS, num_max_tokens_per_rank=n, expert_alignment=alignment,
                do_expand=do_expand)
            ref_grad_x, ref_grad_w = reference.combine(gy, ref_handle, topk_weights=gw)
            ref_grad_e = reference.dispatch(z, topk_idx, None, NUM_EXPERTS, num_max_tokens_per_rank=n,
                                            expert_alignment=alignment, do_expand=do_expand)[0]
        else:
            ref_recv_x, ref_recv_w, ref_grad_x, ref_grad_w, ref_grad_e = recv_x, recv_w, x.grad, w.grad, e.grad
    sums = torch.stack([(recv_x * gy).sum(), (x * x.grad).sum(), (recv_w * gw).sum(), (w * w.grad).sum(),
                        ((y - bias) * z).sum(), (e * e.grad).sum()]).detach()
    dist.all_reduce(sums)
    checks = {
        "recv_x == reference": torch.equal(recv_x, ref_recv_x),
        "recv_w == reference": torch.equal(recv_w, ref_recv_w),
        "x.grad == reference combine": torch.equal(x.grad, ref_grad_x),
        "w.grad == reference combined_w": torch.equal(w.grad, ref_grad_w),
        "e.grad == reference dispatch": torch.equal(e.grad, ref_grad_e),
        "bias.grad == z": torch.equal(bias.grad, z),
        "w.grad is 0 at -1 selections": bool((w.grad[topk_idx < 0] == 0).all()),
    }
    return sums.tolist(), checks


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("num_tokens_per_rank", [(9, 7), (0, 6)], ids=["9+7_tokens", "rank0_no_tokens"])
@pytest.mark.parametrize("do_expand,alignment", [(False, 1), (True, 1), (True, 4)],
                         ids=["non_expand", "expand", "expand_align4"])
def test_adjoint_identity(run_ranks, do_expand, alignment, num_tokens_per_rank, seed):
    results = run_ranks(2, _adjoint, do_expand, alignment, num_tokens_per_rank, seed, timeout=60)
    for rank, (sums, checks) in enumerate(results):
        failed = [name for name, ok in checks.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
    sums = results[0][0]
    assert sums == results[1][0]  # all_reduce gives every rank the same totals
    dispatch_x, adjoint_x, dispatch_w, adjoint_w, combine_e, adjoint_e = sums
    assert dispatch_x == pytest.approx(adjoint_x, rel=1e-12, abs=1e-12)
    assert dispatch_w == pytest.approx(adjoint_w, rel=1e-12, abs=1e-12)
    assert combine_e == pytest.approx(adjoint_e, rel=1e-12, abs=1e-12)
    assert dispatch_x != 0 and dispatch_w != 0 and combine_e != 0


# ------------------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------------------
def _invalid_combination(rank, world_size):
    messages = []
    with EPBuffer(None, num_max_tokens_per_rank=4, hidden=HIDDEN, allow_multiple_reduction=False,
                  num_cpu_timeout_secs=TIMEOUT_S) as buffer:
        for do_expand in (True, False):
            with pytest.raises(ValueError, match=rf"^TokenDispatcher: rank {rank}: the buffer has "
                                                 r"allow_multiple_reduction=False, "
                                                 r"but the differentiable dispatch/combine \(here the "
                                                 r"(non-)?expand layout, do_expand=(True|False)\) needs "
                                                 r"allow_multiple_reduction=True for both layouts") as info:
                TokenDispatcher(buffer, NUM_EXPERTS, do_expand=do_expand)
            messages.append(str(info.value))
    with _buffer((4, 4)) as buffer:
        with pytest.raises(ValueError, match=rf"rank {rank}: num_experts=5 must be a positive multiple of the group "
                                             r"size 2"):
            TokenDispatcher(buffer, 5)
        # A handle of the other layout, with as many rows as this layout would have: refused, not misread.
        idx = torch.tensor([[0, 2], [1, 3], [0, 3]])  # one expert on each rank: as many expand rows as tokens
        x = torch.randn(3, HIDDEN, dtype=torch.float64)
        recv_x, _, non_expand = TokenDispatcher(buffer, 4, do_expand=False).dispatch(x, idx)
        expand = TokenDispatcher(buffer, 4, do_expand=True)
        with pytest.raises(ValueError, match=rf"TokenDispatcher.combine: rank {rank}: the handle has do_expand=False "
                                             r"but this dispatcher has do_expand=True"):
            expand.combine(recv_x, non_expand)
        with pytest.raises(ValueError, match=rf"rank {rank}: the handle has num_experts=4 but this dispatcher has "
                                             r"num_experts=8"):
            TokenDispatcher(buffer, 8, do_expand=False).combine(recv_x, non_expand)
        y = TokenDispatcher(buffer, 4, do_expand=False).combine(recv_x, non_expand)  # still in step
        assert torch.equal(y, 2 * x), (y, x)
        # Only rank 0 passes the wrong handle: rank 1, inside its combine, raises at once too (not at the timeout).
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"TokenDispatcher.combine: rank 0: the handle has do_expand=False" if
                           rank == 0 else r"EPBuffer.combine: rank 1: group rank 0 rejected the call.*the handle has "
                                          r"do_expand=False but this dispatcher has do_expand=True"):
            (expand if rank == 0 else TokenDispatcher(buffer, 4, do_expand=False)).combine(recv_x, non_expand)
        assert time.monotonic() - start < TIMEOUT_S / 2
        y = TokenDispatcher(buffer, 4, do_expand=False).combine(recv_x, non_expand)  # still in step
        assert torch.equal(y, 2 * x), (y, x)
    # FP8 (data, scales) on every rank: the dispatch runs, then every rank raises (no rank is left waiting).
    from epcomm.fp8 import per_token_cast_to_fp8
    idx = torch.tensor([[0, 3], [1, 4], [2, 5], [5, 0]])
    x = torch.randn(4, 128).bfloat16()
    with EPBuffer(None, num_max_tokens_per_rank=4, hidden=128, num_cpu_timeout_secs=TIMEOUT_S) as buffer:
        with pytest.raises(TypeError, match=rf"TokenDispatcher.dispatch: rank {rank}: x must be a bf16/fp16/fp32/fp64 "
                                            r"tensor, got tuple; FP8 \(data, scales\) input has no gradient"):
            TokenDispatcher(buffer, NUM_EXPERTS).dispatch(per_token_cast_to_fp8(x.float()), idx)
        assert buffer.dispatch(x, idx, num_experts=NUM_EXPERTS)[0].shape[1] == 128  # still in step
        with pytest.raises(ValueError, match=r"expert_alignment must be >= 1, got 0"):
            TokenDispatcher(buffer, NUM_EXPERTS, expert_alignment=0)
        with pytest.raises(TypeError, match=r"do_expand must be a bool, got int"):
            TokenDispatcher(buffer, NUM_EXPERTS, do_expand=1)
    with pytest.raises(TypeError, match=r"buffer must be an epcomm.EPBuffer, got NoneType"):
        TokenDispatcher(None, NUM_EXPERTS)
    return messages


def test_invalid_combination_raises(run_ranks):
    for messages in run_ranks(2, _invalid_combination, timeout=60):
        assert "expand layout, do_expand=True" in messages[0]
        assert "non-expand layout, do_expand=False" in messages[1]
        assert messages[0].endswith("create the EPBuffer with allow_multiple_reduction=True")


def _wider_expert_outputs(rank, world_size):
    """bf16 tokens, fp32 expert outputs (bf16 rows x fp32 weights, as TokenDispatcher.combine allows) on a buffer
    sized for bf16, at a shape where the forward calls fit and the backward's fp32 cached dispatch does not: the
    forward combine refuses, on every rank, naming the backward; without grad it runs; a buffer sized with
    dtype=float32 trains."""
    num_tokens, hidden, num_experts = 256, 1024, 2 * world_size
    gen = torch.Generator().manual_seed(5 + rank)
    idx = torch.rand(num_tokens, num_experts, generator=gen).topk(1, dim=1).indices
    w = torch.rand(num_tokens, 1, generator=gen).requires_grad_()
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16().requires_grad_()
    sized = {}
    for dtype in (torch.bfloat16, torch.float32):
        with EPBuffer(None, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=1, dtype=dtype,
                      num_cpu_timeout_secs=TIMEOUT_S) as buffer:
            dispatcher = TokenDispatcher(buffer, num_experts)
            recv_x, recv_w, handle = dispatcher.dispatch(x, idx, w)
            expert_out = recv_x * recv_w[:, None]
            assert expert_out.dtype == torch.float32
            if dtype == torch.bfloat16:
                refused = (rf"TokenDispatcher.combine: rank {rank}: its backward \(a cached dispatch of y's "
                           r"torch.float32 gradient\) needs \d+ bytes but the buffer has num_bytes=\d+; .*"
                           r"dtype=torch.float32\) \(forward only: run it under torch.no_grad\(\)\)$")
                with pytest.raises(ValueError, match=refused):
                    dispatcher.combine(expert_out, handle)
                bias = torch.zeros(num_tokens, hidden, requires_grad=True)  # its gradient needs the backward too
                with pytest.raises(ValueError, match=refused):
                    dispatcher.combine(expert_out.detach(), handle, bias=(None, bias))
                with torch.no_grad():
                    sized["no-grad"] = dispatcher.combine(expert_out, handle).shape
            else:
                y = dispatcher.combine(expert_out, handle)
                y.float().pow(2).sum().backward()
                sized["trained"] = bool(x.grad.abs().sum() > 0 and w.grad.abs().sum() > 0)
    return sized


def test_backward_that_would_not_fit_is_refused_in_the_forward(run_ranks):
    for sized in run_ranks(2, _wider_expert_outputs, timeout=120):
        assert sized == {"no-grad": (256, 1024), "trained": True}, sized


def _wider_tokens_on_two_hosts(rank, world_size):
    """Ranks on two hosts (LOCAL_WORLD_SIZE=1: the combine's staging is per rank), fp32 tokens on a buffer sized
    for bf16: the dispatch fits, its backward (an fp32 combine) would not: every rank raises after the forward
    dispatch, naming the backward; the ranks stay in step; without grad the dispatch runs."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        gen = torch.Generator().manual_seed(9 + rank)
        num_tokens, hidden, num_topk, num_experts = 16, 256, 8, 8 * world_size
        w, idx = torch.rand(num_tokens, num_experts, generator=gen).topk(num_topk, dim=1)
        x = torch.randn(num_tokens, hidden, generator=gen, requires_grad=True)
        with EPBuffer(None, num_max_tokens_per_rank=488, hidden=hidden, num_topk=num_topk,
                      num_cpu_timeout_secs=TIMEOUT_S) as buffer:
            assert buffer.num_bytes == 2 << 20
            dispatcher = TokenDispatcher(buffer, num_experts)
            with pytest.raises(ValueError, match=rf"^TokenDispatcher.dispatch: rank {rank}: its backward \(a combine "
                                                 r"of the torch.float32 gradient\) needs \d+ bytes but the buffer has "
                                                 r"num_bytes=2097152; .*dtype=torch.float32\) \(forward only: run it "
                                                 r"under torch.no_grad\(\)\)$"):
                dispatcher.dispatch(x, idx, w)
            with torch.no_grad():
                return tuple(dispatcher.dispatch(x, idx, w)[0].shape)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def test_dispatch_backward_that_would_not_fit_is_refused_in_the_forward(run_ranks):
    shapes = run_ranks(2, _wider_tokens_on_two_hosts, timeout=120)
    assert all(s[1] == 256 for s in shapes) and sum(s[0] for s in shapes) > 0, shapes


def _compiled_moe_layer(rank: int, world: int, backend: str, do_expand: bool):
    """A MoE layer with the dispatcher inside `torch.compile`: the same outputs and gradients as eager, bitwise, on
    fresh routings, and Dynamo compiles only the caller's code around the calls (epcomm's entry points are
    `torch.compiler.disable`d: tracing into them broke the graph at every host read, dozens of frames a step)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    buf = _buffer([8] * world)
    disp = TokenDispatcher(buf, num_experts=NUM_EXPERTS, do_expand=do_expand)
    w_expert = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def layer(x, idx, w):
        recv_x, recv_w, handle = disp.dispatch(x, idx, w)
        y = torch.tanh(recv_x @ w_expert)
        y = y * recv_w[:, None] if do_expand else y  # expand: one weight per row; non-expand: unweighted rows
        return disp.combine(y, handle) * 2

    compiled = torch.compile(layer, backend=backend)
    for step in range(3):
        idx, w = _routing(step, rank, 8)
        x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.float64)
        outs = []
        for fn in (compiled, layer):
            xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            out = fn(xg, idx, wg)
            (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
            outs.append((out.detach(), xg.grad, wg.grad))
        for a, b in zip(*outs):
            assert torch.equal(a, b), (step, a, b)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    buf.destroy()
    return frames


@pytest.mark.parametrize("backend,do_expand", [("eager", False), ("aot_eager", True)])
def test_dispatcher_inside_torch_compile(run_ranks, backend, do_expand):
    frames = run_ranks(2, _compiled_moe_layer, backend, do_expand)
    assert all(0 < f <= 6 for f in frames), frames


def _skipped_backward(rank, world_size):
    """Rank 1 skips `loss.backward()`: rank 0's timeout names the backward it waits in (the caller made no dispatch
    there), not a bare EPBuffer.dispatch."""
    buf = EPBuffer(None, num_max_tokens_per_rank=8, hidden=HIDDEN, num_topk=NUM_TOPK, dtype=torch.float64,
                   num_cpu_timeout_secs=2)
    idx, w = _routing(3, rank, 6)
    x = torch.randn(6, HIDDEN, dtype=torch.float64, requires_grad=True)
    tokens = TokenDispatcher(buf, num_experts=NUM_EXPERTS)
    recv_x, recv_w, handle = tokens.dispatch(x, idx, w)
    y = tokens.combine(recv_x * 2, handle)
    if rank == 1:
        time.sleep(5)
        return None
    try:
        y.sum().backward()
    except TimeoutError as e:
        return str(e)
    return "no error"


def test_a_timeout_in_backward_names_the_backward():
    from epcomm.testing import run_in_fresh_world

    msg = run_in_fresh_world(2, _skipped_backward, timeout=60)[0]
    assert msg.startswith("the backward of TokenDispatcher.combine (a cached EPBuffer.dispatch): EPBuffer.dispatch"), \
        msg
