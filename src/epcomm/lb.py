"""Redundant-expert load balancing on an `EPBuffer`: weight prefetch and gradient reduction.

DeepEP V2.5 behaviour, §13 (API and checks), §6-7 (the LB region), §8.4 (SM hint). `EPBuffer` inherits
`LoadBalancingMixin`, which uses only the buffer's `group`, `rank`, `num_ranks`, `device`, `transport`,
`num_lb_bytes` and `num_gpu_timeout_secs` (plus its call counter and comm stream when present) and, when a call
fails after the ranks agreed on it, the buffer's `_after_agreement` (a timeout, or an error of this
rank's own that the peers learn from the store: `PeerFailed`); `EPBuffer` calls
`_init_lb_region` before its transport exists and `_lb_attach_transport` (collective) right after.

Both calls are collective over the whole group (one logical domain, docs/decisions.md decision 4): every rank calls
them, with the same `redundancy_mapping`, including ranks with nothing to send. Two data paths: on the `nvlink`
transport, payloads whose redundant tensors lie in the LB region (symmetric memory) are pushed / pulled through
peer views (lb_nvlink.py); every other payload takes the portable path, one `all_to_all_single` of byte rows
whose exact splits every rank derives from the identical mapping:

    # lb_prefetch_weights, naive equivalent (rank me, pair k; L local experts, C slots per rank)
    for r, c with e = mapping[r, c] >= 0 and e // L == me:      # ascending (r, c)
        send expert_weights[k][e % L] (its bytes) to rank r, which stores them in redundant_expert_weights[k][c]
    # lb_reduce_grads: the transpose, then a sum at the owner
    for r, c with e = mapping[r, c] >= 0 and e // L == me:      # ascending (r, c): deterministic
        expert_grads[k][e % L] += redundant_expert_grads[k][c] of rank r     # fp32 accumulate (fp64 for fp64)

Before moving data, one int64 header row per rank ([status, call id, signature, mapping digest, region offset of
each redundant tensor]) goes to every peer through the buffer's transport, bounded by `num_cpu_timeout_secs`: a
rank whose own checks failed, or ranks that disagree on the mapping or the payload sizes, make every rank raise
(docs/decisions.md "Errors and timeouts").

Differences from the reference (redundant tensors anywhere on the device, any bytes per expert, 1-16 gradient
pairs in any float dtype, a fixed summation order) are listed in docs/load_balancing.md.

Shape legend: R ranks, L local experts per rank, C redundant slots per rank, X rows this rank sends, Y rows it
receives, B bytes of one row (all payloads of one expert side by side).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import agreement, lb_nvlink, lb_sum, sizing, streams
from .allocator import BufferAllocator
from .compile_guard import eager_under_compile
from .events import EventHandle, EventOverlap
from .validate import Checker, warn_caller

__all__ = ["MAX_LB_PAYLOADS", "LoadBalancingMixin", "lb_routes"]

MAX_LB_PAYLOADS = 16
_OP_PREFETCH, _OP_REDUCE = 1, 2
_STATUS = {TypeError: 1, ValueError: 2}
_EXC = {1: TypeError, 2: ValueError}
_HEADER = ("status", "call", "op", "num_local_experts", "num_redundant_slots", "num_payloads", "payloads", "mapping")
_OFFSETS = len(_HEADER)  # then MAX_LB_PAYLOADS region offsets (-1: not in a symmetric LB region)
_GRAD_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_OP_NAMES = {_OP_PREFETCH: "EPBuffer.lb_prefetch_weights", _OP_REDUCE: "EPBuffer.lb_reduce_grads"}
# Disagreement messages: a mapping of at most this many values is shown whole on every rank (longer ones by their
# digest, with the first difference); the first difference of at most this many ranks; every rank by itself up to
# this group size (larger groups: ranks with one value together).
_SHOWN_MAPPING_VALUES, _SHOWN_DIFFERENCES, _SHOWN_RANKS = 16, 3, 8
Payloads = Union[Tensor, Sequence[Tensor]]


@dataclass(frozen=True)
class LBRoute:
    """Which rows one rank sends and receives in `lb_prefetch_weights` (grads travel the transpose).

    Fields:
        send_rows: list[int], X -- local expert index of each pushed row, grouped by destination rank
            (ascending), ascending slot within a destination.
        send_splits: list[int], R -- rows to each rank.
        recv_slots: list[int], Y -- redundant slot of each received row, grouped by owner rank (ascending),
            ascending slot within an owner.
        recv_splits: list[int], R -- rows from each rank.
        num_transfers: int -- rows moved over the whole group (identical on every rank).
    """

    send_rows: list
    send_splits: list
    recv_slots: list
    recv_splits: list
    num_transfers: int


def lb_routes(mapping: list, num_local_experts: int, rank: int) -> LBRoute:
    """The rows `rank` pushes and receives for a redundancy mapping (host lists; no checks).

    Args:
        mapping: R lists of C ints -- `redundancy_mapping` as host lists; -1 = unused slot.
        num_local_experts: L > 0.
        rank: this group rank.

    Returns:
        LBRoute -- see its fields.
    """
    num_ranks = len(mapping)
    send_rows, send_splits = [], [0] * num_ranks
    recv, recv_splits = [], [0] * num_ranks
    total = 0
    for r, row in enumerate(mapping):
        for c, e in enumerate(row):
            if e < 0:
                continue
            total += 1
            owner = e // num_local_experts
            if owner == rank:
                send_rows.append(e % num_local_experts)
                send_splits[r] += 1
            if r == rank:
                recv.append((owner, c))
                recv_splits[owner] += 1
    recv.sort()
    return LBRoute(send_rows, send_splits, [c for _, c in recv], recv_splits, total)


class LoadBalancingMixin:
    """Redundant-expert load-balancing calls of `EPBuffer` (reference §13); see the module docstring."""

    # -- the LB region (reference §6-7) ---------------------------------------------------------------
    def _init_lb_region(self, lb_allocation_plan_or_num_bytes) -> None:
        """Validate the constructor argument, allocate `self.lb_storage`, materialize a plan on it. Local.

        Sets `num_lb_bytes` (int), `lb_allocation_plan` (the `BufferAllocator` or None) and `lb_storage`
        ([num_lb_bytes] uint8 on the buffer's device, zero-filled).

        Raises:
            TypeError: neither an int nor a `BufferAllocator`.
            ValueError: a negative or unaligned byte count, or a plan that is already materialized.
        """
        c = Checker("EPBuffer", self.rank, self.device)
        value, plan = lb_allocation_plan_or_num_bytes, None
        if isinstance(value, BufferAllocator):
            c.require(not value.materialized, "lb_allocation_plan_or_num_bytes: the BufferAllocator is already "
                                              "materialized (a plan serves one buffer); make a new plan")
            plan, num_bytes = value, value.num_bytes
        elif isinstance(value, int) and not isinstance(value, bool):
            c.require(value >= 0 and value % sizing.ALLOCATION_ALIGNMENT == 0,
                      f"lb_allocation_plan_or_num_bytes must be a multiple of 2 MiB ({sizing.ALLOCATION_ALIGNMENT}) "
                      f">= 0, got {value}")
            num_bytes = value
        else:
            c.fail(TypeError, "lb_allocation_plan_or_num_bytes must be an int byte count or an epcomm."
                              f"BufferAllocator, got {type(value).__name__}")
        self.num_lb_bytes = num_bytes
        self.lb_allocation_plan = plan
        self.lb_storage = torch.zeros(num_bytes, dtype=torch.uint8, device=self.device)
        self._lb_region = None
        if plan is not None:
            plan.materialize(self.lb_storage)

    def _lb_attach_transport(self) -> None:
        """Collective, once the transport exists: on `nvlink` the LB region (and the plan's tensors) moves into
        symmetric memory of one size on every rank (`lb_nvlink.attach_lb_region`); elsewhere nothing changes."""
        self._lb_region = lb_nvlink.attach_lb_region(self)

    # -- hints ----------------------------------------------------------------------------------------
    def lb_get_theoretical_num_sms(self) -> int:
        """SM count the reference's model suggests for LB calls (reference §8.4); a hint, cached.

        `align(ceil(max(nvlink_gbs / 180, nvlink_gbs / 45)), 2)`, capped at the device's SMs; on CPU (no SMs
        used) the value for an H200-class NVLink.

        Returns:
            int -- an even number >= 2.
        """
        cached = getattr(self, "_lb_num_sms", None)
        if cached is None:
            gbs = sizing.default_nvlink_gbs(self.device) or 0.9 * 18 * 26.5625
            cached = sizing.align(math.ceil(max(gbs / 180.0, gbs / 45.0)), 2)
            if self.device.type == "cuda":
                cached = min(cached, sizing.device_sms(self.device) // 2 * 2)
            self._lb_num_sms = cached
        return cached

    # -- the calls ------------------------------------------------------------------------------------
    @eager_under_compile
    def lb_prefetch_weights(self, redundant_expert_weights: Payloads, expert_weights: Payloads,
                            redundancy_mapping: Tensor, num_sms: int = 0,
                            previous_event: Optional[EventHandle] = None) -> EventOverlap:
        """Push the owners' expert weights into the redundant slots that host them (collective; reference §13.2).

        For every slot `(r, c)` with `e = redundancy_mapping[r, c] >= 0`, the owner `e // L` copies the bytes
        of `expert_weights[k][e % L]` into `redundant_expert_weights[k][c]` on rank r, for every pair k. Slots
        holding -1 and payloads not passed are untouched; bytes are copied, never converted.

        Args:
            redundant_expert_weights: [C, ...] any dtype, contiguous, on the buffer's device -- or a sequence
                of 1-16 such tensors (one per payload: weights, scale factors, ...); written in place. Planned
                in the LB region (`BufferAllocator`), they move over NVLink on the nvlink transport.
            expert_weights: [L, ...] any dtype, contiguous, on the buffer's device (L > 0, the same for every
                pair) -- or a sequence of the same length; pair k has as many bytes per expert as
                `redundant_expert_weights[k]` (trailing shapes and dtypes may differ).
            redundancy_mapping: [R, C] int32 (or int64) on the buffer's device or the CPU (no device read) --
                global expert id `owner * L + local_idx` per slot, -1 = unused; identical on every rank; a rank
                never hosts its own experts. The host reads it (a sync if it lives on the GPU).
            num_sms: SM hint; 0 = `lb_get_theoretical_num_sms()`. On CUDA it must be in [0, device SMs]; the
                data paths (copy engines, all_to_all) launch no SM-limited kernels and ignore it. On CPU: ignored,
                warns once.
            previous_event: `EventHandle` the copies wait for; default: the current stream.

        Returns:
            EventOverlap -- wait on it (`.current_stream_wait()`) before reading the slots. On CPU the work is
            done on return and waiting is a no-op. The host waits only for the header exchange; the copies
            run on the comm stream.

        Raises:
            TypeError: a payload or the mapping is not a tensor, a mapping of another dtype, a bad num_sms or
                previous_event type.
            ValueError: shapes, devices, contiguity, more than 16 payloads, unequal bytes per expert, mapping
                values out of `[-1, R*L)`, a rank hosting its own expert (the offender names its own mistake,
                its peers name the offender); ranks that disagree on the call, the mapping or the payload sizes
                (every rank raises, naming each rank's value and, for the mapping, the first slot that differs).
            TimeoutError: a peer did not arrive within `num_cpu_timeout_secs`.
        """
        return self._lb_call("EPBuffer.lb_prefetch_weights", _OP_PREFETCH, redundant_expert_weights,
                             expert_weights, redundancy_mapping, num_sms, previous_event)

    @eager_under_compile
    def lb_reduce_grads(self, redundant_expert_grads: Payloads, expert_grads: Payloads, redundancy_mapping: Tensor,
                        num_sms: int = 0, previous_event: Optional[EventHandle] = None) -> EventOverlap:
        """Add the replicas' gradients into their owners' gradients, in place (collective; reference §13.3).

        On the owner `me` of `e = redundancy_mapping[r, c]`: `expert_grads[k][e % L] += redundant_expert_grads
        [k][c] of rank r`, for every such `(r, c)` in ascending `(r, c)` order, accumulated in fp32 (fp64 for
        fp64) and rounded once to the gradient's dtype: deterministic, bitwise equal run to run (docs/decisions.md
        "LB gradient reduction"). `expert_grads` is added to (seed it first); `redundant_expert_grads` is
        never modified.

        Args:
            redundant_expert_grads: [C, ...] fp32 (or fp64/bf16/fp16), contiguous, on the buffer's device -- or a
                sequence of 1-16 such tensors; as `redundant_expert_weights` for the NVLink path.
            expert_grads: [L, ...] same dtype and elements per expert as its pair, contiguous, on the buffer's
                device (L > 0, the same for every pair) -- or a sequence of the same length; updated in place.
            redundancy_mapping: as `lb_prefetch_weights`.
            num_sms: as `lb_prefetch_weights`.
            previous_event: as `lb_prefetch_weights`.

        Returns:
            EventOverlap -- wait on it before reading `expert_grads` (no-op on CPU).

        Raises:
            TypeError: as `lb_prefetch_weights`, or a non-float gradient, or pairs of different dtypes.
            ValueError: as `lb_prefetch_weights`, with "elements per expert" for bytes per expert.
            TimeoutError: a peer did not arrive within `num_cpu_timeout_secs`.
        """
        return self._lb_call("EPBuffer.lb_reduce_grads", _OP_REDUCE, redundant_expert_grads, expert_grads,
                             redundancy_mapping, num_sms, previous_event)

    # -- driver ---------------------------------------------------------------------------------------
    def _lb_call(self, name: str, op: int, redundant, original, mapping, num_sms, previous_event) -> EventOverlap:
        if hasattr(self, "_check_alive"):
            self._check_alive(name)
        call_id = self._next_call_id() if hasattr(self, "_next_call_id") else 0
        c = Checker(name, self.rank, self.device)
        err, call = None, None
        try:
            call = self._lb_resolve(c, op, redundant, original, mapping, num_sms, previous_event)
        except (Exception, KeyboardInterrupt) as e:  # a bad argument, out of memory, ...: it travels in the header
            err = e
        try:
            recv = self._lb_agree(name, call_id, op, call, err)
            route = lb_routes(call.mapping, call.num_local_experts, self.rank)
            # A payload moves through symmetric memory when its redundant tensor lies in the LB region on every
            # rank (the headers carry the offsets, so every rank decides alike); the others take all_to_all.
            fast = [k for k in range(len(call.redundant)) if all(row[_OFFSETS + k] >= 0 for row in recv)]
            slow = [k for k in range(len(call.redundant)) if k not in fast]
            self._lb_paths = (len(fast), len(slow))  # payloads on the nvlink / collective path (tests, logs)
            with torch.profiler.record_function("epcomm::" + name.split(".")[-1]), \
                    self._lb_stream(previous_event) as stream:
                if fast and route.num_transfers:
                    self._lb_nvlink(op, call, route, recv, fast)
                if slow:
                    sub = replace(call, redundant=[call.redundant[k] for k in slow], original=[
                        call.original[k] for k in slow], payload_bytes=[call.payload_bytes[k] for k in slow])
                    (self._lb_prefetch if op == _OP_PREFETCH else self._lb_reduce)(sub, route, call_id)
        except (Exception, KeyboardInterrupt) as e:
            self._after_agreement(name, call_id, e, err)
        if stream is None:
            return EventOverlap(EventHandle.completed())
        for t in call.redundant + call.original:
            t.record_stream(stream)
        return EventOverlap(EventHandle(stream=stream))

    def _lb_resolve(self, c: Checker, op: int, redundant, original, mapping, num_sms, previous_event) -> "_LBCall":
        """Reference §13.1-13.3 checks, in argument order; reads the mapping on the host."""
        prefetch = op == _OP_PREFETCH
        red_name, orig_name = ("redundant_expert_weights", "expert_weights") if prefetch else \
            ("redundant_expert_grads", "expert_grads")
        if previous_event is not None and not isinstance(previous_event, EventHandle):
            c.fail(TypeError, f"previous_event must be an EventHandle or None, got {type(previous_event).__name__}")
        if isinstance(num_sms, bool) or not isinstance(num_sms, int):
            c.fail(TypeError, f"num_sms must be an int, got {type(num_sms).__name__}")
        if self.device.type == "cuda":
            device_sms = sizing.device_sms(self.device)
            c.require(0 <= num_sms <= device_sms, f"num_sms={num_sms} must be in [0, {device_sms}] on {self.device} "
                                                  "(0 = lb_get_theoretical_num_sms())")
        elif num_sms:
            self._lb_warn_once("num_sms", "epcomm: num_sms has no effect on CPU; it is ignored")
        reds, origs = _payload_list(c, red_name, redundant), _payload_list(c, orig_name, original)
        c.require(len(reds) == len(origs), f"{red_name} has {len(reds)} tensors but {orig_name} has {len(origs)}; "
                                           "pass one redundant tensor per original tensor")
        if not isinstance(mapping, Tensor):
            c.fail(TypeError, f"redundancy_mapping must be a torch.Tensor [R, C] int32, got {type(mapping).__name__}")
        if mapping.dtype not in (torch.int32, torch.int64):
            c.fail(TypeError, f"redundancy_mapping must have dtype torch.int32 (or int64), got {mapping.dtype}")
        c.require(mapping.dim() == 2 and mapping.shape[0] == self.num_ranks,
                  f"redundancy_mapping must have shape [{self.num_ranks}, C] (one row per group rank), got "
                  f"{tuple(mapping.shape)}")
        c.require(mapping.device.type == "cpu" or mapping.device == self.device,
                  f"redundancy_mapping is on {mapping.device}; it must be on the buffer's device {self.device} or "
                  "the CPU")
        num_slots = mapping.shape[1]
        num_local = origs[0].shape[0] if origs[0].dim() >= 1 else 0
        payload_sizes = []
        for k, (red, orig) in enumerate(zip(reds, origs)):
            rn, on = _indexed(red_name, k, len(reds)), _indexed(orig_name, k, len(reds))
            for n, t in ((rn, red), (on, orig)):
                c.require(t.dim() >= 1, f"{n} must be at least 1-D (experts first), got a 0-D tensor")
                c.require(t.device == self.device, f"{n} is on {t.device} but the buffer lives on {self.device}; "
                                                   "move it there")
                c.require(t.is_contiguous(), f"{n} must be contiguous (strides {t.stride()}); call .contiguous()")
                c.require(not (t.is_conj() or t.is_neg()), f"{n} is a lazily conjugated or negated view, whose bytes "
                                                           "are not its values; call .resolve_conj() / .resolve_neg()")
            c.require(red.shape[0] == num_slots, f"{rn} has {red.shape[0]} rows but redundancy_mapping has "
                                                 f"C={num_slots} slots per rank; expected shape [{num_slots}, ...]")
            c.require(orig.shape[0] == num_local and num_local > 0,
                      f"{on} has {orig.shape[0]} rows; expected num_local_experts={num_local} > 0 (the rows of "
                      f"{_indexed(orig_name, 0, len(reds))}), the same for every pair")
            red_per, orig_per = _per_expert(red), _per_expert(orig)
            if prefetch:
                red_b, orig_b = red_per * red.dtype.itemsize, orig_per * orig.dtype.itemsize
                c.require(red_b == orig_b, f"{rn} holds {red_b} bytes per expert but {on} holds {orig_b}; each "
                                           "pair must have equal bytes per expert")
            else:
                for n, t in ((rn, red), (on, orig)):
                    if t.dtype not in _GRAD_DTYPES:
                        c.fail(TypeError, f"{n} must have dtype in (torch.float32, torch.float64, torch.bfloat16, "
                                          f"torch.float16), got {t.dtype}")
                if red.dtype != orig.dtype:
                    c.fail(TypeError, f"{rn} has dtype {red.dtype} but {on} has {orig.dtype}; a pair shares one "
                                      "dtype")
                c.require(red_per == orig_per, f"{rn} holds {red_per} elements per expert but {on} holds "
                                               f"{orig_per}; each pair must have equal elements per expert")
            # (bytes per expert, dtype code): the dtype matters for gradients only (1 + its index in _GRAD_DTYPES)
            payload_sizes.append((red_per * red.dtype.itemsize, 0 if prefetch else 1 + _GRAD_DTYPES.index(red.dtype)))
        rows = mapping.tolist()
        num_experts = self.num_ranks * num_local
        for r, row in enumerate(rows):
            for s, e in enumerate(row):
                c.require(-1 <= e < num_experts, f"redundancy_mapping[{r}, {s}] = {e}; expected an expert id in "
                                                 f"[0, {num_experts}) (R={self.num_ranks} x L={num_local}) or -1")
                c.require(e < 0 or e // num_local != r,
                          f"redundancy_mapping[{r}, {s}] = {e} is an expert of group rank {r} itself (owner "
                          f"{e} // L={num_local} = {r}); a rank never hosts a replica of its own experts (L is this "
                          "rank's number of local experts: every rank must pass the same)")
        return _LBCall(redundant=reds, original=origs, mapping=rows, num_local_experts=num_local,
                       num_slots=num_slots, payload_bytes=[b for b, _ in payload_sizes], payload_sizes=payload_sizes,
                       payload_digest=agreement.digest(payload_sizes), mapping_digest=agreement.digest(rows))

    def _lb_agree(self, name: str, call_id: int, op: int, call: Optional["_LBCall"],
                  err: Optional[BaseException]) -> list:
        """Header exchange: every rank raises when one failed its checks or the ranks disagree. Returns the
        headers as R host lists (row s from group rank s)."""
        status = 0 if err is None else _STATUS.get(type(err), 2)
        sig = [op, call.num_local_experts, call.num_slots, len(call.redundant), call.payload_digest,
               call.mapping_digest] if call is not None else [op, 0, 0, 0, 0, 0]
        region = getattr(self, "_lb_region", None)
        offsets = [region.offset_of(t) for t in call.redundant] if call is not None and region is not None else []
        offsets += [-1] * (MAX_LB_PAYLOADS - len(offsets))
        row = torch.tensor([status, call_id] + sig + offsets, dtype=torch.int64, device=self.device)
        order = getattr(self, "_order", None)
        recv = streams.ordered_exchange(self.transport, order, self.device,
                                        row.expand(self.num_ranks, row.numel()).contiguous(), call_id,
                                        "load-balancing header", kind="load-balancing header", label=name).tolist()
        if hasattr(self, "_call_id"):
            self._call_id = max(self._call_id, max(r[1] for r in recv))
        failed = [s for s, r in enumerate(recv) if r[0] != 0]
        if failed:
            msg_call = self._next_call_id() if hasattr(self, "_next_call_id") else call_id + 1  # keys of its own
            messages = agreement.gather_messages(
                lambda t: streams.ordered_exchange(self.transport, order, self.device, t, msg_call, "error messages",
                                                   label=name),
                str(err) if err is not None else "", self.num_ranks, self.device)
            if err is not None:
                raise agreement.every_rank(err)
            raise agreement.every_rank(_EXC.get(recv[failed[0]][0], ValueError)(
                agreement.rejected(name, self.rank, failed, messages, group=self.group)))
        for i, field in enumerate(_HEADER[1:], start=1):
            values = [r[i] for r in recv]
            if len(set(values)) > 1:
                raise agreement.every_rank(ValueError(self._lb_disagreement(name, call_id, field, values, call)))
        return recv

    def _lb_disagreement(self, name: str, call_id: int, field: str, values: list, call: "_LBCall") -> str:
        """The message every rank raises when the ranks' headers differ in `field` (`values`: each rank's header
        value): the field and each rank's value (docs/decisions.md "Errors and timeouts"). The mapping and the
        payload sizes ride in the header as digests; their values come from one more exchange (every rank gets
        here at once, from the same headers)."""
        if field == "mapping":
            flat = [e for row in call.mapping for e in row]
            mappings = self._lb_gather_ints(name, call_id, flat)
            num_slots, short = call.num_slots, len(flat) <= _SHOWN_MAPPING_VALUES
            shown = [repr([m[r * num_slots:(r + 1) * num_slots] for r in range(self.num_ranks)]) if short
                     else f"digest {v:#x}" for m, v in zip(mappings, values)]
            ref = _reference_rank(values)
            firsts = []
            for s in [s for s, v in enumerate(values) if v != values[ref]]:
                j = next(j for j, (a, b) in enumerate(zip(mappings[ref], mappings[s])) if a != b)
                firsts.append(f"redundancy_mapping[{j // num_slots}, {j % num_slots}] is {mappings[ref][j]} on "
                              f"rank {ref} but {mappings[s][j]} on rank {s}")
            more = f" (and {len(firsts) - _SHOWN_DIFFERENCES} more ranks)" if len(firsts) > _SHOWN_DIFFERENCES else ""
            return (f"{name}: rank {self.rank}: ranks disagree on the redundancy_mapping ({_per_rank(shown)}); first "
                    f"difference: {'; '.join(firsts[:_SHOWN_DIFFERENCES])}{more}; every rank must pass the same "
                    "redundancy_mapping")
        if field == "payloads":
            sizes = self._lb_gather_ints(name, call_id, [v for pair in call.payload_sizes for v in pair])
            pairs = [list(zip(v[0::2], v[1::2])) for v in sizes]
            several = len(call.payload_sizes) > 1
            if all(code == 0 for p in pairs for _, code in p):  # prefetch: bytes only
                what = "bytes per expert of " + ("each payload" if several else "redundant_expert_weights")
                fix = "pass payloads with the same bytes per expert"
                items = [[str(b) for b, _ in p] for p in pairs]
            else:
                what = "dtype x elements per expert of " + ("each payload" if several else "redundant_expert_grads")
                fix = "pass gradients of the same dtypes and elements per expert"
                items = [[f"{_GRAD_DTYPES[code - 1]} x {b // _GRAD_DTYPES[code - 1].itemsize}" for b, code in p]
                         for p in pairs]
            shown = ["[" + ", ".join(p) + "]" if several else p[0] for p in items]
            return f"{name}: rank {self.rank}: ranks disagree on the {what} ({_per_rank(shown)}); every rank must {fix}"
        what = {"call": "call number (ranks are at different calls on this buffer)", "op": "operation"}.get(field,
                                                                                                            field)
        shown = [_OP_NAMES.get(v, f"op {v}") for v in values] if field == "op" else [str(v) for v in values]
        return (f"{name}: rank {self.rank}: ranks disagree on the {what} ({_per_rank(shown)}); every rank must "
                "make the same call with the same arguments")

    def _lb_gather_ints(self, name: str, call_id: int, values: list) -> list:
        """Every rank's `values` (a list of ints as long on every rank), through bounded header exchanges of at
        most `agreement._WIDEST_ROW` columns, each under a call id of its own. Returns R lists, rank s's at s."""
        order = getattr(self, "_order", None)
        out = [[] for _ in range(self.num_ranks)]
        width = agreement._WIDEST_ROW
        for k, start in enumerate(range(0, len(values), width)):
            row = torch.tensor(values[start:start + width], dtype=torch.int64, device=self.device)
            cid = self._next_call_id() if hasattr(self, "_next_call_id") else call_id + 1 + k
            recv = streams.ordered_exchange(self.transport, order, self.device,
                                            row.expand(self.num_ranks, row.numel()).contiguous(), cid,
                                            "load-balancing disagreement", kind="load-balancing disagreement",
                                            label=name).tolist()
            for s in range(self.num_ranks):
                out[s] += recv[s]
        return out

    # -- data movement --------------------------------------------------------------------------------
    def _lb_exchange(self, send_XB: Tensor, send_splits: list, recv_splits: list, row_bytes: int,
                     call_id: int, what: str) -> Tensor:
        recv_YB = torch.empty(sum(recv_splits), row_bytes, dtype=torch.uint8, device=self.device)
        work = dist.all_to_all_single(recv_YB, send_XB, recv_splits, send_splits, group=self.group, async_op=True)
        if self.device.type == "cpu":
            self.transport.wait(work, what, call_id)
        else:
            work.wait()  # orders the comm stream after the collective; no host wait
        return recv_YB

    def _lb_pack(self, byte_views: list, rows: list) -> Tensor:
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        parts = [v.index_select(0, idx) for v in byte_views if v.shape[1]]
        if not parts:
            return torch.empty(len(rows), 0, dtype=torch.uint8, device=self.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _lb_prefetch(self, call: "_LBCall", route: LBRoute, call_id: int) -> None:
        if route.num_transfers == 0:
            return
        send = self._lb_pack([_bytes(t) for t in call.original], route.send_rows)
        recv = self._lb_exchange(send, route.send_splits, route.recv_splits, sum(call.payload_bytes), call_id,
                                 "lb_prefetch_weights row exchange")
        slots = torch.tensor(route.recv_slots, dtype=torch.int64, device=self.device)
        off = 0
        for red, nbytes in zip(call.redundant, call.payload_bytes):
            if nbytes:
                _bytes(red).index_copy_(0, slots, recv[:, off:off + nbytes])
            off += nbytes

    def _lb_reduce(self, call: "_LBCall", route: LBRoute, call_id: int) -> None:
        if route.num_transfers == 0:
            return
        # The transpose of the prefetch route: my slots go to their owners (ascending owner, then slot); an owner
        # receives its replicas' rows in ascending (rank, slot) order, each adding into local expert experts[j].
        send = self._lb_pack([_bytes(t) for t in call.redundant], route.recv_slots)
        recv = self._lb_exchange(send, route.recv_splits, route.send_splits, sum(call.payload_bytes), call_id,
                                 "lb_reduce_grads row exchange")
        rows, off = [], 0
        for nbytes in call.payload_bytes:
            rows.append(recv[:, off:off + nbytes])
            off += nbytes
        self._lb_accumulate(call.original, rows, route.send_rows)

    def _lb_nvlink(self, op: int, call: "_LBCall", route: LBRoute, recv: list, payloads: list) -> None:
        """Payloads `payloads` through the symmetric LB region: pushes or pulls through peer views (lb_nvlink.py)."""
        region, prefetch = self._lb_region, op == _OP_PREFETCH
        moves = region.moves(call.mapping, call.num_local_experts, self.rank, prefetch)
        reds, origs = [call.redundant[k] for k in payloads], [call.original[k] for k in payloads]
        offsets = [[row[_OFFSETS + k] for row in recv] for k in payloads]
        if prefetch:
            lb_nvlink.push_weights(region, moves, reds, origs, offsets)
        else:
            rows, _ = lb_nvlink.pull_grads(region, moves, reds, offsets)
            self._lb_accumulate(origs, rows, route.send_rows)

    def _lb_accumulate(self, originals: list, rows: list, experts: list) -> None:
        """The ordered sum into `originals` (lb_sum.py), with its index tensors cached per mapping."""
        lb_sum.ordered_accumulate(originals, rows, experts, self.__dict__.setdefault("_lb_rounds", OrderedDict()))

    # -- streams and warnings -------------------------------------------------------------------------
    @contextmanager
    def _lb_stream(self, previous_event: Optional[EventHandle]):
        """Run the enclosed work on the buffer's comm stream after `previous_event` (or the current stream)."""
        if self.device.type != "cuda":
            yield None
            return
        stream = self.get_comm_stream() if hasattr(self, "get_comm_stream") else None
        if stream is None:
            stream = getattr(self, "_lb_own_stream", None)
            if stream is None:
                stream = self._lb_own_stream = torch.cuda.Stream(device=self.device, priority=-1)
        order = getattr(self, "_order", None)
        if order is not None and order.comm is stream:  # after the buffer's last call too (streams.CallOrder)
            order.to_comm(previous_event)
        elif previous_event is not None and previous_event.event is not None:
            stream.wait_event(previous_event.event)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield stream

    def _lb_warn_once(self, key: str, msg: str) -> None:
        if hasattr(self, "_warn_once"):
            self._warn_once(key, msg)
            return
        warned = self.__dict__.setdefault("_lb_warned", set())
        if key not in warned:
            warned.add(key)
            warn_caller(msg)


@dataclass
class _LBCall:
    """A validated LB call: payload pairs, the mapping as host lists, and what the header carries."""

    redundant: list
    original: list
    mapping: list
    num_local_experts: int
    num_slots: int
    payload_bytes: list
    payload_sizes: list  # (bytes per expert, dtype code) of each payload: what the payload digest covers
    payload_digest: int
    mapping_digest: int


def _reference_rank(values: list) -> int:
    """The lowest rank holding the most common value (the ranks that differ from it are the odd ones)."""
    return min(range(len(values)), key=lambda s: (-values.count(values[s]), s))


def _per_rank(shown: list) -> str:
    """Each rank's value: "rank 0: a, rank 1: b"; in groups of more than `_SHOWN_RANKS`, ranks with one value
    together: "ranks 0-2, 4: a; rank 3: b"."""
    if len(shown) <= _SHOWN_RANKS:
        return ", ".join(f"rank {s}: {v}" for s, v in enumerate(shown))
    groups: dict = {}
    for s, v in enumerate(shown):
        groups.setdefault(v, []).append(s)
    parts = []
    for v, ranks in groups.items():
        runs, start = [], ranks[0]
        for a, b in zip(ranks, ranks[1:] + [None]):
            if b != a + 1:
                runs.append(str(start) if start == a else f"{start}-{a}")
                start = b
        parts.append(f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(runs)}: {v}")
    return "; ".join(parts)


def _indexed(name: str, k: int, n: int) -> str:
    return f"{name}[{k}]" if n > 1 else name


def _payload_list(c: Checker, name: str, value) -> list:
    if isinstance(value, Tensor):
        return [value]
    if not isinstance(value, (list, tuple)):
        c.fail(TypeError, f"{name} must be a tensor or a sequence of tensors, got {type(value).__name__}")
    c.require(1 <= len(value) <= MAX_LB_PAYLOADS,
              f"{name} has {len(value)} tensors; expected 1 to {MAX_LB_PAYLOADS} payloads")
    for k, t in enumerate(value):
        if not isinstance(t, Tensor):
            c.fail(TypeError, f"{name}[{k}] must be a torch.Tensor, got {type(t).__name__}")
    return list(value)


def _per_expert(t: Tensor) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


def _bytes(t: Tensor) -> Tensor:
    """[rows, bytes per row] uint8 view of a contiguous tensor whose first dim is the row."""
    return sizing.dense_strides(t).view(t.shape[0], _per_expert(t)).view(torch.uint8)
