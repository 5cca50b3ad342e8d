"""The `nvlink` transport: rows written straight into peers' symmetric memory on one host.

Region of every rank (one symmetric allocation, `SymmetricRegion`):

    [ headers: R x 1088 int64 | split matrix: R x R int64 | rows: receive area | staging 0 | staging 1 ]

Two ways rows move:
* push (sync-free calls, records in the blocked layout): a sender writes its records for rank r into r's receive
  area at `src_rank * cap`, then a device barrier makes them visible; the epilogue copies them out.
* pull (CPU-synced calls, `move_fields`): a sender gathers each field of its rows for the other ranks into its own
  staging area (its rows for itself go straight into its output), one device barrier, then every receiver copies
  its rows out of each peer's staging area straight into its output tensors. The two staging areas alternate
  between eager calls: a call's barrier proves every peer has finished the call before, so the area used two
  calls ago is free again without a second barrier. A call captured in a CUDA graph replays on one area, so it, and
  every call after a capture, waits for its peers before staging (`move_fields`).
Both copy with the copy engines (`copy_` on peer views), which reach the measured link ceiling and use no SMs;
in a graph the pull reads fields of at most 512 bytes a row (FP8 scales, weights) with the SMs instead
(`pull.py`).
Every wait is a device barrier (`SymmetricRegion.barrier`, epcomm's kernel) bounded by `num_gpu_timeout_secs`;
a rank that does not arrive is named in the kernel's message before it aborts.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import envs, sizing, streams
from ..agreement import every_rank
from ..debug import phase
from ..kernels import push
from ..kernels.launch import launch
from ..moves import chunk_count
from ..moves import row_bytes as moves_row_bytes
from ..sizing import align, next_pow2
from .base import Transport
from .pull import PullPlan, pull_fields
from .push_back import ReturnPlan, return_fields
from .symm import SymmetricRegion

# A row holds the call header, the counts to every rank and, for the fused CPU-synced dispatch, the counts for
# each of the receiver's local experts and two flags (exact_nvlink.py): up to 1024 local experts.
_HEADER_COLS = 1024 + 64
# Combine of a CPU-synced dsv3 handle in a CUDA graph, 2x H200, p50 us at 28 / 132 SMs (push chunks 1-4):
# 413 / 246, 350 / 231, 343 / 222, 331 / 242 (pull: 442 / 320). Eager calls lose with chunks (670 -> 897 at 2).
_RETURN_CHUNKS_CAPTURED = 3


class _EventWork:
    """A CUDA event as the work the base class's bounded wait polls (`is_completed`, `wait`)."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def is_completed(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


class NVLinkTransport(Transport):
    name = "nvlink"
    # Received rows (sync-free calls), returned rows (the combine's push) and the counts of a CPU-synced dispatch
    # (its header area) are read in place: the epilogue reads them before the next call's first barrier lets peers
    # write again (stream order; a deferred epilogue: no call starts while it is pending, and the comm stream then
    # waits for it), so one deferred epilogue may be in flight.
    borrows_rows = True
    writes_blocks = False  # CPU-synced calls pull fields (move_fields); sync-free ones push blocks

    def __init__(self, group, device, timeout_s, uid, *, num_bytes: int = 0, gpu_timeout_s: float = 100.0,
                 min_rows_bytes: int = 0):
        super().__init__(group, device, timeout_s, uid)
        # NOTE: 4 programs per SM keep enough rows in flight to saturate NVLink with 4-byte stores (a first guess,
        # to be tuned on 2x H200); `num_sms` of a call does not change it yet.
        self.num_programs = 4 * sizing.device_sms(device)
        num_bytes = max(num_bytes, min_rows_bytes)
        r = self.num_ranks
        self._headers_off = 0
        self._splits_off = align(r * _HEADER_COLS * 8, 4096)
        self._rows_off = align(self._splits_off + r * r * 8, 1 << 16)
        self.rows_capacity = num_bytes
        self._stage_off = [self._rows_off + num_bytes, self._rows_off + 2 * num_bytes]
        self._stage_calls = 0
        self._side = None  # the pull's and the return push's copy stream, made at first use
        self._signals = None  # the return push's barriers (beside its copies), made at first use
        self._captured = False  # a pull or return push was captured: every later call waits for its peers first
        self._exact_table = None  # the fused CPU-synced dispatch's rows, pinned copy and header view (exact_table)
        self._publish_args: dict = {}  # cols -> publish_args (made once: a dict per call costs host time)
        self._wait_event = None  # the event of host waits (`_host_wait`), made at first use
        self.region = SymmetricRegion(group, self._rows_off + 3 * num_bytes, device,
                                      timeout_s=gpu_timeout_s)

    @property
    def rows_off(self) -> int:
        """Byte offset of the receive area in every region."""
        return self._rows_off

    @property
    def headers_off(self) -> int:
        """Byte offset of the count headers: R rows of `header_cols` int64, row s written by rank s."""
        return self._headers_off

    header_cols = _HEADER_COLS

    def barrier(self) -> None:
        """Device barrier of the group on the current stream (`SymmetricRegion.barrier`)."""
        with phase("device_barrier"):
            self.region.barrier()

    def check_rows_fit(self, num_rows: int, rec: int) -> None:
        """Raises: ValueError -- `num_rows` records of `rec` bytes do not fit the receive area."""
        need = num_rows * rec
        if need > self.rows_capacity:  # every rank computes the same (R * N rows of one record kind)
            raise every_rank(ValueError(
                f"EPBuffer: rank {self.rank}: the nvlink receive area holds {self.rows_capacity} bytes but this call "
                f"needs {need} ({num_rows} rows x {rec}-byte records); size the buffer with "
                "EPBuffer.get_buffer_size_hint for this shape (num_max_tokens_per_rank, hidden, num_topk, dtype)"))

    def _all_gather_rows(self, row: Tensor, offset: int, cols: int) -> Tensor:
        """Row `me` of every peer's [R, cols] int64 area gets `row`; returns the local area after a barrier."""
        self.barrier()  # every peer has read the area of the previous call
        for peer in range(self.num_ranks):
            self.region.peer(peer, offset + self.rank * cols * 8, (cols,), torch.int64).copy_(row)
        self.barrier()
        local = self.region.peer(self.rank, offset, (self.num_ranks, cols), torch.int64)
        return local.clone()

    def exchange_counts(self, send_RC: Tensor, *, wait: bool, call_id: int, what: str = "count exchange",
                        kind: Optional[str] = None, label: Optional[str] = None) -> Tensor:
        r, c = send_RC.shape
        assert c <= _HEADER_COLS
        # Peer p must receive row p of send_RC: write it into p's headers at row `me`.
        self.barrier()
        for peer in range(r):
            self.region.peer(peer, self._headers_off + self.rank * _HEADER_COLS * 8, (c,), torch.int64).copy_(
                send_RC[peer])
        self.barrier()
        recv = self._received_headers(r, c)
        if wait:
            self._host_wait(what, call_id)
        return recv

    def exact_table(self) -> Tensor:
        """[R, header_cols] int64 on the device: the rows the fused CPU-synced dispatch publishes (exact_nvlink.py),
        zero between calls: its `send_plan` adds into it and the publish (in `send_plan`'s last program, or
        `publish_rows`) zeroes it again (made at first use)."""
        if self._exact_table is None:
            r = self.num_ranks
            self._exact_table = torch.zeros(r, _HEADER_COLS, dtype=torch.int64, device=self.device)
            self._exact_host = torch.empty(r * _HEADER_COLS, dtype=torch.int64, pin_memory=True)
            self._exact_host_np = self._exact_host.numpy()  # a numpy view costs no torch dispatch per call
            self._headers = self.region.peer(self.rank, self._headers_off, (r * _HEADER_COLS * 8,), torch.uint8)
        return self._exact_table

    def publish_args(self, cols: int) -> dict:
        """The arguments with which `_exact_triton.send_plan` publishes `exact_table()`'s rows (first `cols`
        columns) in its last program, as `publish_rows` would launch them. The kernel takes the table's row stride
        for the header rows' too: both are `_HEADER_COLS` int64. Made once per `cols`; shared, not to be changed.

        Raises:
            TimeoutError: an earlier device barrier of the region timed out.
        """
        region = self.region
        region.check_status()
        args = self._publish_args.get(cols)
        if args is None:
            assert self.exact_table().stride(0) == _HEADER_COLS
            args = self._publish_args[cols] = dict(
                done_ptr=region.programs_done("publish"), host_ptr=self._exact_host.data_ptr(), local_ptr=region.local,
                delta16_ptr=region.delta16, status_ptr=region.status.data_ptr(), timeout_ns=region.timeout_ns,
                flags_off=region.flags_off, hdr_off=self._headers_off, EX_COLS=cols, C_POW2=next_pow2(cols), STAGES=7,
                USE_TIMER=True)
        return args

    def publish_rows(self, cols: int, *, call_id: int, published: bool = False):
        """The count exchange of the fused CPU-synced dispatch, in one kernel (`_exact_triton.publish_rows`, or
        `send_plan` already with `publish_args`: `published`): row p of `exact_table()` (first `cols` columns)
        lands in row `me` of rank p's headers, between two device barriers; then the kernel writes the rows every
        rank published here into pinned host memory, and the host waits (bounded) for it.

        Returns:
            [R, cols] int64 numpy array, row s from rank s: a view of the pinned rows, valid until the next call.

        Raises:
            TimeoutError: the host wait passed `num_cpu_timeout_secs`, or an earlier device barrier of the region
                timed out (a barrier that times out inside this kernel prints the missing rank and traps).
        """
        from ..kernels import _exact_triton as k

        r, region = self.num_ranks, self.region
        assert cols <= _HEADER_COLS
        table = self.exact_table()
        region.check_status()
        if not published:
            launch(k.publish_rows, (1,), table, self._exact_host.data_ptr(), region.local, region.delta16,
                   region.status.data_ptr(), self.rank, region.timeout_ns, region.flags_off, self._headers_off, R=r,
                   R_POW2=next_pow2(r), EX_COLS=cols, HDR_COLS=_HEADER_COLS, C_POW2=next_pow2(cols), STAGES=7,
                   USE_TIMER=True, num_warps=4)
        self._host_wait("count exchange", call_id)
        return self._exact_host_np[:r * cols].reshape(r, cols)

    def received_headers(self) -> tuple:
        """`(bytes, row stride in int64)` of this rank's header area, [R, header_cols] int64, row s written by rank s:
        read in place by the fused dispatch's plan kernels. Peers write it again only after this rank's next
        barrier, which comes after those kernels: by stream order, or by the wait for the previous call that a call
        on another stream makes first (`streams.CallOrder`); for a deferred epilogue, which runs them on the current
        stream at its first wait, because no call starts while it is pending (`EPBuffer._check_alive`) and the comm
        stream then waits for the current stream (`streams.finish`)."""
        self.exact_table()
        return self._headers, _HEADER_COLS

    def _received_headers(self, r: int, c: int) -> Tensor:
        """[r, c] int64, a fresh copy of the first c columns of this rank's headers (row s from rank s)."""
        return self.region.peer(self.rank, self._headers_off, (r, _HEADER_COLS), torch.int64)[:, :c].clone()

    def _host_wait(self, what: str, call_id: int) -> None:
        """Wait (bounded) for the current stream's work so far. One event serves every call: the wait ends (or the
        buffer is broken) before the next record."""
        if self._wait_event is None:
            self._wait_event = torch.cuda.Event()
        self._wait_event.record(streams.current_stream(self.device.index))
        self.wait(_EventWork(self._wait_event), what, call_id)

    def dispatch_rows(
        self, send_XB: Tensor, send_splits: Optional[list], recv_splits: Optional[list], *, call_id: int
    ) -> Tensor:
        num_ranks, me = self.num_ranks, self.rank
        rows, rec = send_XB.shape
        if send_splits is None:
            cap = rows // num_ranks
            counts, send_off = [cap] * num_ranks, [p * cap for p in range(num_ranks)]
            dst_off, num_recv = [me * cap] * num_ranks, rows
        else:
            row = torch.tensor(send_splits, dtype=torch.int64, device=self.device)
            matrix = self._all_gather_rows(row, self._splits_off, num_ranks).tolist()  # [src][dst]
            counts = send_splits
            send_off = [sum(send_splits[:p]) for p in range(num_ranks)]
            dst_off = [sum(matrix[s][p] for s in range(me)) for p in range(num_ranks)]
            num_recv = sum(recv_splits)
        if num_recv * rec > self.rows_capacity:
            raise ValueError(
                f"EPBuffer: rank {me}: the nvlink receive area holds {self.rows_capacity} bytes but this call "
                f"receives {num_recv} rows of {rec} bytes; size the buffer with EPBuffer.get_buffer_size_hint "
                "for this shape (num_max_tokens_per_rank, hidden, num_topk, dtype)")
        self.barrier()  # every peer has copied its previous rows out of its receive area
        for peer in range(num_ranks):
            if counts[peer] == 0:
                continue
            src = send_XB[send_off[peer]: send_off[peer] + counts[peer]].reshape(-1)
            self.region.peer(peer, self._rows_off + dst_off[peer] * rec, (src.numel(),), torch.uint8).copy_(src)
        self.barrier()
        area = self.region.peer(me, self._rows_off, (num_recv * rec,), torch.uint8)
        return area.view(num_recv, rec)

    def push_rows(self, spec, tensors: dict, src_X: Tensor, cap: int, *, call_id: int) -> Tensor:
        """Each send row goes straight from the sender's tensors into its destination's receive area (one pass
        over the data, no staging copy), then one device barrier publishes every block."""
        num_ranks, rec = self.num_ranks, spec.nbytes
        need = num_ranks * cap * rec
        self.check_rows_fit(num_ranks * cap, rec)
        self.barrier()  # every peer has copied its previous rows out of its receive area
        # NOTE: the copy engines beat the Triton push kernel today (2x H200, dsv3 BF16 rows): kernel 409-505 us for
        # 58.7 MB to the peer (117-144 GB/s over 18 grid/block/warp variants, benchmarks/push_sweep.py) against
        # 175 us for a copy-engine write of the same bytes plus a local pack. The kernel stays selectable with
        # EPCOMM_NVLINK_PUSH=kernel until it reaches the link rate.
        if envs.nvlink_push() == "kernel" and push.can_push_words(spec, tensors):
            with phase("push_kernel"):
                push.push_rows(self.region.local, self.region.delta16, self._rows_off, spec, tensors, src_X, cap,
                               self.rank, num_programs=self.num_programs)
        else:  # pack locally, then one copy-engine write per destination block
            with phase("pack"):
                send_XB = spec.pack(tensors, src_X, holes=True)
            for peer in range(num_ranks):
                block = send_XB[peer * cap: (peer + 1) * cap].reshape(-1)
                self.region.peer(peer, self._rows_off + self.rank * cap * rec, (block.numel(),),
                                 torch.uint8).copy_(block)
        self.barrier()
        return self.region.peer(self.rank, self._rows_off, (need,), torch.uint8).view(num_ranks * cap, rec)

    def _check_stage(self, need: int) -> None:
        """Raises: ValueError -- a staging area cannot hold `need` bytes (every rank computes the same `need`)."""
        if need > self.rows_capacity:
            raise every_rank(ValueError(
                f"EPBuffer: rank {self.rank}: the nvlink staging area holds {self.rows_capacity} bytes but this "
                f"call needs {need}; size the buffer with EPBuffer.get_buffer_size_hint for this shape "
                "(num_max_tokens_per_rank, hidden, num_topk, dtype)"))

    def _next_stage(self) -> int:
        """Byte offset of this call's staging area. The two alternate between eager calls; a captured call takes
        the area of the next eager call and does not advance the alternation, so the eager calls before and after a
        capture still use different areas (one barrier per eager call proves that peers finished the one before),
        however many calls the capture holds. Captured calls, and every call after a capture, wait for their peers
        before using their area (`move_fields`, `return_fields`)."""
        stage = self._stage_off[self._stage_calls % 2]
        if not streams.capturing(self.device):
            self._stage_calls += 1
        return stage

    def move_fields(self, moves: list, route, *, call_id: int, beside: tuple = ()) -> None:
        """Pull (transport/pull.py): stage my rows for the peers, barrier, copy my rows out of the peers' areas.

        Args and result as `Transport.move_fields`; `route.matrix` (the split matrix) is required.

        Raises:
            ValueError: the rows a rank stages exceed a staging area (`num_bytes` of the buffer).
        """
        plan = streams.memo(route.cache, "nvlink", lambda: PullPlan(route, self.rank, self.num_ranks, self.device))
        row_bytes = [moves_row_bytes(src) for src, _ in moves]
        self._check_stage(plan.stage_bytes(row_bytes))
        stage = self._next_stage()
        # A CUDA graph replays this call on one staging area, which is also the area of the eager call after the
        # capture, so the alternation that makes one barrier enough does not hold: every peer must have pulled out
        # of it (the replay before, or an eager call) before anyone stages into it again. So captured calls, and
        # every call after a capture, wait for their peers before staging; then no call needs a barrier after its
        # pulls (2x H200: 4-5 us less per replayed call).
        capturing = streams.capturing(self.device)
        if capturing or self._captured:
            self.barrier()
            self._captured = True
        # The second stream overlaps the own-rows gather and the pulls with the staging: a gain in a graph, but
        # eager calls on this kind of host are bound by launch cost, and the stream costs three more event waits.
        pull_fields(self, plan, moves, row_bytes, stage, capturing, self._stream("_side") if capturing else None,
                    beside)

    def return_fields(self, srcs: list, route, *, call_id: int, skip_own: bool = False) -> tuple:
        """The combine direction by a push (transport/push_back.py): my rows for each rank are one block of `srcs`,
        which the copy engines write straight into that rank's area; returns views of my area (borrowed until my
        next call), and in a CUDA graph one event per chunk (`Transport.return_fields`). Rows not in send order,
        or `EPCOMM_NVLINK_RETURN=pull`, take `move_fields`.

        Raises:
            ValueError: the rows a rank receives exceed a staging area (`num_bytes` of the buffer).
        """
        if route.src_X is not None or route.matrix is None or envs.nvlink_return() == "pull":
            return super().return_fields(srcs, route, call_id=call_id, skip_own=skip_own)
        plan = streams.memo(route.cache, "nvlink-return", lambda: ReturnPlan(route, self.rank, self.num_ranks))
        row_bytes = [moves_row_bytes(src) for src in srcs]
        self._check_stage(plan.area_bytes(row_bytes))
        stage = self._next_stage()
        capturing = streams.capturing(self.device)
        chunks = chunk_count(envs.return_chunks(), capturing, max(plan.num_recv) * sum(row_bytes),
                             _RETURN_CHUNKS_CAPTURED)
        if capturing or self._captured:
            # A graph replays this call on one area, which is also the area of the eager call after the capture:
            # every peer must have reduced what it read there (the replay before, or an eager call) before anyone
            # writes into it again, and a replay's last barrier proves only that peers arrived, not that they
            # finished reducing. So captured calls, and every call after a capture, wait for their peers.
            self.barrier()
            self._captured = True
        lanes = None  # (copies, signals) streams, or all on the current one
        if (capturing or chunks > 1) and self.device.type == "cuda":
            lanes = (self._stream("_side"), self._stream("_signals"))
        return return_fields(self, plan, srcs, row_bytes, stage, lanes, chunks, skip_own)

    def _stream(self, name: str) -> "torch.cuda.Stream":
        """The high-priority stream kept in attribute `name` (`_side`, `_signals`), made at first use."""
        if getattr(self, name) is None:
            setattr(self, name, torch.cuda.Stream(self.device, priority=-1))
        return getattr(self, name)

    def destroy(self) -> None:
        self.region = None

