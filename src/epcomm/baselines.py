"""What users write without epcomm: the yardsticks `epcomm-bench` measures epcomm against in the same run.

`TorchNativeDispatcher` is the expert-parallel dispatcher that torch-native MoE stacks (torchtitan style) build
from `torch.distributed` collectives: every (token, selection) pair becomes its own row, rows are sorted by
expert, per-expert counts go through an all-to-all, the host reads the splits (a blocking device-to-host copy),
the payload goes through `all_to_all_single`, and the received rows are permuted to expert-major order. Its
combine mirrors that path and applies the router weights with an fp32 weighted sum, as such dispatchers do
(epcomm's combine is unweighted: the experts apply the weights).

`raw_all_to_all` is the other yardstick: one `all_to_all_single` of exactly the bytes epcomm's dispatch moves
(one row per token and destination rank, "rank dedup"), with no layout work, no count exchange inside the timed
call and no permutation. epcomm can approach it but not beat it with the same collective.

Both are benchmark baselines, not part of epcomm's API: they favour plainness over speed, and they are checked
(tests/test_bench.py, and the benchmark's correctness gate) only to the extent that a wrong baseline would make
the comparison meaningless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["TorchNativeDispatcher", "TorchNativeState", "payload_row_bytes", "raw_all_to_all"]


def _moves_bytes(group: dist.ProcessGroup, t: Tensor) -> bool:
    """gloo lacks all-to-all for some dtypes (bf16 in older releases, FP8 everywhere): move raw bytes there."""
    return "gloo" in str(dist.get_backend(group)).lower() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def _all_to_all_rows(t: Tensor, send_splits: list, recv_splits: list, group: dist.ProcessGroup) -> Tensor:
    """`all_to_all_single` of the rows of a 2-D tensor; on gloo the rows travel as bytes."""
    if _moves_bytes(group, t):
        as_bytes = t.contiguous().view(torch.uint8)
        out = torch.empty(sum(recv_splits), as_bytes.shape[1], dtype=torch.uint8, device=t.device)
        dist.all_to_all_single(out, as_bytes, recv_splits, send_splits, group=group)
        return out.view(t.dtype)
    out = torch.empty(sum(recv_splits), t.shape[1], dtype=t.dtype, device=t.device)
    dist.all_to_all_single(out, t.contiguous(), recv_splits, send_splits, group=group)
    return out


@dataclass
class TorchNativeState:
    """What `TorchNativeDispatcher.dispatch` keeps for the matching `combine`.

    Fields (T tokens, K top-k, P valid selections on this rank, Q rows received on this rank):
        num_tokens, num_topk: the routing's shape.
        valid_pos: [P] int64 -- flat `t * K + k` of each selection, in the order the rows were sent
            (sorted by global expert, stable).
        weights: [P] fp32 -- router weight of each sent selection, same order.
        send_splits, recv_splits: host lists of rows sent to / received from each rank.
        to_expert_major: [Q] int64 -- received row placed at each expert-major position.
        dtype: element type of the dispatched rows (of the data for FP8 input).
    """

    num_tokens: int
    num_topk: int
    valid_pos: Tensor
    weights: Tensor
    send_splits: list
    recv_splits: list
    to_expert_major: Tensor
    dtype: torch.dtype


class TorchNativeDispatcher:
    """The torch-native (torchtitan-style) expert-parallel dispatcher, a benchmark baseline.

    One row per selection: a token with K selections is sent K times (once per expert, even when several of
    its experts live on the same rank), which is what sets it apart from epcomm's one row per destination rank.

    Args:
        group: the EP process group (None: the default group).
        num_experts: experts in the whole group; a multiple of the group size. Rank r owns experts
            `[r * L, (r + 1) * L)` with `L = num_experts / group size`.

    Raises:
        ValueError: `num_experts` is not a positive multiple of the group size.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], num_experts: int):
        self.group = group if group is not None else dist.group.WORLD
        self.num_ranks = self.group.size()
        if num_experts <= 0 or num_experts % self.num_ranks:
            raise ValueError(f"TorchNativeDispatcher: num_experts={num_experts} must be a positive multiple of the "
                             f"group size {self.num_ranks}")
        self.num_experts = num_experts
        self.num_local = num_experts // self.num_ranks

    def dispatch(self, x: Union[Tensor, tuple], topk_idx: Tensor, topk_weights: Tensor):
        """Send every (token, selection) row to the rank of its expert and return them expert-major.

        Collective (every rank of the group calls it), host-blocking (the splits are read on the host), not
        graph-capturable. Steps (each one a separate torch op, as written by hand): drop -1 selections; stable
        argsort of the flat expert ids; per-expert counts `bincount`; count all-to-all; blocking `.tolist()` of
        the splits; gather one row per selection; payload `all_to_all_single`; permute to expert-major.

        Args:
            x: [T, H] floating -- token rows; or an FP8 pair `(data [T, H] float8_e4m3fn, scales [T, P])`, whose
                data and scales of a row travel together, as bytes.
            topk_idx: [T, K] int64 or int32 -- global expert id per selection, -1 = no selection; ids in
                `[-1, num_experts)`, no expert twice in a row.
            topk_weights: [T, K] floating -- router weights, kept (as fp32) for `combine`.

        Returns:
            expert_x: [Q, H] x's dtype (a `(data, scales)` pair for FP8 input) -- rows of local expert 0 first,
                then expert 1, ...; inside an expert, by source rank, then by the source's token order.
            tokens_per_expert: [L] int64 -- rows of each local expert.
            state: `TorchNativeState` -- what `combine` needs.
        """
        data, sf = x if isinstance(x, tuple) else (x, None)
        num_tokens, num_topk = topk_idx.shape
        flat_expert = topk_idx.reshape(-1).long()
        valid_pos = (flat_expert >= 0).nonzero().flatten()
        experts = flat_expert[valid_pos]
        order = torch.argsort(experts, stable=True)
        valid_pos, experts = valid_pos[order], experts[order]
        weights = topk_weights.reshape(-1)[valid_pos].float()

        # Counts per (destination rank, local expert) -> what every rank receives from us.
        send_counts = torch.bincount(experts, minlength=self.num_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits = send_counts.view(self.num_ranks, self.num_local).sum(1).tolist()  # blocking D2H
        recv_RL = recv_counts.view(self.num_ranks, self.num_local)
        recv_splits = recv_RL.sum(1).tolist()

        rows = torch.div(valid_pos, num_topk, rounding_mode="floor")
        payload = data[rows] if sf is None else torch.cat(
            [data[rows].view(torch.uint8), sf[rows].contiguous().view(torch.uint8)], dim=1)
        received = _all_to_all_rows(payload, send_splits, recv_splits, self.group)

        # Received rows are grouped by source rank, then by local expert: regroup by expert.
        expert_of_row = torch.arange(self.num_local, device=data.device).repeat(self.num_ranks)
        expert_of_row = torch.repeat_interleave(expert_of_row, recv_RL.reshape(-1), output_size=received.shape[0])
        to_expert_major = torch.argsort(expert_of_row, stable=True)
        expert_rows = received[to_expert_major]
        if sf is not None:
            h = data.shape[1]
            expert_rows = (expert_rows[:, :h].contiguous().view(data.dtype),
                           expert_rows[:, h:].contiguous().view(sf.dtype))
        state = TorchNativeState(num_tokens=num_tokens, num_topk=num_topk, valid_pos=valid_pos, weights=weights,
                                 send_splits=send_splits, recv_splits=recv_splits, to_expert_major=to_expert_major,
                                 dtype=data.dtype)
        return expert_rows, recv_RL.sum(0), state

    def combine(self, expert_out: Tensor, state: TorchNativeState) -> Tensor:
        """Bring every expert output row back to its token and sum them weighted by the router weights.

        Collective (every rank calls it); host-blocking on gloo. Steps: un-permute from expert-major; payload
        `all_to_all_single` back; scatter each row to its (token, selection) slot of a zero [T*K, H] fp32
        tensor, times its weight; sum over the top-k axis in fp32; one rounding to the expert outputs' dtype.

        Args:
            expert_out: [Q, H] floating -- expert outputs, in the order `dispatch` returned the rows.
            state: `TorchNativeState` -- the state returned by that dispatch.

        Returns:
            [T, H] expert_out's dtype -- `sum_k w_k * y_k` per token; tokens without a valid selection are 0.
        """
        back = torch.empty_like(expert_out)
        back[state.to_expert_major] = expert_out
        returned = _all_to_all_rows(back, state.recv_splits, state.send_splits, self.group)
        slots = torch.zeros(state.num_tokens * state.num_topk, expert_out.shape[1], dtype=torch.float32,
                            device=expert_out.device)
        slots[state.valid_pos] = returned.float() * state.weights.unsqueeze(1)
        return slots.view(state.num_tokens, state.num_topk, -1).sum(dim=1).to(expert_out.dtype)


def payload_row_bytes(hidden: int, dtype: torch.dtype) -> int:
    """Bytes of one dispatched row: `hidden * itemsize`, plus one fp32 scale per 128 elements for FP8 data.

    Args:
        hidden: int -- elements per row (H).
        dtype: torch.dtype -- element type; float8_e4m3fn adds `4 * ceil(H / 128)` bytes of scales.

    Returns:
        int -- bytes of one row.
    """
    if dtype == torch.float8_e4m3fn:
        return hidden + 4 * -(-hidden // 128)
    return hidden * dtype.itemsize


def raw_all_to_all(payload_rows_per_rank: list, hidden: int, dtype: torch.dtype,
                   group: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None,
                   ) -> Callable[[], Tensor]:
    """Set up a plain `all_to_all_single` of a rank-dedup payload and return the call to time.

    What it measures: the collective alone moving the same bytes as epcomm's dispatch (row r of
    `payload_rows_per_rank` = tokens this rank sends to rank r, each `payload_row_bytes(hidden, dtype)` bytes),
    so `epcomm time / raw time` is epcomm's overhead over its own transport. The count exchange and the
    buffers are made here, once (collective: every rank calls it); the returned callable runs only the
    payload all-to-all (collective) on random bytes and returns the receive buffer.

    Args:
        payload_rows_per_rank: list of R ints -- rows this rank sends to each rank (its own share included).
        hidden: int -- hidden size H.
        dtype: torch.dtype -- element type of the rows (float8_e4m3fn adds the FP8 scales).
        group: ProcessGroup or None -- the process group; default None (the default group).
        device: torch.device or None -- where the buffers live; default cuda's current device for NCCL, else cpu.

    Returns:
        A callable taking no arguments: one collective `all_to_all_single` (host-blocking on gloo) that returns
        the [rows received, row bytes] uint8 receive buffer (the same tensor every call).

    Raises:
        ValueError: `payload_rows_per_rank` does not have one entry per rank of the group.
    """
    group = group if group is not None else dist.group.WORLD
    if device is None:
        nccl = "nccl" in str(dist.get_backend(group)).lower()
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    if len(payload_rows_per_rank) != group.size():
        raise ValueError(f"raw_all_to_all: payload_rows_per_rank has {len(payload_rows_per_rank)} entries, the "
                         f"group has {group.size()} ranks")
    send_counts = torch.tensor(payload_rows_per_rank, dtype=torch.int64, device=device)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    row = payload_row_bytes(hidden, dtype)
    send = torch.randint(0, 256, (sum(send_splits), row), dtype=torch.uint8, device=device)
    recv = torch.empty(sum(recv_splits), row, dtype=torch.uint8, device=device)

    def call() -> Tensor:
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        return recv
    return call
