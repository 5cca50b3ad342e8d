"""DeepEP V1's low-latency (decode) API on `EPBuffer`: `low_latency_dispatch` / `low_latency_combine`.

Semantics, on every transport: the dispatch is a sync-free expand-layout dispatch (BF16 in, FP8 cast inside per
128 channels), laid out expert-major and padded: `[num_local_experts, num_ranks * N, hidden]` with
`recv_count[e]` valid rows per expert, ascending token key inside each expert (docs/decisions.md). The combine
returns every (token, expert) row to its token and sums `w_j * y_j` in fp32 in ascending top-k position with one
rounding. Two paths give the same results: on the nvlink transport, two Triton kernels per call with flags in
symmetric memory (`lowlatency_nvlink.py`); on every other transport, the portable path here (a sync-free
dispatch through the transport, then a scatter into the expert-major layout; no host synchronisation on GPU).
Rows past `recv_count[e]` of the expert-major output are unspecified (the nvlink path leaves them unwritten, as
DeepEP V1 does). On CPU each portable call first exchanges a header of its own (op `low_latency_dispatch` /
`low_latency_combine`, the options every rank passes alike: `agreement.low_latency_signature`), so ranks that
disagree, or where one makes the regular call the portable path is built on, raise on every rank before any data
moves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import agreement, pipeline, sizing, streams
from .compile_guard import eager_under_compile
from .events import EventHandle, EventOverlap
from .fp8 import num_sf_packs, per_token_cast_to_fp8, unpack_ue8m0
from .kernels import weighted_reduce_torch
from .lowlatency_nvlink import CallBook, Layout, LowLatencyNVLink
from .streams import capturing
from .handle import EPHandle
from .resolve import warn_if_grad
from .validate import TOPK_IDX_DTYPES, Checker, check_topk_idx, check_topk_values


def _check_flags(c: Checker, **flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            c.fail(TypeError, f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _check_wait_cost(c: Checker, name: str, cost: Optional[Tensor], num_ranks: int, nvlink: bool) -> None:
    """`dispatch_wait_recv_cost_stats` / `combine_wait_recv_cost_stats`: None, or [R] int64, contiguous, measured
    on the nvlink transport (device clock) and on CPU (host clock at the header exchange)."""
    if cost is None:
        return
    c.tensor(name, cost, ndim=1, dtypes=(torch.int64,), shape=(num_ranks,))
    c.require(cost.is_contiguous(), f"{name} must be contiguous")
    c.require(nvlink or cost.device.type == "cpu", f"{name} is measured on the nvlink transport and on CPU ranks; "
              "the collective transport on GPU exchanges no header to time each rank by (pass None)")


@dataclass(frozen=True)
class LowLatencyHandle:
    """What `low_latency_dispatch` returns as its handle (pass it to `low_latency_combine`).

    Fields:
        handle: the underlying expand-layout `EPHandle` (portable path), or None (nvlink path).
        num_max_dispatch_tokens_per_rank: N of the call.
        hidden: H of the dispatched rows.
        num_local_experts: L.
        topk_idx: [T, K] -- the routing of the dispatch.
        expert_idx_S, row_in_expert_S: [S] int64 -- portable path: for each expanded row, its local expert and its
            row in that expert's block of the expert-major output (-1 for padding / the unused tail).
        item_map: [R * N * K] int32 -- nvlink path: the output row `e * R * N + row` of each (source rank, token,
            top-k position), -1 for none.
        buffer_uid: the id of the buffer that made it; topk_idx_version: `topk_idx`'s version counter at the
            dispatch (None for inference tensors), so an in-place edit before the combine is caught.
        area: nvlink path: the `lowlatency_nvlink.Area` of the call's shape.
        calls, call_index: the `CallBook` of the call's shape and the dispatch's index there (the combine checks
            that the dispatch has been received).
    """

    handle: object
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_local_experts: int
    topk_idx: Tensor
    buffer_uid: int
    topk_idx_version: Optional[int]
    expert_idx_S: Optional[Tensor] = None
    row_in_expert_S: Optional[Tensor] = None
    item_map: Optional[Tensor] = None
    area: object = None
    calls: Optional[CallBook] = None
    call_index: int = -1

    def __getitem__(self, index):
        # DeepEP V1's handle is a tuple; code that unpacks or indexes it gets a pointer to the fields instead of
        # Python's bare "not subscriptable".
        raise TypeError(f"LowLatencyHandle is not DeepEP V1's tuple handle (asked for item {index!r}): pass it to "
                        "low_latency_combine as it is, or read its fields (num_max_dispatch_tokens_per_rank, hidden, "
                        "num_local_experts, topk_idx; docs/porting.md)")


class LowLatencyMixin:
    """`low_latency_dispatch`, `low_latency_combine` and their helpers (DeepEP V1 low-latency API)."""

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of `num_bytes` that hold low-latency calls of this shape on every transport (a positive multiple of
        2 MiB; an upper bound, as DeepEP's hint); allocates nothing.

        The larger of the expand-layout dispatch of BF16 or FP8 rows with top-k up to 32 and the combine's return
        of every (token, expert) row: `num_ranks * N * min(32, num_experts / num_ranks)` BF16 rows (transports that
        write into a receive area hold them all at once). A call checks less: the portable path refuses a dispatch
        whose rows at this call's top-k and format exceed `num_bytes` (the same check as `dispatch`, on every
        transport, so that code that fits on CPU fits on GPU), so a smaller buffer may serve a given call. The nvlink
        transport's low-latency kernels use their own symmetric region (`lowlatency_nvlink.Layout`, a few tens of
        MB at decode sizes), allocated collectively by the first low-latency call of a shape and row format
        (`use_fp8`, `use_ue8m0`): a buffer that uses both formats holds two.

        Raises:
            TypeError / ValueError: an argument that is not a positive int, or num_experts not a multiple of
                num_ranks.

        Source: DeepEP V1 `Buffer.get_low_latency_rdma_size_hint` (deep_ep/buffer.py).
        """
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        c = Checker("EPBuffer.get_low_latency_rdma_size_hint", rank, torch.device("cpu"))
        n = c.positive_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        c.positive_int("hidden", hidden)
        c.num_experts(num_experts, c.positive_int("num_ranks", num_ranks), ranks=f"num_ranks={num_ranks}")
        per_pair = num_ranks * n * min(sizing.MAX_TOPK, max(1, num_experts // num_ranks)) * sizing.align(hidden * 2, 64)
        # Both row formats: FP8 records carry scales and metadata, so at a tiny hidden they outgrow the BF16 ones.
        records = max(sizing.buffer_size_hint(num_ranks, n, hidden, num_topk=0, use_fp8_dispatch=fp8)
                      for fp8 in (False, True))
        return sizing.align(max(records, per_pair), sizing.ALLOCATION_ALIGNMENT)

    def _low_latency_header(self, call: str, signature: dict, err: Optional[BaseException],
                            cost: Optional[Tensor] = None) -> int:
        """The portable path's header exchange (CPU; a no-op on GPU), or `err` raised: on CPU on every rank. The op
        of `signature` tells the low-latency calls from the regular calls their portable path makes. Every rank
        sends the host clock (`time.time_ns`) at which it reached the exchange; with `cost` ([R] int64, CPU),
        `cost[s] += max(0, rank s's time - this rank's)`: how long this rank waited there for each rank.

        Returns:
            The call id of the exchange.

        Raises:
            TypeError / ValueError: `err` (the peers: "group rank r rejected the call"), or ranks that disagree.
            TimeoutError: a peer did not arrive within `num_cpu_timeout_secs` (the buffer is unusable after it).
        """
        call_id = self._next_call_id()
        now = time.time_ns()  # sent whether or not this rank keeps statistics: a peer may
        stamps = torch.full((self.num_ranks,), now) if self.device.type == "cpu" else None  # no header on GPU
        try:
            rows = self._exchange_header(call, call_id, signature, err, stamps)
        except TimeoutError as e:
            self._mark_broken(call, e)
        if cost is not None and rows is not None:
            col = agreement.HEADER_LEN + self.rank
            cost += torch.tensor([max(0, row[col] - now) for row in rows], dtype=torch.int64)
        return call_id

    def _check_low_latency_capacity(self, c: Checker, n: int, hidden: int, num_topk: int, num_experts: int,
                                    use_fp8: bool) -> None:
        """The portable path's dispatch must fit in the buffer (`validate.check_capacity`, in this call's terms)."""
        kw = dict(num_topk=num_topk, use_fp8_dispatch=use_fp8, allow_multiple_reduction=self.allow_multiple_reduction,
                  elem_size=2, which="dispatch")
        need = sizing.required_bytes(self.num_ranks, n, hidden, **kw)
        if need > self.num_bytes:
            fits = sizing.max_tokens_that_fit(self.num_bytes, self.num_ranks, hidden, **kw)
            c.fail(ValueError, f"num_max_dispatch_tokens_per_rank={n} needs {need} bytes (hidden={hidden}, "
                               f"top-k {num_topk}, {'FP8' if use_fp8 else 'BF16'} rows) but the buffer has num_bytes="
                               f"{self.num_bytes}; at this shape it fits num_max_dispatch_tokens_per_rank <= {fits}. "
                               f"Construct the buffer with num_bytes=EPBuffer.get_low_latency_rdma_size_hint({n}, "
                               f"{hidden}, {self.num_ranks}, {num_experts})")

    def _low_latency_calls(self, layout: Layout, row_format: tuple) -> CallBook:
        """The `CallBook` of a call shape and row format (`(use_fp8, use_ue8m0)`) on the portable path, as nvlink
        keeps one in each area: the two-calls-in-flight rule counts the calls of one format, on every transport."""
        if getattr(self, "_ll_calls", None) is None:
            self._ll_calls = {}
        return self._ll_calls.setdefault((layout, row_format), CallBook())

    def _low_latency_nvlink(self) -> Optional[LowLatencyNVLink]:
        """The nvlink fast path of this buffer (made at first use), or None on other transports."""
        if self.transport.name != "nvlink":
            return None
        if getattr(self, "_ll_nvlink", None) is None:

            self._ll_regions = []
            from .transport.symm import SymmetricRegion

            def allocate(layout: Layout, row_format: tuple):
                # The allocation is collective and sized by the call's shape: agree on the shape and the row format
                # first (once per pair, so the host wait costs nothing per call), so ranks that disagree raise
                # instead of hanging or reading rows of another format.
                shape = [layout.num_max_tokens, layout.hidden, layout.num_topk, layout.num_local_experts,
                         *map(int, row_format)]
                mine = torch.tensor(shape, dtype=torch.int64, device=self.device)
                rows = streams.ordered_exchange(self.transport, self._order, self.device,
                                                mine.expand(self.num_ranks, len(shape)).contiguous(),
                                                self._next_call_id(), kind="low-latency shape",
                                                label="EPBuffer low-latency call (first of its shape)").tolist()
                if any(row != shape for row in rows):
                    names = ("num_max_dispatch_tokens_per_rank", "hidden", "num_topk", "num_local_experts",
                             "use_fp8", "use_ue8m0")
                    diff = "; ".join(f"{name}: " + ", ".join(f"rank {s}={row[i]}" for s, row in enumerate(rows))
                                     for i, name in enumerate(names) if len({row[i] for row in rows}) > 1)
                    raise ValueError(f"EPBuffer low-latency call: rank {self.rank}: ranks disagree on the call's "
                                     f"shape or row format ({diff}); every rank must pass the same shapes, use_fp8 "
                                     "and use_ue8m0")
                region = SymmetricRegion(self.group, layout.nbytes, self.device,
                                         timeout_s=self.num_gpu_timeout_secs)
                region.local.zero_()
                # No peer may write into a region before its owner has zeroed it (stream order after the barrier).
                region.barrier()
                self._ll_regions.append(region)  # kept alive with the buffer
                return region.local, region.delta16

            self._ll_nvlink = LowLatencyNVLink(self.rank, self.num_ranks, self.device, self.num_gpu_timeout_secs,
                                               allocate)
        return self._ll_nvlink

    @eager_under_compile
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency calls of one shape to their state before the first call (collective: every rank
        calls it with the same shape). Calls in order never need it (the nvlink kernels' flags are counters that
        only grow); it recovers a shape whose receive hooks were dropped, for example by an exception between a
        call and its hook, after which the next calls of the shape would raise "the receive hook of the call two
        calls before this one ... has not been called".

        Every rank synchronises its device (no low-latency kernel may still be waiting for a peer: a rank whose call
        waits for one that never comes meets the device timeout first), then the areas of every top-k width and row
        format of this shape are cleared between two barriers. The hooks and handles of earlier calls of the shape
        are void: calling such a hook, or combining such a handle, raises `ValueError`.

        Args:
            num_max_dispatch_tokens_per_rank, hidden, num_experts: the shape of the calls to reset (as passed to
                `low_latency_dispatch`); a shape with no calls yet is left as it is.

        Raises:
            TypeError / ValueError: an argument that is not a positive int, num_experts not a multiple of the
                group size, ranks that pass different shapes (every rank raises); the buffer was destroyed.
            TimeoutError: a peer did not arrive within `num_cpu_timeout_secs`.

        Source: DeepEP V1 `Buffer.clean_low_latency_buffer` (deep_ep/buffer.py).
        """
        name = "EPBuffer.clean_low_latency_buffer"
        self._check_alive(name)
        c = Checker(name, self.rank, self.device)
        err, shape = None, {}
        try:
            n = c.positive_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
            h = c.positive_int("hidden", hidden)
            e = c.num_experts(num_experts, self.num_ranks)
            shape = dict(num_max_tokens_per_rank=n, hidden=h, num_experts=e)
        except (TypeError, ValueError) as ex:
            err = ex
        op = agreement.OP_CLEAN_LOW_LATENCY
        self._barrier(name, op, with_cpu_sync=True, signature=shape, err=err)  # every rank's kernels are done

        def of_shape(layout: Layout) -> bool:
            return (layout.num_max_tokens, layout.hidden, layout.num_local_experts) == (n, h, e // self.num_ranks)
        fast = getattr(self, "_ll_nvlink", None)  # made by the first low-latency call on nvlink
        if fast is not None:
            for (layout, _), area in fast.areas.items():
                if of_shape(layout):
                    area.reset()
        for key, book in (getattr(self, "_ll_calls", None) or {}).items():
            if of_shape(key[0]):
                book.retired = CallBook.CLEANED
                self._ll_calls[key] = CallBook()
        self._barrier(name, op, with_cpu_sync=True, signature=shape)  # no peer writes into an area not yet cleared

    @eager_under_compile
    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> Tensor:
        """The buffer a `low_latency_combine(..., zero_copy=True)` of this handle's shape reads its expert outputs
        from: write them into it, then combine with `zero_copy=True` (`x` is then only checked, not read).

        One buffer per call shape, allocated at the first request and kept until `destroy()`; every combine of the
        shape uses it, in stream order (so the expert outputs of the next combine may be written once the previous
        combine is issued). epcomm's combine reads its input in place either way, so zero-copy saves no copy here:
        it exists so that code written for DeepEP V1 runs unchanged.

        Args:
            handle: a `LowLatencyHandle` of this buffer.

        Returns:
            [L, R * N, H] bf16 on the buffer's device (contents unspecified until written).

        Raises:
            TypeError: `handle` is not a `LowLatencyHandle`. ValueError: a handle of another buffer, or of a call
            `clean_low_latency_buffer` reset; the buffer was destroyed.

        Source: DeepEP V1 `Buffer.get_next_low_latency_combine_buffer` (deep_ep/buffer.py).
        """
        name = "EPBuffer.get_next_low_latency_combine_buffer"
        self._check_alive(name)
        c = Checker(name, self.rank, self.device)
        if not isinstance(handle, LowLatencyHandle):
            c.fail(TypeError, f"handle must be the LowLatencyHandle of low_latency_dispatch, got "
                              f"{type(handle).__name__}")
        c.require(handle.buffer_uid == self.uid, "handle comes from another EPBuffer")
        if handle.calls is not None:
            handle.calls.check_not_retired(name, self.rank)  # a combine of it would raise so: say it here too
        return self._zero_copy_buffer(handle, create=True)

    def _zero_copy_buffer(self, handle: LowLatencyHandle, create: bool) -> Optional[Tensor]:
        """The zero-copy combine buffer of the handle's shape; made when `create`, else None if never handed out."""
        if getattr(self, "_ll_zero_copy", None) is None:
            self._ll_zero_copy = {}
        shape = (handle.num_local_experts, self.num_ranks * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        buf = self._ll_zero_copy.get(shape)
        if buf is None and create:
            buf = self._ll_zero_copy[shape] = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        return buf

    @eager_under_compile
    def low_latency_dispatch(self, x: Tensor, topk_idx: Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Dispatch decode tokens to their experts, expert-major and padded (collective; no host synchronisation).

        Every rank passes the same N, H, K, `num_experts`, `use_fp8` and `use_ue8m0` (the rest may differ between
        ranks, T included); docs/decisions.md "What ranks must agree on".

        Args:
            x: [T, H] bf16 -- T <= num_max_dispatch_tokens_per_rank.
            topk_idx: [T, K] int64/int32 -- global expert ids, -1 = none.
            num_max_dispatch_tokens_per_rank: N, the same on every rank; on the portable path the buffer must hold
                it (`get_low_latency_rdma_size_hint`).
            num_experts: E, a multiple of the group size; the same on every rank.
            cumulative_local_expert_recv_stats: [L] int32 or None -- `+= recv_count`; per rank.
            dispatch_wait_recv_cost_stats: [R] int64 or None -- `+=` the nanoseconds this rank waited for each
                source rank's rows, to find slow ranks; per rank. nvlink: the device clock (`%globaltimer`) in the
                receive, summed over the receiving programs (DeepEP V1 sums SM clock cycles over its receiving
                warps); a rank whose rows were there at once adds 0. CPU: the host clock (`time.time_ns`) at the
                call's header exchange, `max(0, arrival of rank s - arrival of this rank)` (exact on one host;
                across hosts the clocks' offset counts too). The collective transport on GPU raises (no header
                to time).
            use_fp8: cast to float8_e4m3fn per 1x128 block inside the call (default) or send BF16; the same on
                every rank.
            round_scale: power-of-two fp32 scales; per rank (each rank's rows carry their own scales).
            use_ue8m0: packed UE8M0 scales ([.., ceil(H/512)] int32); implies power-of-two scales; the same on every
                rank.
            async_finish: return an event to wait on instead of ordering the current stream; per rank.
            return_recv_hook: also return a hook that waits for arrival (the data is complete when it returns); per
                rank.

        Returns:
            `(recv_x, recv_count, handle, event, hook)`: recv_x is [L, R*N, H] bf16, or `(data [L, R*N, H] e4m3,
            scales [L, R*N, P])` with scales laid out token-contiguous (column-major per expert); recv_count [L]
            int32 valid rows per expert (rows past them are unspecified); a `LowLatencyHandle`; an `EventOverlap`;
            with `return_recv_hook`, a callable that receives (on nvlink it launches the receive kernel: call it
            before reading the outputs; its first call receives, later calls do nothing), else None. Two calls of
            a kind may be in flight (issued, hooks not yet called), as in DeepEP V1: call e reuses the area of
            call e - 2, so that call's hook must have been called before call e is issued (checked; ValueError).

        Raises:
            TypeError / ValueError: bad arguments, unsupported options (`async_finish=True` with
                `return_recv_hook=True`, as in DeepEP V1; `round_scale` or `use_ue8m0` without `use_fp8`), N past the
                buffer's capacity (portable path), a hook two calls back not yet called, ranks that disagree (on
                CPU) or ranks where one makes this call and another a `dispatch`. On CPU every rank raises; on GPU
                the offending rank raises before any data moves (no header is exchanged, docs/decisions.md; nvlink
                checks the shape and `use_fp8` / `use_ue8m0` at the first call of each such pair only), and
                `topk_idx` values are not read on the host (that would synchronise): on nvlink the send kernel
                prints the token holding an id outside [-1, num_experts) and traps (the CUDA context is lost);
                on the collective transport an id >= num_experts fails torch's device-side index check and one
                below -1 counts as -1 (docs/decisions.md); an expert repeated in a row gives unspecified results.
            TimeoutError: a peer did not arrive within `num_cpu_timeout_secs` (CPU; the buffer is unusable after
                it), or an earlier low-latency call of this buffer timed out on the GPU (nvlink; the message names
                the rank that never signalled).

        Source: DeepEP V1 `Buffer.low_latency_dispatch` (deep_ep/buffer.py); nvlink kernels in
        `lowlatency_nvlink.py`.
        """
        name = "EPBuffer.low_latency_dispatch"
        self._check_alive(name)
        c = Checker(name, self.rank, self.device)
        warn_if_grad(self, "low_latency_dispatch", x)
        fast = None
        try:
            n = c.positive_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
            c.num_experts(num_experts, self.num_ranks)
            _check_flags(c, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=async_finish,
                         return_recv_hook=return_recv_hook)
            _check_wait_cost(c, "dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, self.num_ranks,
                             self.transport.name == "nvlink")
            scale_options = [f"{k}=True" for k, v in (("use_ue8m0", use_ue8m0), ("round_scale", round_scale)) if v]
            c.require(use_fp8 or not scale_options, f"{' and '.join(scale_options)} "
                      f"require{'s' if len(scale_options) == 1 else ''} use_fp8=True (they shape the FP8 scales)")
            c.require(not (async_finish and return_recv_hook), "async_finish=True and return_recv_hook=True cannot "
                      "be combined (with a hook, the data is complete when the hook returns)")
            if not isinstance(x, Tensor) or x.dtype != torch.bfloat16:
                c.fail(TypeError, f"x must be a bf16 tensor (the FP8 cast happens inside), got "
                                  f"{getattr(x, 'dtype', type(x).__name__)}")
            c.tensor("x", x, ndim=2, dtypes=(torch.bfloat16,))
            c.require(x.shape[1] > 0, f"x must have hidden > 0 columns, got shape {tuple(x.shape)}")
            c.require(x.shape[0] <= n, f"x has {x.shape[0]} tokens but num_max_dispatch_tokens_per_rank={n}; size "
                      "the call for the largest decode batch")
            check_topk_idx(c, topk_idx, x.shape[0])
            if cumulative_local_expert_recv_stats is not None:
                c.tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, ndim=1,
                         dtypes=(torch.int32,), shape=(num_experts // self.num_ranks,))
                c.require(cumulative_local_expert_recv_stats.is_contiguous(),
                          "cumulative_local_expert_recv_stats must be contiguous")
            if self.device.type == "cpu":  # values need a host read: free on CPU, a synchronisation on GPU
                check_topk_values(c, topk_idx, num_experts)
            fast = self._low_latency_nvlink()
            if fast is not None:
                fast.check_status(name)
            else:  # nvlink checks this when it launches; here every rank raises together on CPU
                self._check_low_latency_capacity(c, n, x.shape[1], topk_idx.shape[1], num_experts, use_fp8)
                calls = self._low_latency_calls(
                    Layout(self.num_ranks, n, x.shape[1], topk_idx.shape[1], num_experts // self.num_ranks),
                    (bool(use_fp8), bool(use_ue8m0)))
                call_index = calls.next_call(0, self.rank)
                signature = agreement.low_latency_signature(
                    hidden=x.shape[1], num_topk=topk_idx.shape[1], num_experts=num_experts, use_fp8=use_fp8,
                    use_ue8m0=use_ue8m0, num_max_dispatch_tokens_per_rank=n)
        except (Exception, KeyboardInterrupt) as e:  # a bad argument, out of memory, ...: it travels in the header
            self._low_latency_header(name, {}, e)  # raises e (on CPU every rank raises)
        num_local = num_experts // self.num_ranks
        version = EPHandle.capture_version(topk_idx)
        if fast is not None:
            area = fast.prepare(Layout(self.num_ranks, n, x.shape[1], topk_idx.shape[1], num_local), name,
                                (bool(use_fp8), bool(use_ue8m0)))
            recv_x, recv_count, item_map, call_index, receive = fast.dispatch(
                area, x, topk_idx, cumulative_local_expert_recv_stats, use_fp8, round_scale or use_ue8m0, use_ue8m0,
                hook=return_recv_hook, cost=dispatch_wait_recv_cost_stats)
            ll_handle = LowLatencyHandle(None, n, x.shape[1], num_local, topk_idx, self.uid, version,
                                         item_map=item_map, area=area, calls=area.calls, call_index=call_index)
            event = EventOverlap(EventHandle(self.device) if async_finish else None)
            return recv_x, recv_count, ll_handle, event, receive
        # Its own header first (CPU): the expand dispatch below exchanges a regular dispatch's header, which cannot
        # tell this call from a dispatch nor name use_fp8 / use_ue8m0.
        ll_call = self._low_latency_header(name, signature, None, dispatch_wait_recv_cost_stats)
        if version is None:  # an inference tensor has no version to guard: keep the routing the rows were laid by
            topk_idx = topk_idx.clone()
        try:
            if use_fp8:
                data, scales = per_token_cast_to_fp8(x.detach(), use_ue8m0=use_ue8m0 or round_scale)
                if round_scale and not use_ue8m0:
                    scales = unpack_ue8m0(scales, num_sf_packs(x.shape[1]))
                payload = (data, scales)
            else:
                payload = x.detach()  # this call warned about gradients already (not the dispatch below)
        except (Exception, KeyboardInterrupt) as e:  # out of memory, ...: the peers go on to the dispatch below
            self._fail_mid_call(name, ll_call, e)
        try:
            recv, _, _, handle, _ = self.dispatch(payload, topk_idx, None, cumulative_local_expert_recv_stats,
                                                  num_experts=num_experts, num_max_tokens_per_rank=n, do_expand=True,
                                                  do_cpu_sync=False, emit_expert_ids=True)
        except (TypeError, ValueError, TimeoutError) as e:  # name this call and its argument
            if isinstance(e, TimeoutError):
                self._broken = f"{name} timed out"
            msg = str(e).replace("EPBuffer.dispatch", name, 1)
            raise type(e)(msg.replace("num_max_tokens_per_rank", "num_max_dispatch_tokens_per_rank")) from None
        rows = self.num_ranks * n
        expert_S = handle.recv_expert_ids.long()
        start_L = (handle.psum_num_recv_tokens_per_expert - handle.num_unaligned_recv_tokens_per_expert).long()
        row_S = (torch.arange(expert_S.numel(), device=self.device) - start_L[expert_S.clamp(min=0)])
        row_S = row_S.masked_fill(expert_S < 0, -1)
        slot_S = (expert_S * rows + row_S).masked_fill(expert_S < 0, num_local * rows)  # last slot: trash row

        def expert_major(t_SC: Tensor) -> Tensor:
            """[S, C] expanded rows -> [L, R*N, C], zero past each expert's rows."""
            as_bytes = t_SC.dtype == torch.float8_e4m3fn  # index_copy_ has no FP8 kernel: move bytes
            src = t_SC.view(torch.uint8) if as_bytes else t_SC
            out = torch.zeros(num_local * rows + 1, src.shape[1], dtype=src.dtype, device=self.device)
            out.index_copy_(0, slot_S, src)
            out = out[:-1].view(num_local, rows, src.shape[1])
            return out.view(t_SC.dtype) if as_bytes else out

        if use_fp8:
            # Scales token-contiguous per expert (column-major, as V1 returns them for TMA loads).
            scales_LRP = expert_major(recv[1]).transpose(1, 2).contiguous().transpose(1, 2)
            recv_x = (expert_major(recv[0]), scales_LRP)
        else:
            recv_x = expert_major(recv)
        ll_handle = LowLatencyHandle(handle, n, x.shape[1], num_local, topk_idx, self.uid, version, expert_S, row_S,
                                     calls=calls, call_index=call_index)
        recv_count = handle.num_unaligned_recv_tokens_per_expert.clone()
        event = EventOverlap(EventHandle(self.device) if async_finish else None)
        received = calls.book(0, call_index, return_recv_hook, self.rank)  # the data is complete: the hook books it
        return recv_x, recv_count, ll_handle, event, (received if return_recv_hook else None)

    @eager_under_compile
    def low_latency_combine(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, handle: LowLatencyHandle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[Tensor] = None):
        """Weighted combine of expert-major outputs back to their tokens (collective).

        `combined[t] = round(sum_j w[t, j] * x[expert of j, row of (t, j)])`, fp32 products and sums in ascending
        top-k position, one rounding to bf16 (docs/decisions.md).

        Args:
            x: [L, R*N, H] bf16 -- expert outputs in the dispatch's expert-major layout.
            topk_idx: [T, K] -- the routing of the dispatch: its tensor, unmodified since, or one of equal values
                (an inference-mode routing is copied by the portable path's dispatch, so an edit raises here).
            topk_weights: [T, K] fp32 -- the weights applied here.
            handle: the `LowLatencyHandle` of the dispatch (every rank combines the same dispatch).
            use_logfmt: not implemented; must be False.
            zero_copy: read the expert outputs from `get_next_low_latency_combine_buffer(handle)` instead of `x`
                (which is still checked); per rank.
            combine_wait_recv_cost_stats: [R] int64 or None -- as `low_latency_dispatch`'s
                `dispatch_wait_recv_cost_stats`, for the expert outputs coming back (nvlink: summed over the
                receiving programs, one per token and channel block).
            async_finish, return_recv_hook: as `low_latency_dispatch` (per rank).
            out: [T, H] bf16 or None -- written in place and returned when given; per rank.

        Returns:
            `(combined_x [T, H] bf16, event, hook)`; with `return_recv_hook`, `combined_x` is complete once the hook
            has been called (its first call receives; later calls do nothing).

        Raises:
            TypeError / ValueError: bad arguments, unsupported options (`use_logfmt=True`; `async_finish=True`
                with `return_recv_hook=True`), a handle of another buffer or from before a
                `clean_low_latency_buffer` of its shape, a routing edited in place since the dispatch, a dispatch
                whose receive hook has not been called, the hook of the combine two calls back not yet called, ranks
                that pass the handles of different dispatches (CPU), or ranks where one makes this call and another
                a `combine`. Where each raises: as `low_latency_dispatch`.
            TimeoutError: as `low_latency_dispatch`.

        Source: DeepEP V1 `Buffer.low_latency_combine` (deep_ep/buffer.py); nvlink kernels in
        `lowlatency_nvlink.py`.
        """
        name = "EPBuffer.low_latency_combine"
        self._check_alive(name)
        c = Checker(name, self.rank, self.device)
        warn_if_grad(self, "low_latency_combine", x, topk_weights)
        fast = None
        try:
            _check_flags(c, use_logfmt=use_logfmt, zero_copy=zero_copy, async_finish=async_finish,
                         return_recv_hook=return_recv_hook)
            c.require(not use_logfmt, "use_logfmt=True (LogFMT combine payloads) is not implemented by epcomm")
            _check_wait_cost(c, "combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, self.num_ranks,
                             self.transport.name == "nvlink")
            c.require(not (async_finish and return_recv_hook), "async_finish=True and return_recv_hook=True cannot "
                      "be combined (with a hook, the data is complete when the hook returns)")
            if not isinstance(handle, LowLatencyHandle):
                c.fail(TypeError, f"handle must be the LowLatencyHandle of low_latency_dispatch, got "
                                  f"{type(handle).__name__}")
            c.require(handle.buffer_uid == self.uid, "handle comes from another EPBuffer; combine on the buffer "
                      "whose low_latency_dispatch made it")
            handle.calls.check_not_retired(name, self.rank)
            num_local, rows = handle.num_local_experts, self.num_ranks * handle.num_max_dispatch_tokens_per_rank
            c.tensor("x", x, ndim=3, dtypes=(torch.bfloat16,), shape=(num_local, rows, handle.hidden))
            c.tensor("topk_idx", topk_idx, ndim=2, dtypes=TOPK_IDX_DTYPES, shape=tuple(handle.topk_idx.shape))
            # The dispatch's routing tensor must be unchanged (views share its version counter; inference tensors
            # have none), and a different tensor must hold the same values (a host read: not under capture,
            # where a captured combine trusts the routing it is replayed with).
            c.require(handle.topk_idx_version is None or EPHandle.capture_version(handle.topk_idx) ==
                      handle.topk_idx_version, "topk_idx was modified in place after the low_latency_dispatch "
                      "that made the handle; pass the routing of that dispatch")
            if topk_idx is not handle.topk_idx and not capturing(self.device) and \
                    not torch.equal(topk_idx, handle.topk_idx):
                t, k = (topk_idx != handle.topk_idx).nonzero()[0].tolist()
                c.fail(ValueError, f"topk_idx must be the routing of the low_latency_dispatch that made the handle: "
                                   f"topk_idx[{t}, {k}] is {int(topk_idx[t, k])}, the dispatch's was "
                                   f"{int(handle.topk_idx[t, k])}")
            c.tensor("topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,), shape=tuple(topk_idx.shape))
            if out is not None:
                c.tensor("out", out, ndim=2, dtypes=(torch.bfloat16,), shape=(topk_idx.shape[0], handle.hidden))
                c.require(out.shape[0] <= 1 or out.stride(0) >= out.shape[1] * out.stride(1),
                          f"out must be row-major, its rows apart (stride(0) >= {out.shape[1]} x stride(1)), got "
                          f"strides {tuple(out.stride())}; pass a row-major [T, H] tensor or a view of one")
            c.require(handle.calls.received(handle.call_index), "the low_latency_dispatch that made the handle has "
                      "not been received; call its receive hook before combining")
            if zero_copy:
                registered = self._zero_copy_buffer(handle, create=False)
                c.require(registered is not None, "zero_copy=True reads the expert outputs from "
                          "get_next_low_latency_combine_buffer(handle); call it and write them there first")
                x = registered
            if handle.area is not None:
                fast = self._low_latency_nvlink()
                fast.check_status(name)
            else:  # nvlink checks this when it launches; here every rank raises together on CPU
                call_index = handle.calls.next_call(1, self.rank)
        except (Exception, KeyboardInterrupt) as e:  # a bad argument, out of memory, ...: it travels in the header
            self._low_latency_header(name, {}, e)  # raises e (on CPU every rank raises)
        if fast is not None:
            combined = out if out is not None else torch.empty(topk_idx.shape[0], handle.hidden,
                                                               dtype=torch.bfloat16, device=self.device)
            receive = fast.combine(handle.area, x, topk_idx, topk_weights, handle.item_map, combined,
                                   hook=return_recv_hook, cost=combine_wait_recv_cost_stats)
            event = EventOverlap(EventHandle(self.device) if async_finish else None)
            return combined, event, receive
        # Back to the expand layout (padding rows read the zero row), then every (token, expert) row home.
        try:
            slot_S = (handle.expert_idx_S * rows + handle.row_in_expert_S).masked_fill(handle.expert_idx_S < 0,
                                                                                        num_local * rows)
            flat = torch.cat([x.reshape(num_local * rows, -1), x.new_zeros(1, x.shape[2])])
            x_S = flat.index_select(0, slot_S)
            h = handle.handle
            call = pipeline.CombineCall(x=x_S, handle=h, topk_weights=None, bias_0=None, bias_1=None, per_pair=True)
        except (Exception, KeyboardInterrupt) as e:  # out of memory, ...: it travels in the header
            self._low_latency_header(name, {}, e)
        call_id = self._low_latency_header(name, call.signature() | {"op": agreement.OP_LOW_LATENCY_COMBINE}, None,
                                           combine_wait_recv_cost_stats)
        try:
            launched = pipeline.combine_launch(self, call, call_id)
        except (Exception, KeyboardInterrupt) as e:  # after the header exchange, as EPBuffer.combine
            self._after_agreement(name, call_id, e)
        item_TK = pipeline.returned_item_rows(self, h, per_pair=True)
        y = launched["spec"].view(launched["recv_XB"], "x")
        combined = weighted_reduce_torch(y, item_TK, topk_weights, torch.bfloat16)
        if out is not None:
            out.copy_(combined)
            combined = out
        event = EventOverlap(EventHandle(self.device) if async_finish else None)
        received = handle.calls.book(1, call_index, return_recv_hook, self.rank)  # the sum is complete already
        return combined, event, (received if return_recv_hook else None)

