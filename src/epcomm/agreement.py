"""The call header that rides with the count exchange, so that every rank raises together.

Each rank sends every peer one int64 row: `[status, call_id, signature..., counts to every rank]`. `status` is 0, or the code
of the exception the rank's own checks raised; the signature names what all ranks must agree on (operation,
hidden, top-k, dtype, experts, layout, alignment, FP8, ...; the low-latency calls have operations of their own,
`low_latency_signature`). After the exchange every rank sees every header and raises the same exception class,
naming the offending group rank (docs/decisions.md "Errors and timeouts", "What ranks must agree on").
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Callable, Optional

import torch
from torch import Tensor

from .streams import capturing

STATUS_OK, STATUS_TYPE, STATUS_VALUE = 0, 1, 2
_EXC = {STATUS_TYPE: TypeError, STATUS_VALUE: ValueError}
_STATUS = {TypeError: STATUS_TYPE, ValueError: STATUS_VALUE}

OPS = {1: "dispatch", 2: "cached dispatch", 3: "combine", 4: "barrier", 5: "destroy", 6: "low_latency_dispatch",
       7: "low_latency_combine", 8: "clean_low_latency_buffer"}
OP_BARRIER, OP_DESTROY, OP_LOW_LATENCY_DISPATCH, OP_LOW_LATENCY_COMBINE, OP_CLEAN_LOW_LATENCY = 4, 5, 6, 7, 8
SIGNATURE_FIELDS = (
    "op", "hidden", "num_topk", "dtype", "num_experts", "do_expand", "expert_alignment", "fp8",
    "num_sf_packs", "sf_dtype", "num_max_tokens_per_rank", "has_topk_weights", "do_cpu_sync", "fused_exact", "buffer",
    "handle",
)
HEADER_LEN = 2 + len(SIGNATURE_FIELDS)
BUFFER_COL = 2 + SIGNATURE_FIELDS.index("buffer")  # the header column of the buffer id
_BOOL_FIELDS = ("do_expand", "fp8", "has_topk_weights", "do_cpu_sync", "fused_exact")
_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float64: 4, torch.float8_e4m3fn: 5,
                torch.int32: 6}
DTYPE_NAMES = {v: str(k) for k, v in _DTYPE_CODES.items()}
# The low-latency calls carry their own arguments in these slots, under their own names in messages (the header
# keeps its length, which the nvlink transport's published rows build on).
_LOW_LATENCY_NAMES = {"fp8": "use_fp8", "sf_dtype": "use_ue8m0",
                      "num_max_tokens_per_rank": "num_max_dispatch_tokens_per_rank"}
# Slots of the regular calls that are not arguments of their own: the argument they describe, how a value reads.
_ARGUMENT_NAMES = {
    "fp8": ("x", lambda v: "an FP8 (data, scales) tuple" if v else "a tensor",
            "pass x as an FP8 (data, scales) tuple on every rank or on none"),
    "has_topk_weights": ("topk_weights", lambda v: "a tensor" if v else "None",
                         "pass topk_weights on every rank or on none"),
    "num_sf_packs": ("the scale columns of x (x[1].shape[1])", lambda v: v,
                     "pass FP8 scales with the same number of columns"),
    "sf_dtype": ("the scales' dtype of x (x[1].dtype)", lambda v: DTYPE_NAMES.get(v, "?"),
                 "pass FP8 scales of the same dtype"),
    # The call id of the dispatch that made the handle (`EPHandle._dispatch_id`), the same on every rank.
    "handle": ("handle", lambda v: f"the handle of call #{v}",
               "pass the handle of the same dispatch (the one every rank made at the same point)"),
}


def dtype_code(dtype: Optional[torch.dtype]) -> int:
    return _DTYPE_CODES.get(dtype, 0)


def digest(values) -> int:
    """A 62-bit digest of a list of ints, for header fields that compare a whole list (bucket sizes, an Engram
    table's per-layer sizes, LB payloads and mappings): equal lists give equal digests on every rank and process,
    different ones collide with probability ~2^-62 (a keyed hash, not a polynomial that crafted sizes can match)."""
    return int.from_bytes(hashlib.blake2b(repr(list(values)).encode(), digest_size=8).digest(), "little") >> 2


def status_of(err: Optional[BaseException]) -> int:
    if err is None:
        return STATUS_OK
    return _STATUS.get(type(err), STATUS_VALUE)


def low_latency_signature(*, hidden: int, num_topk: int, num_experts: int, use_fp8: bool, use_ue8m0: bool,
                          num_max_dispatch_tokens_per_rank: int) -> dict:
    """The signature of a `low_latency_dispatch`: what every rank must pass alike (round_scale, the hook, the event
    and the stats may differ); `use_ue8m0` rides in the `sf_dtype` slot (`_LOW_LATENCY_NAMES`)."""
    return dict(op=OP_LOW_LATENCY_DISPATCH, hidden=hidden, num_topk=num_topk, dtype=dtype_code(torch.bfloat16),
                num_experts=num_experts, do_expand=True, fp8=use_fp8, sf_dtype=use_ue8m0,
                num_max_tokens_per_rank=num_max_dispatch_tokens_per_rank)


def header(status: int, call_id: int, signature: dict, buffer_uid: int = 0) -> list:
    """The header row; `buffer_uid` (the id every rank agreed on at construction) catches ranks that make the call
    on different buffers of one group."""
    return [status, call_id] + [int(signature.get(k, buffer_uid if k == "buffer" else 0)) for k in SIGNATURE_FIELDS]


def pack(header_row: list, counts_R: Optional[Tensor], num_ranks: int, device: torch.device) -> Tensor:
    """[R, HEADER_LEN + R] int64: to every peer, the header and this rank's whole count vector (0 when None).

    Every rank thus receives the full count matrix (row s = rank s's counts to each rank), which one-sided
    transports need to find their rows in peers' memory; `recv[s, HEADER_LEN + me]` is what s sends me.
    """
    send = torch.empty(num_ranks, HEADER_LEN + num_ranks, dtype=torch.int64, device=device)
    if capturing(device):
        # A CUDA graph cannot capture a copy from pageable host memory: write the (then constant) header with
        # fills instead. Sync-free calls on GPU never check headers on the host, so a constant one is harmless.
        for i, v in enumerate(header_row):
            send[:, i].fill_(v)
    else:
        send[:, :HEADER_LEN] = torch.tensor(header_row, dtype=torch.int64, device=device)
    if counts_R is None:
        send[:, HEADER_LEN:] = 0
    else:
        send[:, HEADER_LEN:] = counts_R
    return send


MESSAGE_BYTES = 2048  # of each rank's error message the failure exchange carries (an nvlink header holds 8704)
_CUT = b" [...]"  # ends a message cut at MESSAGE_BYTES
_MORE_MESSAGES = 3  # messages of the other rejecting ranks a rank without a fault of its own shows


def gather_messages(exchange: Callable[[Tensor], Tensor], msg: str, num_ranks: int,
                    device: torch.device) -> list:
    """Every rank's `msg` (its first MESSAGE_BYTES bytes of UTF-8), through `exchange`: the caller's bounded
    all-to-all of an [R, C] int64 tensor (row r to rank r; returns row s from rank s). A failed call gathers the
    messages this way rather than with `dist.all_gather_object`, whose wait has no bound, so a rank that arrives
    after its peers gave up raises a timeout naming them instead of waiting for ever.

    Returns:
        [R] str, rank s's message at s.

    Raises:
        TimeoutError: from `exchange`, when a peer does not join within the caller's `num_cpu_timeout_secs`.
    """
    data = msg.encode("utf-8", errors="backslashreplace")  # (a lone surrogate must not raise here)
    if len(data) > MESSAGE_BYTES:
        data = data[:MESSAGE_BYTES - len(_CUT)].decode("utf-8", errors="ignore").encode() + _CUT  # whole chars
    row = torch.zeros(1 + MESSAGE_BYTES // 8, dtype=torch.int64)
    row[0] = len(data)
    if data:
        row[1:].view(torch.uint8)[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    recv = exchange(row.expand(num_ranks, -1).contiguous().to(device)).cpu()
    return [bytes(recv[s, 1:].view(torch.uint8)[:int(recv[s, 0])].tolist()).decode("utf-8", errors="replace")
            for s in range(num_ranks)]


def rejected(call: str, rank: int, failed: list, messages: list, what: str = "the call", group=None) -> str:
    """The message of a rank without a fault of its own: every group rank in `failed` rejected `what`, with the
    messages of the first four (the rest by rank; each raised its own). On a subgroup (`group`) each failed rank
    is also named by its global rank, the process a user looks for."""
    from .waits import global_ranks, rank_name, ranks_name  # (not at module level: waits needs no agreement)

    every = global_ranks(group)
    first = failed[0]
    also = "".join(f"; group {rank_name(s, every)} rejected it too: {messages[s]}"
                   for s in failed[1:1 + _MORE_MESSAGES])
    if len(failed) > 1 + _MORE_MESSAGES:
        also += f"; and {ranks_name(failed[1 + _MORE_MESSAGES:], every)} (their messages are in their own errors)"
    return f"{call}: {rank_name(rank, every)}: group {rank_name(first, every)} rejected {what}: {messages[first]}{also}"


def every_rank(exc: BaseException) -> BaseException:
    """Mark `exc` as raised by every rank of the call together (a rank's failed check and its peers' "rejected",
    a disagreement, a limit every rank computes alike): nothing is left pending, so the call's buffer stays usable.
    A call's error without the mark after the ranks agreed on the call is the rank's own (`waits.fail_mid_call`)."""
    exc.epcomm_every_rank = True
    return exc


def raised_everywhere(exc: BaseException) -> bool:
    """Whether `exc` was marked by `every_rank`."""
    return getattr(exc, "epcomm_every_rank", False)


def check(
    call: str, rank: int, recv_RC: list, local_error: Optional[BaseException], gather_messages: Callable[[str], list],
    group=None,
) -> None:
    """Raise on every rank if any rank failed its checks or the ranks disagree about the call. A rank whose own
    checks failed raises its own error; the others raise naming every rank that failed, with the messages of the
    first four. Every error it raises is marked `every_rank`.

    Args:
        recv_RC: the received headers as host lists, row s from group rank s.
        local_error: this rank's own check failure, or None.
        gather_messages: gathers one string per rank, bounded (`gather_messages` above; only called when some
            rank failed).
        group: the process group, to name failed ranks by their global ranks too on a subgroup.
    """
    try:
        _check(call, rank, recv_RC, local_error, gather_messages, group)
    except (TypeError, ValueError) as e:
        raise every_rank(e)


def _check(call: str, rank: int, recv_RC: list, local_error: Optional[BaseException],
           gather_messages: Callable[[str], list], group=None) -> None:
    failed = [s for s, row in enumerate(recv_RC) if row[0] != STATUS_OK]
    if failed:
        messages = gather_messages(str(local_error) if local_error is not None else "")
        if local_error is not None:
            raise local_error
        raise _EXC.get(recv_RC[failed[0]][0], ValueError)(rejected(call, rank, failed, messages, group=group))
    low_latency = [row[2] in (OP_LOW_LATENCY_DISPATCH, OP_LOW_LATENCY_COMBINE, OP_CLEAN_LOW_LATENCY)
                   for row in recv_RC]
    # Two buffers of one group count their calls apart: say that the buffers differ, not only the call numbers.
    _raise_if_disagree(call, rank, recv_RC, "buffer", low_latency)
    calls = [row[1] for row in recv_RC]
    if len(set(calls)) > 1:
        ops = [OPS.get(row[2], "?") for row in recv_RC]
        desc = ", ".join(f"rank {s}: call #{c} ({o})" for s, (c, o) in enumerate(zip(calls, ops)))
        raise ValueError(f"{call}: rank {rank}: ranks are at different calls on this buffer ({desc}); every rank "
                         "must make the same dispatch/combine calls in the same order")
    for field in SIGNATURE_FIELDS:
        _raise_if_disagree(call, rank, recv_RC, field, low_latency)


def _raise_if_disagree(call: str, rank: int, recv_RC: list, field: str, low_latency: list) -> None:
    """Raise the ValueError naming `field` and every rank's value when the ranks' headers differ there."""
    i = SIGNATURE_FIELDS.index(field)
    values = [row[2 + i] for row in recv_RC]
    if len(set(values)) == 1:
        return
    name = _LOW_LATENCY_NAMES.get(field, field) if all(low_latency) else field
    if name in _ARGUMENT_NAMES:
        name, show, fix = _ARGUMENT_NAMES[name]
        desc = ", ".join(f"rank {s}: {show(v)}" for s, v in enumerate(values))
        raise ValueError(f"{call}: rank {rank}: ranks disagree on {name} ({desc}); every rank must {fix}")
    if name == "op":
        shown = [OPS.get(v, "?") for v in values]
    elif name in ("dtype", "sf_dtype"):
        shown = [DTYPE_NAMES.get(v, "?") for v in values]
    elif name in _BOOL_FIELDS or name in ("use_fp8", "use_ue8m0"):
        shown = [bool(v) for v in values]
    elif name == "buffer":  # the id every rank of a buffer agreed on at its construction
        shown = [f"the EPBuffer of uid {v:#x}" for v in values]
    else:
        shown = values
    desc = ", ".join(f"rank {s}: {v}" for s, v in enumerate(shown))
    op_fix = ("the low-latency calls are calls of their own, not a dispatch or combine" if any(low_latency)
              else "in training: every rank runs the backward of every TokenDispatcher call; a rank whose "
                   "output needs no gradient skips it")
    fix = {"op": f"make the same call at the same point ({op_fix})",
           "hidden": "pass x with the same hidden size (x.shape[1])",
           "num_topk": "pass topk_idx with the same number of columns (topk_idx.shape[1])",
           "dtype": "pass x in the same dtype",
           "use_fp8": "pass the same use_fp8 (the rows' format on the link)",
           "use_ue8m0": "pass the same use_ue8m0 (the received scales' format)",
           "fused_exact": "set EPCOMM_FUSED_EXACT the same (the nvlink CPU-synced dispatch's path)",
           "buffer": "make the call on the same buffer (one EPBuffer object per group, used in the same "
                     "order on every rank)"}.get(name, f"pass the same {name}")
    raise ValueError(f"{call}: rank {rank}: ranks disagree on {name} ({desc}); every rank must {fix}")


# -- Frames: every header exchange on CPU has one size ---------------------------------------------------------------
# Gloo aborts the process when the two sides of an all-to-all disagree on its size, and the header rows of
# different calls differ in width (a dispatch header, a load-balancing header, an Engram signature, a failed call's
# messages). So on CPU every header exchange of every epcomm buffer sends rows of one width per group size, framed:
# [magic, kind, width, label (64 bytes), row, zeros]. Ranks whose frames disagree on the kind or width are in
# different calls: every rank raises naming each rank's call, and the calls' own checks see only rows of their kind.
_FRAME_MAGIC = 0x6570636F6D6D  # "epcomm"
_LABEL_COLS = 8
_FRAME_HEAD = 3 + _LABEL_COLS
_WIDEST_ROW = 64  # a bound on every other header row (tests/test_agreement_messages.py checks the real widths)


class CallsDiffer(ValueError):
    """Ranks of a group are in different calls (`framed_exchange`)."""


def frame_cols(num_ranks: int) -> int:
    """Columns of a framed row for a group of `num_ranks`: the widest row any call sends, and the frame's head."""
    return _FRAME_HEAD + max(1 + MESSAGE_BYTES // 8, HEADER_LEN + num_ranks, _WIDEST_ROW)


def _text_cols(text: str) -> list:
    data = text.encode("utf-8", errors="backslashreplace")[:_LABEL_COLS * 8].ljust(_LABEL_COLS * 8, b"\0")
    return torch.frombuffer(bytearray(data), dtype=torch.int64).tolist()


def _cols_text(cols: list) -> str:
    return bytes(torch.tensor(cols, dtype=torch.int64).view(torch.uint8).tolist()).rstrip(b"\0").decode(
        "utf-8", errors="replace")


def _kind_code(kind: str) -> int:
    return zlib.crc32(kind.encode()) & 0x7FFFFFFF


def framed_exchange(exchange: Callable[[Tensor], Tensor], send_RC: Tensor, *, kind: str, label: str,
                    rank: int) -> Tensor:
    """`exchange(send_RC)` (the caller's bounded all-to-all of an [R, C] int64 CPU tensor) through frames of
    `frame_cols(R)` columns, so that ranks in different calls neither abort gloo nor read each other's rows.

    Args:
        kind: the layout of the rows (the calls that send rows of one layout check each other's rows themselves).
        label: the call, as messages name it.

    Returns:
        [R, C] int64: row s from rank s.

    Raises:
        CallsDiffer (a ValueError): on every rank, when the ranks' rows are of different kinds or widths
            (different calls).
        TimeoutError: from `exchange`.
    """
    num_ranks, width = send_RC.shape
    cols = frame_cols(num_ranks)
    if width > cols - _FRAME_HEAD:
        raise AssertionError(f"a header row of {width} columns exceeds the frame ({cols - _FRAME_HEAD})")
    frame = torch.zeros(num_ranks, cols, dtype=torch.int64)
    frame[:, 0], frame[:, 1], frame[:, 2] = _FRAME_MAGIC, _kind_code(kind), width
    frame[:, 3:_FRAME_HEAD] = torch.tensor(_text_cols(label), dtype=torch.int64)
    frame[:, _FRAME_HEAD:_FRAME_HEAD + width] = send_RC
    got = exchange(frame)
    heads = got[:, :3].tolist()
    if any(head != heads[rank] for head in heads):
        calls = ", ".join(f"rank {s}: {_cols_text(got[s, 3:_FRAME_HEAD].tolist())}" if head[0] == _FRAME_MAGIC
                          else f"rank {s}: not an epcomm call" for s, head in enumerate(heads))
        raise every_rank(CallsDiffer(f"{label}: rank {rank}: ranks are in different calls on this group ({calls}); "
                                     "every rank of the group must make the same calls, on the same buffers, in the "
                                     "same order"))
    return got[:, _FRAME_HEAD:_FRAME_HEAD + width].contiguous()
