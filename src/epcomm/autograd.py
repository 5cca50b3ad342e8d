"""`TokenDispatcher`: differentiable dispatch and combine (docs/decisions.md "Autograd").

Each direction is a `torch.autograd.Function` whose backward is the other direction on the same handle:

    forward                                   backward
    dispatch(x, w) -> recv_x, recv_w          combine(grad_recv_x, handle, topk_weights=grad_recv_w)
                                                  -> grad_x, grad_w
    combine(expert_out, handle, bias) -> y    cached dispatch(grad_y, handle) -> grad_expert_out
                                              grad_bias = grad_y

Dispatch copies each token to the rows that need it and combine sums rows back per token, so the two are
adjoint: sum over ranks of <dispatch(x), y> equals sum over ranks of <x, combine(y)> (and likewise for the
router weights, which travel as `topk_weights`). Rows that the forward does not read or fill (alignment padding
of the expand layout, non-local weight columns of the non-expand layout) get a zero gradient, because cached
dispatch zeroes them and combine ignores them.

Every forward and every backward is a collective call: all ranks must run the same sequence of dispatches and
combines, and then the same backward through them. A backward always calls its collective, even when the local
incoming gradient of an output is undefined (it is replaced by zeros), so the ranks stay in lockstep.

Shape legend (docs/shapes.md): T tokens on this rank, H hidden, K top-k, M received rows (non-expand),
S expanded rows (expand).
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Optional, Union

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import sizing
from .buffer import EPBuffer
from .compile_guard import eager_under_compile
from .handle import EPHandle

__all__ = ["TokenDispatcher"]


def _grad_or_zeros(grad: Optional[Tensor], meta: tuple, device: torch.device) -> Tensor:
    """The incoming gradient, contiguous, or zeros of the forward output's `(shape, dtype)` when undefined."""
    if grad is None:
        shape, dtype = meta
        return torch.zeros(shape, dtype=dtype, device=device)
    return grad.contiguous()


class _DispatchFunction(torch.autograd.Function):
    """recv_x, recv_topk_weights = dispatch(x, topk_weights); backward = combine on the same handle."""

    @staticmethod
    def forward(ctx, x: Tensor, topk_weights: Optional[Tensor], buffer: EPBuffer, topk_idx: Tensor,
                num_experts: int, expert_alignment: int, do_expand: bool):
        recv_x, _, recv_w, handle, _ = buffer.dispatch(
            x, topk_idx, topk_weights, num_experts=num_experts, expert_alignment=expert_alignment,
            do_expand=do_expand)
        if not isinstance(x, Tensor):  # the buffer checked that every rank passed (data, scales): all raise here
            raise TypeError(f"TokenDispatcher.dispatch: rank {buffer.rank}: x must be a bf16/fp16/fp32/fp64 tensor, "
                            f"got {type(x).__name__}; FP8 (data, scales) input has no gradient: use "
                            "EPBuffer.dispatch for it")
        ctx.set_materialize_grads(False)
        ctx.buffer, ctx.handle = buffer, handle
        # Shapes and dtypes only: backward builds zeros from them when a gradient is undefined.
        ctx.recv_x_meta = (recv_x.shape, recv_x.dtype)
        ctx.recv_w_meta = None if recv_w is None else (recv_w.shape, recv_w.dtype)
        return recv_x, recv_w, handle

    @staticmethod
    @once_differentiable  # the backward's collectives are not themselves differentiable
    def backward(ctx, grad_recv_x, grad_recv_w, _grad_handle):
        device = ctx.buffer.device
        grad_recv_x = _grad_or_zeros(grad_recv_x, ctx.recv_x_meta, device)
        grad_recv_w = None if ctx.recv_w_meta is None else _grad_or_zeros(grad_recv_w, ctx.recv_w_meta, device)
        # Always collective, even when both local gradients are zero: the peers make the same call.
        with _named("the backward of TokenDispatcher.dispatch (an EPBuffer.combine)"):
            grad_x, grad_w, _ = ctx.buffer.combine(grad_recv_x, ctx.handle, topk_weights=grad_recv_w)
        return grad_x, grad_w, None, None, None, None, None


@contextlib.contextmanager
def _named(what: str):
    """An error of a backward's collective names the backward: the caller made no dispatch or combine there (a
    rank that skips `loss.backward()` leaves its peers waiting in it). Same class, `what` first."""
    try:
        yield
    except (TimeoutError, TypeError, ValueError) as e:
        try:
            named = type(e)(f"{what}: {e}")
        except Exception:  # noqa: BLE001 -- a class that takes other arguments: as it is
            raise e from None
        raise named from e


def _backward_overflow(buffer: EPBuffer, handle: EPHandle, grad: Tensor, which: str, call: str,
                       backward: str) -> Optional[ValueError]:
    """The error for a backward call (`which`: "dispatch" or "combine" on `handle`, moving rows of `grad`'s dtype)
    that would not fit in the buffer, or None. A gradient wider than the forward's rows (fp32 = bf16 rows x fp32
    weights), or a combine across hosts, can need more of the buffer than the forward calls did: the forward refuses
    it rather than the first `backward()`."""
    n, hidden, num_topk, dtype = handle.num_max_tokens_per_rank, grad.shape[1], handle.num_topk, grad.dtype
    need = sizing.required_bytes(buffer.num_ranks, n, hidden, num_topk=num_topk,
                                 allow_multiple_reduction=buffer.allow_multiple_reduction,
                                 elem_size=grad.element_size(), which=which)
    if need <= buffer.num_bytes:
        return None
    return ValueError(
        f"{call}: rank {buffer.rank}: its backward ({backward} {dtype} gradient) needs {need} bytes but the buffer "
        f"has num_bytes={buffer.num_bytes}; size the buffer for the widest dtype the layer sends: EPBuffer(..., "
        f"dtype={dtype}) or EPBuffer.get_buffer_size_hint(group, {n}, {hidden}, {num_topk}, dtype={dtype}) (forward "
        "only: run it under torch.no_grad())")


class _CombineFunction(torch.autograd.Function):
    """y = combine(expert_out, handle, bias); backward = cached dispatch of grad_y, and grad_y for each bias."""

    @staticmethod
    def forward(ctx, expert_out: Tensor, bias_0: Optional[Tensor], bias_1: Optional[Tensor], buffer: EPBuffer,
                handle: EPHandle):
        bias = tuple(b for b in (bias_0, bias_1) if b is not None)
        bias = None if not bias else (bias[0] if len(bias) == 1 else bias)
        combined_x, _, _ = buffer.combine(expert_out, handle, bias=bias)
        ctx.set_materialize_grads(False)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.has_bias = (bias_0 is not None, bias_1 is not None)
        ctx.y_meta = (combined_x.shape, combined_x.dtype)
        return combined_x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        grad_y = _grad_or_zeros(grad_y, ctx.y_meta, ctx.buffer.device)
        # Cached dispatch replays the forward's routing; its padding and tail rows are zero. Always collective.
        with _named("the backward of TokenDispatcher.combine (a cached EPBuffer.dispatch)"):
            grad_expert_out, _, _, _, _ = ctx.buffer.dispatch(grad_y, handle=ctx.handle,
                                                              do_expand=ctx.handle.do_expand)
        grad_bias_0 = grad_y if ctx.has_bias[0] else None
        grad_bias_1 = grad_y.clone() if ctx.has_bias[1] else None  # its own tensor: grads may be accumulated in place
        return grad_expert_out, grad_bias_0, grad_bias_1, None, None


class TokenDispatcher:
    """Differentiable dispatch and combine over an `EPBuffer` (docs/decisions.md "Autograd"). Collective.

    `dispatch` sends tokens (and their router weights) to the ranks owning their experts and `combine` sums the
    expert outputs back per token, unweighted; gradients flow to `x`, `topk_weights`, `expert_out` and `bias`.
    The backward of each call is the opposite call on the same handle (dispatch backward = combine, combine
    backward = cached dispatch), so backward is collective too: every rank must call `dispatch` and `combine`
    in the same order and then run backward through all of them (for example one `loss.backward()` per rank
    per step). An output that a rank's loss does not use counts as a zero gradient, but autograd only runs a
    call's backward when the loss depends on at least one of its outputs: a rank whose loss depends on none of
    them skips that collective and its peers fail with `TimeoutError` (add `0 * y.sum()` to such a loss).
    Blocks the host (CPU-synced dispatch: exact output sizes); not capturable in a CUDA graph.

    Naive equivalent of the forward (plain epcomm calls, no autograd):

        recv_x, _, recv_w, handle, _ = buffer.dispatch(x, topk_idx, topk_weights, num_experts=num_experts,
                                                       expert_alignment=expert_alignment, do_expand=do_expand)
        y, _, _ = buffer.combine(expert_out, handle, bias=bias)

    Args:
        buffer: the `EPBuffer` of the EP group; it must have `allow_multiple_reduction=True` (for both layouts).
        num_experts: E -- total experts over the group, a multiple of the group size; > 0.
        expert_alignment: each local expert's segment of the expand layout is padded to a multiple of it
            (padding rows are zero and get zero gradient); default 1; >= 1.
        do_expand: True (default): one received row per (token, local expert), grouped by local expert;
            False: one received row per (token, rank).

    Raises:
        TypeError: `buffer` is not an `EPBuffer`; `num_experts`, `expert_alignment` not ints; `do_expand` not
            a bool.
        ValueError: the buffer has `allow_multiple_reduction=False`; `num_experts` not a positive multiple of
            the group size; `expert_alignment < 1`.
    """

    def __init__(self, buffer: EPBuffer, num_experts: int, expert_alignment: int = 1, do_expand: bool = True):
        name = "TokenDispatcher"
        if not isinstance(buffer, EPBuffer):
            raise TypeError(f"{name}: buffer must be an epcomm.EPBuffer, got {type(buffer).__name__}")
        for arg, value in (("num_experts", num_experts), ("expert_alignment", expert_alignment)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name}: {arg} must be an int, got {type(value).__name__}")
        num_experts, expert_alignment = int(num_experts), int(expert_alignment)  # numpy ints too
        if not isinstance(do_expand, bool):
            raise TypeError(f"{name}: do_expand must be a bool, got {type(do_expand).__name__}")
        if not buffer.allow_multiple_reduction:
            layout_name = "expand" if do_expand else "non-expand"
            raise ValueError(
                f"{name}: rank {buffer.rank}: the buffer has allow_multiple_reduction=False, but the differentiable "
                f"dispatch/combine (here the {layout_name} layout, do_expand={do_expand}) needs allow_multiple_reduction=True for "
                "both layouts (dispatch backward returns router-weight gradients through combine's topk_weights, "
                "which an expand-layout combine without multiple reduction cannot carry); create the EPBuffer "
                "with allow_multiple_reduction=True")
        if num_experts <= 0 or num_experts % buffer.num_ranks != 0:
            raise ValueError(f"{name}: rank {buffer.rank}: num_experts={num_experts} must be a positive multiple of "
                             f"the group size {buffer.num_ranks}")
        if expert_alignment < 1:
            raise ValueError(f"{name}: rank {buffer.rank}: expert_alignment must be >= 1, got {expert_alignment}")
        self.buffer = buffer
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.do_expand = do_expand

    @property
    def num_local_experts(self) -> int:
        """L = num_experts / group size: experts owned by this rank (ids `rank * L .. rank * L + L - 1`)."""
        return self.num_experts // self.buffer.num_ranks

    @eager_under_compile
    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weights: Optional[Tensor] = None) -> tuple:
        """Send each token to the ranks owning its top-k experts; differentiable w.r.t. `x` and `topk_weights`.

        Collective (every rank calls it, in the same order as its other dispatch/combine calls); its backward is
        a combine on the returned handle, also collective. Blocks the host for the count exchange.

        Args:
            x: [T, H] bf16/fp16/fp32/fp64 -- the tokens of this rank; T may be 0; `T <= num_max_tokens_per_rank`
                of the buffer.
            topk_idx: [T, K] int64 or int32 -- global expert id per selection, -1 = none; ids in
                `[-1, num_experts)`, no expert twice in a row. Not differentiable; must not be modified in place
                until backward has run (the handle holds it).
            topk_weights: [T, K] fp32 (fp64 when x is fp64) or None -- router weights delivered beside the rows
                (not applied); all ranks pass a tensor or all pass None. Default None.

        Returns:
            `(recv_x, recv_topk_weights, handle)`:
            recv_x: [S, H] (expand) or [M, H] (non-expand), x's dtype -- expand: rows grouped by local expert,
                ascending token key in each segment, segment i has `handle.num_recv_tokens_per_expert_list[i]`
                rows (aligned; padding rows are zero); non-expand: one row per received token, ascending token key.
            recv_topk_weights: [S] (expand) or [M, K] (non-expand; 0 in non-local columns), topk_weights' dtype
                -- the weight of each row's selection; None when `topk_weights` is None.
            handle: `EPHandle` -- the routing; pass it to `combine`. In the non-expand layout
                `handle.recv_topk_idx` ([M, K]) gives each row's local expert ids (-1 where not local).

        Raises:
            TypeError: wrong types or dtypes (on every rank).
            ValueError: wrong shapes or values, capacity, ranks that disagree on the call (on every rank); an `x`
                or `topk_weights` that requires grad in a dtype whose backward (a combine) would not fit in the
                buffer (after the forward dispatch, on every rank).
            TimeoutError: a peer did not arrive within the buffer's `num_cpu_timeout_secs`.
        """
        recv_x, recv_w, handle = _DispatchFunction.apply(
            x, topk_weights, self.buffer, topk_idx, self.num_experts, self.expert_alignment, self.do_expand)
        if recv_x.requires_grad or (recv_w is not None and recv_w.requires_grad):  # a backward will run
            # From values every rank agreed on in the dispatch's header: every rank raises here.
            err = _backward_overflow(self.buffer, handle, x, "combine", "TokenDispatcher.dispatch", "a combine of the")
            if err is not None:
                raise err
        return recv_x, recv_w, handle

    @eager_under_compile
    def combine(self, expert_out: Tensor, handle: EPHandle, bias: Union[None, Tensor, tuple] = None) -> Tensor:
        """Sum the expert outputs back per token, unweighted; differentiable w.r.t. `expert_out` and `bias`.

        Collective; its backward is a cached dispatch on `handle` (collective too). The sum is epcomm's canonical
        order (`EPBuffer.combine`): bias first, then ascending top-k position. Apply router weights to
        `expert_out` before calling it (e.g. `expert_out * recv_topk_weights[:, None]` in the expand layout).

        Args:
            expert_out: [S, H] (expand) or [M, H] (non-expand) -- expert outputs in the layout of the dispatch
                that made `handle`, any float dtype (not necessarily the dispatch's: bf16 rows times fp32 router
                weights are fp32, and y is then fp32); padding rows are ignored (their gradient is 0).
            handle: the `EPHandle` returned by this dispatcher's `dispatch`.
            bias: None, a tensor, or a pair `(bias_0, bias_1)`; each [T, H] in expert_out's dtype -- added per
                token before the expert rows; each gets the gradient of y. Default None.

        Returns:
            y: [T, H] expert_out's dtype -- per token, bias plus the sum of its expert rows.

        Raises:
            TypeError: wrong types or dtypes, a bias that is not None, a tensor or a pair.
            ValueError: shapes that do not match the handle, a handle from another buffer, a modified `topk_idx`,
                ranks that disagree on the call; an `expert_out` that requires grad in a dtype whose backward (a
                cached dispatch of y's gradient) would not fit in the buffer (size it with `dtype=` that dtype);
                a handle whose layout (`do_expand`, `num_experts`,
                `expert_alignment`) is not this dispatcher's (where the rows of both layouts have one count, the
                buffer could not tell them apart; on CPU every rank raises, on GPU the rank that passes it).
            TimeoutError: a peer did not arrive within the buffer's `num_cpu_timeout_secs`.
        """
        if isinstance(handle, EPHandle):
            for arg, mine, theirs in (("do_expand", self.do_expand, handle.do_expand),
                                      ("num_experts", self.num_experts, handle.num_experts),
                                      ("expert_alignment", self.expert_alignment, handle.expert_alignment)):
                if mine != theirs:  # through the combine's header: peers inside their combine raise too
                    self.buffer._reject_call("EPBuffer.combine", ValueError(
                        f"TokenDispatcher.combine: rank {self.buffer.rank}: the handle has {arg}={theirs} but this "
                        f"dispatcher has {arg}={mine}; pass the handle that this dispatcher's dispatch returned"))
        if bias is None or isinstance(bias, Tensor):
            bias_0, bias_1 = bias, None
        elif isinstance(bias, (tuple, list)) and len(bias) == 2:
            bias_0, bias_1 = bias
        else:
            # Let the buffer produce its message (and keep the peers in step with the header exchange).
            return self.buffer.combine(expert_out, handle, bias=bias)[0]
        # A backward runs when any input needs a gradient: refused now, through the combine's header (every rank
        # raises), if its cached dispatch would not fit.
        if (torch.is_grad_enabled() and isinstance(handle, EPHandle) and isinstance(expert_out, Tensor)
                and expert_out.dim() == 2 and expert_out.is_floating_point()
                and any(isinstance(t, Tensor) and t.requires_grad for t in (expert_out, bias_0, bias_1))):
            err = _backward_overflow(self.buffer, handle, expert_out, "dispatch", "TokenDispatcher.combine",
                                     "a cached dispatch of y's")
            if err is not None:
                self.buffer._reject_call("EPBuffer.combine", err)
        return _CombineFunction.apply(expert_out, bias_0, bias_1, self.buffer, handle)
