"""Argument resolution and checks for dispatch/combine, run once before any data moves.

Which reference checks (DeepEP V2.5 EPBuffer behaviour, §9.1-9.2, §11.1) epcomm keeps is docs/decisions.md "Checks table".
User mistakes raise `TypeError` (wrong type/dtype) or `ValueError` (shape, value, device, capacity, options);
messages name the call, the group rank, the argument, the expected and the actual value, and the fix.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import gloo_exit, sizing
from .events import EventHandle, EventOverlap

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
FP8_DTYPES = (torch.float8_e4m3fn,)
TOPK_IDX_DTYPES = (torch.int64, torch.int32)


class Checker:
    """Raises errors prefixed with the call and the group rank."""

    def __init__(self, call: str, rank: int, device: torch.device):
        self.call, self.rank, self.device = call, rank, device

    def fail(self, exc: type, msg: str):
        raise exc(f"{self.call}: rank {self.rank}: {msg}")

    def tensor(self, name: str, t, *, ndim: int, dtypes: tuple, shape: Optional[tuple] = None) -> Tensor:
        if not isinstance(t, Tensor):
            self.fail(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:  # sparse, mkldnn, ...: the data path reads strided memory
            self.fail(TypeError, f"{name} must be a dense (strided) tensor, got layout {t.layout}")
        if t.dim() != ndim:
            self.fail(ValueError, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            want = str(dtypes[0]) if len(dtypes) == 1 else "in (" + ", ".join(str(d) for d in dtypes) + ")"
            self.fail(TypeError, f"{name} must have dtype {want}, got {t.dtype}")
        if t.device.type != self.device.type or (self.device.index is not None and t.device != self.device):
            self.fail(ValueError, f"{name} is on {t.device} but the buffer lives on {self.device}; move it there")
        if shape is not None:
            for i, (want, got) in enumerate(zip(shape, t.shape)):
                if want is not None and want != got:
                    self.fail(ValueError, f"{name} must have shape {_fmt(shape)}, got {tuple(t.shape)} (dim {i})")
        return t

    def integer(self, name: str, v) -> int:
        """`v` as a Python int (numpy ints too; not bool) that fits in int64 (the call headers carry it), or a
        TypeError / ValueError naming `name`."""
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            self.fail(TypeError, f"{name} must be an int, got {type(v).__name__} {v!r}")
        v = int(v)
        if not -2 ** 63 <= v < 2 ** 63:
            self.fail(ValueError, f"{name} must fit in a 64-bit integer, got {v}")
        return v

    def positive_int(self, name: str, v, minimum: int = 1) -> int:
        """`v` as a Python int (`integer`) of at least `minimum`, or a TypeError / ValueError naming `name`."""
        v = self.integer(name, v)
        if v < minimum:
            self.fail(ValueError, f"{name} must be >= {minimum}, got {v}")
        return v

    def num_experts(self, v, num_ranks: int, ranks: Optional[str] = None) -> int:
        """`num_experts` as an int in [1, sizing.MAX_EXPERTS] and a multiple of `num_ranks`, or a TypeError /
        ValueError naming it (`ranks`: how the message names `num_ranks`; default "the group size R")."""
        v = self.positive_int("num_experts", v)
        self.require(v <= sizing.MAX_EXPERTS, f"num_experts must be <= {sizing.MAX_EXPERTS} (epcomm's layouts keep "
                                              f"per-expert tables; DeepEP allows 2048), got {v}")
        self.require(v % num_ranks == 0, f"num_experts={v} must be a multiple of "
                                         f"{ranks or f'the group size {num_ranks}'}")
        return v

    def seconds(self, name: str, v) -> float:
        """`v` as a float number of seconds, finite and > 0 (a timeout), or a TypeError / ValueError naming `name`."""
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            self.fail(TypeError, f"{name} must be a number of seconds, got {type(v).__name__}")
        if not v > 0:
            self.fail(ValueError, f"{name} must be > 0 seconds, got {v}")
        if not math.isfinite(v):
            self.fail(ValueError, f"{name} must be a finite number of seconds, got {v}")
        return float(v)

    def timeouts(self, num_cpu_timeout_secs, num_gpu_timeout_secs) -> None:
        """A buffer constructor's two timeouts (`seconds`)."""
        self.seconds("num_cpu_timeout_secs", num_cpu_timeout_secs)
        self.seconds("num_gpu_timeout_secs", num_gpu_timeout_secs)

    def require(self, cond: bool, msg: str) -> None:
        if not cond:
            self.fail(ValueError, msg)


DEFAULT_CPU_TIMEOUT_S = 300  # the buffers' default num_cpu_timeout_secs


def construction_timeout(num_cpu_timeout_secs, err: Optional[BaseException]) -> float:
    """The bound of a constructor's exchange: `num_cpu_timeout_secs`, or the default when this rank's checks failed
    (`err`; the timeout may be what failed): such a rank still joins the exchange, so that every rank raises."""
    return num_cpu_timeout_secs if err is None else DEFAULT_CPU_TIMEOUT_S


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def warn_caller(message: str, category: type = UserWarning) -> None:
    """`warnings.warn` at the caller's line: the first frame outside epcomm and torch's Dynamo wrappers (which
    `compile_guard` puts around the entry points once Dynamo is loaded), however many frames stand between."""
    frame, level = sys._getframe(1), 2
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                 or f"torch{os.sep}_dynamo" in frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def process_group(owner: str, group) -> "dist.ProcessGroup":
    """The `group` argument of a buffer's constructor: a ProcessGroup this rank belongs to, None for the default group.

    Raises:
        TypeError: anything else, naming the argument and its type; `dist.new_group`'s value on a rank outside the
            new group (not a ProcessGroup) says so.
        ValueError: None before `torch.distributed.init_process_group`.
    """
    if group is None:
        group = dist.group.WORLD
        if group is None:
            raise ValueError(f"{owner}: group=None means the default process group, but torch.distributed is not "
                             "initialised: call torch.distributed.init_process_group first")
    if isinstance(group, dist.ProcessGroup):
        gloo_exit.arm(group)
        return group
    rank = dist.get_rank() if dist.is_initialized() else 0
    shown = repr(group) if len(repr(group)) <= 80 else repr(group)[:77] + "..."
    outside = getattr(dist.GroupMember, "NON_GROUP_MEMBER", object())
    hint = (" (what dist.new_group returns on a rank outside the new group: only the group's members construct the "
            "buffer)") if isinstance(group, int) and not isinstance(group, bool) and group == outside else ""
    raise TypeError(f"{owner}: rank {rank}: group must be a torch.distributed ProcessGroup this rank belongs to, or "
                    f"None for the default group; got {type(group).__name__} {shown}{hint}")


def _fmt(shape: tuple) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


@dataclass(frozen=True)
class XSpec:
    """The payload of a dispatch/combine input: data, optional scale factors, and their element types."""

    data: Tensor
    sf: Optional[Tensor]

    @property
    def is_fp8(self) -> bool:
        return self.sf is not None

    @property
    def num_tokens(self) -> int:
        return self.data.shape[0]

    @property
    def hidden(self) -> int:
        return self.data.shape[1]


def check_x(c: Checker, x, *, allow_fp8: bool) -> XSpec:
    """`x` as a float tensor [T, H] or, when allowed, an FP8 tuple `(data [T, H] e4m3, scales [T, P])`."""
    if isinstance(x, tuple):
        if not allow_fp8:
            c.fail(TypeError, "x must be a float tensor here; FP8 (data, scales) tuples are dispatch-only")
        if len(x) != 2:
            c.fail(ValueError, f"x as a tuple must be (data, scales), got {len(x)} elements")
        data = c.tensor("x[0] (FP8 data)", x[0], ndim=2, dtypes=FP8_DTYPES)
        sf = c.tensor("x[1] (scales)", x[1], ndim=2, dtypes=(torch.float32, torch.int32), shape=(data.shape[0], None))
        _require_hidden(c, "x[0] (FP8 data)", data)
        c.require(sf.shape[1] >= 1, f"x[1] (scales) has shape {tuple(sf.shape)}: it needs at least one column of "
                                    "scale factors per token")
        return XSpec(data, sf)
    data = c.tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    _require_hidden(c, "x", data)
    return XSpec(data, None)


def _require_hidden(c: Checker, name: str, data: Tensor) -> None:
    c.require(data.shape[1] >= 1, f"{name} has shape {tuple(data.shape)}: hidden must be >= 1")


def weights_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """topk_weights are fp32, or fp64 when x is fp64 (docs/decisions.md decision 3)."""
    return torch.float64 if x_dtype == torch.float64 else torch.float32


def check_weights_dtype(c: Checker, name: str, w, x_dtype: torch.dtype) -> None:
    """A weights tensor of the wrong float dtype: a TypeError that says why this dtype (it follows x's)."""
    want = weights_dtype(x_dtype)
    if isinstance(w, Tensor) and w.dtype != want:
        c.fail(TypeError, f"{name} must have dtype {want}, got {w.dtype} (weights are fp32, fp64 when x is fp64; "
                          f"x is {x_dtype})")


def check_topk_idx(c: Checker, topk_idx, num_tokens: int) -> Tensor:
    t = c.tensor("topk_idx", topk_idx, ndim=2, dtypes=TOPK_IDX_DTYPES)
    c.require(t.shape[0] == num_tokens, f"topk_idx must have shape [{num_tokens}, *] (a row per token of x), got "
              f"{tuple(t.shape)}")
    c.require(1 <= t.shape[1] <= sizing.MAX_TOPK, f"topk_idx has {t.shape[1]} columns; num_topk must be in [1, 32]")
    return t


def check_topk_values(c: Checker, topk_idx: Tensor, num_experts: int) -> None:
    """Host-side value checks: ids in [-1, num_experts), no expert twice in a row. Reads the tensor (syncs)."""
    if topk_idx.numel() == 0:
        return
    s, _ = topk_idx.sort(dim=1)
    dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
    # One host read for all three facts: each .item() is a device sync (tens of us on the GPU hosts).
    lo, hi, any_dup = torch.stack([s[:, 0].min().long(), s[:, -1].max().long(), dup.any().long()]).tolist()
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        row = int(((topk_idx < -1) | (topk_idx >= num_experts)).any(1).nonzero()[0])
        c.fail(ValueError, f"topk_idx holds {bad} (token {row}); ids must be in [-1, num_experts={num_experts})")
    if any_dup:
        row = int(dup.any(1).nonzero()[0])
        c.fail(
            ValueError,
            f"topk_idx row {row} names expert {int(s[row, 1:][dup[row]][0])} more than once; each token selects "
            "distinct experts (use -1 for empty selections)",
        )


def check_capacity(c: Checker, buffer, *, num_tokens: int, hidden: int, num_topk: int, is_fp8: bool,
                   elem_size: int, n: int, which: str) -> None:
    """The call (`which`: "dispatch" or "combine") must fit in the buffer's `num_bytes` (reference §4.3, §11.1)."""
    c.require(num_tokens <= n, f"x has {num_tokens} tokens but num_max_tokens_per_rank is {n}; raise "
              "num_max_tokens_per_rank (a dispatch argument, or the EPBuffer argument) and size the buffer for it")
    # The shapes that fit, per buffer: its size never changes, and the formula costs host time on every call.
    fitted = getattr(buffer, "_shapes_that_fit", None)
    shape = (n, hidden, num_topk, is_fp8, elem_size, which)
    if fitted is not None and shape in fitted:
        return
    kw = dict(num_topk=num_topk, use_fp8_dispatch=is_fp8, allow_multiple_reduction=buffer.allow_multiple_reduction,
              elem_size=elem_size, which=which)
    need = sizing.required_bytes(buffer.num_ranks, n, hidden, **kw)
    if need <= buffer.num_bytes and fitted is not None:
        fitted.add(shape)
    if need > buffer.num_bytes:
        fits = sizing.max_tokens_that_fit(buffer.num_bytes, buffer.num_ranks, hidden, **kw)
        dtype = {2: "torch.bfloat16", 4: "torch.float32", 8: "torch.float64"}.get(elem_size, f"{elem_size}-byte")
        c.fail(
            ValueError,
            f"the call needs {need} bytes (num_max_tokens_per_rank={n}, hidden={hidden}, num_topk={num_topk}, "
            f"{elem_size}-byte elements{', FP8' if is_fp8 else ''}) but the buffer has num_bytes={buffer.num_bytes}; "
            f"at this shape it fits num_max_tokens_per_rank <= {fits}. Size the buffer with "
            f"EPBuffer.get_buffer_size_hint(group, {n}, {hidden}, {num_topk}, use_fp8_dispatch={is_fp8}, "
            f"dtype={dtype}) or pass num_max_tokens_per_rank/hidden/dtype to EPBuffer",
        )


def check_event_options(c: Checker, *, previous_event, allocate_on_comm_stream: bool,
                        async_with_compute_stream: bool, defer_epilogue: bool) -> None:
    c.require(not defer_epilogue or async_with_compute_stream,
              "defer_epilogue=True requires async_with_compute_stream=True (reference §3.5)")
    if previous_event is not None and not isinstance(previous_event, (EventHandle, EventOverlap)):
        c.fail(TypeError, f"previous_event must be None, an EventHandle (EPBuffer.capture()) or an EventOverlap, "
                          f"got {type(previous_event).__name__}")
    c.require(previous_event is None or allocate_on_comm_stream,
              "previous_event requires allocate_on_comm_stream=True (reference §3.4)")
