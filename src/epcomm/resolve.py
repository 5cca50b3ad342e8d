"""Argument resolution of dispatch and combine: reference §9.1-9.2 and §11.1 as amended by docs/decisions.md.

Every check runs here, once, before any data moves; the results are the `DispatchCall` / `CombineCall` the data
path (`pipeline.py`) consumes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from . import layout, pipeline, sizing, streams
from .handle import EPHandle
from .validate import (Checker, check_capacity, check_topk_idx, check_topk_values, check_weights_dtype, check_x,
                       weights_dtype)


def resolve_dispatch(buf, c: Checker, x, topk_idx, topk_weights, stats, num_experts, n, expert_alignment, num_sms,
                      num_qps, handle, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding, emit_expert_ids,
                      col_major_sf, defer_value_checks: bool = False) -> pipeline.DispatchCall:
    """Reference §9.1-9.2 in order, as amended by docs/decisions.md. `defer_value_checks`: a CPU-synced call on GPU
    leaves the value checks of `topk_idx` (one host read) to its caller (the fused nvlink path runs them on the
    device and reports them with the counts, exact_nvlink.py); a call whose `topk_idx` values and another argument
    are both wrong then reports the other one."""
    c.require(not do_handle_copy, "do_handle_copy must be False (legacy option)")
    if do_expand is None:
        do_expand = handle.do_expand if isinstance(handle, EPHandle) else False
    for name, flag in (("do_expand", do_expand), ("do_zero_padding", do_zero_padding),
                       ("emit_expert_ids", emit_expert_ids), ("do_cpu_sync", do_cpu_sync)):
        if flag is not None and not isinstance(flag, (bool, int)):  # ints 0/1 pass, as bools do in torch code
            c.fail(TypeError, f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
    do_expand, do_zero_padding, emit_expert_ids = bool(do_expand), bool(do_zero_padding), bool(emit_expert_ids)
    x = tuple(map(_payload, x)) if isinstance(x, tuple) else _payload(x)
    topk_idx, topk_weights = sizing.dense_strides(topk_idx), _payload(topk_weights)
    xs = check_x(c, x, allow_fp8=True)
    warn_if_grad(buf, "dispatch", xs.data, xs.sf, topk_weights)
    if handle is not None:
        if not isinstance(handle, EPHandle):
            c.fail(TypeError, f"handle must be an EPHandle from dispatch, got {type(handle).__name__}")
        c.require(handle._buffer_uid == buf.uid, "handle comes from another EPBuffer; use the handle returned "
                                                  "by this buffer's dispatch")
        c.require(topk_idx is None, "topk_idx must be None when handle is given (the handle holds the routing)")
        c.require(not do_cpu_sync, f"do_cpu_sync must be None or False with handle (cached dispatch reuses the "
                                   f"handle's sizes), got {do_cpu_sync}")
        c.require(stats is None, "cumulative_local_expert_recv_stats must be None with handle (counted once, "
                                 "by the non-cached dispatch)")
        c.require(not emit_expert_ids, "emit_expert_ids needs a non-cached dispatch (the ids are in the handle)")
        for arg, value, want in (("num_experts", num_experts, handle.num_experts),
                                 ("num_max_tokens_per_rank", n, handle.num_max_tokens_per_rank),
                                 ("expert_alignment", expert_alignment, handle.expert_alignment),
                                 ("do_expand", do_expand, handle.do_expand)):
            if value is not None and arg != "do_expand":
                value = c.integer(arg, value)
            c.require(value is None or value == want, f"{arg}={value} does not match the handle's {arg}={want}; "
                                                      "pass the values of the dispatch that made the handle")
        try:
            topk_idx = handle.topk_idx
        except ValueError as e:
            c.fail(ValueError, str(e))
        num_experts, n, expert_alignment = handle.num_experts, handle.num_max_tokens_per_rank, \
            handle.expert_alignment
        do_cpu_sync = False
        c.require(xs.num_tokens == topk_idx.shape[0], f"x has {xs.num_tokens} tokens but the handle's dispatch "
                                                      f"had {topk_idx.shape[0]}")
    else:
        if num_experts is None:
            hint = ""
            if isinstance(stats, int) and not isinstance(stats, bool):  # dispatch(x, idx, w, E): E went to the stats
                hint = (f"; cumulative_local_expert_recv_stats (the fourth positional argument) got the int {stats}: "
                        f"pass num_experts={stats} by keyword")
            c.fail(ValueError, "num_experts is required for a non-cached dispatch" + hint)
        num_experts = c.num_experts(num_experts, buf.num_ranks)
        n = buf.num_max_tokens_per_rank if n is None else c.integer("num_max_tokens_per_rank", n)
        c.require(n > 0, f"num_max_tokens_per_rank must be > 0 (pass it to dispatch or EPBuffer), got {n}")
        expert_alignment = c.positive_int("expert_alignment", 1 if expert_alignment is None else expert_alignment)
        do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        topk_idx = check_topk_idx(c, topk_idx, xs.num_tokens)
        # An inference tensor has no version counter to guard (EPHandle): keep the routing the rows are laid by.
        # Not in a CUDA graph: its routing is a static input the caller overwrites before each replay (one copy
        # node per dispatch would cost the decode step ~2 us).
        if topk_idx.is_inference() and not streams.capturing(topk_idx.device):
            topk_idx = topk_idx.clone()
        if buf.device.type == "cpu" or (do_cpu_sync and not defer_value_checks):
            check_topk_values(c, topk_idx, num_experts)
    c.require(not do_zero_padding or do_expand, "do_zero_padding=True requires do_expand=True")
    c.require(not emit_expert_ids or do_expand, "emit_expert_ids=True requires do_expand=True")
    num_topk = topk_idx.shape[1]
    if handle is None:  # expanded-row positions and per-expert prefix sums are int32 (handle, plan kernels)
        num_local = num_experts // buf.num_ranks
        worst = layout.worst_case_expanded_rows(buf.num_ranks, n, num_topk, num_local, expert_alignment)
        c.require(worst < 2 ** 31, f"expert_alignment={expert_alignment}, num_max_tokens_per_rank={n}: with "
                                   f"{num_local} local experts and {buf.num_ranks} ranks the aligned rows could "
                                   f"reach {worst}, past the int32 row indices of the layout (2^31 - 1); use a "
                                   "smaller alignment or token count")
    if topk_weights is not None:
        check_weights_dtype(c, "topk_weights", topk_weights, xs.data.dtype)
        c.tensor("topk_weights", topk_weights, ndim=2, dtypes=(weights_dtype(xs.data.dtype),),
                 shape=(xs.num_tokens, num_topk))
    if stats is not None:
        c.tensor("cumulative_local_expert_recv_stats", stats, ndim=1, dtypes=(torch.int32,),
                 shape=(num_experts // buf.num_ranks,))
        c.require(stats.numel() <= 1 or stats.stride(0) != 0,  # added to in place: one element per local expert
                  "cumulative_local_expert_recv_stats has stride 0 (an expanded view: its elements share one "
                  "memory location), but each local expert's count is added to its own element; pass a tensor "
                  "with distinct elements (e.g. .clone())")
    elem = 2 if xs.is_fp8 else xs.data.dtype.itemsize
    check_capacity(c, buf, num_tokens=xs.num_tokens, hidden=xs.hidden, num_topk=num_topk, is_fp8=xs.is_fp8,
                   elem_size=elem, n=n, which="dispatch")
    num_sms = resolve_sms(buf, c, num_sms, num_qps, num_experts, num_topk)
    return pipeline.DispatchCall(
        x=xs, topk_idx=topk_idx, topk_weights=topk_weights, stats=stats, num_experts=num_experts, n=n,
        expert_alignment=expert_alignment, do_cpu_sync=do_cpu_sync, do_expand=do_expand,
        do_zero_padding=do_zero_padding, emit_expert_ids=emit_expert_ids, col_major_sf=col_major_sf,
        num_sms=num_sms, handle=handle)

def resolve_sms(buf, c: Checker, num_sms: int, num_qps: int, num_experts: int, num_topk: int,
                default: Optional[int] = None) -> int:
    """`num_sms` checked; 0 resolves to `default` (combine: the handle's, reference §11.1) or, without one,
    `get_theoretical_num_sms`."""
    num_qps = c.integer("num_qps", num_qps)
    c.require(0 <= num_qps <= buf.num_allocated_qps,
              f"num_qps={num_qps} must be in [0, num_allocated_qps={buf.num_allocated_qps}]")
    num_sms = c.integer("num_sms", num_sms)
    c.require(num_sms >= 0, f"num_sms must be an int >= 0 (0 = get_theoretical_num_sms), got {num_sms!r}")
    if buf.device.type == "cpu":
        if num_sms:
            buf._warn_once("num_sms", "epcomm: num_sms has no effect on CPU; it is ignored")
        return num_sms or default or buf.get_theoretical_num_sms(num_experts, num_topk)
    if num_sms == 0:
        return default or buf.get_theoretical_num_sms(num_experts, num_topk)
    device_sms = sizing.device_sms(buf.device)
    c.require(0 < num_sms <= device_sms, f"num_sms={num_sms} must be in [1, {device_sms}] on {buf.device}")
    return num_sms + num_sms % 2

def resolve_combine(buf, c: Checker, x, handle, topk_weights, bias, num_sms, num_qps) -> pipeline.CombineCall:
    """Reference §11.1 as amended by docs/decisions.md."""
    if not isinstance(handle, EPHandle):
        c.fail(TypeError, f"handle must be an EPHandle from dispatch, got {type(handle).__name__}")
    c.require(handle._buffer_uid == buf.uid, "handle comes from another EPBuffer; combine with the buffer "
                                              "that dispatched")
    try:
        topk_idx = handle.topk_idx
    except ValueError as e:
        c.fail(ValueError, str(e))
    x, topk_weights = _payload(x), _payload(topk_weights)
    x = check_x(c, x, allow_fp8=False).data
    rows = handle.num_expanded_tokens if handle.do_expand else handle.recv_src_metadata.shape[0]
    layout_name = "expand" if handle.do_expand else "non-expand"
    rows_of = "handle.num_expanded_tokens" if handle.do_expand else "the rows of handle.recv_src_metadata"
    c.require(x.shape[0] == rows, f"x has {x.shape[0]} rows but the handle's {layout_name} layout has {rows} "
                                  f"({rows_of})")
    per_pair = handle.do_expand and not buf.allow_multiple_reduction
    if topk_weights is not None:
        c.require(not per_pair, "topk_weights must be None for an expand-layout combine when the buffer has "
                                "allow_multiple_reduction=False (reference §11.1)")
        shape = (rows,) if handle.do_expand else (rows, handle.num_topk)
        check_weights_dtype(c, "topk_weights", topk_weights, x.dtype)
        c.tensor("topk_weights", topk_weights, ndim=len(shape), dtypes=(weights_dtype(x.dtype),), shape=shape)
    if bias is None:
        biases = ()
    elif isinstance(bias, Tensor):
        biases = (bias,)
    elif isinstance(bias, (tuple, list)):
        c.require(len(bias) == 2, f"bias as a tuple must be (bias_0, bias_1), got {len(bias)} elements")
        biases = tuple(b for b in bias if b is not None)  # a missing bias adds 0 (reference §11.2)
        names = [f"bias[{i}]" for i, b in enumerate(bias) if b is not None]
    else:
        c.fail(TypeError, f"bias must be None, a tensor or a pair of tensors, got {type(bias).__name__}")
    biases = tuple(map(sizing.dense_strides, biases))  # read as they are (a deferred combine reads them at wait)
    for i, b in enumerate(biases):
        c.tensor(names[i] if isinstance(bias, (tuple, list)) else "bias", b, ndim=2, dtypes=(x.dtype,),
                 shape=(topk_idx.shape[0], x.shape[1]))
    warn_if_grad(buf, "combine", x, topk_weights, *biases)
    check_capacity(c, buf, num_tokens=topk_idx.shape[0], hidden=x.shape[1], num_topk=handle.num_topk,
                   is_fp8=False, elem_size=x.dtype.itemsize, n=handle.num_max_tokens_per_rank,
                   which="combine")
    num_sms = resolve_sms(buf, c, num_sms, num_qps, handle.num_experts, handle.num_topk, default=handle.num_sms)
    biases = biases + (None,) * (2 - len(biases))
    return pipeline.CombineCall(x=x, handle=handle, topk_weights=topk_weights, bias_0=biases[0],
                                bias_1=biases[1], per_pair=per_pair, num_sms=num_sms)


def padded_if_narrowed(call: pipeline.CombineCall) -> pipeline.CombineCall:
    """A non-expand combine of a narrowed handle (`EPHandle`: `recv_src_metadata` cut to its first n rows): `x` and
    `topk_weights` of n rows, padded with zero rows to the dispatch's allocation, whose rows past n were not
    received. Called on the stream the combine runs on, so that the padding is ordered before it."""
    full = call.handle.full_recv_src_metadata.shape[0]
    rows = call.x.shape[0]
    if call.handle.do_expand or rows >= full:
        return call
    w = call.topk_weights
    return dataclasses.replace(
        call, x=torch.cat([call.x, call.x.new_zeros(full - rows, call.x.shape[1])]),
        topk_weights=None if w is None else torch.cat([w, w.new_zeros(full - rows, w.shape[1])]))


def narrowed_outputs(handle, outputs: tuple) -> tuple:
    """A cached non-expand dispatch on a narrowed handle returns the handle's rows: `(recv_x, recv_topk_idx,
    recv_topk_weights, handle)` cut to `recv_src_metadata.shape[0]` rows (views), so that its combine takes them."""
    rows = handle.recv_src_metadata.shape[0]
    if handle.do_expand or rows >= handle.full_recv_src_metadata.shape[0]:
        return outputs
    recv_x, recv_topk_idx, recv_w, out_handle = outputs
    recv_x = tuple(t[:rows] for t in recv_x) if isinstance(recv_x, tuple) else recv_x[:rows]
    return (recv_x, None if recv_topk_idx is None else recv_topk_idx[:rows],
            None if recv_w is None else recv_w[:rows], out_handle)


def warn_if_grad(buf, call: str, *tensors) -> None:
    """EPBuffer calls record no autograd graph; say so once instead of dropping gradients silently."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        buf._warn_once(f"grad-{call}", f"EPBuffer.{call}: inputs require grad but EPBuffer calls are not recorded "
                                       "by autograd; use epcomm.TokenDispatcher for training")


def _payload(t):
    """A row payload that travels (x, its scales, weights) with the strides and the start the word moves need."""
    return sizing.word_aligned(sizing.dense_strides(t))
