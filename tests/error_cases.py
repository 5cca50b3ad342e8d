"""Bad-input scenarios, run on every rank of one group; each returns what every rank raised.

Rank 1 is the offender unless a scenario says otherwise; on CPU every call exchanges a header, so every rank
must raise the same class (docs/decisions.md "Errors and timeouts").
"""

from __future__ import annotations

import os
import random
import time

import torch

import epcomm
from epcomm.fp8 import per_token_cast_to_fp8

H, E, K, N = 32, 8, 2, 16


def _inputs(rank: int, num_tokens: int = 6):
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(num_tokens, H, generator=gen).bfloat16()
    topk_idx = torch.rand(num_tokens, E, generator=gen).topk(K, dim=1).indices
    w = torch.rand(num_tokens, K, generator=gen)
    return x, topk_idx, w


def _on(rank, bad, good):
    return bad if rank == 1 else good


def scenarios():
    """name -> fn(buf, rank) making one call (with rank 1's arguments wrong)."""
    def dispatch(buf, rank, **kw):
        x, idx, w = _inputs(rank)
        args = dict(x=x, topk_idx=idx, topk_weights=w, num_experts=E)
        args.update({k: v(args) for k, v in kw.items()})
        return buf.dispatch(**args)

    def bad(**kw):  # rank 1 gets the overrides, rank 0 the normal arguments
        return lambda buf, rank: dispatch(buf, rank, **(kw if rank == 1 else {}))

    def combine(mutate, expand=False):
        def run(buf, rank):
            x, idx, w = _inputs(rank)
            recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=E, do_expand=expand)
            args = dict(x=recv_x, handle=handle, topk_weights=recv_w, bias=None)
            if rank == 1:
                mutate(args, x)
            return buf.combine(**args)
        return run

    def cached(mutate, **first):  # `first`: arguments of the dispatch that makes the handle
        def run(buf, rank):
            x, idx, w = _inputs(rank)
            _, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E, **first)
            args = dict(x=x, handle=handle, do_expand=False)
            if rank == 1:
                mutate(args, idx)
            return buf.dispatch(**args)
        return run

    def fp8_scales(rank1_columns):  # every rank passes FP8 x; rank 1's scales have `rank1_columns` columns
        def run(buf, rank):
            x, idx, w = _inputs(rank)
            data, sf = per_token_cast_to_fp8(x.double())
            if rank == 1:
                sf = torch.rand(sf.shape[0], rank1_columns) + 0.5
            return buf.dispatch((data, sf), idx, w, num_experts=E)
        return run

    def other_dispatch_handle(then):  # two dispatches; rank 1 passes the second's handle, rank 0 the first's
        def run(buf, rank):
            x, idx, w = _inputs(rank)
            made = [buf.dispatch(x, idx, w, num_experts=E) for _ in range(2)]
            recv_x, _, _, handle, _ = made[1 if rank == 1 else 0]
            return then(buf, x, recv_x, handle)
        return run

    def expand_combine_without_multiple_reduction(buf, rank):
        # reference §11.1, §24 item 17: expand layout and allow_multiple_reduction=False reject topk_weights
        nomr = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=20,
                               allow_multiple_reduction=False)
        try:
            x, idx, w = _inputs(rank)
            recv_x, _, recv_w, handle, _ = nomr.dispatch(x, idx, w, num_experts=E, do_expand=True)
            return nomr.combine(recv_x, handle, topk_weights=recv_w if rank == 1 else None)
        finally:
            nomr.destroy()

    return {
        "x_int_dtype": bad(x=lambda a: a["x"].int()),
        "do_expand_str": bad(do_expand=lambda a: "yes"),
        "num_sms_negative": bad(num_sms=lambda a: -3),
        "x_3d": bad(x=lambda a: a["x"].unsqueeze(0)),
        "x_hidden_zero": bad(x=lambda a: a["x"][:, :0]),
        "x_meta_device": bad(x=lambda a: a["x"].to("meta")),
        "x_sparse": bad(x=lambda a: a["x"].to_sparse()),
        "topk_idx_sparse": bad(topk_idx=lambda a: a["topk_idx"].to_sparse()),
        "weights_sparse": bad(topk_weights=lambda a: a["topk_weights"].to_sparse()),
        "fp8_scales_no_columns": bad(x=lambda a: (a["x"].float().to(torch.float8_e4m3fn), torch.ones(6, 0))),
        "x_tuple_len3": bad(x=lambda a: (a["x"], a["x"], a["x"])),
        "too_many_tokens": bad(x=lambda a: torch.randn(N + 1, H).bfloat16(),
                               topk_idx=lambda a: torch.full((N + 1, K), -1, dtype=torch.int64),
                               topk_weights=lambda a: None),
        "topk_idx_float": bad(topk_idx=lambda a: a["topk_idx"].float()),
        "topk_idx_rows": bad(topk_idx=lambda a: a["topk_idx"][:-1]),
        "topk_33": bad(topk_idx=lambda a: torch.full((6, 33), -1, dtype=torch.int64),
                       topk_weights=lambda a: None),
        "topk_id_too_large": bad(topk_idx=lambda a: a["topk_idx"].clone().fill_(E)),
        "topk_id_below_minus_one": bad(topk_idx=lambda a: a["topk_idx"].clone().fill_(-2)),
        "topk_repeated_expert": bad(topk_idx=lambda a: torch.tensor([[3, 3]] * 6)),
        "weights_dtype": bad(topk_weights=lambda a: a["topk_weights"].double()),
        "weights_shape": bad(topk_weights=lambda a: a["topk_weights"][:, :1]),
        "stats_dtype": bad(cumulative_local_expert_recv_stats=lambda a: torch.zeros(E // 2, dtype=torch.int64)),
        "stats_shape": bad(cumulative_local_expert_recv_stats=lambda a: torch.zeros(E, dtype=torch.int32)),
        "stats_stride_zero": bad(cumulative_local_expert_recv_stats=lambda a: torch.zeros(1, dtype=torch.int32)
                                 .expand(E // 2)),
        "num_experts_not_multiple": bad(num_experts=lambda a: 7),
        "num_experts_missing": bad(num_experts=lambda a: None),
        "num_experts_as_stats": bad(num_experts=lambda a: None, cumulative_local_expert_recv_stats=lambda a: E),
        "num_experts_huge": bad(num_experts=lambda a: 2 ** 40),
        "alignment_zero": bad(expert_alignment=lambda a: 0),
        "alignment_huge": bad(expert_alignment=lambda a: 2 ** 40),
        "zero_padding_without_expand": bad(do_zero_padding=lambda a: True),
        "expert_ids_without_expand": bad(emit_expert_ids=lambda a: True),
        "defer_without_async": bad(defer_epilogue=lambda a: True),
        "previous_event_without_comm_alloc": bad(previous_event=lambda a: epcomm.EPBuffer.capture()),
        "previous_event_type": bad(previous_event=lambda a: "ev", allocate_on_comm_stream=lambda a: True),
        "do_handle_copy": bad(do_handle_copy=lambda a: True),
        "num_qps_too_many": bad(num_qps=lambda a: 10_000),
        "capacity_hidden": bad(x=lambda a: torch.randn(6, 64 * 1024).bfloat16()),
        "disagree_hidden": bad(x=lambda a: a["x"][:, : H // 2].contiguous()),
        "disagree_num_experts": bad(num_experts=lambda a: 2 * E,
                                    topk_idx=lambda a: a["topk_idx"]),
        "disagree_layout": bad(do_expand=lambda a: True),
        "disagree_alignment": bad(expert_alignment=lambda a: 4),
        "disagree_dtype": bad(x=lambda a: a["x"].half()),
        "disagree_sync": bad(do_cpu_sync=lambda a: False),
        "disagree_topk": bad(topk_idx=lambda a: torch.rand(6, E, generator=torch.Generator().manual_seed(9)).topk(
            K + 1, dim=1).indices, topk_weights=lambda a: torch.rand(6, K + 1)),
        "disagree_fp8": bad(x=lambda a: per_token_cast_to_fp8(a["x"].double())),
        "disagree_scale_columns": fp8_scales(2),
        "disagree_weights_given": bad(topk_weights=lambda a: None),
        "disagree_combine_weights_given": combine(lambda a, x: a.update(topk_weights=None)),
        # Rows and handle agree on each rank, but the ranks combine (or replay) different dispatches.
        "disagree_combine_handle": other_dispatch_handle(lambda buf, x, recv_x, h: buf.combine(recv_x, h)),
        "disagree_cached_handle": other_dispatch_handle(lambda buf, x, recv_x, h: buf.dispatch(x, handle=h)),
        "combine_rows": combine(lambda a, x: a.update(x=a["x"][:-1])),
        "combine_x_sparse": combine(lambda a, x: a.update(x=a["x"].to_sparse())),
        "combine_x_fp8_tuple": combine(lambda a, x: a.update(x=(a["x"], a["x"]))),
        "combine_bias_len3": combine(lambda a, x: a.update(bias=(x, x, x))),
        "combine_bias_shape": combine(lambda a, x: a.update(bias=x[:-1])),
        "combine_bias_dtype": combine(lambda a, x: a.update(bias=x.float())),
        "combine_weights_shape": combine(lambda a, x: a.update(topk_weights=a["topk_weights"][:, :1])),
        "combine_weights_dtype": combine(lambda a, x: a.update(topk_weights=a["topk_weights"].double())),
        "combine_expand_weights_dtype": combine(lambda a, x: a.update(topk_weights=a["topk_weights"].half()),
                                                expand=True),
        "combine_expand_weights_without_multiple_reduction": expand_combine_without_multiple_reduction,
        "combine_handle_type": combine(lambda a, x: a.update(handle=object())),
        "combine_topk_idx_modified": combine(lambda a, x: a["handle"].topk_idx.add_(0)),
        "cached_with_topk_idx": cached(lambda a, idx: a.update(topk_idx=idx)),
        "cached_with_cpu_sync": cached(lambda a, idx: a.update(do_cpu_sync=True)),
        "cached_layout_mismatch": cached(lambda a, idx: a.update(do_expand=True)),
        "cached_num_experts_mismatch": cached(lambda a, idx: a.update(num_experts=2 * E)),
        "cached_tokens_mismatch": cached(lambda a, idx: a.update(num_max_tokens_per_rank=N // 2)),
        "cached_alignment_mismatch": cached(lambda a, idx: a.update(expert_alignment=4)),
        # The handle's own values differ from the buffer's / the defaults; the caller passes those instead.
        "cached_tokens_vs_buffer": cached(lambda a, idx: a.update(num_max_tokens_per_rank=N),
                                          num_max_tokens_per_rank=N // 2),
        "cached_alignment_vs_handle": cached(lambda a, idx: a.update(expert_alignment=1), expert_alignment=4),
        "cached_stats": cached(lambda a, idx: a.update(
            cumulative_local_expert_recv_stats=torch.zeros(E // 2, dtype=torch.int32))),
        "cached_topk_idx_modified": cached(lambda a, idx: a["handle"].topk_idx.mul_(1)),
        "cached_token_count": cached(lambda a, idx: a.update(x=a["x"][:-1])),
    }


def run_scenarios(rank: int, world: int, names=None) -> dict:
    """Run every scenario on one buffer; return name -> (exception class name, message) or None."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=20)
    results = {}
    for name, fn in scenarios().items():
        if names is not None and name not in names:
            continue
        try:
            fn(buf, rank)
            results[name] = None
        except (TypeError, ValueError) as e:
            results[name] = (type(e).__name__, str(e))
    # The buffer still works after every rejected call.
    x, idx, w = _inputs(rank)
    recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E)
    buf.combine(recv_x, handle)
    buf.destroy()
    return results


def integer_arguments(rank: int, world: int):
    """Integer arguments given on rank 1 only: numpy ints are ints (dispatch's num_max_tokens_per_rank and num_sms
    as everywhere else); None, a bool, a string or an int past int64 raise naming the argument on every rank, before
    any exchange could fail (an int past int64 overflowed the call header on that rank alone)."""
    import numpy as np

    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H)
    x, idx, w = _inputs(rank)
    ref = buf.dispatch(x, idx, w, num_experts=E)[0]
    out = []
    for kwargs in (dict(num_max_tokens_per_rank=np.int64(N), num_sms=np.int32(0)), dict(num_qps=None),
                   dict(num_max_tokens_per_rank=True), dict(num_experts=2 ** 63), dict(num_sms="4")):
        args = dict(num_experts=E) | (kwargs if rank == 1 else {})
        try:
            got = buf.dispatch(x, idx, w, **args)[0]
            out.append("ok" if torch.equal(got, ref) else "wrong result")
        except (TypeError, ValueError) as e:
            out.append(f"{type(e).__name__}: {e}")
    try:
        epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_allocated_qps="a" if rank == 1 else 0)
        out.append("constructed")
    except (TypeError, ValueError) as e:
        out.append(f"{type(e).__name__}: {e}")
    return out


def deep_copied_handle(rank: int, world: int):
    """copy.deepcopy of a handle (a model holding one, deep-copied) gives a handle that works like the original, and
    still sees an in-place edit of the dispatch's topk_idx."""
    import copy

    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H)
    x, idx, w = _inputs(rank)
    recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E)
    twin = copy.deepcopy(handle)
    same = (torch.equal(buf.combine(recv_x, twin)[0], buf.combine(recv_x, handle)[0])
            and torch.equal(buf.dispatch(x, handle=twin)[0], recv_x)
            and torch.equal(buf.combine(recv_x, copy.copy(handle))[0], buf.combine(recv_x, handle)[0]))
    import pickle
    try:  # refused with its reason (an unpickled copy, detached from the buffer, raised a false "modified" error)
        pickle.dumps(handle)
        same = False
    except TypeError as e:
        same = same and "an EPHandle cannot be pickled" in str(e)
    idx.add_(0)  # an in-place edit (a new version)
    try:
        buf.combine(recv_x, twin)
        return same, None
    except ValueError as e:
        return same, str(e)


def other_buffer_handle(rank: int, world: int):
    """A handle used with a buffer that did not make it; Python's `random` seeded alike before each construction
    (as training scripts seed it) must not give the two buffers one id."""
    random.seed(1234)
    a = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H)
    random.seed(1234)
    b = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H)
    x, idx, w = _inputs(rank)
    recv_x, _, _, handle, _ = a.dispatch(x, idx, w, num_experts=E)
    out = []
    for call in (lambda: b.combine(recv_x, handle), lambda: b.dispatch(x, handle=handle)):
        try:
            call()
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    b.destroy()
    for call in (lambda: b.dispatch(x, idx, num_experts=E), lambda: b.combine(recv_x, handle)):
        try:
            call()
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


def dispatch_vs_combine(rank: int, world: int):
    """Rank 0 dispatches while rank 1 combines: both raise naming the disagreement."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=20)
    x, idx, w = _inputs(rank)
    recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E)
    try:
        if rank == 0:
            buf.dispatch(x, idx, w, num_experts=E)
        else:
            buf.combine(recv_x, handle)
    except ValueError as e:
        return str(e)
    return None


def two_buffers(rank: int, world: int):
    """Two buffers on one group: rank 0 dispatches on the first, rank 1 on the second; both raise at that call, and
    the next calls on either buffer are in step (each rank took its call id back). Returns the message, or None."""
    first = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=20)
    second = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=20)
    x, idx, w = _inputs(rank)
    msg = None
    try:
        (first if rank == 0 else second).dispatch(x, idx, w, num_experts=E)
    except ValueError as e:
        msg = str(e)
    got = [buf.dispatch(x, idx, w, num_experts=E)[0] for buf in (first, second)]
    assert torch.equal(got[0], got[1]) and got[0].shape[1] == H, "the buffers disagree after the mismatch"
    return msg


def missing_peer(rank: int, world: int, timeout_s: float):
    """Rank 1 never calls dispatch: the others raise TimeoutError naming it within the timeout."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=timeout_s)
    if rank == 1:
        time.sleep(timeout_s + 4)
        return "skipped"
    x, idx, w = _inputs(rank)
    start = time.monotonic()
    try:
        buf.dispatch(x, idx, w, num_experts=E)
    except TimeoutError as e:
        elapsed = time.monotonic() - start
        try:
            buf.dispatch(x, idx, w, num_experts=E)
            after = None
        except ValueError as e2:
            after = str(e2)
        return str(e), elapsed, after
    return None


def late_peer(rank: int, world: int, timeout_s: float):
    """Rank 1 comes to its dispatch after rank 0 gave up on it: rank 1 raises at its first look in the store (about
    a second in), naming rank 0, instead of waiting out its own timeout. Returns (message, seconds in the call)."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=timeout_s)
    x, idx, w = _inputs(rank)
    if rank == 1:
        time.sleep(timeout_s + 3)
    start = time.monotonic()
    try:
        buf.dispatch(x, idx, w, num_experts=E)
    except TimeoutError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


def failure_mid_call(rank: int, world: int, timeout_s: float, where: str, internal: bool = False):
    """Rank 1 runs out of memory during a dispatch (`where`: "resolve", before the header exchange, or "move",
    after it) or a combine ("combine", after its header exchange). Before the exchange the error travels in it as a
    bad argument does: rank 1 re-raises it, its peers raise "group rank 1 rejected the call", and the buffers stay
    usable. After it, rank 1 re-raises it and its buffer and group refuse later calls and constructions; the peers
    raise `PeerFailed` naming rank 1, the call and its error within a few seconds, not after the timeout. Returns
    (first error, seconds to it, [next dispatch, a new EPBuffer, a new BucketBuffer on the group]). `internal`: a
    ValueError of the code's own (a bug) rather than out of memory, which is this rank's too, not raised on every
    rank by the call's agreement (gloo aborted the peers when it was taken for one)."""
    import epcomm.pipeline as pipeline
    import epcomm.resolve as resolve

    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=timeout_s)
    x, idx, w = _inputs(rank)
    recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E)  # a call that works first
    if rank == 1:
        owner, name = {"resolve": (resolve, "resolve_dispatch"), "move": (pipeline, "_move_fields"),
                       "combine": (pipeline, "_return_fields")}[where]
        original = getattr(owner, name)

        def out_of_memory(*args, **kwargs):
            if internal:
                raise ValueError("an internal error (injected)")
            raise torch.OutOfMemoryError("CPU out of memory (injected)")
        setattr(owner, name, out_of_memory)
    start = time.monotonic()
    try:
        if where == "combine":
            buf.combine(recv_x, handle)
        else:
            buf.dispatch(x, idx, w, num_experts=E)
        return "no error"
    except (torch.OutOfMemoryError, TimeoutError, ValueError) as e:
        first, elapsed = f"{type(e).__name__}: {e}", time.monotonic() - start
    if rank == 1:
        setattr(owner, name, original)
    outcome = []
    for make in (lambda: buf.dispatch(x, idx, w, num_experts=E)[0],  # the buffer
                 lambda: epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H),  # another one on the group
                 lambda: epcomm.BucketBuffer(None, 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=20)):
        try:
            made = make()
            if isinstance(made, epcomm.BucketBuffer):
                made.destroy()
            outcome.append("no error")
        except ValueError as e:
            outcome.append(str(e))
    return first, elapsed, outcome


def low_latency_failure_mid_call(rank: int, world: int, timeout_s: float):
    """Rank 1 runs out of memory in the FP8 cast of a low-latency dispatch (portable path, after the call's own
    header): it re-raises, its buffer refuses the next call, and the peers, already in the dispatch that follows,
    raise PeerFailed naming it within a few seconds."""
    import epcomm.lowlatency as lowlatency

    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=128, num_cpu_timeout_secs=timeout_s)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 128, generator=gen).bfloat16()
    idx = torch.rand(6, E, generator=gen).topk(K, dim=1).indices
    buf.low_latency_dispatch(x, idx, N, E, use_fp8=True)  # a call that works first
    if rank == 1:
        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("CPU out of memory (injected)")
        lowlatency.per_token_cast_to_fp8 = out_of_memory
    start = time.monotonic()
    try:
        buf.low_latency_dispatch(x, idx, N, E, use_fp8=True)
        return "no error"
    except (torch.OutOfMemoryError, TimeoutError) as e:
        first, elapsed = f"{type(e).__name__}: {e}", time.monotonic() - start
    try:
        buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
        after = "no error"
    except ValueError as e:
        after = str(e)
    return first, elapsed, after


def collective_failure_mid_call(rank: int, world: int, timeout_s: float, which: str):
    """Rank 1 runs out of memory after the ranks agreed on a call, while its data moves: a BucketBuffer all-gather
    ("bucket"), an EngramBuffer fetch ("engram", after the row ids went out) or write ("engram-write", copying its
    rows in) or a load-balancing weight prefetch ("lb"). It re-raises, its buffer and process group refuse later calls; its peers, waiting in a collective it
    never joins, raise `PeerFailed` naming it within a few seconds rather than at their timeout. Returns (first
    error, seconds to it, the next call's outcome)."""
    import epcomm.bucket_placement as bucket_placement
    import epcomm.engram as engram
    import epcomm.lb as lb
    from lb_cases import make_mapping

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CPU out of memory (injected)")

    gen = torch.Generator().manual_seed(rank)
    if which == "bucket":
        buf = epcomm.BucketBuffer(None, 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=timeout_s)
        words = buf.storage.view(torch.float32)  # buckets are views of the buffer's storage
        src, dst = words[:64], words[64: 64 + 64 * world]
        src.copy_(torch.randn(64, generator=gen))
        buf.all_gather([src], [dst]).wait()  # a call that works first
        owner, name = bucket_placement, "_all_gather"
        call = lambda: buf.all_gather([src], [dst]).wait()  # noqa: E731
    elif which.startswith("engram"):
        entries, hidden, tokens, per_token = [40], 16, 4, 3  # 40 rows of the table per rank
        gpu, storage = epcomm.EngramBuffer.get_storage_size_hint(None, entries, hidden, tokens, per_token,
                                                                 torch.bfloat16, 0)
        buf = epcomm.EngramBuffer(None, gpu, storage, False, 1, 1, explicitly_destroy=True,
                                  num_cpu_timeout_secs=timeout_s)
        buf.set_config(entries, hidden, tokens, per_token, torch.bfloat16, 0)
        buf.write([torch.randn(40, hidden, generator=gen).bfloat16()])
        idx = torch.randint(0, 40 * world, (1, tokens, per_token), generator=gen).int()  # [layers, T, per token]
        buf.fetch(idx)  # a call that works first
        owner, name = engram, "transfer_word"  # after the row ids went out, before the rows come back
        call = lambda: buf.fetch(idx)  # noqa: E731
        if which == "engram-write":  # copying this rank's rows in, before the barrier after them
            owner, name = engram.sizing, "dense_strides"
            call = lambda: buf.write([torch.randn(40, hidden, generator=gen).bfloat16()])  # noqa: E731
    else:
        num_local, num_slots, nbytes = 2, 3, 64
        plan = epcomm.BufferAllocator()
        red = plan.allocate((num_slots, nbytes), torch.uint8)
        orig = torch.randint(0, 255, (num_local, nbytes), generator=gen, dtype=torch.uint8)
        mapping = make_mapping("ring", world, num_local, num_slots)
        buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=timeout_s,
                              lb_allocation_plan_or_num_bytes=plan)
        buf.lb_prefetch_weights(red, orig, mapping).current_stream_wait()  # a call that works first
        owner, name = lb, "lb_routes"
        call = lambda: buf.lb_prefetch_weights(red, orig, mapping).current_stream_wait()  # noqa: E731
    if rank == 1:
        original = getattr(owner, name)
        setattr(owner, name, out_of_memory)
    start = time.monotonic()
    try:
        call()
        first, elapsed = "no error", time.monotonic() - start
    except (torch.OutOfMemoryError, TimeoutError) as e:
        first, elapsed = f"{type(e).__name__}: {e}", time.monotonic() - start
    if rank == 1:
        setattr(owner, name, original)
    try:
        call()
        after = "no error"
    except ValueError as e:
        after = str(e)
    return first, elapsed, after


def late_rank_with_bad_value(rank: int, world: int, timeout_s: float):
    """Rank 1 calls dispatch after rank 0 has given up waiting for it, with a bad expert id: its header exchange
    pairs with rank 0's abandoned one and shows its own failure, and the message gather that follows is bounded
    too: rank 1 raises a timeout naming rank 0 within its own timeout instead of waiting while rank 0 lives."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=timeout_s)
    x, idx, w = _inputs(rank)
    if rank == 1:
        time.sleep(timeout_s + 1)
        idx = idx.clone()
        idx[0, 0] = E + 5
    start = time.monotonic()
    try:
        buf.dispatch(x, idx, w, num_experts=E)
        outcome = "returned"
    except (TimeoutError, ValueError) as e:
        outcome = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - start
    if rank == 0:
        time.sleep(timeout_s + 6)  # alive (and out of the collective) until rank 1 is done
    return outcome, elapsed


def missing_at_construction(rank: int, world: int, timeout_s: float):
    """Rank 1 never constructs the buffer: rank 0's constructor raises TimeoutError naming it."""
    if rank == 1:
        time.sleep(timeout_s + 4)
        return "skipped"
    try:
        epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=timeout_s)
    except TimeoutError as e:
        return str(e)
    return None


def construct_one_bad(rank: int, world: int, kind: str):
    """Rank 1 passes a bad constructor argument (or another transport): every rank must raise."""
    kwargs = dict(num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=20)
    if rank == 1:
        kwargs.update({"num_bytes": dict(num_bytes=1000), "timeout": dict(num_cpu_timeout_secs=-1),
                       "timeout_type": dict(num_cpu_timeout_secs="5"), "dtype": dict(dtype=torch.int8),
                       "transport": dict(transport="collective"),
                       "tokens": dict(num_max_tokens_per_rank=N + 1),
                       "size": dict(num_bytes=4 << 20), "hidden": dict(hidden=2 * H), "topk": dict(num_topk=4),
                       "topk_default": dict(num_topk=32), "topk_33": dict(num_topk=33),
                       "topk_type": dict(num_topk=8.0), "tokens_type": dict(num_max_tokens_per_rank=8.5),
                       "hidden_type": dict(hidden="64"), "bytes_type": dict(num_bytes=float(4 << 20)),
                       "half": dict(dtype=torch.float16), "fp8": dict(use_fp8_dispatch=True),
                       "reduction": dict(allow_multiple_reduction=False),
                       "tokens_negative": dict(num_max_tokens_per_rank=-1),
                       # DeepEP V1's Buffer(group, num_nvl_bytes, num_rdma_bytes), positionally
                       "v1_bytes": dict(num_bytes=256 << 20, num_max_tokens_per_rank=1 << 30)}.get(kind, {}))
    if rank == 0 and kind == "transport":
        kwargs["transport"] = "auto"
    env, value = {"env": ("EPCOMM_FUSED_SYNC_FREE_ROWS", "4k"), "env_return": ("EPCOMM_NVLINK_RETURN", "fetch"),
                  "env_chunks": ("EPCOMM_RETURN_CHUNKS", "0"), "env_differs": ("EPCOMM_PULL_CHUNKS", "2"),
                  "env_debug": ("EPCOMM_DEBUG", "maybe"),
                  "env_choice_differs": ("EPCOMM_NVLINK_RETURN", "pull")}.get(kind, (None, None))
    if rank == 1 and env is not None:
        os.environ[env] = value
    start = time.monotonic()
    try:
        epcomm.EPBuffer(None, **kwargs)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e), time.monotonic() - start
    finally:
        if env is not None:
            os.environ.pop(env, None)
    return None


def barrier_vs_dispatch(rank: int, world: int):
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=20)
    x, idx, w = _inputs(rank)
    try:
        if rank == 0:
            buf.barrier()
        else:
            buf.dispatch(x, idx, w, num_experts=E)
    except ValueError as e:
        return str(e)
    return None


def grad_warning(rank: int, world: int):
    """The warning of each way an input may require grad: x, FP8 scales, a combine's bias (each on a fresh buffer,
    since a buffer warns once per call kind); and a bias pair with a None."""
    import warnings
    out = {}
    x, idx, w = _inputs(rank)
    data, sf = per_token_cast_to_fp8(x.double())
    for name in ("x", "scales", "bias"):
        buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if name == "x":
                buf.dispatch(x.float().requires_grad_(), idx, w, num_experts=E)
            elif name == "scales":
                buf.dispatch((data, sf.requires_grad_()), idx, w, num_experts=E)
            else:
                recv_x, _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=E)
                buf.combine(recv_x, handle, bias=torch.zeros_like(x).requires_grad_())
        out[name] = [str(c.message) for c in caught]
        if name == "bias":  # (b, None) and (None, b) are b alone (a missing bias adds 0)
            b = torch.randn(x.shape, dtype=x.dtype)
            want = buf.combine(recv_x, handle, bias=b)[0]
            out["pairs"] = [torch.equal(buf.combine(recv_x, handle, bias=pair)[0], want) for pair in ((b, None),
                                                                                                    (None, b))]
        buf.destroy()
    return out


def two_offenders(rank: int, world: int):
    """Ranks 1 and 2 of 3 pass different bad arguments (a float topk_idx; more tokens than N): each raises its own
    error, and rank 0 names both with their messages."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H)
    num_tokens = N + 1 if rank == 2 else 6
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(num_tokens, H, generator=gen).bfloat16()
    idx = torch.rand(num_tokens, 6, generator=gen).topk(K, dim=1).indices
    try:
        buf.dispatch(x, idx.float() if rank == 1 else idx, None, num_experts=6)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    finally:
        buf.destroy()
    return None


def calls_of_other_kinds(rank: int, world: int, pair: str):
    """Rank 0 makes one call and rank 1 another of a different kind, on one buffer or on two buffers of one group
    (rows of other widths, which gloo would abort on): what each rank raised, then a dispatch both make after."""
    ep = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=30)
    bucket = epcomm.BucketBuffer(None, 2 << 20, num_cpu_timeout_secs=30)
    engram = epcomm.EngramBuffer(None, 2 << 20, 2 << 20, num_cpu_timeout_secs=30)
    engram.set_config([2], 8, 2, 1)
    pp = epcomm.PPBuffer(None, 64, 1, num_cpu_timeout_secs=30)
    x, idx, w = _inputs(rank)
    lb_args = (torch.zeros(1, 2), torch.zeros(2, 2), torch.tensor([[(r + 1) % world * 2] for r in range(world)],
                                                                  dtype=torch.int32))
    calls = {
        "dispatch": lambda: ep.dispatch(x, idx, w, num_experts=E),
        "barrier": lambda: ep.barrier(),
        "lb_prefetch_weights": lambda: ep.lb_prefetch_weights(*lb_args),
        "bucket.all_reduce": lambda: bucket.all_reduce(bucket.storage[:16 * world].view(torch.float32)).wait(),
        "bucket.barrier": lambda: bucket.barrier(),
        "engram.fetch": lambda: engram.fetch(torch.zeros(1, 2, 1, dtype=torch.int64))[0](),
        "engram.set_config": lambda: engram.set_config([2], 8, 2, 1),
        "pp.destroy": lambda: pp.destroy(),
    }
    try:
        calls[pair.split(" vs ")[rank]]()
        raised = None
    except ValueError as e:
        raised = str(e)
    after = ep.dispatch(x, idx, w, num_experts=E)[0].shape[0]  # in step: the failed call's id was taken back
    for buf in (ep, bucket, engram, pp):
        buf.destroy()
    return raised, after


def construct_two_bad(rank: int, world: int):
    """Ranks 1 and 2 of 3 pass different bad constructor arguments: what each raised."""
    bad = {1: dict(num_bytes=1000), 2: dict(num_cpu_timeout_secs=-1)}.get(rank, {})
    try:
        epcomm.EPBuffer(None, **(dict(num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=20) | bad))
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def numpy_ints(rank: int, world: int):
    """numpy integers where ints are asked for (num_experts, expert_alignment, the constructor's sizes): the same
    results as Python ints."""
    import numpy as np

    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=np.int64(N), hidden=np.int32(H), num_cpu_timeout_secs=20)
    x, idx, w = _inputs(rank)
    want = buf.dispatch(x, idx, w, num_experts=E, do_expand=True, expert_alignment=2)
    got = buf.dispatch(x, idx, w, num_experts=np.int64(E), do_expand=True, expert_alignment=np.int32(2))
    for a, b in ((want[0], got[0]), (want[2], got[2])):
        assert torch.equal(a, b)
    assert got[3].num_experts == E and type(got[3].num_experts) is int
    return True


def per_call_disagreements(rank: int, world: int):
    """The last rank of the group differs from the others in one per-call argument at a time (the top-k width,
    an FP8 x beside bf16 x, topk_weights given or not, in dispatch and in combine): every rank raises a
    ValueError at once (no hang), and a good call after each works on every rank. Returns, per case, the class
    name, the message and the seconds the failed call took."""
    buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=20)
    odd = rank == world - 1
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(6 + rank, H, generator=gen).bfloat16()
    experts = 4 * world
    scores = torch.rand(x.shape[0], experts, generator=gen)
    idx = {k: scores.topk(k, dim=1).indices for k in (K, K + 1)}
    w = {k: torch.rand(x.shape[0], k, generator=gen) for k in (K, K + 1)}
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, idx[K], w[K], num_experts=experts)
    cases = {
        "topk": lambda: buf.dispatch(x, idx[K + 1 if odd else K], w[K + 1 if odd else K], num_experts=experts),
        "fp8": lambda: buf.dispatch(per_token_cast_to_fp8(x.double()) if odd else x, idx[K], w[K], num_experts=experts),
        "weights": lambda: buf.dispatch(x, idx[K], None if odd else w[K], num_experts=experts),
        "combine_weights": lambda: buf.combine(recv_x, handle, topk_weights=None if odd else recv_w),
    }
    out = {}
    for name, call in cases.items():
        start = time.monotonic()
        try:
            call()
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = (type(e).__name__, str(e), time.monotonic() - start)
        got = buf.dispatch(x, idx[K], w[K], num_experts=experts)  # in step after the failed call
        assert torch.equal(got[0], recv_x), f"{name}: the next dispatch differs"
    buf.destroy()
    return out


def missing_peer_in_subgroup(rank: int, world: int, timeout_s: float):
    """On the subgroup of global ranks [1, 2], global rank 2 never dispatches: global rank 1's timeout names it by
    its group rank and its global rank."""
    sub = torch.distributed.new_group([1, 2])
    if rank == 0:
        return None
    buf = epcomm.EPBuffer(sub, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=timeout_s)
    if rank == 2:
        time.sleep(timeout_s + 4)
        return "skipped"
    x, idx, w = _inputs(rank)
    try:
        buf.dispatch(x, idx, w, num_experts=E)
    except TimeoutError as e:
        return str(e)
    return "no error"


def rejected_in_subgroup(rank: int, world: int, timeout_s: float):
    """On the subgroup of global ranks [1, 2], global rank 2 passes an expert id out of range: global rank 1's
    "rejected" message names it by its group rank and its global rank. Returns each rank's message."""
    sub = torch.distributed.new_group([1, 2])
    if rank == 0:
        return None
    buf = epcomm.EPBuffer(sub, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=timeout_s)
    x, idx, w = _inputs(rank)
    if rank == 2:
        idx = idx.clone()
        idx[0, 0] = E  # out of range
    try:
        buf.dispatch(x, idx, w, num_experts=E)
    except ValueError as e:
        return str(e)
    finally:
        buf.destroy()
    return "no error"


def collective_error_before_header(rank: int, world: int, which: str):
    """Rank 1's error before the ranks agree on a call travels in the call's header as a bad argument does: a
    conjugate view that torch refuses to reinterpret as bytes (a RuntimeError) in a bucket all-gather ("conj"), out
    of memory while a bucket all-reduce is checked ("bucket-oom") or while an Engram fetch plans its rows
    ("engram-oom"). Rank 1 raises its error, rank 0 "group rank 1 rejected the call"; nothing is left pending, so
    the next call is right on both. Returns (first outcome, next call's result)."""
    import epcomm.bucket_placement as bucket_placement
    import epcomm.engram as engram

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CPU out of memory (injected)")

    if which.startswith("engram"):
        hidden, tokens, per_token = 16, 4, 3
        gpu, storage = epcomm.EngramBuffer.get_storage_size_hint(None, [8], hidden, tokens, per_token,
                                                                 torch.bfloat16, 0)
        buf = epcomm.EngramBuffer(None, gpu, storage, False, 1, 1, explicitly_destroy=True, num_cpu_timeout_secs=20)
        buf.set_config([8], hidden, tokens, per_token, torch.bfloat16, 0)
        table = torch.arange(8 * world * hidden, dtype=torch.float32).view(8 * world, hidden).bfloat16()
        buf.write([table[rank * 8:(rank + 1) * 8]])
        idx = torch.tensor([[[1, 9, 2], [15, 0, 8], [3, 3, 12], [7, 10, 4]]], dtype=torch.int32)
        owner, name = engram, "plan"
        call = lambda: buf.fetch(idx)[0]()  # noqa: E731
        result = lambda out: bool(torch.equal(out.reshape(-1, hidden), table[idx.view(-1).long()]))  # noqa: E731
    else:
        buf = epcomm.BucketBuffer(None, 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=20)
        if which == "conj":
            shard = buf.storage.view(torch.complex64)[rank * 4:(rank + 1) * 4]
            shard.fill_(rank + 1)
            call = lambda: buf.all_gather(shard.conj() if rank == 1 and first else shard).wait()  # noqa: E731
            result = lambda out: out.real.tolist()  # noqa: E731
            owner = None
        else:
            x = buf.storage.view(torch.float32)[:16]  # reductions move 32-byte shards
            x.fill_(rank + 1)
            owner, name = bucket_placement, "_check_disjoint"
            call = lambda: buf.all_reduce(x).wait()  # noqa: E731
            result = lambda out: out.tolist()  # noqa: E731
    first = True
    if rank == 1 and owner is not None:
        original = getattr(owner, name)
        setattr(owner, name, out_of_memory)
    try:
        call()
        outcome = "no error"
    except (RuntimeError, ValueError, TypeError, TimeoutError) as e:
        outcome = f"{type(e).__name__}: {e}"
    if rank == 1 and owner is not None:
        setattr(owner, name, original)
    first = False
    out = result(call())
    buf.destroy()
    return outcome, out


def two_bucket_buffers(rank: int, world: int):
    """Rank 0 calls all_reduce on buffer A while rank 1 calls it on buffer B, with the same sizes: every rank
    raises instead of summing one buffer's data with the other's."""
    a = epcomm.BucketBuffer(None, 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=20)
    b = epcomm.BucketBuffer(None, 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=20)
    buf = a if rank == 0 else b
    buf.storage.view(torch.float32)[:16].fill_(1.0)  # reductions move 32-byte shards
    try:
        buf.all_reduce(buf.storage.view(torch.float32)[:16]).wait()
        outcome = "no error"
    except ValueError as e:
        outcome = str(e)
    for t in (a, b):
        t.storage.view(torch.float32)[:16].fill_(1.0)
    sums = [float(t.all_reduce(t.storage.view(torch.float32)[:16]).wait()[0]) for t in (a, b)]  # both usable
    a.destroy(), b.destroy()
    return outcome, sums


def destroy_after_failure(rank: int, world: int):
    """After rank 1's mid-call failure in an EPBuffer dispatch broke the group, every buffer's destroy() frees its
    local memory without a collective on the broken group (a PP destroy's exchange aborted the peer in gloo)."""
    import epcomm.pipeline as pipeline

    ep = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_cpu_timeout_secs=20)
    bucket = epcomm.BucketBuffer(None, 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=20)
    pp = epcomm.PPBuffer(None, 1 << 20, 2, num_cpu_timeout_secs=20)
    x, idx, w = _inputs(rank)
    if rank == 1:
        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("CPU out of memory (injected)")
        pipeline._move_fields = out_of_memory
    try:
        ep.dispatch(x, idx, w, num_experts=E)
        first = "no error"
    except (torch.OutOfMemoryError, TimeoutError) as e:
        first = type(e).__name__
    outcomes = [first]
    for buf in (bucket, pp, ep):
        try:
            buf.destroy()
            outcomes.append("destroyed")
        except Exception as e:  # noqa: BLE001 -- the outcome is the test's result
            outcomes.append(f"{type(e).__name__}: {e}")
    return outcomes


def failure_after_last_collective(rank: int, world: int, timeout_s: float):
    """Rank 1 runs out of memory in a BucketBuffer reduce-scatter after the call's collectives (its peers complete
    it); then every rank calls all_reduce on a second BucketBuffer of the group. Returns (first call, second call,
    seconds the second took)."""
    import epcomm.bucket_placement as bucket_placement

    a = epcomm.BucketBuffer(None, 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=timeout_s)
    b = epcomm.BucketBuffer(None, 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=timeout_s)
    xa, xb = a.storage.view(torch.float32)[:16 * world], b.storage.view(torch.float32)[:16 * world]
    xa.fill_(rank + 1), xb.fill_(rank + 1)
    if rank == 1:
        class OutOfMemory:  # the call's event, made after its collectives: EventHandle(...) or .completed()
            def __init__(self, *args, **kwargs):
                raise torch.OutOfMemoryError("CPU out of memory (injected)")

            @classmethod
            def completed(cls):
                return cls()
        bucket_placement.EventHandle = OutOfMemory
    outcomes = []
    for call in (lambda: a.reduce_scatter(xa).wait(), lambda: b.all_reduce(xb).wait()):
        start = time.monotonic()
        try:
            call()
            outcomes.append("no error")
        except (torch.OutOfMemoryError, TimeoutError, ValueError) as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    return outcomes[0], outcomes[1], time.monotonic() - start


def barriers_of_two_buffers(rank: int, world: int):
    """Two EPBuffers of one group, the first used once more: rank 0 calls the first one's barrier, rank 1 the
    second's. Their call numbers differ too; the message must say that the buffers differ. Returns the message."""
    a = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, explicitly_destroy=True)
    b = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, explicitly_destroy=True)
    x, idx, w = _inputs(rank)
    a.dispatch(x, idx, w, num_experts=E)
    try:
        (a if rank == 0 else b).barrier()
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        a.destroy()
        b.destroy()


def late_bucket_peer(rank: int, world: int, timeout_s: float):
    """As `late_peer`, on a BucketBuffer: rank 1's first exchange may pair with the one rank 0 abandoned and go on
    to its next collective, so the record of who gave up is per buffer, not per collective. Returns (message,
    seconds in the call)."""
    from epcomm import BucketBuffer

    buf = BucketBuffer(None, 2 << 20, num_cpu_timeout_secs=timeout_s)
    x = buf.storage[:256].view(torch.float32)
    x.fill_(1.0)
    if rank == 1:
        time.sleep(timeout_s + 3)
    start = time.monotonic()
    try:
        buf.all_reduce(x).wait()
    except TimeoutError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


def routing_edited_before_deferred_wait(rank: int, world: int):
    """Rank 1 edits `topk_idx` in place between a deferred call and its first wait(): the wait raises there (the
    epilogue reads the routing then; it used to return wrong combined weights, or a wrong per-pair combine, or a
    gloo abort); rank 0 waits normally, and the next calls are right on both. Returns per case: (rank 1's error or
    None, whether the following dispatch + combine equals the reference)."""
    import epcomm.reference as ref
    out = {}
    for which in ("dispatch", "combine"):
        for expand, amr in ((False, True), (True, True), (True, False)):
            buf = epcomm.EPBuffer(None, num_max_tokens_per_rank=N, hidden=H, num_topk=K, num_cpu_timeout_secs=20,
                                  allow_multiple_reduction=amr)
            x, idx, w = _inputs(rank)
            kw = dict(async_with_compute_stream=True, defer_epilogue=True)
            err = None
            try:
                if which == "dispatch":
                    event = buf.dispatch(x, idx, w, num_experts=E, do_expand=expand, **kw)
                else:
                    recv_x, _, recv_w, h, _ = buf.dispatch(x, idx, w, num_experts=E, do_expand=expand)
                    event = buf.combine(recv_x, h, None if expand and not amr else recv_w, **kw)
                if rank == 1:
                    idx[0] = idx[0].flip(0)  # in place, before the wait
                event.wait()
            except ValueError as e:
                err = str(e)
                try:  # a second wait says the first one failed (it returned None)
                    event.wait()
                    err += " | second wait returned"
                except ValueError as again:
                    err += " | " + str(again)
            x, idx, w = _inputs(rank)
            recv_x, _, recv_w, h, _ = buf.dispatch(x, idx, w, num_experts=E, do_expand=expand)
            cw = None if expand and not amr else recv_w
            y, yw, _ = buf.combine(recv_x, h, cw)
            r = ref.dispatch(x, idx, w, E, num_max_tokens_per_rank=N, do_expand=expand)
            want = ref.combine(r[0], r[3], None if cw is None else r[2], allow_multiple_reduction=amr)
            same = torch.equal(y, want[0]) and (yw is None) == (want[1] is None) and (yw is None or
                                                                                    torch.equal(yw, want[1]))
            out[(which, expand, amr)] = (err, same)
            buf.destroy()
    return out
