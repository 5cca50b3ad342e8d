"""The nvlink low-latency kernels under TRITON_INTERPRET=1: ranks simulated one after another in one process.

Every rank's region is a CPU tensor and the kernels address the others through the same 16-byte deltas as on
GPU. With several ranks a call runs as split kernels (`return_recv_hook=True`): the send kernels of every rank
before the receive kernels (the order the flags enforce on GPU), so the waits are satisfied; a receive whose
peer never sent checks the bounded wait. A fused kernel runs on a single rank, or on one rank after its split peers
have sent (`fused-with-peers`), as one program: the interpreter runs programs one after another, and a fused
program waits for other programs' sends. So the interleaving of many programs is left to the GPU tests. Run as a script:
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
        return lambda _layout, _row_format: (regions[r], torch.div(ptrs - ptrs[r], 16, rounding_mode="floor"))

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


class Combines:
    """Two ranks (or one) with dispatched rows, for combine calls one by one: expert e of a rank scales its rows by
    `scale + e`, and `expected` is the weighted sum in ascending top-k position (every selection live)."""

    def __init__(self, num_ranks=2, tokens=(4, 3), timeout_s=0.05, n=4, hidden=256, num_experts=4, num_topk=3):
        gen = torch.Generator().manual_seed(sum(tokens) + num_ranks)
        self.num_local = num_experts // num_ranks
        self.layout = Layout(num_ranks, n, hidden, num_topk, self.num_local)
        self.eng, self.areas = engines(num_ranks, self.layout, timeout_s)
        self.xs = [torch.randn(t, hidden, generator=gen).bfloat16() for t in tokens]
        self.idx = [torch.stack([torch.randperm(num_experts, generator=gen)[:num_topk] for _ in range(t)]) if t
                    else torch.empty(0, num_topk, dtype=torch.int64) for t in tokens]
        self.ws = [torch.rand(t, num_topk, generator=gen) for t in tokens]
        self.items = None

    def dispatch(self):  # split on every rank: the combine's item maps
        pend = [e.dispatch(a, x, i, None, False, False, False, hook=True)
                for e, a, x, i in zip(self.eng, self.areas, self.xs, self.idx)]
        for p in pend:
            p[4]()
        self.pend = pend

    def combine(self, r, scale, fused=False):
        """Rank r's combine (split unless `fused`): `(out, receive hook or None)`."""
        y = (self.pend[r][0].float() * (scale + torch.arange(self.num_local)).view(-1, 1, 1)).bfloat16()
        out = torch.empty(self.xs[r].shape[0], self.layout.hidden, dtype=torch.bfloat16)
        return out, self.eng[r].combine(self.areas[r], y, self.idx[r], self.ws[r], self.pend[r][2], out,
                                        hook=not fused)

    def expected(self, r, scale):
        acc = torch.zeros(self.xs[r].shape[0], self.layout.hidden)
        for j in range(self.idx[r].shape[1]):
            for t in range(self.xs[r].shape[0]):
                e = int(self.idx[r][t, j])
                y = (self.xs[r][t].float() * (scale + e % self.num_local)).bfloat16().float()
                acc[t] = acc[t] + self.ws[r][t, j] * y
        return acc.bfloat16()

    def arrivals(self, r):
        """[2 parities, N, R] int64: rank r's arrival counts."""
        lay = self.layout
        return self.areas[r].local[lay.arr_off:].view(torch.int64)[:2 * lay.num_max_tokens * lay.num_ranks].view(
            2, lay.num_max_tokens, lay.num_ranks)


def check_combine_waits() -> None:
    """A combine receive waits for exactly its token's rows: it times out, naming the rank, when that rank sent
    nothing this call (also after two complete calls: the counts of the call two before do not satisfy it), or
    when one send item for the token has not been counted yet, split or fused. A sender two calls ahead waits for
    the receiver to free the area (and names it when it does not)."""
    c = Combines()
    c.dispatch()
    c.combine(0, 1)[1]()  # rank 1 never sends
    assert int(c.eng[0].status[0]) == 2, c.eng[0].status

    c = Combines()
    for call in range(2):  # two complete calls (both parities), then rank 1 is silent in call 2
        c.dispatch()
        got = [c.combine(r, 1 + call) for r in range(2)]
        for r, (out, hook) in enumerate(got):
            hook()
            assert torch.equal(out, c.expected(r, 1 + call)), (call, r)
    assert int(c.eng[0].status[0]) == 0
    c.dispatch()
    c.combine(0, 7)[1]()
    assert int(c.eng[0].status[0]) == 2, c.eng[0].status

    c = Combines()  # rank 1 two calls ahead of rank 0's receives: its sends wait for rank 0 to free the area
    c.dispatch()
    first = c.combine(0, 1)  # rank 0's receives of calls 0 and 1 stay pending
    c.combine(1, 1)[1]()
    c.combine(0, 2)
    c.combine(1, 2)[1]()
    c.combine(1, 3)  # call 2 reuses call 0's area, which rank 0 has not read: the wait names rank 0
    assert int(c.eng[1].status[0]) == 1 and int(c.eng[0].status[0]) == 0, (c.eng[0].status, c.eng[1].status)
    assert first[1] is not None

    for fused in (False, True):  # one item of token 1 from rank 1 not counted yet
        c = Combines()
        c.dispatch()
        c.combine(1, 1)
        c.arrivals(0)[0, 1, 1] -= 1
        out, hook = c.combine(0, 1, fused=fused)
        if hook is not None:
            hook()
        assert int(c.eng[0].status[0]) == 2, (fused, c.eng[0].status)


def check_combine_mixed() -> None:
    """Fused and split combines mix on one area: a fused call while a split call's receive is pending, on one rank
    and beside a split peer, and ranks with different token counts (0 included). Every result exact; every
    arrival count ends at (calls of its parity) x items per slot."""
    c = Combines(num_ranks=1, tokens=(3,), timeout_s=5.0)
    for splits in [(True, False), (False, True), (True, True), (False, False)]:
        c.dispatch()
        got = [c.combine(0, 1 + j, fused=not split) for j, split in enumerate(splits)]
        for j, (out, hook) in enumerate(got):
            if hook is not None:
                hook()
        for j, (out, _) in enumerate(got):
            assert torch.equal(out, c.expected(0, 1 + j)), (splits, j)
    c = Combines(tokens=(4, 2), timeout_s=5.0)
    for _ in range(2):  # rank 0: split call e (receive pending), fused call e + 1, then the hook of e
        c.dispatch()
        peer = [c.combine(1, 1 + j) for j in range(2)]
        first = c.combine(0, 1)
        second = c.combine(0, 2, fused=True)
        first[1]()
        for _, hook in peer:
            hook()
        for j, (r, out) in enumerate([(0, first[0]), (0, second[0]), (1, peer[0][0]), (1, peer[1][0])]):
            assert torch.equal(out, c.expected(r, 1 + j % 2)), (r, j)
    for tokens in [(0, 3), (3, 0), (4, 1)]:
        for fused0 in (False, True):
            c = Combines(tokens=tokens, timeout_s=5.0)
            for call in range(3):
                c.dispatch()
                got = [None, None]
                for r in (1, 0):  # the split peer sends first (a fused call waits for it)
                    got[r] = c.combine(r, 1 + call, fused=fused0 and r == 0)
                for r, (out, hook) in enumerate(got):
                    if hook is not None:
                        hook()
                    assert torch.equal(out, c.expected(r, 1 + call)), (tokens, fused0, call, r)
            kb = -(-c.layout.num_topk // 2)
            for r in range(2):
                assert (c.arrivals(r)[0] == 2 * kb).all() and (c.arrivals(r)[1] == kb).all(), (tokens, r)
    for e in c.eng:
        assert int(e.status[0]) == 0


def check_wait_costs() -> None:
    """`*_wait_recv_cost_stats` (the `cost` argument): added to, never overwritten; nothing for a rank whose rows
    were there when the receive began (split calls after every send, a fused call on one rank), in dispatch and
    combine; and the wait for a rank that never sent, charged to that rank alone (the interpreter counts a
    millisecond per poll until the 0.05 s timeout)."""
    c = Combines(timeout_s=0.05)
    costs = [torch.tensor([5, 7]), torch.tensor([11, 13])]
    pend = [e.dispatch(a, x, i, None, False, False, False, hook=True, cost=k)
            for e, a, x, i, k in zip(c.eng, c.areas, c.xs, c.idx, costs)]
    for p in pend:
        p[4]()
    c.pend = pend
    check_dispatch(pend, c.xs, c.idx, c.num_local, False, False, False)
    got = []
    for r in range(2):
        y = (pend[r][0].float() * (1 + torch.arange(c.num_local)).view(-1, 1, 1)).bfloat16()
        out = torch.empty(c.xs[r].shape[0], c.layout.hidden, dtype=torch.bfloat16)
        got.append((out, c.eng[r].combine(c.areas[r], y, c.idx[r], c.ws[r], pend[r][2], out, hook=True,
                                          cost=costs[r])))
    for r, (out, hook) in enumerate(got):
        hook()
        assert torch.equal(out, c.expected(r, 1)), r
    assert [k.tolist() for k in costs] == [[5, 7], [11, 13]], costs

    one = Combines(num_ranks=1, tokens=(3,), timeout_s=5.0)  # fused: its own sends are in before it waits
    cost = torch.zeros(1, dtype=torch.int64)
    p = one.eng[0].dispatch(one.areas[0], one.xs[0], one.idx[0], None, False, False, False, hook=False, cost=cost)
    check_dispatch([p], one.xs, one.idx, one.num_local, False, False, False)
    assert cost.tolist() == [0], cost

    for kind in ("dispatch", "combine"):  # rank 1 never sends: rank 0 waits 0.05 s for it, and only for it
        c = Combines(timeout_s=0.05)
        if kind == "combine":
            c.dispatch()
        cost = torch.tensor([5, 7])
        if kind == "dispatch":
            c.eng[0].dispatch(c.areas[0], c.xs[0], c.idx[0], None, False, False, False, hook=True, cost=cost)[4]()
        else:
            y = c.pend[0][0].clone()
            out = torch.empty(c.xs[0].shape[0], c.layout.hidden, dtype=torch.bfloat16)
            c.eng[0].combine(c.areas[0], y, c.idx[0], c.ws[0], c.pend[0][2], out, hook=True, cost=cost)()
        assert int(c.eng[0].status[0]) == 2, (kind, c.eng[0].status)
        assert cost[0] == 5 and cost[1] >= 7 + 50_000_000, (kind, cost)


@triton.jit
def _timed_wait(flags_ptr, status_ptr, cost_ptr, target, timeout_ns, R: tl.constexpr, R_POW2: tl.constexpr):
    from epcomm.kernels._signal_triton import _wait_all_timed
    _wait_all_timed(flags_ptr, target, timeout_ns, status_ptr, cost_ptr, R, R_POW2, False)


def check_timed_wait_order() -> None:
    """`_wait_all_timed` charges each rank until its own flag is seen: rank 0's flag is up at once, rank 1's comes
    up during the wait, rank 2's well after it (set by a thread while the interpreted kernel polls); so rank 0
    costs nothing and rank 1 less than rank 2 (the interpreter counts a millisecond per poll)."""
    import threading
    import time

    flags = torch.tensor([1, 0, 0, 0], dtype=torch.int64)
    cost = torch.tensor([3, 0, 0, 0], dtype=torch.int64)
    status = torch.zeros(1, dtype=torch.int64)

    def arrive():  # the kernel's first read comes well within the first second (the interpreter's set-up)
        time.sleep(1.0)
        flags[1] = 1
        time.sleep(0.5)
        flags[2] = 1
    helper = threading.Thread(target=arrive)
    helper.start()
    _timed_wait[(1,)](flags, status.data_ptr(), cost, 1, 600 * 10**9, R=3, R_POW2=4)
    helper.join()
    assert int(status[0]) == 0, status
    assert cost[0] == 3 and 0 < cost[1] < cost[2] and cost[3] == 0, cost


def run(case: str) -> None:
    gen = torch.Generator().manual_seed(len(case))
    if case == "cast":
        return check_cast()
    if case == "wait-costs":
        check_timed_wait_order()
        return check_wait_costs()
    if case == "combine-waits":
        return check_combine_waits()
    if case == "combine-mixed":
        return check_combine_mixed()
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
    elif case == "bad-id":
        num_ranks, n, hidden, num_experts, num_topk, tokens = 1, 4, 256, 4, 2, [4]
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
    if case == "bad-id":  # the host reads no ids: the send kernel names the token (and traps on GPU)
        for bad in (num_experts, -2):
            ids = idx[0].clone()
            ids[2, 1] = bad
            eng[0].dispatch(areas[0], xs[0], ids, None, False, False, False, hook=False)
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
                assert not areas[r].calls.received(p[3])
                p[4]()
                p[4]()  # a hook receives once; calling it again does nothing
                assert areas[r].calls.received(p[3])
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
    for name in sys.argv[1:]:
        run(name)
        print(name, "ok")
    print("ok")
