"""The slow, obviously correct dispatch/combine: the oracle for tests, the benchmark gate and the examples.

Written for reading, not speed: plain `torch.distributed.all_to_all_single` per tensor, Python loops over ranks,
experts and top-k positions (never over tokens). Semantics: DeepEP V2.5 EPBuffer behaviour §9.3-9.6 and §11.2
as amended by docs/decisions.md (token-key order, 0 in non-local weight columns, one logical domain, canonical order).
Only CPU-synced semantics (exact sizes); callers compare the valid rows of sync-free results against it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import comm, gloo_exit
from .sizing import MAX_EXPERTS


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _all_to_all(t: Tensor, send_splits: list, recv_splits: list, group) -> Tensor:
    """Variable all-to-all of rows of any dtype (moved as bytes, so gloo handles bf16 and FP8 too)."""
    row_shape = tuple(t.shape[1:])
    row_bytes = t.dtype.itemsize * int(torch.Size(row_shape).numel())
    # A fresh dense copy: `contiguous()` keeps the strides of size-1 dims, which a byte view refuses.
    as_bytes = t.clone(memory_format=torch.contiguous_format).view(torch.uint8).reshape(t.shape[0], row_bytes)
    out = torch.empty(sum(recv_splits), as_bytes.shape[1], dtype=torch.uint8, device=t.device)
    dist.all_to_all_single(out, as_bytes, recv_splits, send_splits, group=group)
    return out.view(t.dtype).reshape(-1, *row_shape)


@dataclass
class RefHandle:
    """What the reference dispatch returns as its handle (the fields tests compare).

    Fields:
        topk_idx: [T, K] the routing; do_expand, num_experts, num_max_tokens_per_rank, expert_alignment.
        tokens_to_rank: list of R int64 tensors -- tokens sent to each rank, ascending.
        recv_counts: list[int] -- tokens received from each rank.
        recv_g: [M] int64 -- token key of each received row (ascending).
        recv_local_idx: [M, K] int64 -- local expert id per column, -1 where not local.
        row_ptr: [M, K] int64 -- expand: expanded row of (row, position), -1; None for non-expand.
        num_recv_per_expert: list[int] -- unaligned received pairs per local expert.
    """

    topk_idx: Tensor
    do_expand: bool
    num_experts: int
    num_max_tokens_per_rank: int
    expert_alignment: int
    tokens_to_rank: list
    recv_counts: list
    recv_g: Tensor
    recv_local_idx: Tensor
    row_ptr: Optional[Tensor]
    num_recv_per_expert: list

    @property
    def num_recv_tokens_per_expert_list(self) -> list:
        """Received rows per local expert, each aligned up to `expert_alignment` (as `EPHandle`'s)."""
        return [_align(n, self.expert_alignment) for n in self.num_recv_per_expert]


_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def _check_call(x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank, expert_alignment, do_expand,
                num_ranks: int) -> tuple:
    """`(problem, call)`: this rank's first invalid argument ("" if none) and what every rank must pass alike."""
    data, sf = (x if isinstance(x, tuple) and len(x) == 2 else (x, None))
    if not isinstance(data, Tensor) or data.dim() != 2 or data.dtype not in _DTYPES:
        return "x must be a 2-D float tensor or an FP8 (data, scales) pair", {}
    if not isinstance(topk_idx, Tensor) or topk_idx.dim() != 2 or topk_idx.dtype not in (torch.int64, torch.int32) \
            or topk_idx.shape[0] != data.shape[0]:
        return "topk_idx must be a [T, K] int64/int32 tensor with a row per token of x", {}
    ints = dict(num_experts=num_experts, expert_alignment=expert_alignment,
                num_max_tokens_per_rank=-1 if num_max_tokens_per_rank is None else num_max_tokens_per_rank)
    for name, v in ints.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not -2 ** 62 < v < 2 ** 62:
            return f"{name} must be an int, got {v!r}", {}
    call = dict(num_experts=int(num_experts), hidden=data.shape[1], num_topk=topk_idx.shape[1],
                dtype=_DTYPES.index(data.dtype), do_expand=bool(do_expand), expert_alignment=int(expert_alignment),
                weights=-1 if topk_weights is None else _DTYPES.index(topk_weights.dtype)
                if isinstance(topk_weights, Tensor) and topk_weights.dtype in _DTYPES else -2,
                scale_packs=-1 if sf is None else (sf.shape[1] if isinstance(sf, Tensor) and sf.dim() == 2 else -2),
                num_max_tokens_per_rank=ints["num_max_tokens_per_rank"])
    idx, num_experts = topk_idx.long(), call["num_experts"]
    if not (1 <= num_experts <= MAX_EXPERTS and num_experts % num_ranks == 0):
        return f"num_experts={num_experts} must be in [1, {MAX_EXPERTS}] and a multiple of {num_ranks} ranks", call
    if call["expert_alignment"] < 1:
        return f"expert_alignment={expert_alignment} must be >= 1", call
    if num_max_tokens_per_rank is not None and not data.shape[0] <= num_max_tokens_per_rank:
        return f"num_max_tokens_per_rank={num_max_tokens_per_rank} is below this rank's {data.shape[0]} tokens", call
    if call["weights"] == -2 or (topk_weights is not None and tuple(topk_weights.shape) != tuple(idx.shape)):
        return "topk_weights must be a float tensor shaped like topk_idx", call
    if call["scale_packs"] == -2 or (sf is not None and sf.shape[0] != data.shape[0]):
        return "an FP8 x's scales must be a [T, P] tensor", call
    outside = ((idx < -1) | (idx >= num_experts)).nonzero()
    if outside.shape[0]:
        t, j = outside[0].tolist()
        return (f"topk_idx holds ids outside [-1, num_experts={num_experts}) (token {t}, position {j}: "
                f"{int(idx[t, j])})"), call
    same = (idx[:, :, None] == idx[:, None, :]) & (idx[:, :, None] >= 0)
    twice = (same & ~torch.eye(idx.shape[1], dtype=torch.bool, device=idx.device)).any(2).any(1).nonzero()
    if twice.shape[0]:
        t = int(twice[0])
        return f"a topk_idx row names an expert twice (token {t}: {idx[t].tolist()})", call
    return "", call


def _agree(group, rank: int, num_ranks: int, x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
           expert_alignment, do_expand) -> list:
    """Every rank's token count, after the ranks checked together that each one's arguments are valid and the same
    on every rank: one all-gather, then every rank raises the same ValueError or none does, so a bad oracle call
    never returns results to compare against (nor leaves a peer in a collective it never meets)."""
    try:
        problem, call = _check_call(x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                                    expert_alignment, do_expand, num_ranks)
    except Exception as e:  # noqa: BLE001 -- anything odd in the arguments: refused, on every rank
        problem, call = f"invalid arguments ({type(e).__name__}: {e})", {}
    names = ("num_experts", "hidden", "num_topk", "dtype", "do_expand", "expert_alignment", "weights", "scale_packs",
             "num_max_tokens_per_rank")
    num_tokens = 0 if problem else (x[0] if isinstance(x, tuple) else x).shape[0]
    mine = torch.tensor([[int(not problem), num_tokens, *[int(call.get(n, 0)) for n in names]]],
                        device=comm.group_device(group))
    every = [torch.zeros_like(mine) for _ in range(num_ranks)]
    dist.all_gather(every, mine, group=group)
    rows = torch.cat(every).tolist()
    if problem:
        raise ValueError(f"epcomm.reference.dispatch: rank {rank}: {problem}")
    bad = [r for r, row in enumerate(rows) if not row[0]]
    if bad:
        raise ValueError(f"epcomm.reference.dispatch: rank {rank}: group ranks {bad} passed invalid arguments")
    for i, name in enumerate(names):
        if len({row[2 + i] for row in rows}) > 1:
            shown = [(_DTYPES[v] if v >= 0 else None) if name in ("dtype", "weights") else v
                     for v in (row[2 + i] for row in rows)]
            raise ValueError(f"epcomm.reference.dispatch: rank {rank}: ranks disagree on {name} ("
                             + ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown)) + ")")
    return [row[1] for row in rows]


def dispatch(
    x: Union[Tensor, tuple],
    topk_idx: Tensor,
    topk_weights: Optional[Tensor],
    num_experts: int,
    group: Optional[dist.ProcessGroup] = None,
    num_max_tokens_per_rank: Optional[int] = None,
    expert_alignment: int = 1,
    do_expand: bool = False,
):
    """Reference dispatch (collective).

    Args:
        x: [T, H] float, or FP8 `(data [T, H], scales [T, P])`.
        topk_idx: [T, K] int64/int32 -- global expert ids, -1 = none.
        topk_weights: [T, K] float or None.
        num_experts: E, a multiple of the group size.
        group: the process group (default: world).
        num_max_tokens_per_rank: N of the token key; default: the largest token count of any rank.
        expert_alignment: expand segments are padded to a multiple of it.
        do_expand: expand layout.

    Returns:
        `(recv_x, recv_topk_idx, recv_topk_weights, handle)` as `EPBuffer.dispatch` with CPU sync (exact
        sizes); handle is a `RefHandle`.

    Raises:
        ValueError: on every rank, when a rank's arguments are malformed (types, shapes, dtypes) or invalid
            (`num_experts` outside [1, 65536] or not a multiple of the group size, ids outside [-1, num_experts),
            an expert twice in a row, fewer `num_max_tokens_per_rank` than tokens), or the ranks pass different
            num_experts, hidden, top-k, x or weights dtypes, layout, alignment, FP8 scale packs or
            num_max_tokens_per_rank (one all-gather checks them before anything moves).
    """
    group = group or dist.group.WORLD
    gloo_exit.arm(group)  # a clean exit right after these collectives
    rank, num_ranks = group.rank(), group.size()
    tokens = _agree(group, rank, num_ranks, x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                    expert_alignment, do_expand)
    data, sf = (x if isinstance(x, tuple) else (x, None))
    num_tokens, num_topk = topk_idx.shape
    idx = topk_idx.long()
    num_local = num_experts // num_ranks
    if num_max_tokens_per_rank is None:
        num_max_tokens_per_rank = max(tokens)

    # Which tokens go to which rank: every token with at least one expert there, once, ascending.
    tokens_to_rank = []
    for dst in range(num_ranks):
        has_expert_on_dst = ((idx >= dst * num_local) & (idx < (dst + 1) * num_local)).any(dim=1)
        tokens_to_rank.append(has_expert_on_dst.nonzero().flatten())
    send_counts = [len(t) for t in tokens_to_rank]
    recv_counts_t = torch.empty(num_ranks, dtype=torch.int64, device=data.device)
    dist.all_to_all_single(recv_counts_t, torch.tensor(send_counts, device=data.device), group=group)
    recv_counts = recv_counts_t.tolist()

    order = torch.cat(tokens_to_rank) if num_ranks else torch.empty(0, dtype=torch.int64)
    g = rank * num_max_tokens_per_rank + torch.arange(num_tokens, device=data.device)
    recv = {}
    payload = {"x": data, "sf": sf, "idx": idx, "w": topk_weights, "g": g}
    for key, t in payload.items():
        if t is not None:
            recv[key] = _all_to_all(t[order], send_counts, recv_counts, group)
    # Rows arrive grouped by source rank, ascending token: that is ascending g. Sort anyway, to say so.
    by_g = torch.argsort(recv["g"], stable=True)
    recv = {k: v[by_g] for k, v in recv.items()}

    is_local = (recv["idx"] >= rank * num_local) & (recv["idx"] < (rank + 1) * num_local)
    local_idx = torch.where(is_local, recv["idx"] - rank * num_local, torch.full_like(recv["idx"], -1))
    recv_w = None if "w" not in recv else torch.where(is_local, recv["w"], torch.zeros_like(recv["w"]))
    num_per_expert = [int((local_idx == e).sum()) for e in range(num_local)]
    row_ptr = None
    if not do_expand:
        recv_x = recv["x"] if sf is None else (recv["x"], recv["sf"])
        out_idx = local_idx.to(topk_idx.dtype)
    else:
        # One row per (token, local expert), grouped by expert, ascending g, each segment padded with zeros.
        row_ptr = torch.full_like(local_idx, -1)
        xs, sfs, ws, start = [], [], [], 0
        for e in range(num_local):
            rows, cols = (local_idx == e).nonzero(as_tuple=True)
            n, padded = len(rows), _align(len(rows), expert_alignment)
            row_ptr[rows, cols] = start + torch.arange(n, device=data.device)
            pad = padded - n
            xs += [recv["x"][rows], recv["x"].new_zeros(pad, recv["x"].shape[1])]
            if sf is not None:
                sfs += [recv["sf"][rows], recv["sf"].new_zeros(pad, recv["sf"].shape[1])]
            if recv_w is not None:
                ws += [recv_w[rows, cols], recv_w.new_zeros(pad)]
            start += padded
        cat = lambda parts, like: torch.cat(parts) if parts else like[:0]  # noqa: E731
        recv_x = cat(xs, recv["x"]) if sf is None else (cat(xs, recv["x"]), cat(sfs, recv["sf"]))
        recv_w = None if recv_w is None else cat(ws, recv_w.flatten())
        out_idx = None
    handle = RefHandle(topk_idx=topk_idx, do_expand=do_expand, num_experts=num_experts,
                       num_max_tokens_per_rank=num_max_tokens_per_rank, expert_alignment=expert_alignment,
                       tokens_to_rank=tokens_to_rank, recv_counts=recv_counts, recv_g=recv["g"],
                       recv_local_idx=local_idx, row_ptr=row_ptr, num_recv_per_expert=num_per_expert)
    return recv_x, out_idx, recv_w, handle


def combine(
    x: Tensor,
    handle: RefHandle,
    topk_weights: Optional[Tensor] = None,
    bias: Union[None, Tensor, tuple] = None,
    group: Optional[dist.ProcessGroup] = None,
    allow_multiple_reduction: bool = True,
):
    """Reference combine (collective): unweighted sum in the canonical order. Returns `(combined_x, combined_w)`.

    Canonical order: acc = 0; acc += bias_0; acc += bias_1; then each item in ascending top-k position; one
    rounding to x's dtype at the end (and at the per-rank partial level in expand layout with multiple
    reduction). Items: non-expand, one row per destination rank at its largest position; expand + multiple
    reduction, one partial per rank at its largest position; expand without, every (token, expert) row at its
    own position.

    Args:
        x: [M, H] or [S, H] float -- expert outputs in the handle's layout (exact sizes).
        handle: the `RefHandle` of the reference dispatch.
        topk_weights: [M, K] or [S] or None -- carried back to the owner of each selection.
        bias: None, a tensor or a pair `(bias_0, bias_1)` (either may be None: it adds 0); each [T, H] in x's
            dtype.
        group: the process group (default: world).
        allow_multiple_reduction: expand layout: sum each rank's rows before sending them back.

    Returns:
        `(combined_x [T, H], combined_topk_weights [T, K] or None)`.

    Raises:
        ValueError: `bias` is a tuple or list of other than two items (before any collective).
    """
    if isinstance(bias, (tuple, list)) and len(bias) != 2:
        raise ValueError(f"epcomm.reference.combine: bias as a tuple must be (bias_0, bias_1), got {len(bias)} items")
    group = group or dist.group.WORLD
    gloo_exit.arm(group)  # a clean exit right after these collectives
    num_ranks = group.size()
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    idx = handle.topk_idx.long()
    num_tokens, num_topk = idx.shape
    num_local = handle.num_experts // num_ranks
    local_idx = handle.recv_local_idx
    per_pair = handle.do_expand and not allow_multiple_reduction

    # Expert side: what goes back for each received row (m ascending is grouped by source rank).
    back_x = back_w = None
    if not handle.do_expand:
        back_x, back_w = x[: local_idx.shape[0]], topk_weights
    elif not per_pair:
        back_x = torch.zeros(local_idx.shape[0], x.shape[1], dtype=acc_dtype, device=x.device)
        for j in range(num_topk):
            has = handle.row_ptr[:, j] >= 0
            back_x[has] += x[handle.row_ptr[has, j]].to(acc_dtype)
        back_x = back_x.to(x.dtype)
        back_w = None
        if topk_weights is not None:
            back_w = torch.zeros(local_idx.shape, dtype=topk_weights.dtype, device=x.device)
            has = handle.row_ptr >= 0
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[topk_weights.element_size()]
            # Weights travel as bits (a one-element float index_put goes through a scalar and quiets a signalling NaN)
            back_w.view(bits)[has] = topk_weights.view(bits)[handle.row_ptr[has]]
    if back_w is not None and not per_pair:
        back_w = torch.where(local_idx >= 0, back_w, torch.zeros_like(back_w))

    if per_pair:
        # Every (row, position) pair with a local expert, in (row, position) order.
        rows, cols = (handle.row_ptr >= 0).nonzero(as_tuple=True)
        src_rank = torch.div(handle.recv_g, handle.num_max_tokens_per_rank, rounding_mode="floor")
        send_counts = [int((src_rank[rows] == s).sum()) for s in range(num_ranks)]
        back = x[handle.row_ptr[rows, cols]]
        dest = torch.where(idx >= 0, torch.div(idx, num_local, rounding_mode="floor"), -1)
        recv_counts = [int((dest == d).sum()) for d in range(num_ranks)]
        returned = _all_to_all(back, send_counts, recv_counts, group)
        offset = 0
        items = {}  # position -> list of (tokens, rows)
        for d in range(num_ranks):
            tokens, positions = (dest == d).nonzero(as_tuple=True)
            for p in range(num_topk):
                sel = positions == p
                items.setdefault(p, []).append((tokens[sel], returned[offset:][: len(tokens)][sel]))
            offset += len(tokens)
        combined_w = None
    else:
        returned_x = _all_to_all(back_x, handle.recv_counts, [len(t) for t in handle.tokens_to_rank], group)
        returned_w = None if back_w is None else _all_to_all(back_w, handle.recv_counts,
                                                              [len(t) for t in handle.tokens_to_rank], group)
        items, offset = {}, 0
        combined_w = None if returned_w is None else torch.zeros(num_tokens, num_topk, dtype=returned_w.dtype,
                                                                  device=x.device)
        for d, tokens in enumerate(handle.tokens_to_rank):
            on_d = (idx[tokens] >= d * num_local) & (idx[tokens] < (d + 1) * num_local)
            positions = torch.arange(num_topk, device=x.device).expand_as(on_d)
            last_pos = torch.where(on_d, positions, -1).amax(dim=1) if len(tokens) else positions[:, 0]
            rows_from_d = returned_x[offset: offset + len(tokens)]
            for p in range(num_topk):
                sel = last_pos == p
                items.setdefault(p, []).append((tokens[sel], rows_from_d[sel]))
            if combined_w is not None:
                w_from_d = returned_w[offset: offset + len(tokens)]
                combined_w[tokens] = torch.where(on_d, w_from_d, combined_w[tokens])
            offset += len(tokens)

    acc = torch.zeros(num_tokens, x.shape[1], dtype=acc_dtype, device=x.device)
    biases = () if bias is None else ((bias,) if isinstance(bias, Tensor) else tuple(b for b in bias if b is not None))
    for b in biases:
        acc += b.to(acc_dtype)
    for p in range(num_topk):
        for tokens, rows in items.get(p, []):
            acc[tokens] += rows.to(acc_dtype)
    return acc.to(x.dtype), combined_w
