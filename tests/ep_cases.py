"""Rank-side bodies of the multi-rank dispatch/combine tests (importable by the worker processes).

Every check compares epcomm against `epcomm.reference` on fresh random inputs, bitwise.
Each function runs on every rank as `fn(rank, world_size, ...)` and returns a small summary or raises.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

import epcomm
from epcomm import reference as ref
from epcomm.fp8 import per_token_cast_to_fp8

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def assert_equal(actual, expected, what: str) -> None:
    """Bitwise equality with a useful message (first mismatching index, max difference)."""
    if actual is None or expected is None:
        assert actual is None and expected is None, f"{what}: one is None ({actual is None}, {expected is None})"
        return
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if torch.equal(actual, expected):
        return
    a, e = actual.view(torch.uint8) if actual.dtype == torch.float8_e4m3fn else actual, expected
    e = e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e
    diff = (a != e).nonzero()
    first = tuple(diff[0].tolist())
    raise AssertionError(f"{what}: {len(diff)} elements differ; first at {first}: {a[first]} vs {e[first]}")


def random_routing(gen, num_tokens: int, num_experts: int, num_topk: int, masked_ratio: float = 0.2):
    """top-k of random scores (distinct experts per row) with a fraction of selections set to -1."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    topk_idx = scores.topk(num_topk, dim=1).indices
    mask = torch.rand(num_tokens, num_topk, generator=gen) < masked_ratio
    topk_idx = topk_idx.masked_fill(mask, -1)
    weights = torch.rand(num_tokens, num_topk, generator=gen).masked_fill(mask, 0.0)
    return topk_idx, weights


def make_x(gen, num_tokens: int, hidden: int, dtype: str, use_ue8m0: bool = False):
    x = torch.randn(num_tokens, hidden, generator=gen, dtype=torch.float64)
    if dtype == "fp8":
        return per_token_cast_to_fp8(x, use_ue8m0=use_ue8m0)
    return x.to(DTYPES[dtype])


def check_mode(
    rank: int,
    world: int,
    *,
    seed: int = 0,
    tokens=(33, 20),
    hidden: int = 64,
    num_experts: int = 16,
    num_topk: int = 4,
    dtype: str = "bf16",
    use_ue8m0: bool = False,
    do_expand: bool = False,
    expert_alignment: int = 1,
    do_cpu_sync: bool = True,
    num_bias: int = 0,
    allow_multiple_reduction: bool = True,
    masked_ratio: float = 0.2,
    topk_idx_dtype=torch.int64,
    defer: bool = False,
    col_major_sf: bool = False,
    routing=None,
    groups=None,
    buffer=None,
    async_op: bool = False,
    device: str = "cpu",
    transport: str = "auto",
    force_blocked: bool = False,
    group=None,
    emit_expert_ids: bool = False,
):
    """Dispatch, cached dispatch and combine against the reference in one mode; returns counts.

    `groups`: lists of world ranks; every rank creates every group and runs in the one that holds it (as its
    group rank). `group`: an existing process group to run in instead (this rank must belong to it). `buffer`: reuse this buffer instead of making (and destroying) one.
    `emit_expert_ids` (expand only): also check `handle.recv_expert_ids` against the reference's segments.
    """
    if group is not None:
        rank, world = group.rank(), group.size()
    elif groups is not None:
        made = [dist.new_group(g) for g in groups]
        group = next(grp for grp, g in zip(made, groups) if rank in g)
        rank, world = group.rank(), group.size()
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    num_tokens = tokens[rank % len(tokens)]
    n = buffer.num_max_tokens_per_rank if buffer is not None else max(tokens)
    if routing is None:
        topk_idx, weights = random_routing(gen, num_tokens, num_experts, num_topk, masked_ratio)
    else:
        topk_idx, weights = routing(rank, world, gen)
        num_tokens = topk_idx.shape[0]
    topk_idx = topk_idx.to(topk_idx_dtype)
    x = make_x(gen, num_tokens, hidden, dtype, use_ue8m0)
    if dtype == "fp64":
        weights = weights.double()
    x = tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)
    topk_idx, weights = topk_idx.to(device), weights.to(device)
    x_ref = x
    buf = buffer or epcomm.EPBuffer(group, num_max_tokens_per_rank=n, hidden=hidden, num_topk=num_topk,
                          use_fp8_dispatch=dtype == "fp8", allow_multiple_reduction=allow_multiple_reduction,
                          dtype=DTYPES.get(dtype, torch.bfloat16), explicitly_destroy=True, transport=transport)
    if force_blocked:  # the nvlink layout (per-sender blocks even with CPU sync) over the collective transport
        buf.transport.writes_blocks = True
    # Stats are added to (`+=`), never overwritten: start from nonzero counts.
    stats_seed = torch.randint(0, 50, (num_experts // world,), generator=torch.Generator().manual_seed(11),
                               dtype=torch.int32).to(device)
    stats = stats_seed.clone()
    kwargs = dict(num_experts=num_experts, expert_alignment=expert_alignment, do_cpu_sync=do_cpu_sync,
                  do_expand=do_expand, use_tma_aligned_col_major_sf=col_major_sf)
    if emit_expert_ids:
        kwargs["emit_expert_ids"] = True
    if defer:
        event = buf.dispatch(x, topk_idx, weights, stats, async_with_compute_stream=True, defer_epilogue=True,
                             **kwargs)
        recv_x, recv_idx, recv_w, handle = event.wait()
        assert event.wait() is None, "a second wait must return None"
    else:
        recv_x, recv_idx, recv_w, handle, event = buf.dispatch(x, topk_idx, weights, stats,
                                                               async_with_compute_stream=async_op, **kwargs)
        assert (event.event is not None) == async_op
        if async_op:
            assert event.wait() is None
    r_x, r_idx, r_w, r_handle = ref.dispatch(x_ref, topk_idx, weights, num_experts, num_max_tokens_per_rank=n,
                                             expert_alignment=expert_alignment, do_expand=do_expand, group=group)
    num_valid = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
    assert num_valid == len(r_handle.recv_g)
    assert handle.topk_idx is topk_idx
    num_local = num_experts // world

    # Data rows: exact rows with CPU sync, the valid prefix (or valid expanded rows) without.
    def rows(t, count):
        return t if t is None else t[:count]
    count = r_x[0].shape[0] if dtype == "fp8" else r_x.shape[0]
    if dtype == "fp8":
        assert_equal(rows(recv_x[0], count), r_x[0], "recv_x data")
        assert_equal(rows(recv_x[1], count), r_x[1], "recv_x scales")
        if col_major_sf:
            alloc = recv_x[1].shape[0]
            assert recv_x[1].stride() == (1, (alloc + 3) // 4 * 4), recv_x[1].stride()
    else:
        assert_equal(rows(recv_x, count), r_x, "recv_x")
    assert_equal(rows(recv_w, count), r_w, "recv_topk_weights")
    assert_equal(rows(recv_idx, count), r_idx, "recv_topk_idx")
    if do_cpu_sync:  # exactly the received rows (without CPU sync: worst-case rows, valid prefix checked above)
        got_rows = (recv_x[0] if dtype == "fp8" else recv_x).shape[0]
        assert got_rows == count, f"recv_x has {got_rows} rows, the reference {count}"

    # Handle fields (reference §10, §24).
    meta = handle.recv_src_metadata
    assert_equal(meta[:num_valid, 0].long(), r_handle.recv_g, "recv_src_metadata[:, 0]")
    assert bool((meta[num_valid:] == -1).all()), "rows past the valid extent must be -1"
    if do_expand:
        assert_equal(meta[:num_valid, 2:].long(), r_handle.row_ptr, "recv_src_metadata[:, 2:]")
    n_ref = torch.tensor(r_handle.num_recv_per_expert, dtype=torch.int32, device=device)
    assert_equal(handle.num_unaligned_recv_tokens_per_expert, n_ref, "num_unaligned_recv_tokens_per_expert")
    assert_equal(stats - stats_seed, n_ref, "cumulative_local_expert_recv_stats (added)")
    aligned = (n_ref + expert_alignment - 1) // expert_alignment * expert_alignment
    if do_cpu_sync:
        assert handle.num_recv_tokens_per_expert_list == aligned.tolist()
        assert handle.num_recv_tokens == num_valid
    else:
        assert handle.num_recv_tokens_per_expert_list == []
        assert handle.num_recv_tokens == world * n
    psum_expected = (aligned.cumsum(0) - aligned + n_ref) if do_expand else aligned.cumsum(0)
    assert_equal(handle.psum_num_recv_tokens_per_expert, psum_expected.to(torch.int32), "psum per expert")
    counts = torch.tensor(r_handle.recv_counts, device=device)
    assert_equal(handle.psum_num_recv_tokens_per_scaleup_rank, counts.cumsum(0).to(torch.int32), "psum per rank")
    if emit_expert_ids:
        expert_ids = check_recv_expert_ids(handle, r_handle, (recv_x[0] if dtype == "fp8" else recv_x).shape[0])
    else:
        assert handle.recv_expert_ids is None, "recv_expert_ids without emit_expert_ids"

    # Cached dispatch replays positions bitwise and returns the same handle object.
    c_x, c_idx, c_w, c_handle, _ = buf.dispatch(x, handle=handle, topk_weights=weights, do_expand=do_expand,
                                                use_tma_aligned_col_major_sf=col_major_sf)
    assert c_handle is handle
    if emit_expert_ids:  # the cached call keeps the handle's ids (reference §9.12: non-cached only)
        assert_equal(handle.recv_expert_ids, expert_ids, "recv_expert_ids after a cached dispatch")
    for a, b, what in ((c_x, recv_x, "cached recv_x"), (c_w, recv_w, "cached recv_topk_weights"),
                       (c_idx, recv_idx, "cached recv_topk_idx")):
        if isinstance(a, tuple):
            assert_equal(rows(a[0], count), rows(b[0], count), what)
            assert_equal(rows(a[1], count), rows(b[1], count), what + " scales")
        else:
            assert_equal(rows(a, count), rows(b, count), what)

    # Combine: expert outputs derived from the received rows (random per row), biases, weights back.
    if dtype == "fp8":
        if buffer is None:
            buf.destroy()
        return dict(num_valid=num_valid)
    y = recv_x * (1 + torch.rand(recv_x.shape, generator=gen, dtype=torch.float64)).to(recv_x.dtype).to(device)
    if y.shape[0] > count:  # rows past the valid extent (no CPU sync) are not the combine's: garbage must not count
        y = y.clone()
        y[count:] = (1000 * (1 + torch.rand(y[count:].shape, generator=gen, dtype=torch.float64))).to(y.dtype).to(
            device)
    biases = [torch.randn(num_tokens, hidden, generator=gen, dtype=torch.float64).to(recv_x.dtype).to(device)
              for _ in range(num_bias)]
    bias = None if num_bias == 0 else (biases[0] if num_bias == 1 else tuple(biases))
    per_pair = do_expand and not allow_multiple_reduction
    combine_w = None if per_pair else recv_w
    if combine_w is not None and not do_expand:
        # Noise in the columns of experts a rank does not own: combine returns only the owners' values (§11.4).
        noise = torch.rand(combine_w.shape, generator=gen, dtype=torch.float64).to(combine_w.dtype).to(device)
        combine_w = torch.where(recv_idx >= 0, combine_w, noise + 1)
        combine_w = torch.cat([combine_w, noise], 1)[:, :noise.shape[1]]  # a strided view: rows not contiguous
    if defer:
        event = buf.combine(y, handle, topk_weights=combine_w, bias=bias, async_with_compute_stream=True,
                            defer_epilogue=True)
        combined_x, combined_w = event.wait()
    else:
        combined_x, combined_w, _ = buf.combine(y, handle, topk_weights=combine_w, bias=bias)
    y_ref = y[:count]
    ref_w = None if combine_w is None else r_w
    c_ref, cw_ref = ref.combine(y_ref, r_handle, topk_weights=ref_w, bias=bias,
                                allow_multiple_reduction=allow_multiple_reduction, group=group)
    assert_equal(combined_x, c_ref, "combined_x")
    if combine_w is not None:
        assert_equal(combined_w, cw_ref, "combined_topk_weights")
        # Weights round trip (reference §24 item 17): the original weights, 0 at -1 selections.
        assert_equal(combined_w, torch.where(topk_idx >= 0, weights, torch.zeros_like(weights)), "weights round trip")
    if buffer is None:
        buf.destroy()
    return dict(num_valid=num_valid, num_local=num_local, recv_rows=tuple(recv_x.shape))


def check_recv_expert_ids(handle, r_handle, rows: int) -> torch.Tensor:
    """`handle.recv_expert_ids` (reference §9.12): [rows] int32 (`rows` the allocated expanded rows), the local
    expert id on each real row of its segment (segments start at the aligned sums of the reference's counts),
    -1 on alignment padding and on the unused tail of a sync-free dispatch; every (received row, position) with a
    local expert points at a row of that expert. Returns a copy of the ids."""
    ids = handle.recv_expert_ids
    assert ids is not None, "emit_expert_ids=True left handle.recv_expert_ids None"
    assert ids.dtype == torch.int32 and tuple(ids.shape) == (rows,), (ids.dtype, tuple(ids.shape), rows)
    want = torch.full((rows,), -1, dtype=torch.int32)
    start, alignment = 0, r_handle.expert_alignment
    for e, n_e in enumerate(r_handle.num_recv_per_expert):
        want[start: start + n_e] = e
        start += (n_e + alignment - 1) // alignment * alignment
    assert_equal(ids.cpu(), want, "handle.recv_expert_ids")
    has = r_handle.row_ptr >= 0
    assert_equal(ids.cpu()[r_handle.row_ptr[has].cpu()].long(), r_handle.recv_local_idx[has].cpu(),
                 "recv_expert_ids at the reference's row pointers")
    return ids.clone()


def combine_counts_ranks(rank: int, world: int, seed: int = 0):
    """combine(ones) in non-expand layout = number of distinct destination ranks per token (§24 item 14)."""
    gen = torch.Generator().manual_seed(seed + rank)
    num_experts, num_topk, hidden = 12, 3, 8
    topk_idx, _ = random_routing(gen, 17, num_experts, num_topk)
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=17, hidden=hidden)
    for expand in (False, True):
        recv_x, _, _, handle, _ = buf.dispatch(torch.randn(17, hidden, generator=gen).bfloat16(), topk_idx,
                                               num_experts=num_experts, do_expand=expand)
        out, _, _ = buf.combine(torch.ones_like(recv_x), handle)
        dest = torch.where(topk_idx >= 0, topk_idx // (num_experts // world), -1)
        if expand:
            expected = (topk_idx >= 0).sum(1)
        else:
            expected = torch.tensor([len(set(r) - {-1}) for r in dest.tolist()])
        assert_equal(out[:, 0].long(), expected, f"combine(ones) expand={expand}")
    return True


def world_group_ranks(rank: int, world: int):
    return dist.get_world_size()


# -- routings for edge cases: fn(rank, world, gen) -> (topk_idx, weights) -----------------------------------
def routing_all_to_rank0(rank, world, gen, num_tokens=10, num_experts=8, num_topk=2):
    """Every selection lands on rank 0's experts: the other ranks receive 0 rows."""
    num_local = num_experts // world
    idx = torch.stack([torch.randperm(num_local, generator=gen)[:num_topk] for _ in range(num_tokens)])
    return idx, torch.rand(num_tokens, num_topk, generator=gen)


def routing_all_masked(rank, world, gen, num_tokens=9, num_topk=3):
    return torch.full((num_tokens, num_topk), -1, dtype=torch.int64), torch.zeros(num_tokens, num_topk)


def routing_all_local(rank, world, gen, num_tokens=7, num_experts=16, num_topk=3):
    """Every token picks only experts of its own rank (and rank 0's tokens: mixed)."""
    num_local = num_experts // world
    idx = torch.stack([torch.randperm(num_local, generator=gen)[:num_topk] + rank * num_local
                       for _ in range(num_tokens)])
    return idx, torch.rand(num_tokens, num_topk, generator=gen)


def routing_one_expert(rank, world, gen, num_tokens=11, num_topk=2):
    """Every token picks expert 5 (and -1)."""
    idx = torch.full((num_tokens, num_topk), -1, dtype=torch.int64)
    idx[:, 0] = 5
    return idx, torch.rand(num_tokens, num_topk, generator=gen)


def routing_alignment_counts(rank, world, gen):
    """With alignment 4 and 5 local experts, rank r receives 0, 1, 3, 4, 5 rows for its experts (world 2)."""
    counts = [0, 1, 3, 4, 5]
    other = 1 - rank
    ids = [other * 5 + e for e, c in enumerate(counts) for _ in range(c)]
    idx = torch.tensor(ids, dtype=torch.int64).unsqueeze(1)
    return idx, torch.rand(len(ids), 1, generator=gen)


def routing_masked_tails(rank, world, gen, num_tokens=13, num_experts=12, num_topk=4):
    """-1 selections at any position (some rows -1 in their first columns only, some in their last), whole rows of
    -1 (the first, a middle and the last token: sent nowhere) and zero weights on selections that do route."""
    idx, w = random_routing(gen, num_tokens, num_experts, num_topk, masked_ratio=0.35)
    idx[1, :2] = -1
    idx[2, 2:] = -1
    for t in (0, num_tokens // 2, num_tokens - 1):
        idx[t] = -1
    zero = (torch.rand(idx.shape, generator=gen) < 0.3) | (idx < 0)
    routed = (idx >= 0).nonzero()
    if len(routed):  # at least one routed selection carries weight 0
        zero[routed[0, 0], routed[0, 1]] = True
    return idx, w.masked_fill(zero, 0.0)


def reused_buffer(rank: int, world: int):
    """One buffer, many calls with changing token counts (including 0 and exactly N) and both layouts."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=24, hidden=32, num_topk=4, explicitly_destroy=True)
    shapes = []
    for i, tokens in enumerate([(5, 9), (0, 24), (24, 0), (17, 3), (1, 1)]):
        for expand in (False, True):
            out = check_mode(rank, world, seed=100 + i, tokens=tokens, hidden=32, num_experts=8, num_topk=4,
                             do_expand=expand, expert_alignment=3, num_bias=1, buffer=buf)
            shapes.append(out["recv_rows"])
    buf.destroy()
    return shapes


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def memory_growth(rank: int, world: int, iters: int = 1000):
    """RSS after iteration 100 and after iteration `iters` of dispatch/combine pairs (fresh routing each)."""
    gen = torch.Generator().manual_seed(rank)
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=64, hidden=128, num_topk=4)
    rss = {}
    for it in range(1, iters + 1):
        idx, w = random_routing(gen, 64, 16, 4)
        x = torch.randn(64, 128, generator=gen).bfloat16()
        recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=16, do_expand=bool(it % 2))
        buf.combine(recv_x, handle, topk_weights=recv_w)
        if it in (100, iters):
            rss[it] = _rss_bytes()
    buf.destroy()
    return rss


def events_on_cpu(rank: int, world: int):
    """The event contract of reference §3 on CPU (docs/decisions.md "Events on CPU")."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=8, hidden=16)
    gen = torch.Generator().manual_seed(rank)
    idx, w = random_routing(gen, 8, 4, 2)
    x = torch.randn(8, 16, generator=gen).bfloat16()
    prev = epcomm.EPBuffer.capture()
    assert prev.query()
    out = buf.dispatch(x, idx, w, num_experts=4, previous_event=prev, allocate_on_comm_stream=True)
    assert out[4].event is None
    for method in ("wait", "current_stream_wait"):
        try:
            getattr(out[4], method)()
            raise AssertionError("waiting on a synchronous call's event must raise")
        except ValueError as e:
            assert f"EventOverlap.{method}: event is None" in str(e), e
    ev = buf.dispatch(x, idx, w, num_experts=4, async_with_compute_stream=True, defer_epilogue=True)
    assert isinstance(ev, epcomm.EventOverlap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # epcomm warns that the results are dropped (test_events.py)
        with ev:
            pass  # the with-block waits on exit: that wait runs the deferred epilogue and drops its result
    assert ev.wait() is None
    ev = buf.dispatch(x, idx, w, num_experts=4, async_with_compute_stream=True, defer_epilogue=True)
    recv_x, _, recv_w, handle = ev.wait()
    ev2 = buf.combine(recv_x, handle, async_with_compute_stream=True, defer_epilogue=True)
    combined, combined_w = ev2.wait()
    assert combined.shape == x.shape and combined_w is None
    return True


def stream_order(rank: int, world: int, transport: str = "auto"):
    """Synchronous calls run on the caller's current stream, the others on the comm stream (streams.CallOrder),
    and a call on another stream than the buffer's previous call runs after it: stream A sleeps ~25 ms before its
    call, stream B does not wait for A, yet B's call ends after A's (event times), for each pair of kinds with a
    synchronous call in it; results stay the reference's. Also: a synchronous call leaves no work on the comm stream;
    an asynchronous combine on a handle that is dropped before its event is waited on reads it intact (a smoke
    check: which of the handle's tensors a combine reads on the device depends on the path)."""
    torch.manual_seed(rank)
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=512, hidden=1024, transport=transport)
    idx, w = random_routing(torch.Generator().manual_seed(rank), 512, 32, 4)
    idx, w = idx.cuda(), w.cuda()
    x = torch.randn(512, 1024, device="cuda").bfloat16()
    ref_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=32)
    ref_combined = buf.combine(ref_x, handle)[0]
    comm = buf.get_comm_stream()
    torch.cuda.synchronize()
    buf.dispatch(x, handle=handle)
    torch.cuda._sleep(50_000_000)  # ~25 ms: on the comm stream, the combine would wait for it
    buf.combine(ref_x, handle)
    with torch.cuda.stream(comm):
        probe = torch.cuda.Event()
        probe.record()
    deadline = time.perf_counter() + 0.005
    while not probe.query() and time.perf_counter() < deadline:
        pass
    assert probe.query(), "a synchronous call left work on the comm stream"
    torch.cuda.synchronize()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()

    def call(kind: str, stream):
        """The call of `kind` on `stream`; returns (its result's x, an event with timing after its work)."""
        done = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            if kind == "sync":
                out = buf.combine(ref_x, handle)[0]
                done.record()
            else:  # async, after an event of this stream
                prev = epcomm.EPBuffer.capture()
                out, _, ev = buf.combine(ref_x, handle, previous_event=prev, allocate_on_comm_stream=True,
                                         async_with_compute_stream=True)
                with torch.cuda.stream(comm):
                    done.record()
                ev.current_stream_wait()
        return out, done

    for first, second in (("sync", "sync"), ("sync", "async"), ("async", "sync")):  # (async, async: stream order)
        for _ in range(2):
            start = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(a):
                start.record()
                torch.cuda._sleep(50_000_000)
            out_a, done_a = call(first, a)
            out_b, done_b = call(second, b)
            torch.cuda.synchronize()
            assert start.elapsed_time(done_a) > 5, (first, second)  # A's call came after the sleep
            assert done_a.elapsed_time(done_b) > 0, (first, second, "the second call did not wait for the first")
            assert torch.equal(out_a, ref_combined) and torch.equal(out_b, ref_combined)
    # A handle made by a synchronous dispatch (its tensors from the current stream's pool), used by an asynchronous
    # combine on the comm stream and dropped at once: the current stream then allocates and writes while the
    # combine still waits behind a sleep on the comm stream; the buffer's hold keeps the handle's memory untouched.
    for _ in range(2):
        own_x, _, _, own_handle, _ = buf.dispatch(x, idx, w, num_experts=32)
        with torch.cuda.stream(comm):
            torch.cuda._sleep(50_000_000)
        out, _, ev = buf.combine(own_x, own_handle, async_with_compute_stream=True)
        del own_handle
        scribble = [torch.full((n,), -1, dtype=torch.int64, device="cuda")  # sizes of the handle's small blocks
                    for n in (16, 64, 512, 2048, 8192, 65536) for _ in range(16)]
        ev.current_stream_wait()
        assert torch.equal(out, ref_combined)
        del scribble
    buf.destroy()
    return True


def gpu_streams(rank: int, world: int, transport: str = "auto"):
    """Reference §3 on CUDA: async results valid after wait, previous_event ordering, deferred epilogue."""
    torch.manual_seed(rank)
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=512, hidden=1024, transport=transport)
    assert transport == "auto" or buf.transport.name == transport
    assert buf.get_comm_stream() is not None
    idx, w = random_routing(torch.Generator().manual_seed(rank), 512, 32, 4)
    idx, w = idx.cuda(), w.cuda()
    x = torch.randn(512, 1024, device="cuda").bfloat16()
    ref_x, _, _, handle, ev = buf.dispatch(x, idx, w, num_experts=32)
    assert ev.event is None
    for _ in range(3):
        # Produce x on the compute stream right before an async dispatch that waits for it via previous_event.
        x2 = x * 1  # same values, new tensor written on the current stream
        prev = epcomm.EPBuffer.capture()
        out = buf.dispatch(x2, idx, w, num_experts=32, previous_event=prev, allocate_on_comm_stream=True,
                           async_with_compute_stream=True)
        out[4].current_stream_wait()
        assert torch.equal(out[0], ref_x)
        ev = buf.dispatch(x, handle=handle, async_with_compute_stream=True, defer_epilogue=True)
        recv_x, _, _, h2 = ev.wait()
        assert h2 is handle and torch.equal(recv_x, ref_x)
        ev = buf.combine(recv_x, handle, async_with_compute_stream=True)
        combined = ev[0]
        ev[2].current_stream_wait()
        assert combined.shape == x.shape
    # A synchronous call between asynchronous ones keeps their order on the comm stream:
    # after an async call left unwaited, and before a later one whose previous_event was taken before it.
    ref_combined = buf.combine(ref_x, handle)[0]
    for _ in range(3):
        prev = epcomm.EPBuffer.capture()
        with torch.cuda.stream(buf.get_comm_stream()):
            torch.cuda._sleep(20_000_000)  # ~10 ms: the async call starts late, so a missing wait shows
        first = buf.dispatch(x, handle=handle, async_with_compute_stream=True)
        torch.cuda._sleep(20_000_000)  # and the current stream is busy when the synchronous call comes
        middle = buf.dispatch(x, handle=handle)
        last = buf.combine(middle[0], handle, previous_event=prev, allocate_on_comm_stream=True,
                           async_with_compute_stream=True)
        last[2].current_stream_wait()
        first[4].current_stream_wait()
        assert torch.equal(first[0], ref_x) and torch.equal(middle[0], ref_x)
        assert torch.equal(last[0], ref_combined)
    # A barrier without the comm stream's order (wait_comm_stream=False) beside an asynchronous combine in flight:
    # rank 0 reaches the barrier first, rank 1 the combine's transfers. The barrier's exchange runs after the
    # combine in the comm stream's order on both ranks; on one stream of its own, each rank's device barriers would
    # pair with the other's combine barriers.
    for _ in range(2):
        if rank == 0:
            with torch.cuda.stream(buf.get_comm_stream()):
                torch.cuda._sleep(20_000_000)
        pending = buf.combine(ref_x, handle, async_with_compute_stream=True)
        if rank == 1:
            torch.cuda._sleep(20_000_000)
        buf.barrier(wait_comm_stream=False)
        pending[2].current_stream_wait()
        assert torch.equal(pending[0], ref_combined)
    torch.cuda.synchronize()
    buf.destroy()
    return True


def transport_name(rank: int, world: int):
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=8, hidden=16)
    name = buf.transport.name
    buf.destroy()
    return name


def handle_recv_topk_idx(rank: int, world: int):
    """handle.recv_topk_idx equals the non-expand dispatch's recv_topk_idx, and the returned tensor is the caller's:
    editing it in place (as a grouped GEMM's remap might) changes neither the handle nor the combine. The same for a
    cached dispatch's recv_topk_idx (in topk_idx's dtype, int64 and int32), whose copy the transport makes while
    the rows travel (`Transport.move_fields(beside=...)`) for a CPU-synced handle."""
    gen = torch.Generator().manual_seed(rank)
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=11, hidden=8)
    for idx_dtype in (torch.int64, torch.int32):
        idx, w = random_routing(gen, 11, 8, 3)
        idx = idx.to(idx_dtype)
        for sync in (True, False):
            x = torch.randn(11, 8, generator=gen)
            recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=8, do_cpu_sync=sync)
            assert torch.equal(handle.recv_topk_idx, recv_idx)
            before = buf.combine(recv_x, handle, topk_weights=recv_w)[:2]
            recv_idx.fill_(-1)
            assert not torch.equal(handle.recv_topk_idx, recv_idx) or recv_idx.numel() == 0
            after = buf.combine(recv_x, handle, topk_weights=recv_w)[:2]
            assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
            cached_idx = buf.dispatch(x, handle=handle)[1]
            assert cached_idx.dtype == idx_dtype and torch.equal(cached_idx, handle.recv_topk_idx)
            cached_idx.fill_(-1)
            again = buf.dispatch(x, handle=handle)[1]
            assert torch.equal(again, handle.recv_topk_idx) and again.data_ptr() != cached_idx.data_ptr()
            assert not torch.equal(again, cached_idx) or again.numel() == 0
    return True


def captured(step):
    """`step()` captured in a CUDA graph after two warm-up calls on a side stream (kernels compiled, allocator
    pools filled): returns `(graph, the outputs of the captured call)`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


def graph_replay(rank: int, world: int, transport: str = "auto", replays: int = 4, num_tokens: int = 96,
                 hidden: int = 256, num_experts: int = 16, num_topk: int = 4):
    """Issue 3 item 3: sync-free dispatch, cached dispatch and combine captured in one CUDA graph, replayed with
    new inputs and new routings copied into the static inputs; every replay bitwise against the reference."""
    import os

    device = torch.device("cuda", torch.cuda.current_device())
    if transport == "nvlink-generic":  # the generic sync-free path at a size the fused one would take
        transport = "nvlink"
        os.environ["EPCOMM_FUSED_SYNC_FREE_ROWS"] = "0"
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=num_topk,
                          explicitly_destroy=True, transport=transport)
    gen = torch.Generator().manual_seed(100 + rank)

    def inputs():
        topk_idx, weights = random_routing(gen, num_tokens, num_experts, num_topk, masked_ratio=0.2)
        return make_x(gen, num_tokens, hidden, "bf16").to(device), topk_idx.to(device), weights.to(device)
    x_s, topk_s, w_s = inputs()
    scale = (1 + torch.rand(world * num_tokens, 1, generator=gen)).to(torch.bfloat16).to(device)

    def step():
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x_s, topk_s, w_s, num_experts=num_experts,
                                                           do_cpu_sync=False)
        c_x, _, c_w, _, _ = buf.dispatch(x_s, handle=handle, topk_weights=w_s)
        y = recv_x * scale  # a stand-in expert: rows past the valid extent are zero and stay zero
        comb_x, comb_w, _ = buf.combine(y, handle, topk_weights=recv_w)
        return recv_x, recv_idx, recv_w, c_x, c_w, y, comb_x, comb_w, handle.psum_num_recv_tokens_per_scaleup_rank

    graph, outs = captured(step)
    for i in range(replays):
        x, topk_idx, weights = inputs()
        x_s.copy_(x)
        topk_s.copy_(topk_idx)
        w_s.copy_(weights)
        graph.replay()
        torch.cuda.synchronize()
        recv_x, recv_idx, recv_w, c_x, c_w, y, comb_x, comb_w, psum = outs
        r_x, r_idx, r_w, r_handle = ref.dispatch(x, topk_idx, weights, num_experts, num_max_tokens_per_rank=num_tokens)
        count = r_x.shape[0]
        assert int(psum[-1]) == count, f"replay {i}: {int(psum[-1])} rows received, reference {count}"
        assert_equal(recv_x[:count], r_x, f"replay {i}: recv_x")
        assert bool((recv_x[count:] == 0).all()), f"replay {i}: rows past the valid extent must be zero"
        assert_equal(recv_idx[:count], r_idx, f"replay {i}: recv_topk_idx")
        assert_equal(recv_w[:count], r_w, f"replay {i}: recv_topk_weights")
        assert_equal(c_x[:count], r_x, f"replay {i}: cached recv_x")
        assert_equal(c_w[:count], r_w, f"replay {i}: cached recv_topk_weights")
        c_ref, cw_ref = ref.combine(y[:count], r_handle, topk_weights=r_w)
        assert_equal(comb_x, c_ref, f"replay {i}: combined_x")
        assert_equal(comb_w, cw_ref, f"replay {i}: combined_topk_weights")
    buf.destroy()
    os.environ.pop("EPCOMM_FUSED_SYNC_FREE_ROWS", None)
    return replays


def graph_replay_exact(rank: int, world: int, transport: str = "auto", replays: int = 4, num_tokens: int = 80,
                       hidden: int = 192, num_experts: int = 16, num_topk: int = 4, dtype: str = "bf16",
                       pull_chunks: str = ""):
    """A CPU-synced handle's cached dispatch and combine captured in one CUDA graph (a captured nvlink call, and every
    call after a capture, waits for its peers before using the staging area), replayed with new inputs and eager
    calls in between; bitwise every replay.
    `dtype` "fp8": the dispatch moves FP8 rows and their scales; `pull_chunks`: EPCOMM_PULL_CHUNKS for the capture
    (the nvlink pull stages and pulls in that many chunks)."""
    import os

    device = torch.device("cuda", torch.cuda.current_device())
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=num_topk,
                          explicitly_destroy=True, transport=transport, use_fp8_dispatch=dtype == "fp8")
    gen = torch.Generator().manual_seed(200 + rank)
    topk_idx, weights = random_routing(gen, num_tokens, num_experts, num_topk, masked_ratio=0.2)
    topk_idx, weights = topk_idx.to(device), weights.to(device)

    def inputs():
        x = make_x(gen, num_tokens, hidden, dtype)
        return tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)

    def fields(x):
        return x if isinstance(x, tuple) else (x,)

    x_s = inputs()
    recv_x, _, recv_w, handle, _ = buf.dispatch(x_s, topk_idx, weights, num_experts=num_experts)
    y_s = torch.empty(handle.num_recv_tokens, hidden, dtype=torch.bfloat16, device=device)

    def step():
        c_x, c_idx, c_w, _, _ = buf.dispatch(x_s, handle=handle, topk_weights=weights)
        comb_x, comb_w, _ = buf.combine(y_s, handle, topk_weights=c_w)
        return c_x, c_w, comb_x, comb_w, c_idx

    os.environ["EPCOMM_PULL_CHUNKS"] = pull_chunks
    try:
        graph, outs = captured(step)
    finally:
        os.environ.pop("EPCOMM_PULL_CHUNKS")
    for i in range(replays):
        x = inputs()
        y = make_x(gen, handle.num_recv_tokens, hidden, "bf16").to(device)
        for static, new in zip(fields(x_s), fields(x)):
            static.copy_(new)
        y_s.copy_(y)
        outs[4].fill_(-7)  # each replay writes the fresh recv_topk_idx again (a copy beside the last pull)
        graph.replay()
        # Eager calls between replays: a combine right after the replay writes into peers' staging areas; the
        # captured calls took the area of the next eager call, so it is the one the replay's combine was reduced in
        # (the eager push waits for its peers first), then a cached dispatch.
        eager_comb_x, eager_comb_w, _ = buf.combine(y, handle, topk_weights=outs[1])
        eager = buf.dispatch(x, handle=handle, topk_weights=weights)
        torch.cuda.synchronize()
        c_x, c_w, comb_x, comb_w, c_idx = outs
        r_x, r_idx, r_w, r_handle = ref.dispatch(x, topk_idx, weights, num_experts,
                                                 num_max_tokens_per_rank=num_tokens)
        assert_equal(c_idx, r_idx, f"replay {i}: cached recv_topk_idx")
        assert_equal(eager[1], r_idx, f"replay {i}: eager cached recv_topk_idx after the replay")
        assert c_idx.data_ptr() != handle._plan.recv.local_idx_MK.data_ptr(), "recv_topk_idx must be a fresh tensor"
        for j, (got, got_eager, want) in enumerate(zip(fields(c_x), fields(eager[0]), fields(r_x))):
            assert_equal(got, want, f"replay {i}: cached recv_x field {j}")
            assert_equal(got_eager, want, f"replay {i}: eager cached recv_x field {j} after the replay")
        assert_equal(c_w, r_w, f"replay {i}: cached recv_topk_weights")
        c_ref, cw_ref = ref.combine(y, r_handle, topk_weights=r_w)
        assert_equal(comb_x, c_ref, f"replay {i}: combined_x")
        assert_equal(comb_w, cw_ref, f"replay {i}: combined_topk_weights")
        assert_equal(eager_comb_x, c_ref, f"replay {i}: eager combined_x after the replay")
        assert_equal(eager_comb_w, cw_ref, f"replay {i}: eager combined_topk_weights after the replay")
    buf.destroy()
    return replays


def captured_before_eager(rank: int, world: int, transport: str = "nvlink", num_tokens: int = 80, hidden: int = 192,
                          num_experts: int = 16, num_topk: int = 4) -> int:
    """A handle whose first cached dispatch and combine are captured (no eager warm-up on it), then eager calls on it
    before the graph is ever replayed, then replays: every result bitwise against the reference. Index tensors made
    inside a capture are only filled by a replay, so they must not be kept for eager calls (`streams.memo`)."""
    device = torch.device("cuda", torch.cuda.current_device())
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=num_topk,
                          explicitly_destroy=True, transport=transport)
    gen = torch.Generator().manual_seed(300 + rank)

    def handle_and_inputs():
        topk_idx, weights = random_routing(gen, num_tokens, num_experts, num_topk, masked_ratio=0.2)
        topk_idx, weights = topk_idx.to(device), weights.to(device)
        x = make_x(gen, num_tokens, hidden, "bf16").to(device)
        recv_x, _, recv_w, handle, _ = buf.dispatch(x, topk_idx, weights, num_experts=num_experts)
        return x, topk_idx, weights, recv_x, recv_w, handle

    # Kernels compiled and pools warm on another handle of the same shapes.
    x0, _, w0, recv0, rw0, h0 = handle_and_inputs()
    for _ in range(2):
        buf.combine(buf.dispatch(x0, handle=h0, topk_weights=w0)[0], h0, topk_weights=rw0)
    x_s, topk_idx, weights, recv_x, recv_w, handle = handle_and_inputs()
    y_s = make_x(gen, recv_x.shape[0], hidden, "bf16").to(device)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c_x, _, c_w, _, _ = buf.dispatch(x_s, handle=handle, topk_weights=weights)
        comb_x, comb_w, _ = buf.combine(y_s, handle, topk_weights=recv_w)
    r_x, _, r_w, r_handle = ref.dispatch(x_s, topk_idx, weights, num_experts, num_max_tokens_per_rank=num_tokens)
    e_x, _, e_w, _, _ = buf.dispatch(x_s, handle=handle, topk_weights=weights)  # before any replay
    e_comb_x, e_comb_w, _ = buf.combine(y_s, handle, topk_weights=recv_w)
    c_ref, cw_ref = ref.combine(y_s, r_handle, topk_weights=r_w)
    assert_equal(e_x, r_x, "eager cached recv_x before the first replay")
    assert_equal(e_w, r_w, "eager cached recv_topk_weights before the first replay")
    assert_equal(e_comb_x, c_ref, "eager combined_x before the first replay")
    assert_equal(e_comb_w, cw_ref, "eager combined_topk_weights before the first replay")
    for i in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(c_x, r_x, f"replay {i}: cached recv_x")
        assert_equal(c_w, r_w, f"replay {i}: cached recv_topk_weights")
        assert_equal(comb_x, c_ref, f"replay {i}: combined_x")
        assert_equal(comb_w, cw_ref, f"replay {i}: combined_topk_weights")
    buf.destroy()
    return 2


def return_in_chunks(rank: int, world: int, chunks: str) -> int:
    """The nvlink combine's return push in `chunks` chunks (EPCOMM_RETURN_CHUNKS), each reduced as it lands:
    eager calls (on the second stream) in several modes and routings, then a captured cached dispatch + combine."""
    import os

    os.environ["EPCOMM_RETURN_CHUNKS"] = chunks
    try:
        for case in (dict(num_bias=2), dict(do_expand=True, dtype="fp8", allow_multiple_reduction=True),
                     dict(routing=routing_all_to_rank0), dict(routing=routing_all_masked), dict(tokens=(37, 0)),
                     dict(tokens=(300, 299), hidden=512, num_experts=32, num_topk=8)):
            check_mode(rank, world, seed=11, device="cuda", transport="nvlink", **case)
        graph_replay_exact(rank, world, "nvlink")
    finally:
        os.environ.pop("EPCOMM_RETURN_CHUNKS", None)
    return int(chunks)


def _fields_equal(a, b, what: str) -> None:
    """Dataclasses (handle, plan, layouts), tensors, tuples and plain values, bitwise, field by field."""
    from dataclasses import fields, is_dataclass

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{what}: a tensor and a {type(b).__name__}"
        assert_equal(b.contiguous(), a.contiguous(), what)
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b), what
        for i, (u, v) in enumerate(zip(a, b)):
            _fields_equal(u, v, f"{what}[{i}]")
    elif is_dataclass(a):
        for f in fields(a):
            if f.name not in ("cache", "_topk_idx_version", "_buffer_uid", "_dispatch_id"):  # per call
                _fields_equal(getattr(a, f.name), getattr(b, f.name), f"{what}.{f.name}")
    else:
        assert a == b, f"{what}: {a!r} vs {b!r}"


def fused_matches_generic(rank: int, world: int, *, seed: int = 0, num_tokens=(96, 70), n: int = 96,
                          hidden: int = 256, num_experts: int = 16, num_topk: int = 4, dtype: str = "bf16",
                          do_expand: bool = False, expert_alignment: int = 1, emit_expert_ids: bool = False,
                          col_major_sf: bool = False, with_weights: bool = True, with_stats: bool = True,
                          iters: int = 3, sync: bool = False):
    """The fused sync-free dispatch (syncfree_nvlink.py; with `sync`, the fused CPU-synced one, exact_nvlink.py)
    against the generic path on the same buffer and inputs: outputs, stats and every field of the handle and its
    plan, bitwise; then combine and cached dispatch on both handles. Fresh routings per iteration, including a rank
    that sends nothing."""
    import os

    env, values = ("EPCOMM_FUSED_EXACT", ("0", "1")) if sync else ("EPCOMM_FUSED_SYNC_FREE_ROWS", ("0", ""))

    device = torch.device("cuda", torch.cuda.current_device())
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=n, hidden=hidden, num_topk=num_topk,
                          explicitly_destroy=True, transport="nvlink")
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    local = num_experts // world
    checked = 0
    for it in range(iters):
        t = num_tokens[rank] if it != 1 else (0 if rank == 1 else num_tokens[rank])
        topk_idx, weights = random_routing(gen, t, num_experts, num_topk)
        if it == 2:  # skewed: every selection on rank 0's experts
            topk_idx = torch.stack([torch.randperm(local, generator=gen)[:min(num_topk, local)]
                                    for _ in range(t)]) if t else torch.empty(0, min(num_topk, local), dtype=torch.long)
            topk_idx = torch.nn.functional.pad(topk_idx, (0, num_topk - topk_idx.shape[1]), value=-1)
        x = make_x(gen, t, hidden, dtype)
        x = tuple(v.to(device) for v in x) if isinstance(x, tuple) else x.to(device)
        topk_idx, weights = topk_idx.to(device), weights.to(device) if with_weights else None
        stats0 = torch.randint(0, 50, (local,), generator=gen, dtype=torch.int32).to(device)
        results = {}
        for path, value in zip(("generic", "fused"), values):
            os.environ[env] = value
            stats = stats0.clone() if with_stats else None
            out = buf.dispatch(x, topk_idx, weights, stats, num_experts=num_experts, do_cpu_sync=sync,
                               do_expand=do_expand, expert_alignment=expert_alignment,
                               emit_expert_ids=emit_expert_ids, use_tma_aligned_col_major_sf=col_major_sf)
            handle = out[3]
            rows_out = out[0][0] if isinstance(out[0], tuple) else out[0]
            y = (rows_out.float() if dtype == "fp8" else rows_out).to(torch.bfloat16) * 1.5
            comb = buf.combine(y, handle, topk_weights=None if do_expand else out[2])
            cached = buf.dispatch(x, handle=handle, topk_weights=weights,
                                  use_tma_aligned_col_major_sf=col_major_sf)
            results[path] = (out[:3], stats, handle, comb[:2], cached[:3])
        os.environ.pop(env)
        g, f = results["generic"], results["fused"]
        for i, name in enumerate(("outputs", "stats", "handle", "combine", "cached dispatch")):
            _fields_equal(g[i], f[i], f"rank {rank} iteration {it}: {name}")
        assert f[2]._topk_idx is topk_idx
        if isinstance(f[0][0], tuple):  # the caller sees the scales' layout
            assert f[0][0][1].stride() == g[0][0][1].stride(), f"rank {rank}: scale strides"
        checked += 1
    buf.destroy()
    return checked


def bad_values_raise_everywhere(rank: int, world: int, fused: str):
    """CPU-synced dispatch on nvlink with a bad `topk_idx` value on rank 1 (an id >= num_experts, an id below -1,
    an expert twice in a token), on the fused path (`fused="1"`: the device flags) or the generic one ("0": the host
    check): rank 1 raises the check's message, rank 0 names group rank 1; then a good call works on both paths.
    Returns the messages."""
    import os

    os.environ["EPCOMM_FUSED_EXACT"] = fused
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts, num_topk = 16, 4
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=64, hidden=128, num_topk=num_topk, explicitly_destroy=True,
                          transport="nvlink")
    gen = torch.Generator().manual_seed(5 + rank)
    messages = []
    try:
        for kind, value, pattern in (("large", num_experts, "topk_idx holds 16 (token 9)"),
                                     ("negative", -2, "topk_idx holds -2 (token 9)"),
                                     ("twice", None, "topk_idx row 9 names expert")):
            topk_idx, weights = random_routing(gen, 40, num_experts, num_topk)
            if rank == 1:
                if kind == "twice":
                    topk_idx[9, :2] = torch.tensor([3, 3])
                else:
                    topk_idx[9, 1] = value
            x = make_x(gen, 40, 128, "bf16").to(device)
            try:
                buf.dispatch(x, topk_idx.to(device), weights.to(device), num_experts=num_experts)
            except ValueError as e:
                messages.append(str(e))
                assert pattern in str(e), (kind, str(e))
                assert rank == 1 or "group rank 1 rejected the call" in str(e), str(e)
            else:
                raise AssertionError(f"rank {rank}: {kind} was accepted")
        topk_idx, weights = random_routing(gen, 40, num_experts, num_topk)
        x = make_x(gen, 40, 128, "bf16").to(device)
        out = buf.dispatch(x, topk_idx.to(device), weights.to(device), num_experts=num_experts)
        buf.combine(out[0], out[3])
    finally:
        os.environ.pop("EPCOMM_FUSED_EXACT", None)
        buf.destroy()
    return messages


def check_mode_per_rank_options(rank: int, world: int, **mode):
    """`check_mode` with options docs/decisions.md lists as per rank set differently on each rank: the deferred
    epilogue, the async event, the column-major FP8 scales and the biases."""
    per_rank = dict(defer=rank == 0, async_op=rank == 1, col_major_sf=rank == 0 and mode.get("dtype") == "fp8",
                    num_bias=rank)
    return check_mode(rank, world, **mode, **per_rank)


def per_rank_dispatch_flags(rank: int, world: int):
    """emit_expert_ids, do_zero_padding and num_sms may differ between ranks: the same rows and sums as when they
    agree."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=8, hidden=64)
    gen = torch.Generator().manual_seed(rank)
    idx, _ = random_routing(gen, 8, 8, 2)
    x = torch.randn(8, 64, generator=gen).bfloat16()
    out = []
    for mixed in (False, True):
        kw = dict(emit_expert_ids=rank == 0, do_zero_padding=rank == 1, num_sms=4 * rank) if mixed else {}
        recv_x, _, _, handle, _ = buf.dispatch(x, idx, None, num_experts=8, do_expand=True, expert_alignment=4, **kw)
        y, _, _ = buf.combine(recv_x, handle)
        out.append((recv_x, y))
    assert_equal(out[1][0], out[0][0], "recv_x")
    assert_equal(out[1][1], out[0][1], "combine")
    buf.destroy()
    return True


def narrowed_handle(rank: int, world: int, device: str = "cpu", do_cpu_sync: bool = False, seed: int = 3):
    """DeepEP's test idiom after a dispatch without CPU sync: `handle.recv_src_metadata =
    handle.recv_src_metadata[:num_recv_tokens]`, then a non-expand combine of the valid rows only. The result must
    equal the combine of every row, bitwise; narrowings that drop received rows, and other assignments, raise.
    Returns the number of valid rows."""
    import dataclasses

    gen = torch.Generator().manual_seed(seed + rank)
    num_tokens, hidden, num_experts, num_topk, n = 12, 64, 8, 3, 16
    idx, w = random_routing(gen, num_tokens, num_experts, num_topk)
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    idx, w, x = idx.to(device), w.to(device), x.to(device)
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=n, hidden=hidden, num_topk=num_topk, explicitly_destroy=True)
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=num_experts, do_cpu_sync=do_cpu_sync)
    y = (recv_x.float() * 1.5).bfloat16()
    want = buf.combine(y, handle, topk_weights=recv_w)[0]
    valid = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
    full = handle.recv_src_metadata
    for bad in (full[:valid - 1] if valid else None, full[1:], full.clone(), full[:, :2]):
        if bad is None:
            continue
        try:
            handle.recv_src_metadata = bad
        except ValueError as e:
            assert "recv_src_metadata" in str(e), e
        else:
            raise AssertionError(f"narrowing to {tuple(bad.shape)} did not raise")
    try:
        handle.num_recv_tokens = valid
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("an EPHandle field other than recv_src_metadata was assignable")
    handle.recv_src_metadata = handle.recv_src_metadata[:valid]
    got = buf.combine(y[:valid], handle, topk_weights=recv_w[:valid])[0]
    assert_equal(got, want, "combine of the narrowed handle")
    # A cached dispatch on the narrowed handle returns its rows, which its combine then takes.
    cached_x, _, cached_w, same, _ = buf.dispatch(x, handle=handle, topk_weights=w)
    assert same is handle and cached_x.shape[0] == valid == cached_w.shape[0], (cached_x.shape, valid)
    assert_equal(cached_x, recv_x[:valid], "cached dispatch of the narrowed handle")
    got = buf.combine((cached_x.float() * 1.5).bfloat16(), handle, topk_weights=cached_w)[0]
    assert_equal(got, want, "combine of the cached dispatch's rows")
    if valid < y.shape[0]:  # sync-free: the narrowed handle takes the valid rows only
        try:
            buf.combine(y, handle, topk_weights=recv_w)
        except ValueError as e:
            assert f"x has {y.shape[0]} rows but the handle's non-expand layout has {valid}" in str(e), e
        else:
            raise AssertionError("the narrowed handle took every row")
    buf.destroy()
    return valid


def syncfree_matches_synced(rank: int, world: int, *, do_expand: bool, expert_alignment: int = 1, seed: int = 0,
                            hidden: int = 24, num_experts: int = 12, num_topk: int = 4, n: int = 16):
    """A sync-free dispatch (`do_cpu_sync=False`) of a routing with -1 tails (`routing_masked_tails`: rows of
    -1, -1 in leading and trailing columns, zero weights on routed selections) against the CPU-synced dispatch of
    the same inputs on the same buffer, and both against the reference: the valid rows and the handle's fields
    bitwise, the worst-case tails as docs/decisions.md says (-1 ids and metadata, 0 weights, -1 expert ids), then a
    combine (expert outputs past the valid extent are garbage it must ignore) and a cached dispatch on each handle,
    bitwise equal. A rank with no tokens at all (the last of three) takes part. Returns the number of valid rows."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    num_tokens = 0 if world > 2 and rank == world - 1 else 13
    idx, w = routing_masked_tails(rank, world, gen, num_tokens=max(num_tokens, 3), num_experts=num_experts,
                                  num_topk=num_topk)
    idx, w = idx[:num_tokens], w[:num_tokens]
    x = make_x(gen, num_tokens, hidden, "bf16")
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=n, hidden=hidden, num_topk=num_topk,
                          explicitly_destroy=True)
    kw = dict(num_experts=num_experts, do_expand=do_expand, expert_alignment=expert_alignment,
              emit_expert_ids=do_expand)
    synced = buf.dispatch(x, idx, w, do_cpu_sync=True, **kw)
    free = buf.dispatch(x, idx, w, do_cpu_sync=False, **kw)
    r_x, r_idx, r_w, r_handle = ref.dispatch(x, idx, w, num_experts, num_max_tokens_per_rank=n,
                                             expert_alignment=expert_alignment, do_expand=do_expand)
    rows, valid = r_x.shape[0], len(r_handle.recv_g)
    (s_x, s_idx, s_w, s_h, _), (f_x, f_idx, f_w, f_h, _) = synced, free
    for got, want, what in ((s_x, r_x, "recv_x"), (s_w, r_w, "recv_topk_weights"), (s_idx, r_idx, "recv_topk_idx")):
        assert_equal(got, want, f"CPU-synced {what}")
    for got, want, what in ((f_x, s_x, "recv_x"), (f_w, s_w, "recv_topk_weights"), (f_idx, s_idx, "recv_topk_idx")):
        assert_equal(None if got is None else got[:rows], want, f"sync-free {what} (valid rows)")
    num_local = num_experts // world
    alloc = world * n if not do_expand else f_x.shape[0]
    assert f_x.shape[0] == alloc and f_w.shape[0] == alloc, (f_x.shape, f_w.shape, alloc)
    assert bool((f_w[rows:] == 0).all()), "sync-free weights past the valid extent must be 0"
    if not do_expand:
        assert bool((f_idx[rows:] == -1).all()), "sync-free recv_topk_idx past the valid extent must be -1"
    else:
        assert alloc == layout_worst(world, n, num_topk, num_local, expert_alignment), alloc
    # Handles: the same counts and rows; the sync-free one has worst-case sizes and no host list.
    for field in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                  "num_unaligned_recv_tokens_per_expert", "dst_buffer_slot_idx"):
        assert_equal(getattr(f_h, field), getattr(s_h, field), f"handle.{field}")
    assert int(f_h.psum_num_recv_tokens_per_scaleup_rank[-1]) == valid
    assert_equal(f_h.recv_src_metadata[:valid], s_h.recv_src_metadata, "handle.recv_src_metadata (valid rows)")
    assert bool((f_h.recv_src_metadata[valid:] == -1).all()), "metadata past the valid extent must be -1"
    assert f_h.num_recv_tokens_per_expert_list == [] and f_h.num_recv_tokens == world * n
    assert s_h.num_recv_tokens == valid
    if do_expand:
        check_recv_expert_ids(s_h, r_handle, rows)
        check_recv_expert_ids(f_h, r_handle, alloc)
    # Combine: the same expert outputs on the valid rows (garbage past them on the sync-free handle), biases and
    # weights: bitwise the same sums and weights, and the reference's.
    y = (s_x.double() * (1 + torch.rand(s_x.shape, generator=gen, dtype=torch.float64))).to(s_x.dtype)
    garbage = torch.rand(alloc - rows, hidden, generator=gen, dtype=torch.float64)
    garbage[::2] = float("nan")  # a tail row that were summed (even times 0) would show
    garbage[1::4] = float("inf")
    y_free = torch.cat([y, garbage.to(y.dtype)])
    bias = tuple(make_x(gen, num_tokens, hidden, "bf16") for _ in range(2))
    w_free = torch.cat([s_w, torch.full((alloc - rows,) + tuple(s_w.shape[1:]), float("nan"))])
    got_s = buf.combine(y, s_h, topk_weights=s_w, bias=bias)
    got_f = buf.combine(y_free, f_h, topk_weights=w_free, bias=bias)
    c_ref, cw_ref = ref.combine(y, r_handle, topk_weights=r_w, bias=bias)
    for got, what in ((got_s, "CPU-synced"), (got_f, "sync-free")):
        assert_equal(got[0], c_ref, f"{what} combined_x")
        assert_equal(got[1], cw_ref, f"{what} combined_topk_weights")
    assert_equal(got_f[1], torch.where(idx >= 0, w, torch.zeros_like(w)), "weights round trip (zeros kept)")
    # Cached dispatch of new data on both handles: the same valid rows.
    x2 = make_x(gen, num_tokens, hidden, "bf16")
    w2 = torch.rand(w.shape, generator=gen).masked_fill(idx < 0, 0.0)
    c_s = buf.dispatch(x2, handle=s_h, topk_weights=w2)
    c_f = buf.dispatch(x2, handle=f_h, topk_weights=w2)
    r2_x, _, r2_w, _ = ref.dispatch(x2, idx, w2, num_experts, num_max_tokens_per_rank=n,
                                    expert_alignment=expert_alignment, do_expand=do_expand)
    assert_equal(c_s[0], r2_x, "cached recv_x on the CPU-synced handle")
    assert_equal(c_f[0][:rows], r2_x, "cached recv_x on the sync-free handle (valid rows)")
    assert_equal(c_f[2][:rows], r2_w, "cached recv_topk_weights on the sync-free handle (valid rows)")
    buf.destroy()
    return valid


def layout_worst(world: int, n: int, num_topk: int, num_local: int, alignment: int) -> int:
    """Reference §9.5: the sync-free expand allocation."""
    a = alignment
    return (world * n * min(num_topk, num_local) + (a - 1) * num_local + a - 1) // a * a


def deferred_combine_bias(rank: int, world: int, *, do_expand: bool, num_bias: int = 2, seed: int = 0,
                          packed: bool = False):
    """A deferred combine (`async_with_compute_stream=True, defer_epilogue=True`) reads its bias at the first wait,
    not at the call (reference §3.5: "tensors referenced by the epilogue (e.g. bias) are read at wait time, so a
    bias produced after the launch but before the wait is legal"), and the expert outputs `x` at the call
    (`pipeline.combine_launch`: the epilogue "may run after the caller has reused x"). The bias tensors are
    overwritten in place between the call and the wait, and so is `x`: the result is the reference's sum of the
    call-time `x` with the wait-time bias, bitwise, while a non-deferred combine adds the bias it was given.
    `packed`: each bias a view starting 2 bytes into a flat buffer (read where it is too)."""
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    num_tokens, hidden, num_experts, num_topk = 11, 40, 8, 3
    idx, w = random_routing(gen, num_tokens, num_experts, num_topk)
    x = make_x(gen, num_tokens, hidden, "bf16")
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=num_topk,
                          explicitly_destroy=True)
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=num_experts, do_expand=do_expand)
    _, _, r_w, r_handle = ref.dispatch(x, idx, w, num_experts, do_expand=do_expand)
    y = (recv_x.double() * (1 + torch.rand(recv_x.shape, generator=gen, dtype=torch.float64))).to(recv_x.dtype)
    y_at_call = y.clone()
    biases = [make_x(gen, num_tokens, hidden, "bf16") for _ in range(num_bias)]
    if packed:
        biases = [torch.cat([b.new_zeros(1), b.flatten()])[1:].view(b.shape) for b in biases]
    old = [b.clone() for b in biases]
    new = [make_x(gen, num_tokens, hidden, "bf16") for _ in range(num_bias)]
    bias = biases[0] if num_bias == 1 else tuple(biases)
    event = buf.combine(y, handle, topk_weights=recv_w, bias=bias, async_with_compute_stream=True,
                        defer_epilogue=True)
    assert isinstance(event, epcomm.EventOverlap)
    for b, fresh in zip(biases, new):
        b.copy_(fresh)  # produced after the call, before the wait
    y.copy_(make_x(gen, y.shape[0], hidden, "bf16"))  # the caller reuses its expert outputs
    combined_x, combined_w = event.wait()
    want_new = ref.combine(y_at_call, r_handle, topk_weights=r_w, bias=new[0] if num_bias == 1 else tuple(new))
    want_old = ref.combine(y_at_call, r_handle, topk_weights=r_w, bias=old[0] if num_bias == 1 else tuple(old))
    assert not torch.equal(want_new[0], want_old[0]), "the two biases must give different sums"
    assert_equal(combined_x, want_new[0], "deferred combined_x (bias read at the wait)")
    assert_equal(combined_w, want_new[1], "deferred combined_topk_weights")
    assert event.wait() is None, "a second wait must return None"
    # Not deferred (async or not): the bias given to the call, whatever happens to it afterwards.
    for b, before in zip(biases, old):
        b.copy_(before)
    for async_op in (False, True):
        got = buf.combine(y_at_call, handle, topk_weights=recv_w, bias=bias, async_with_compute_stream=async_op)
        for b, fresh in zip(biases, new):
            b.copy_(fresh)
        assert_equal(got[0], want_old[0], f"combined_x (async_with_compute_stream={async_op})")
        for b, before in zip(biases, old):
            b.copy_(before)
    buf.destroy()
    return True


def fp8_scale_columns(rank: int, world: int, *, num_sf_packs: int, sf_dtype: str = "fp32", do_expand: bool = False,
                      do_cpu_sync: bool = True, hidden: int = 256, seed: int = 0):
    """FP8 dispatch with `num_sf_packs` scale columns, whatever `hidden` implies (`epcomm.fp8.num_sf_packs(256)` is
    2 fp32 columns; 1 packed UE8M0 int32): dispatch does not check the count against hidden and moves the scales as
    opaque bytes (reference §9.11: `[T, P]`, `P = num_sf_packs`, transported unchanged), so any P >= 1 arrives
    bitwise where the reference puts it, in both layouts, and a cached dispatch replays it. Random scale bits."""
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    num_tokens, num_experts, num_topk = 9 + 4 * rank, 8, 3
    idx, w = random_routing(gen, num_tokens, num_experts, num_topk)
    data = per_token_cast_to_fp8(torch.randn(num_tokens, hidden, generator=gen, dtype=torch.float64))[0]
    if sf_dtype == "fp32":
        sf = torch.rand(num_tokens, num_sf_packs, generator=gen) * 4 + 0.5
    else:
        sf = torch.randint(-2 ** 31, 2 ** 31 - 1, (num_tokens, num_sf_packs), generator=gen, dtype=torch.int32)
    n = 16
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=n, hidden=hidden, num_topk=num_topk, use_fp8_dispatch=True,
                          explicitly_destroy=True)
    kw = dict(num_experts=num_experts, do_expand=do_expand, expert_alignment=2, do_cpu_sync=do_cpu_sync)
    recv_x, _, recv_w, handle, _ = buf.dispatch((data, sf), idx, w, **kw)
    r_x, _, r_w, _ = ref.dispatch((data, sf), idx, w, num_experts, num_max_tokens_per_rank=n, expert_alignment=2,
                                  do_expand=do_expand)
    rows = r_x[0].shape[0]
    assert recv_x[1].shape[1] == num_sf_packs and recv_x[1].dtype == sf.dtype, (recv_x[1].shape, recv_x[1].dtype)
    assert_equal(recv_x[0][:rows], r_x[0], "recv_x data")
    assert_equal(recv_x[1][:rows], r_x[1], "recv_x scales")
    assert_equal(recv_w[:rows], r_w, "recv_topk_weights")
    cached = buf.dispatch((data, sf), handle=handle)
    assert_equal(cached[0][1][:rows], r_x[1], "cached recv_x scales")
    buf.destroy()
    return rows


def empty_rank_broadcast_strides(rank: int, world: int, *, do_expand: bool = False, hidden: int = 8,
                                 num_experts: int = 4, num_topk: int = 1) -> int:
    """Rank 1 has no tokens, and its empty inputs carry the strides of broadcast ops (a [0, 1] weight scaled by a
    factor has strides (1, 0); torch calls every empty tensor contiguous): dispatch and combine (expert outputs and
    weights also with such strides on a rank that received no rows, a bias likewise) equal the reference on dense
    copies. Returns the rows this rank received."""
    gen = torch.Generator().manual_seed(40 + rank)
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=4, hidden=hidden, num_topk=num_topk, num_cpu_timeout_secs=30)
    t = 0 if rank == 1 else 4

    def odd(v: torch.Tensor) -> torch.Tensor:  # the same values; an empty tensor gets broadcast strides
        return v[:, :1].expand(v.shape) if v.shape[0] == 0 and v.dim() == 2 and v.shape[1] else v

    x = torch.randn(t, hidden, generator=gen).bfloat16()
    scores = torch.rand(t, num_experts, generator=gen)
    w, idx = scores.topk(num_topk, dim=1)
    w = w * 2.5
    recv_x, _, recv_w, handle, _ = buf.dispatch(odd(x), odd(idx), odd(w), num_experts=num_experts,
                                                do_expand=do_expand)
    r_x, _, r_w, r_handle = ref.dispatch(x, idx, w, num_experts, num_max_tokens_per_rank=4, do_expand=do_expand)
    assert_equal(recv_x, r_x, "recv_x")
    assert_equal(recv_w, r_w, "recv_topk_weights")
    y = odd(recv_x * 2)
    bias = odd(torch.randn(t, hidden, generator=gen).bfloat16())
    got = buf.combine(y, handle, topk_weights=odd(recv_w * 1.0), bias=bias)
    want = ref.combine(recv_x * 2, r_handle, topk_weights=recv_w * 1.0, bias=bias.contiguous())
    assert_equal(got[0], want[0], "combined_x")
    assert_equal(got[1], want[1], "combined_topk_weights")
    buf.destroy()
    return recv_x.shape[0]


def _dispatch_odd_inputs(buf, payload, odd, idx, odd_idx, w, odd_of, num_experts: int, n: int, do_expand: bool):
    """Dispatch and cached dispatch of `odd` (the payload laid out oddly; the routing `odd_idx`, the weights
    `odd_of(w)`) equal the reference's dispatch of `payload`. Returns `(recv_x, recv_w, handle, ref_handle)`."""
    fp8 = isinstance(payload, tuple)
    recv_x, _, recv_w, handle, _ = buf.dispatch(odd, odd_idx, odd_of(w), num_experts=num_experts,
                                                do_expand=do_expand)
    r_x, _, r_w, r_handle = ref.dispatch(payload, idx, w, num_experts, num_max_tokens_per_rank=n,
                                         do_expand=do_expand)
    cached = buf.dispatch(odd, handle=handle, topk_weights=odd_of(w))
    for got_x, what in ((recv_x, "recv_x"), (cached[0], "cached recv_x")):
        for part, want_part, name in zip(got_x if fp8 else (got_x,), r_x if fp8 else (r_x,), ("data", "scales")):
            assert_equal(part, want_part, f"{what} {name}")
    assert_equal(recv_w, r_w, "recv_topk_weights")
    return recv_x, recv_w, handle, r_handle


def size_one_last_dim_strides(rank: int, world: int, *, fp8: bool, do_expand: bool = False) -> int:
    """Inputs whose last dim has size 1 and a stride other than 1 (torch calls them contiguous; a byte view refuses
    them): top-1 `topk_idx` / weights and, without FP8, hidden-1 `x` laid out column-major ([T, 1] of strides (1, T));
    with FP8, column-major scales of one pack (hidden <= 128, as a TMA-aligned layout gives them); rank 0 holds one
    token ([1, 1] tensors). Dispatch, cached dispatch and combine (expert outputs and weights likewise) equal the
    reference. Returns the rows this rank received."""
    gen = torch.Generator().manual_seed(60 + rank)
    num_tokens, num_experts, hidden = (1, 4, 64 if fp8 else 1) if rank == 0 else (5, 4, 64 if fp8 else 1)
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=5, hidden=hidden, num_topk=1, use_fp8_dispatch=fp8,
                          num_cpu_timeout_secs=30)

    def col_major(v: torch.Tensor) -> torch.Tensor:  # [rows, 1], the same values, strides (1, 4)
        assert v.dim() == 2 and v.shape[1] == 1, v.shape
        return torch.empty_strided(v.shape, (1, 4), dtype=v.dtype).copy_(v)

    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    w, idx = torch.rand(num_tokens, num_experts, generator=gen).topk(1, dim=1)
    payload = per_token_cast_to_fp8(x) if fp8 else x
    odd = (payload[0], col_major(payload[1])) if fp8 else col_major(payload)
    assert odd[1].stride(-1) != 1 if fp8 else odd.stride(-1) != 1
    recv_x, recv_w, handle, r_handle = _dispatch_odd_inputs(buf, payload, odd, idx, col_major(idx), w, col_major,
                                                            num_experts, 5, do_expand)
    y = (recv_x[0].float() if fp8 else recv_x.float()).bfloat16()[:, :1].contiguous()
    y = y.expand(y.shape[0], hidden).contiguous() if hidden > 1 else y
    got = buf.combine(col_major(y) if hidden == 1 else y, handle,
                      topk_weights=None if do_expand else col_major(recv_w))
    want = ref.combine(y, r_handle, topk_weights=None if do_expand else recv_w)
    assert_equal(got[0], want[0], "combined_x")
    buf.destroy()
    return y.shape[0]


def packed_views(rank: int, world: int, *, fp8: bool, do_expand: bool) -> int:
    """Every row payload a view into a packed flat buffer, starting 1 to 4 bytes into its storage (contiguous, but a
    word view of its rows fails): x (or the FP8 data and scales), weights, the cached dispatch's inputs, the expert
    outputs, the combine's weights, and a bias (read where it is: it does not travel). Every call completes and
    equals the reference, and the buffer stays usable, where the word view used to fail after the header exchange
    (the buffer and the group were broken). Returns the rows this rank received."""
    gen = torch.Generator().manual_seed(70 + rank)
    num_tokens, num_experts, hidden, num_topk = 6 + rank, 4 * world, 256, 2

    def packed(v: torch.Tensor) -> torch.Tensor:  # the same values, contiguous, one element into a flat buffer
        flat = torch.empty(1 + v.numel(), dtype=v.dtype)
        out = flat[1:].view(v.shape).copy_(v)
        assert out.is_contiguous() and out.storage_offset() * out.element_size() % 8, out.storage_offset()
        return out

    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=8, hidden=hidden, num_topk=num_topk, use_fp8_dispatch=fp8,
                          num_cpu_timeout_secs=30)
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    w, idx = torch.rand(num_tokens, num_experts, generator=gen).topk(num_topk, dim=1)
    payload = per_token_cast_to_fp8(x) if fp8 else x
    odd = tuple(map(packed, payload)) if fp8 else packed(payload)
    recv_x, recv_w, handle, r_handle = _dispatch_odd_inputs(buf, payload, odd, idx, idx, w, packed, num_experts, 8,
                                                            do_expand)
    y = torch.randn(recv_w.shape[0], hidden, generator=gen).bfloat16()
    bias = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    weights = None if do_expand else recv_w
    got = buf.combine(packed(y), handle, topk_weights=None if weights is None else packed(weights), bias=packed(bias))
    want = ref.combine(y, r_handle, topk_weights=weights, bias=bias)
    assert_equal(got[0], want[0], "combined_x")
    if weights is not None:
        assert_equal(got[1], want[1], "combined_topk_weights")
    buf.destroy()
    return y.shape[0]


def inference_routing_edited(rank: int, world: int, *, do_expand: bool) -> int:
    """Under `torch.inference_mode()` the routing has no version counter for the in-place guard: dispatch keeps a
    copy, so a `topk_idx` edited after the dispatch (columns swapped, an id changed) leaves combine (rows and weights)
    and cached dispatch on the dispatch's routing, equal to the reference's. Returns the rows this rank received."""
    gen = torch.Generator().manual_seed(80 + rank)
    num_tokens, num_experts, hidden, num_topk = 7, 4 * world, 16, 3
    with torch.inference_mode():
        buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=8, hidden=hidden, num_topk=num_topk,
                              num_cpu_timeout_secs=30)
        x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
        w, idx = torch.rand(num_tokens, num_experts, generator=gen).topk(num_topk, dim=1)
        original = idx.clone()
        recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=num_experts, do_expand=do_expand)
        idx[:, 0], idx[:, 1] = original[:, 1], original[:, 0]  # edited in place: not caught, not followed
        idx[0, 2] = -1
        r_x, _, r_w, r_handle = ref.dispatch(x, original, w, num_experts, num_max_tokens_per_rank=8,
                                             do_expand=do_expand)
        assert_equal(buf.dispatch(x, handle=handle, topk_weights=w)[0], r_x, "cached recv_x")
        y = torch.randn(recv_x.shape[0], hidden, generator=gen).bfloat16()
        weights = None if do_expand else recv_w
        got = buf.combine(y, handle, topk_weights=weights)
        want = ref.combine(y, r_handle, topk_weights=weights)
        assert_equal(got[0], want[0], "combined_x")
        if weights is not None:
            assert_equal(got[1], want[1], "combined_topk_weights")
        buf.destroy()
        return y.shape[0]


def warning_at_caller(rank: int, world: int, load_dynamo: bool) -> tuple:
    """The file of the grad warning a dispatch gives (inputs that require grad): the caller's, also once Dynamo is
    loaded and its wrapper stands between (compile_guard). Returns (warning files, this file)."""
    import importlib
    import warnings

    if load_dynamo:
        importlib.import_module("torch._dynamo")
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=4, hidden=8, num_topk=2)
    x = torch.randn(4, 8, requires_grad=True)
    idx = torch.rand(4, 2 * world).topk(2, dim=1).indices
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf.dispatch(x, idx, None, num_experts=2 * world)
    buf.destroy()
    return [w.filename for w in caught if "require grad" in str(w.message)], __file__
