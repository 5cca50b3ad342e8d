"""The nvlink transport's pull (`move_fields`, transport/pull.py) on CPU: fake symmetric regions shared by threads.

Each thread is one rank with its own `NVLinkTransport` whose region views are slices of plain CPU tensors and
whose device barrier is a `threading.Barrier`, so the staging layout, the alternating staging areas and the
offsets each rank reads at are checked without a GPU (the GPU suite runs the real transport).
"""

import random
import threading

import pytest
import torch

from epcomm import moves
from epcomm.moves import Route, chunk_bounds, pull_weights, return_weights
from epcomm.transport.nvlink import NVLinkTransport

HIDDEN, CAP, HEAD = 24, 1 << 16, 4096


class FakeRegion:
    """`SymmetricRegion`'s two methods over CPU tensors: `peer` views a slice, `barrier` meets the threads."""

    def __init__(self, regions: list, barrier: threading.Barrier):
        self.regions, self.meet = regions, barrier

    def peer(self, rank, offset, shape, dtype):
        numel = 1
        for s in shape:
            numel *= s
        return self.regions[rank][offset: offset + numel * dtype.itemsize].view(dtype).view(shape)

    def barrier(self, channel=0, timeout_ms=0):
        self.meet.wait()


def _transport(rank: int, num_ranks: int, region: FakeRegion) -> NVLinkTransport:
    tr = object.__new__(NVLinkTransport)  # no process group, no symmetric memory: only what move_fields reads
    tr.num_ranks, tr.rank, tr.device = num_ranks, rank, torch.device("cpu")
    tr.rows_capacity, tr._stage_off, tr._stage_calls = CAP, [HEAD + CAP, HEAD + 2 * CAP], 0
    tr.region, tr._side, tr._signals, tr._captured = region, None, None, False
    return tr


def _run_ranks(num_ranks: int, rank_body, meet: threading.Barrier) -> None:
    """`rank_body(r)` on one thread per rank under a watchdog; a failing rank releases the others (the barrier is
    aborted) instead of leaving them waiting, and its error is raised here."""
    errors = []

    def guarded(r: int) -> None:
        try:
            rank_body(r)
        except BaseException as e:
            errors.append(e)
            meet.abort()

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank did not finish (watchdog)"
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]


def _run(num_ranks: int, num_tokens: int, seed: int, back_mode: str = "push") -> None:
    gen = torch.Generator().manual_seed(seed)
    pick = random.Random(seed)
    # sends[s][d]: the tokens rank s sends to rank d, ascending (any subset, empty included)
    sends = [[sorted(pick.sample(range(num_tokens), pick.randint(0, num_tokens))) for _ in range(num_ranks)]
             for _ in range(num_ranks)]
    matrix = [[len(sends[s][d]) for d in range(num_ranks)] for s in range(num_ranks)]
    xs = [torch.randn(num_tokens, HIDDEN, generator=gen).bfloat16() for _ in range(num_ranks)]
    ws = [torch.randn(num_tokens, 3, generator=gen) for _ in range(num_ranks)]
    ys, ws_back = [None] * num_ranks, [None] * num_ranks
    meet = threading.Barrier(num_ranks)
    region = FakeRegion([torch.zeros(HEAD + 3 * CAP, dtype=torch.uint8) for _ in range(num_ranks)], meet)

    def rank_body(r: int) -> None:
        tr = _transport(r, num_ranks, region)
        src_X = torch.tensor([t for d in range(num_ranks) for t in sends[r][d]], dtype=torch.int64)
        route = Route(matrix[r], [matrix[s][r] for s in range(num_ranks)], src_X, matrix)
        want_x = torch.cat([xs[s][sends[s][r]] for s in range(num_ranks)])
        want_w = torch.cat([ws[s][sends[s][r]] for s in range(num_ranks)])
        for call in range(3):  # both staging areas, then the first again
            out_x = torch.full((route.num_recv, HIDDEN), float("nan"), dtype=torch.bfloat16)
            out_w = torch.full((route.num_recv, 3), float("nan"))
            tr.move_fields([(xs[r], out_x), (ws[r], out_w)], route, call_id=call)
            assert torch.equal(out_x, want_x) and torch.equal(out_w, want_w), f"rank {r} call {call}"
            meet.wait()
        # The return direction: each received row goes back to its source, landing in the source's send order.
        ys[r] = torch.randn(route.num_recv, HIDDEN, generator=torch.Generator().manual_seed(r)).bfloat16()
        ws_back[r] = torch.randn(route.num_recv, 3, generator=torch.Generator().manual_seed(100 + r))
        meet.wait()
        back = route.back()

        def want_back(field: list) -> torch.Tensor:
            parts = []
            for d in range(num_ranks):
                first = sum(matrix[s][d] for s in range(r))  # my rows sit after those of lower ranks at d
                parts.append(field[d][first: first + matrix[r][d]])
            return torch.cat(parts)
        out_y = torch.empty(back.num_recv, HIDDEN, dtype=torch.bfloat16)
        tr.move_fields([(ys[r], out_y)], back, call_id=3)
        assert torch.equal(out_y, want_back(ys)), f"rank {r}: combine direction"
        # `return_fields` (the combine's move: a push into the origins' areas, read in place) between pulls on the
        # same two staging areas. A borrowed result must still hold after my next call, whose rows every peer
        # has written by the time that call returns.
        prev = None
        for call in range(4, 12):
            if call % 3 == 0:
                out_x = torch.empty_like(want_x)
                tr.move_fields([(xs[r], out_x)], route, call_id=call)
                assert torch.equal(out_x, want_x), f"rank {r} call {call}: pull after a return"
                got = None
            else:
                skip_own = call % 2 == 0
                got, ready, own = tr.return_fields([ys[r], ws_back[r]], back, call_id=call, skip_own=skip_own)
                assert ready is None  # one stream on CPU: ready in order
                if own is not None:  # my rows for myself stayed in the sources: take them from there
                    assert back_mode == "push" and skip_own
                    row, count, src_row = own
                    got = [g.clone() for g in got]
                    for g, src in zip(got, (ys[r], ws_back[r])):
                        g[row: row + count] = src[src_row: src_row + count]
                assert torch.equal(got[0], want_back(ys)) and torch.equal(got[1], want_back(ws_back)), (
                    f"rank {r} call {call}: return")
                if own is not None:
                    got = None  # a patched copy: nothing borrowed to check after the next call
            if prev is not None:
                assert torch.equal(prev[0], want_back(ys)) and torch.equal(prev[1], want_back(ws_back)), (
                    f"rank {r} call {call}: the previous call's borrowed result was overwritten")
            prev = got
            meet.wait()

    _run_ranks(num_ranks, rank_body, meet)


def test_chunk_bounds_split_every_block_in_weighted_order():
    """moves.chunk_bounds covers the block once, in order, in pieces proportional to the weights (equal weights:
    `c * n // C`), empty chunks included; one chunk is the whole block."""
    for n in range(0, 60):
        for weights in [(1,), (1, 1, 1), (1, 2, 4), (4, 2, 1), (9, 3, 1), (1, 3, 3, 3), (0, 2, 0, 1)]:
            b = chunk_bounds(n, weights)
            assert b[0] == 0 and b[-1] == n and all(x <= y for x, y in zip(b, b[1:])), (n, weights)
            for c, w in enumerate(weights):  # within one row of the exact share
                assert abs((b[c + 1] - b[c]) - n * w / sum(weights)) < 1 + 1e-9, (n, weights, c)
        assert chunk_bounds(n, (1, 1, 1)) == [c * n // 3 for c in range(4)]
    assert len(pull_weights(4)) == len(return_weights(4)) == 4 and pull_weights(1) == return_weights(1) == (1,)


@pytest.mark.parametrize("chunks,back", [("", "push"), ("3", "push"), ("", "pull"), ("3", "pull")])
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_pull_lands_every_row_in_place(num_ranks, chunks, back, monkeypatch):
    """Random routings (empty ranks included), three calls on one route (both staging areas), then the return
    direction (combine) by `move_fields` and by `return_fields` (push or pull) mixed with pulls; in one piece and
    in 3 chunks (each published by its own barrier, for the pull and the return push) of unequal sizes."""
    monkeypatch.setenv("EPCOMM_PULL_CHUNKS", chunks)
    monkeypatch.setenv("EPCOMM_RETURN_CHUNKS", chunks)
    monkeypatch.setenv("EPCOMM_NVLINK_RETURN", back)
    monkeypatch.setattr(moves, "RETURN_EARLIER", 2)  # unequal chunks both ways (the pull's by default)
    for seed in range(4):
        _run(num_ranks, 17, seed, back)


def test_staging_overflow_is_a_clear_error():
    region = FakeRegion([torch.zeros(HEAD + 3 * CAP, dtype=torch.uint8)] * 2, threading.Barrier(1))
    tr = _transport(0, 2, region)
    rows = CAP // (HIDDEN * 2) + 1
    x = torch.zeros(rows, HIDDEN, dtype=torch.bfloat16)
    route = Route([0, rows], [0, 0], torch.arange(rows), [[0, rows], [0, 0]])
    with pytest.raises(ValueError, match="staging area holds"):
        tr.move_fields([(x, torch.empty(0, HIDDEN, dtype=torch.bfloat16))], route, call_id=0)


@pytest.mark.parametrize("var,value", [("EPCOMM_NVLINK_RETURN", "push-pull"), ("EPCOMM_RETURN_CHUNKS", "0"),
                                       ("EPCOMM_RETURN_CHUNKS", "three"), ("EPCOMM_PULL_CHUNKS", "65")])
def test_return_and_chunk_variables_are_checked(var, value, monkeypatch):
    """EPBuffer construction parses every EPCOMM_* value (envs.check_all): a bad one names itself and the value."""
    from epcomm import envs

    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"{var} must be .* got '{value}'"):
        envs.check_all()


def test_eager_return_after_a_captured_one_waits_for_the_slow_reader(monkeypatch):
    """A graph replays its return push on one area; the eager calls' alternation does not know it, so the eager
    return right after a replay may write into the area a peer is still reducing (its replay's last barrier only
    says the peer arrived). Replayed here on fake regions: rank 0 reads its "replayed" result slowly while rank 1
    starts an eager return into the same area; the result must hold until rank 0's next call."""
    import time

    from epcomm import streams as streams_mod

    monkeypatch.delenv("EPCOMM_RETURN_CHUNKS", raising=False)
    num_ranks = 2
    matrix = [[3, 4], [2, 5]]  # rows rank s returns to rank d (the route of the combine direction)
    region = FakeRegion([torch.zeros(HEAD + 3 * CAP, dtype=torch.uint8) for _ in range(num_ranks)],
                        threading.Barrier(num_ranks))
    ys = [torch.randn(sum(matrix[r]), HIDDEN, generator=torch.Generator().manual_seed(r)).bfloat16()
          for r in range(num_ranks)]
    capturing = threading.local()
    monkeypatch.setattr(streams_mod, "capturing", lambda device: getattr(capturing, "on", False))

    def rank_body(r: int) -> None:
        tr = _transport(r, num_ranks, region)
        back = Route(matrix[r], [matrix[s][r] for s in range(num_ranks)], None, matrix)
        capturing.on = True
        got, _, _ = tr.return_fields([ys[r]], back, call_id=0)  # "captured": area 0
        capturing.on = False
        want = torch.cat([ys[s][sum(matrix[s][:r]): sum(matrix[s][:r + 1])] for s in range(num_ranks)])
        assert tr._stage_calls == 0  # a captured call takes the next eager call's area: this one lands on area 0 too
        if r == 0:
            time.sleep(0.3)  # a slow reduction of the replayed result
            assert torch.equal(got[0], want), "rank 0: the replayed result was overwritten by the peer's eager call"
        tr.return_fields([ys[r] * 2], back, call_id=1)

    _run_ranks(num_ranks, rank_body, region.meet)


def _slow_reader_of_a_replayed_pull(monkeypatch, matrix: list, then) -> None:
    """Every rank makes a "captured" pull of `matrix` (one chunk, on one stream), in which rank 0 pulls slowly (after
    the staging's barrier, the second of the call), then the eager call `then(tr, r)`; rank 0 must still read the
    captured call's rows, whatever its peers' eager calls write meanwhile."""
    import time

    from epcomm import streams as streams_mod

    monkeypatch.delenv("EPCOMM_PULL_CHUNKS", raising=False)  # one chunk: the staging's barrier is the second
    num_ranks = len(matrix)
    meet = threading.Barrier(num_ranks)
    region = FakeRegion([torch.zeros(HEAD + 3 * CAP, dtype=torch.uint8) for _ in range(num_ranks)], meet)
    xs = [torch.randn(sum(matrix[r]), HIDDEN, generator=torch.Generator().manual_seed(r)).bfloat16()
          for r in range(num_ranks)]
    capturing = threading.local()
    monkeypatch.setattr(streams_mod, "capturing", lambda device: getattr(capturing, "on", False))

    def rank_body(r: int) -> None:
        tr = _transport(r, num_ranks, region)
        tr._stream = lambda name: None  # no CUDA: the "captured" call runs on one stream
        route = Route(matrix[r], [matrix[s][r] for s in range(num_ranks)], None, matrix)
        barriers = []
        if r == 0:  # a slow copy engine
            def slow_barrier():
                meet.wait()
                barriers.append(1)
                if capturing.on and len(barriers) == 2:
                    time.sleep(0.3)
            tr.barrier = slow_barrier
        want = torch.cat([xs[s][sum(matrix[s][:r]): sum(matrix[s][:r + 1])] for s in range(num_ranks)])
        got = torch.empty_like(want)
        capturing.on = True
        tr.move_fields([(xs[r], got)], route, call_id=0)  # "captured": the area of the next eager call
        capturing.on = False
        assert torch.equal(got, want), f"rank {r}: the replayed pull read rows of a peer's eager call"
        then(tr, r)

    _run_ranks(num_ranks, rank_body, meet)


def test_eager_pull_after_a_captured_one_waits_for_the_slow_reader(monkeypatch):
    """A graph replays its pull on one staging area, the one the eager call after the capture stages into; a
    captured pull has no barrier after its copies, so the eager call must wait for its peers before staging. Here on
    fake regions: rank 0 pulls slowly out of rank 1's area in its "replayed" call while rank 1 goes on to an eager
    pull that stages other rows into that area."""
    matrix = [[3, 4], [2, 5]]  # rows rank s sends to rank d

    def eager_pull(tr, r):
        route = Route(matrix[r], [matrix[s][r] for s in range(2)], None, matrix)
        rows = torch.randn(sum(matrix[r]), HIDDEN).bfloat16()
        tr.move_fields([(rows, torch.empty(sum(m[r] for m in matrix), HIDDEN).bfloat16())], route, call_id=1)

    _slow_reader_of_a_replayed_pull(monkeypatch, matrix, eager_pull)


def test_captured_pull_after_a_captured_one_waits_for_the_slow_reader(monkeypatch):
    """Two captured pulls back to back (two replays of a graph, or two calls in one graph) on one staging area:
    rank 0 pulls slowly out of rank 1's area in the first; rank 1's second must not stage over it. With no barrier
    after a captured pull's copies, only the captured pull's own barrier before staging guards this."""
    import time

    from epcomm import streams as streams_mod

    num_ranks, matrix = 2, [[3, 4], [2, 5]]
    meet = threading.Barrier(num_ranks)
    region = FakeRegion([torch.zeros(HEAD + 3 * CAP, dtype=torch.uint8) for _ in range(num_ranks)], meet)
    xs = [torch.randn(sum(matrix[r]), HIDDEN, generator=torch.Generator().manual_seed(r)).bfloat16()
          for r in range(num_ranks)]
    monkeypatch.setattr(streams_mod, "capturing", lambda device: True)

    def rank_body(r: int) -> None:
        tr = _transport(r, num_ranks, region)
        tr._stream = lambda name: None  # no CUDA: the "captured" calls run on one stream
        route = Route(matrix[r], [matrix[s][r] for s in range(num_ranks)], None, matrix)
        first_call = [True]
        if r == 0:  # every barrier of the first call is followed by a slow reader
            def slow_barrier():
                meet.wait()
                if first_call[0]:
                    time.sleep(0.3)
            tr.barrier = slow_barrier
        want = torch.cat([xs[s][sum(matrix[s][:r]): sum(matrix[s][:r + 1])] for s in range(num_ranks)])
        got = torch.empty_like(want)
        tr.move_fields([(xs[r], got)], route, call_id=0)
        first_call[0] = False
        assert torch.equal(got, want), f"rank {r}: the first replay read rows of the peer's next replay"
        tr.move_fields([(xs[r] * 2, torch.empty_like(want))], route, call_id=1)

    _run_ranks(num_ranks, rank_body, meet)


def test_eager_return_after_a_captured_pull_waits_for_the_slow_reader(monkeypatch):
    """3 ranks: a captured pull, then an eager return push on the same staging area. Rank 0 pulls slowly out of
    rank 1's area while rank 2's return push writes into that area (rank 1 itself has finished its pull): the
    return push after a capture must wait for its peers first, whichever kind of call was captured."""
    monkeypatch.delenv("EPCOMM_RETURN_CHUNKS", raising=False)
    monkeypatch.setenv("EPCOMM_NVLINK_RETURN", "push")
    matrix = [[1, 1, 1], [3, 1, 2], [1, 1, 1]]  # pull: rank 1 stages 3 rows for rank 0 first (its area's rows 0..2)
    back = [[1, 0, 1], [1, 0, 1], [1, 5, 1]]  # return: only rank 2 writes into rank 1's area, from row 0

    def eager_return(tr, r):
        route_back = Route(back[r], [back[s][r] for s in range(3)], None, back)
        tr.return_fields([torch.randn(sum(back[r]), HIDDEN).bfloat16()], route_back, call_id=1)

    _slow_reader_of_a_replayed_pull(monkeypatch, matrix, eager_return)


def test_one_row_sources_with_a_wide_stride():
    """A tensor of 0 or 1 rows counts as contiguous whatever its stride(0), so a column slice keeps a wide one: the
    areas' row sizes must come from the shape, or the fields after the first land at the wrong offsets. Rank 1 has
    one row (a column slice); both the pull and the return push move it with a second field behind it."""
    num_ranks = 2
    matrix = [[2, 3], [0, 1]]  # rank 1 sends a single row (to itself) and receives 3 from rank 0
    meet = threading.Barrier(num_ranks)
    region = FakeRegion([torch.zeros(HEAD + 3 * CAP, dtype=torch.uint8) for _ in range(num_ranks)], meet)
    gens = [torch.Generator().manual_seed(r) for r in range(num_ranks)]
    xs = [torch.randn(5, HIDDEN, generator=gens[0]), torch.randn(1, 2 * HIDDEN, generator=gens[1])[:, :HIDDEN]]
    ws = [torch.randn(sum(matrix[r]), 3, generator=gens[r]) for r in range(num_ranks)]
    assert xs[1].is_contiguous() and xs[1].stride(0) == 2 * HIDDEN

    def rank_body(r: int) -> None:
        tr = _transport(r, num_ranks, region)
        route = Route(matrix[r], [matrix[s][r] for s in range(num_ranks)], None, matrix)

        def want(fields):
            return torch.cat([fields[s][sum(matrix[s][:r]): sum(matrix[s][:r + 1])] for s in range(num_ranks)])
        out_x, out_w = torch.empty_like(want(xs)), torch.empty_like(want(ws))
        tr.move_fields([(xs[r], out_x), (ws[r], out_w)], route, call_id=0)
        assert torch.equal(out_x, want(xs)) and torch.equal(out_w, want(ws)), f"rank {r}: pull"
        got, _, _ = tr.return_fields([xs[r], ws[r]], route, call_id=1)
        assert torch.equal(got[0], want(xs)) and torch.equal(got[1], want(ws)), f"rank {r}: return push"
        meet.wait()

    _run_ranks(num_ranks, rank_body, meet)


@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("chunks", ["", "3"])
@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_pull_makes_the_callers_beside_copies(num_ranks, chunks, captured, monkeypatch):
    """`move_fields(beside=...)`: the caller's local copies (the cached dispatch's fresh `recv_topk_idx`) are done,
    with dtype conversion, into fresh tensors, on every call, whatever the chunking and capture state; the pulled
    rows are still right."""
    from epcomm import streams as streams_mod

    monkeypatch.setenv("EPCOMM_PULL_CHUNKS", chunks)
    monkeypatch.setattr(streams_mod, "capturing", lambda device: captured)
    pick, gen, num_tokens = random.Random(num_ranks), torch.Generator().manual_seed(num_ranks), 11
    sends = [[sorted(pick.sample(range(num_tokens), pick.randint(0, num_tokens))) for _ in range(num_ranks)]
             for _ in range(num_ranks)]
    matrix = [[len(sends[s][d]) for d in range(num_ranks)] for s in range(num_ranks)]
    xs = [torch.randn(num_tokens, HIDDEN, generator=gen).bfloat16() for _ in range(num_ranks)]
    meet = threading.Barrier(num_ranks)
    region = FakeRegion([torch.zeros(HEAD + 3 * CAP, dtype=torch.uint8) for _ in range(num_ranks)], meet)

    def rank_body(r: int) -> None:
        tr = _transport(r, num_ranks, region)
        tr._stream = lambda name: None  # a captured pull on CPU: every step on the one stream
        src_X = torch.tensor([t for d in range(num_ranks) for t in sends[r][d]], dtype=torch.int64)
        route = Route(matrix[r], [matrix[s][r] for s in range(num_ranks)], src_X, matrix)
        want_x = torch.cat([xs[s][sends[s][r]] for s in range(num_ranks)])
        local = torch.randint(-1, 4, (route.num_recv, 5), generator=torch.Generator().manual_seed(r))
        for call in range(3):
            out_x = torch.full((route.num_recv, HIDDEN), float("nan"), dtype=torch.bfloat16)
            idx32 = torch.full((route.num_recv, 5), 99, dtype=torch.int32)
            idx64 = torch.full((route.num_recv, 5), 99, dtype=torch.int64)
            tr.move_fields([(xs[r], out_x)], route, call_id=call, beside=((local, idx32), (local, idx64)))
            assert torch.equal(out_x, want_x), f"rank {r}, call {call}: pulled rows"
            assert torch.equal(idx32, local.int()) and torch.equal(idx64, local), f"rank {r}, call {call}: beside"
            meet.wait()

    _run_ranks(num_ranks, rank_body, meet)


def test_a_capture_does_not_flip_the_eager_alternation(monkeypatch):
    """Eager calls rely on alternating the two staging areas (one barrier per call proves peers finished the call
    before). A captured call takes the next eager call's area and leaves the alternation as it was, so the eager
    calls around a capture of any number of calls use different areas."""
    from epcomm import streams as streams_mod

    tr = _transport(0, 1, FakeRegion([torch.zeros(HEAD + 3 * CAP, dtype=torch.uint8)], threading.Barrier(1)))
    capturing = [False]
    monkeypatch.setattr(streams_mod, "capturing", lambda device: capturing[0])
    before = tr._next_stage()
    capturing[0] = True
    captured = [tr._next_stage() for _ in range(3)]  # an odd number of staged calls in the graph
    capturing[0] = False
    after = tr._next_stage()
    assert after != before and captured == [after] * 3


def test_staged_pieces_cover_every_staged_row_in_order():
    """`PullPlan.staged_pieces(a, b)`: staged rows a .. b - 1 (every send row but this rank's own block) as slices of
    the send index, each with its first staged row, for every range and for own blocks first, in the middle, last
    and empty."""
    from epcomm.transport.pull import PullPlan

    for me, matrix in ((0, [[3, 2, 4], [1, 1, 1], [2, 0, 5]]), (1, [[3, 2, 4], [4, 3, 2], [2, 0, 5]]),
                       (2, [[1, 1, 1], [1, 1, 1], [2, 3, 4]]), (1, [[2, 2], [3, 0]])):
        send = matrix[me]
        src_X = torch.randperm(sum(send) + 4)[:sum(send)]
        route = Route(send, [row[me] for row in matrix], src_X, matrix)
        plan = PullPlan(route, me, len(matrix), torch.device("cpu"))
        lo, hi = plan.own_rows
        want = torch.cat([src_X[:lo], src_X[hi:]])
        for a in range(want.shape[0] + 1):
            for b in range(a, want.shape[0] + 1):
                pieces = plan.staged_pieces(a, b)
                got = torch.cat([idx for idx, _ in pieces]) if pieces else want[:0]
                assert torch.equal(got, want[a:b]), (me, a, b)
                row = a
                for idx, first in pieces:
                    assert first == row and idx.shape[0] > 0, (me, a, b, pieces)
                    row += idx.shape[0]


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_every_piece_is_each_peers_whole_block(chunks):
    """`PullPlan.views`' `every` (what the SMs read in a graph): one piece per peer that sends here, at its output
    rows, viewing exactly that peer's staged rows for me, one view per field, whatever the chunking (one chunk
    reuses its pulled pieces)."""
    from epcomm.transport.pull import PullPlan, aligned

    regions = [torch.zeros(HEAD + 3 * CAP, dtype=torch.uint8) for _ in range(3)]
    region = FakeRegion(regions, threading.Barrier(1))
    fields = [torch.zeros(0, HIDDEN, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.float32)]
    row_bytes = [HIDDEN * 2, 8]
    for me, matrix in ((0, [[3, 2, 4], [1, 1, 1], [2, 0, 5]]), (1, [[3, 2, 4], [4, 3, 2], [2, 0, 5]]),
                       (2, [[1, 1, 1], [1, 1, 1], [2, 3, 4]])):
        route = Route(matrix[me], [row[me] for row in matrix], torch.arange(sum(matrix[me])), matrix)
        plan = PullPlan(route, me, 3, torch.device("cpu"))
        moves = [(f, None) for f in fields]
        _, _, every = plan.views(region, HEAD, moves, row_bytes, chunks)
        want = [s for s in range(3) if s != me and matrix[s][me]]
        assert [piece[:2] for piece in every] == [(plan.recv_off[s], matrix[s][me]) for s in want], (me, every)
        for s, (_, n, views) in zip(want, every):
            off = HEAD
            for f, b, view in zip(fields, row_bytes, views):
                want_view = region.peer(s, off + plan.first_row_at[s] * b, (n,) + tuple(f.shape[1:]), f.dtype)
                assert view.data_ptr() == want_view.data_ptr() and view.shape == want_view.shape, (me, s)
                off += aligned(plan.staged_rows[s] * b)
