"""The nvlink low-latency kernels under TRITON_INTERPRET=1: ranks simulated one after another in one process.

Every rank's region is a CPU tensor and the kernels address the others through the same 16-byte deltas as on
GPU. With several ranks a call runs as split kernels (`return_recv_hook=True`): the send kernels of every rank
before the receive kernels (the order the flags enforce on GPU), so the waits are satisfied; a receive whose
peer never sent checks the bounded wait. A single rank runs the fused kernels (one program: the interpreter runs
programs one after another, and a fused program waits for every program's sends). Run as a script:
`python lowlatency_sim.py CASE` (the test sets TRITON_INTERPRET=1, which must precede the triton import).
"""

import sys

import torch
import triton
import triton.language as tl

from epcomm.fp8 import num_sf_packs, per_token_cast_to_fp8, unpack_ue8m0
from epcomm.kernels._lowlatency_triton import _e4m3_bits
from epcomm.lowlatency_nvlink import Layout, LowLatencyNVLink


def engines(num_ranks, layout, timeout_s=30.0):
    regions = [torch.zeros(layout.nbytes, dtype=torch.uint8) for _ in range(num_ranks)]
    ptrs = torch.tensor([t.data_ptr() for t in regions], dtype=torch.int64)

    def allocate_for(r):
        return lambda _layout: (regions[r], torch.div(ptrs - ptrs[r], 16, rounding_mode="floor"))

    out = [LowLatencyNVLink(r, num_ranks, torch.device("cpu"), timeout_s, allocate_for(r)) for r in range(num_ranks)]
    return out, [e.prepare(layout, "test") for e in out]


def routing(gen, num_tokens, num_experts, num_topk):
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:num_topk] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty(0, num_topk, dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=gen) < 0.2] = -1
    return idx


def cast(x, use_fp8, pow2, ue8m0):
    """What the low-latency dispatch sends for x (lowlatency.py's portable path)."""
    if not use_fp8:
        return x
    data, scales = per_token_cast_to_fp8(x, use_ue8m0=pow2 or ue8m0)
    return data, (unpack_ue8m0(scales, num_sf_packs(x.shape[1])) if pow2 and not ue8m0 else scales)


def check_dispatch(pend, xs, idx, num_local, use_fp8, pow2, ue8m0):
    """Each expert's rows are the tokens that chose it, in ascending (source rank, token), as the reference."""
    num_ranks = len(xs)
    sent = [cast(x, use_fp8, pow2, ue8m0) for x in xs]
    for r in range(num_ranks):
        recv_x, count = pend[r][:2]
        for e in range(num_local):
            rows = [(s, t) for s in range(num_ranks) for t in range(xs[s].shape[0])
                    if r * num_local + e in idx[s][t].tolist()]
            assert int(count[e]) == len(rows), (r, e, count.tolist(), rows)
            for j, (s, t) in enumerate(rows):
                if use_fp8:
                    assert torch.equal(recv_x[0][e, j].view(torch.uint8), sent[s][0][t].view(torch.uint8)), (r, e, j)
                    assert torch.equal(recv_x[1][e, j], sent[s][1][t]), (r, e, j)
                    assert recv_x[1].stride(1) == 1
                else:
                    assert torch.equal(recv_x[e, j], sent[s][t]), (r, e, j)


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _e4m3_bits(tl.load(x_ptr + offs, mask=offs < n, other=0.0), False), mask=offs < n)


def check_cast() -> None:
    """The integer FP8 spelling (`_e4m3_bits`, HW off: the interpreter's and pre-8.9 GPUs' path) gives torch's
    float8_e4m3fn bits for every |v| <= 448 it is given: random magnitudes over the whole range, subnormals, ties,
    the ends, signed zeros, and NaN."""
    gen = torch.Generator().manual_seed(11)
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite code
    mid = (grid[1:] + grid[:-1]) / 2  # ties, rounded to even
    rand = torch.randn(20000, generator=gen) * torch.pow(2.0, torch.randint(-12, 9, (20000,), generator=gen).float())
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, float("nan")])
    v = torch.cat([grid, -grid, mid, -mid, rand.clamp(-448, 448), special])
    out = torch.empty(v.shape[0], dtype=torch.uint8)
    _cast_kernel[(triton.cdiv(v.shape[0], 1024),)](v, out, v.shape[0], BLOCK=1024)
    want = v.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (out != want).nonzero()
    assert bad.numel() == 0, [(float(v[i]), int(out[i]), int(want[i])) for i in bad[:5, 0]]


def run(case: str) -> None:
    gen = torch.Generator().manual_seed(len(case))
    if case == "cast":
        return check_cast()
    if case == "two-ranks":
        num_ranks, n, hidden, num_experts, num_topk, tokens = 2, 6, 2200, 8, 3, [5, 3]  # 18 blocks: 2 per row
    elif case == "three-ranks":  # a partial last FP8 block, an empty rank, top-2
        num_ranks, n, hidden, num_experts, num_topk, tokens = 3, 4, 200, 6, 2, [4, 0, 2]
    elif case == "fused-with-peers":  # rank 0 fused (its sends to peers, their arrivals), ranks 1 and 2 split
        num_ranks, n, hidden, num_experts, num_topk, tokens = 3, 5, 300, 9, 4, [5, 2, 4]
    elif case == "one-rank-fused":
        num_ranks, n, hidden, num_experts, num_topk, tokens = 1, 5, 4200, 6, 3, [4]  # 33 blocks: 2 per row
    elif case == "timeout":
        num_ranks, n, hidden, num_experts, num_topk, tokens = 2, 2, 128, 4, 2, [2, 2]
    elif case == "mixed":  # fused and split calls of one kind interleaved on one area
        num_ranks, n, hidden, num_experts, num_topk, tokens = 1, 4, 600, 4, 2, [3]
    num_local = num_experts // num_ranks
    layout = Layout(num_ranks, n, hidden, num_topk, num_local)
    eng, areas = engines(num_ranks, layout, timeout_s=0.05 if case == "timeout" else 30.0)
    xs = [torch.randn(t, hidden, generator=gen).bfloat16() for t in tokens]
    idx = [routing(gen, t, num_experts, num_topk) for t in tokens]
    if case == "timeout":  # rank 0 waits for a dispatch rank 1 never sends: the wait ends and names rank 1
        eng[0].dispatch(areas[0], xs[0], idx[0], None, False, False, False, hook=True)[4]()
        assert int(eng[0].status[0]) == 2, eng[0].status
        try:
            eng[0].check_status("EPBuffer.low_latency_dispatch")
        except TimeoutError as e:
            assert "waiting for rank 1" in str(e), e
        else:
            raise AssertionError("no TimeoutError after a timed-out wait")
        return
    if case == "mixed":  # split send (e), fused (e + 1), receive (e); then fused, split: every result exact
        order = [(True, False), (False, True), (True, True)]  # (first call split?, second call split?) per round
        for round_, (first_split, second_split) in enumerate(order):
            first = eng[0].dispatch(areas[0], xs[0], idx[0], None, False, False, False, hook=first_split)
            second = eng[0].dispatch(areas[0], xs[0], idx[0], None, True, False, False, hook=second_split)
            for p in (first, second):
                if p[4] is not None:
                    p[4]()
            check_dispatch([first], xs, idx, num_local, False, False, False)
            check_dispatch([second], xs, idx, num_local, True, False, False)
        assert areas[0].state[:6].tolist() == [6, 0, 0, 0, 0, 0], areas[0].state
        # The ready counts assume a fixed number of send items per call: a program shape changed under a live area
        # raises on the host before anything is launched (every rank computes the same shape, so every rank raises).
        import epcomm.lowlatency_nvlink as lln
        saved, lln._BLOCKS_PER_PROGRAM = lln._BLOCKS_PER_PROGRAM, 4  # 8 blocks per item here -> 4: twice the items
        try:
            eng[0].dispatch(areas[0], xs[0], idx[0], None, False, False, False, hook=False)
        except RuntimeError as e:
            assert "send items per peer" in str(e) and "program shape" in str(e), e
        else:
            raise AssertionError("a changed program shape did not raise")
        finally:
            lln._BLOCKS_PER_PROGRAM = saved
        assert areas[0].state[:6].tolist() == [6, 0, 0, 0, 0, 0], areas[0].state  # nothing ran
        return
    # Split calls on several ranks; one rank runs fused (after the peers' send kernels it waits for). With
    # "fused-with-peers", rank 0 runs fused among split peers: both count the same sends, so they mix.
    fused = [num_ranks == 1 or (case == "fused-with-peers" and r == 0) for r in range(num_ranks)]
    order = sorted(range(num_ranks), key=lambda r: fused[r])  # split senders first
    # Several calls in a row: both parities, counters past the first round, every scale format.
    for round_, (use_fp8, ue8m0, pow2) in enumerate([(False, False, False), (True, False, False), (True, True, True),
                                                     (True, False, True), (False, False, False)]):
        stats = [torch.zeros(num_local, dtype=torch.int32) for _ in range(num_ranks)]
        pend = [None] * num_ranks
        for r in order:
            pend[r] = eng[r].dispatch(areas[r], xs[r], idx[r], stats[r], use_fp8, pow2, ue8m0, hook=not fused[r])
        for r, p in enumerate(pend):
            if not fused[r]:
                assert not eng[r].received(areas[r], p[3])
                p[4]()
                p[4]()  # a hook receives once; calling it again does nothing
                assert eng[r].received(areas[r], p[3])
        check_dispatch(pend, xs, idx, num_local, use_fp8, pow2, ue8m0)
        for r in range(num_ranks):
            assert torch.equal(stats[r], pend[r][1]), (stats[r], pend[r][1])
        if use_fp8:
            continue
        # Expert e of rank r multiplies by (1 + e); the combine weights and sums in ascending top-k position.
        ws = [torch.rand(t, num_topk, generator=gen) for t in tokens]
        # The last round writes into strided views (stride 2 along hidden): the kernels write a contiguous copy.
        outs = [torch.empty(t, hidden, dtype=torch.bfloat16) if round_ == 0 else
                torch.empty(t, 2 * hidden, dtype=torch.bfloat16)[:, ::2] for t in tokens]
        ys = [(pend[r][0].float() * (1 + torch.arange(num_local)).view(-1, 1, 1)).bfloat16()
              for r in range(num_ranks)]
        receives = [None] * num_ranks
        for r in order:
            receives[r] = eng[r].combine(areas[r], ys[r], idx[r], ws[r], pend[r][2], outs[r], hook=not fused[r])
        for r, f in enumerate(receives):
            if not fused[r]:
                f()
        for r in range(num_ranks):
            acc = torch.zeros(tokens[r], hidden)
            for j in range(num_topk):
                for t in range(tokens[r]):
                    e = int(idx[r][t, j])
                    if e >= 0:
                        acc[t] = acc[t] + ws[r][t, j] * (xs[r][t].float() * (1 + e % num_local)).bfloat16().float()
            assert torch.equal(outs[r], acc.bfloat16()), (r, (outs[r].float() - acc).abs().max())
    for e in eng:
        assert int(e.status[0]) == 0
    # Call counters advanced once per call (5 dispatches, 2 combines); finish counters back at 0.
    for a in areas:
        assert a.state[:6].tolist() == [5, 2, 0, 0, 0, 0], a.state
    if not fused[0]:  # a third call while the call two before is still unreceived raises before launching anything
        first = [eng[0].dispatch(areas[0], xs[0], idx[0], None, False, False, False, hook=True) for _ in range(2)]
        try:
            eng[0].dispatch(areas[0], xs[0], idx[0], None, False, False, False, hook=True)
        except ValueError as e:
            assert "receive hook of the call two calls before" in str(e), e
        else:
            raise AssertionError("a third call with the call two before unreceived did not raise")
        assert len(first) == 2


if __name__ == "__main__":
    run(sys.argv[1])
    print("ok")
