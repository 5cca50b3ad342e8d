"""The latency-optimised low-latency (decode) path on the nvlink transport: one Triton kernel per call.

`low_latency_dispatch` sends (FP8 cast fused, each token written once per destination rank) and receives
(expands the rows into the expert-major output); `low_latency_combine` sends every expert output row back to its
token's rank and receives (the weighted sum). Each call is one kernel launch; ranks signal each other with flags in
symmetric memory, inside the kernel: no device barrier, no host synchronisation, nothing sized for more than the
call's tokens on the link. With `return_recv_hook=True` the call launches a send kernel and the hook launches the
receive kernel. Kernels: `kernels/_lowlatency_triton.py`.

Region of every rank, one per call shape and row format (`use_fp8`, `use_ue8m0`: its own symmetric allocation,
made collectively by the first low-latency call of the pair, after the ranks agree on both; `Layout`, `Area`):

    [ flags | counts: 2 x R x L int32 | arrivals: 2 x N x R int64 | dispatch rows: 2 x R x N rows
      | combine rows: 2 x N*K rows ]

Each area exists twice and calls alternate between the two by parity: call e of a kind reuses the area of call
e - 2, so that call must have been received (its hook called) before call e is issued (checked on the host: two
calls of a kind may be in flight, as in DeepEP V1). Results are identical to the portable path (`lowlatency.py`),
except that rows past `recv_count[e]` of the expert-major output are left unwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from .sizing import align, ceil_div, next_pow2
from .streams import capturing

_CHUNK = 1024  # (token, k) items compared per step when the send kernel ranks its items
# Blocks of 128 channels per dispatch program (a multiple of 4: UE8M0 packs four blocks per word). Splitting a
# row over several programs puts more loads and stores in flight at decode sizes.
_BLOCKS_PER_PROGRAM = 32
# Combine rows (top-k positions of one token) per send item. 2x H200, graph of 8 calls, p50 (lowlatency_sweep.py):
# 2 beats 4 at 1 and 128 tokens (11.2 / 36.2 us against 13.8 / 41.2) and loses 4-8 us at 256 (67.5-72.1 against
# 63.6).
_ROWS_PER_PROGRAM = 2
# Fused combine: programs per SM that send the rows for other ranks first (then, as every program, copy this rank's
# rows and receive).
# 2x H200, graph of 8 calls, p50 (lowlatency_sweep.py; benchmarks/results/decode-s12_*): 2 per SM is best or tied
# at 128 and 256 tokens (256: 58 us against 62-67 us with 8 per SM, i.e. every program sending; 1 per SM: 67-69 us).
_COMBINE_SENDERS_PER_SM = 2
# Fused kernels: at most this many programs per SM, fewer when the compiled kernel does not fit them (measured on
# 2x H200: 4 dispatch and 8 combine programs per SM beat 1 and 2 at 128-256 tokens).
_FUSED_PROGRAMS_PER_SM = 8


def hardware_fp8(device: torch.device) -> bool:
    """Whether the send kernels cast to FP8 with the hardware conversion: NVIDIA GPUs of compute capability 8.9
    and up (Triton has no `float8e4nv` below); elsewhere an integer spelling of the same rounding."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass(frozen=True)
class Layout:
    """Byte offsets of the low-latency region for one call shape (every rank computes the same)."""

    num_ranks: int
    num_max_tokens: int  # N
    hidden: int
    num_topk: int
    num_local_experts: int

    @property
    def num_blocks(self) -> int:
        return -(-self.hidden // 128)

    @property
    def scale_off(self) -> int:  # inside a dispatch row: data (BF16-sized) | fp32 scales | expert ids | positions
        return align(2 * self.hidden, 16)

    @property
    def meta_off(self) -> int:
        return self.scale_off + align(4 * self.num_blocks, 16)

    @property
    def row_bytes(self) -> int:
        return self.meta_off + align(8 * self.num_topk, 16)

    @property
    def crow_bytes(self) -> int:
        return align(2 * self.hidden, 16)

    hdr_off = 4096  # after the flags: [kind 2][ready/freed 2][parity 2][R] int64

    @property
    def arr_off(self) -> int:  # the combine's arrival counts: [parity 2][N][R] int64
        return self.hdr_off + align(2 * self.num_ranks * self.num_local_experts * 4, 4096)

    @property
    def rows_off(self) -> int:
        return self.arr_off + align(2 * self.num_max_tokens * self.num_ranks * 8, 4096)

    @property
    def comb_off(self) -> int:
        return align(self.rows_off + 2 * self.num_ranks * self.num_max_tokens * self.row_bytes, 4096)

    @property
    def nbytes(self) -> int:
        return align(self.comb_off + 2 * self.num_max_tokens * self.num_topk * self.crow_bytes, 1 << 21)


_KIND_NAMES = ("low_latency_dispatch", "low_latency_combine")


class CallBook:
    """The low-latency calls of one call shape: how many of each kind (0 dispatch, 1 combine) were issued, and which
    have a receive hook not yet called. Call e of a kind reuses what call e - 2 used (the nvlink area), so that call
    must have been received before call e is issued: two calls of a shape and kind may be in flight, as in DeepEP
    V1. Every transport keeps this rule, so code that runs on CPU runs on nvlink. `clean_low_latency_buffer`
    retires the book of a shape it resets (the shape starts again with a new one): the handles and hooks of its calls
    then raise instead of reading rows that are gone; so does `EPBuffer.destroy`."""

    CLEANED = ("clean_low_latency_buffer reset this call shape after the low_latency_dispatch / low_latency_combine "
               "this hook or handle belongs to; its rows are gone: make the call again")
    DESTROYED = "the buffer was destroyed before the hook was called"

    def __init__(self):
        self.issued = [0, 0]
        self.pending: list = [set(), set()]
        self.retired: Optional[str] = None  # why the book's hooks and handles raise now (CLEANED, DESTROYED)

    def next_call(self, kind: int, rank: int) -> int:
        """The index of the next call of `kind` (booked by `book` once it is launched).

        Raises:
            ValueError: the call two before has not been received (its hook was not called): on nvlink its rows
                would be overwritten, and the call would wait for it until the device timeout.
        """
        e = self.issued[kind]
        if e - 2 in self.pending[kind]:
            raise ValueError(f"EPBuffer.{_KIND_NAMES[kind]}: rank {rank}: the receive hook of the call two calls "
                             "before this one (same shape) has not been called; call it first (two calls of a shape "
                             "and kind may be in flight: call e reuses the area of call e - 2)")
        return e

    def book(self, kind: int, e: int, hook: bool, rank: int) -> Callable:
        """Record launched call `e`; returns `received()`, which its receive calls (once or more).

        `received()` raises ValueError once the book is retired (`clean_low_latency_buffer` reset the shape)."""
        self.issued[kind] = e + 1
        if hook:
            self.pending[kind].add(e)

        def received() -> None:
            self.check_not_retired(f"low-latency receive hook ({_KIND_NAMES[kind]})", rank)
            self.pending[kind].discard(e)
        return received

    def check_not_retired(self, call: str, rank: int) -> None:
        """Raises: ValueError -- `clean_low_latency_buffer` reset this shape after the call that made the hook or
        handle was issued, or the buffer was destroyed (`retired` says which)."""
        if self.retired is not None:
            raise ValueError(f"{call}: rank {rank}: {self.retired}")

    def received(self, e: int) -> bool:
        """Whether dispatch call `e` has been received (its hook called, or it had none)."""
        return e not in self.pending[0]


class Area:
    """One call shape and row format's region and its call state (a buffer keeps one per pair it has seen).

    Fields:
        layout: the `Layout`.
        local: [nbytes] uint8 -- this rank's region; delta16: [R] int64 -- every region's base relative to it, in
            16-byte units.
        state: [8] int64 (device) -- call counters (dispatch, combine) and the kernels' finish counters.
        calls: the `CallBook` of this shape (calls issued, hooks not yet called).
        send_items: per kind, the send items a rank does per call for each peer (dispatch) or for each token slot
            of each rank (combine), fixed at the first call: a receiver waits until a peer's `ready` count (dispatch)
            or a token's arrival count (combine) reaches (calls of this parity) x send_items.
    """

    def __init__(self, layout: Layout, local: Tensor, delta16: Tensor):
        self.layout, self.local, self.delta16 = layout, local, delta16
        self.send_items = [None, None]
        self.state = torch.zeros(8, dtype=torch.int64, device=local.device)
        self.calls = CallBook()

    def reset(self) -> None:
        """Back to the state of a new area (`clean_low_latency_buffer`; no kernel of it may be in flight on any
        rank): flags, counts and call counters zero, the send items not fixed yet, a new `CallBook`."""
        self.local.zero_()
        self.state.zero_()
        self.send_items = [None, None]
        self.calls.retired = CallBook.CLEANED
        self.calls = CallBook()


class LowLatencyNVLink:
    """Per-buffer state of the fast path: one `Area` per call shape and row format, and the timeout record.

    Fields:
        status: [1] int64 (host memory the GPU writes) -- 0, or 1 + the rank a wait timed out on.
    """

    def __init__(self, rank: int, num_ranks: int, device: torch.device, timeout_s: float, allocate: Callable):
        self.rank, self.num_ranks, self.device = rank, num_ranks, device
        self.timeout_ns = int(timeout_s * 1e9)
        self._allocate = allocate  # (layout, row format) -> (local, delta16): collective
        self.areas: dict = {}
        pinned = device.type == "cuda"
        self.status = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)
        self.use_timer = device.type == "cuda"
        self._no_cost = torch.zeros(1, dtype=torch.int64, device=device)  # the cost argument when none is given
        self.hw_fp8 = hardware_fp8(device)  # the send kernels' FP8 cast
        self._props = None  # CUDA device properties, read at the first fused launch
        self._per_sm: dict = {}  # fused kernel variant -> programs one SM holds (`_note_occupancy`)
        self.closed = False  # set by EPBuffer.destroy: pending hooks must not launch any more

    def check_status(self, call: str) -> None:
        """Raises: TimeoutError -- an earlier low-latency call of this buffer timed out waiting for a rank."""
        missing = int(self.status[0])
        if missing:
            raise TimeoutError(f"{call}: rank {self.rank}: an earlier low-latency call timed out after "
                               f"{self.timeout_ns / 1e9:g} s (num_gpu_timeout_secs) waiting for rank {missing - 1}; "
                               "the buffer is unusable, restart the process group")

    def prepare(self, layout: Layout, call: str, row_format: tuple = (False, False)) -> Area:
        """The area of this call shape and row format `(use_fp8, use_ue8m0)`, allocated (collectively, after the
        ranks agree on both) by the first call of the pair. Every pair has its own area: no header travels with a
        call, so ranks that pass another format to a later call wait for each other in different areas, and the
        bounded wait names the rank, rather than read rows of another format."""
        area = self.areas.get((layout, row_format))
        if area is not None:
            return area
        if capturing(self.device):
            raise ValueError(f"{call}: rank {self.rank}: the first low-latency call of a shape and row format "
                             f"(here N={layout.num_max_tokens}, hidden={layout.hidden}, top-k={layout.num_topk}, "
                             f"use_fp8={row_format[0]}, use_ue8m0={row_format[1]}) allocates symmetric memory and "
                             "cannot be captured; make one eager call of this shape and format before capturing a "
                             "CUDA graph")
        area = Area(layout, *self._allocate(layout, row_format))
        self.areas[(layout, row_format)] = area
        return area

    @staticmethod
    def _check_items(area: Area, kind: int, items: int) -> None:
        """The `ready` counts (dispatch) and arrival counts (combine) only add up if every call of an area does the
        same number of send items per peer (dispatch) or per token slot (combine), fixed by the layout and this
        module's program shapes, which must not change while the area lives."""
        if area.send_items[kind] is None:
            area.send_items[kind] = items
        elif area.send_items[kind] != items:
            raise RuntimeError(f"EPBuffer.{_KIND_NAMES[kind]}: this call would do {items} send items per "
                               f"{'peer' if kind == 0 else 'token slot'} where "
                               f"the earlier calls of this shape did {area.send_items[kind]}: the program shape "
                               "constants of epcomm.lowlatency_nvlink changed while the buffer was in use")

    def _once(self, launch: Callable, received: Callable) -> Callable:
        """The receive hook: launches the receive kernel at its first call; later calls do nothing.

        Raises:
            ValueError: the buffer was destroyed before the hook was called (its memory is gone).
        """
        done = [False]

        def hook() -> None:
            if self.closed:
                raise ValueError(f"low-latency receive hook: rank {self.rank}: the buffer was destroyed before the "
                                 "hook was called")
            if not done[0]:
                received()  # raises (and launches nothing) when clean_low_latency_buffer reset the shape
                done[0] = True
                launch()
        return hook

    def _common(self, lay: Layout) -> dict:
        return dict(N=lay.num_max_tokens, H=lay.hidden, K=lay.num_topk, R=self.num_ranks, USE_TIMER=self.use_timer,
                    R_POW2=1 << (self.num_ranks - 1).bit_length())

    # -- dispatch ----------------------------------------------------------------------------------
    def dispatch(self, area: Area, x: Tensor, topk_idx: Tensor, stats: Optional[Tensor], use_fp8: bool,
                 pow2_scales: bool, use_ue8m0: bool, hook: bool, cost: Optional[Tensor] = None):
        """Launch the call; returns `(recv_x, recv_count, item_map, call, receive)`. Without `hook`, one fused kernel
        does everything and `receive` is None; with it, the send kernel runs now and `receive()` launches the receive
        kernel. The receive fills recv_x, recv_count, the stats and item_map ([R * N * K] int32: the output row
        `e * R * N + row` of each (source rank, token, top-k) item, -1 for none), and adds to `cost` ([R] int64, or
        None) the nanoseconds its programs waited for each rank (`_signal_triton._wait_all_timed`); `call` is the
        call's index on the area (`area.calls.received(call)`)."""
        from .kernels import _lowlatency_triton as k

        e = area.calls.next_call(0, self.rank)
        lay = area.layout
        n, h, num_local, r = lay.num_max_tokens, lay.hidden, lay.num_local_experts, self.num_ranks
        rows = r * n
        nb = lay.num_blocks
        nbc = min(_BLOCKS_PER_PROGRAM, max(4, next_pow2(nb)))  # blocks of 128 channels per item
        num_c = ceil_div(nb, nbc)
        self._check_items(area, 0, n * num_c)
        topk = topk_idx if topk_idx.stride(1) == 1 else topk_idx.contiguous()
        x = x if x.stride(1) == 1 else x.contiguous()
        if use_fp8:
            data = torch.empty(num_local, rows, h, dtype=torch.float8_e4m3fn, device=self.device)
            cols = -(-nb // 4) if use_ue8m0 else nb
            scales = torch.empty(num_local, cols, rows, dtype=torch.int32 if use_ue8m0 else torch.float32,
                                 device=self.device)
            recv_x = (data, scales.transpose(1, 2))  # token-contiguous scales per expert
            out, scales_arg = data.view(torch.uint8), scales
        else:
            cols = nb
            out = torch.empty(num_local, rows, h, dtype=torch.bfloat16, device=self.device)
            recv_x, scales_arg = out, out
        count = torch.empty(num_local, dtype=torch.int32, device=self.device)
        item_map = torch.empty(rows * lay.num_topk, dtype=torch.int32, device=self.device)
        stats_arg = stats if stats is not None else count
        cost_arg = cost if cost is not None else self._no_cost  # not read without HAS_COST
        status = self.status.data_ptr()
        offsets = dict(hdr_off=lay.hdr_off, rows_off=lay.rows_off, row_bytes=lay.row_bytes,
                       scale_off=lay.scale_off, meta_off=lay.meta_off)
        shape = dict(L=num_local, USE_FP8=use_fp8, NBC=nbc, K_POW2=next_pow2(lay.num_topk), num_warps=4,
                     **self._common(lay))
        recv_opts = dict(UE8M0=use_ue8m0, HAS_STATS=stats is not None, HAS_COST=cost is not None, NB=nb,
                         L_POW2=next_pow2(num_local), SCALE_COLS=cols)
        if not hook:
            variant = ("dispatch", lay, use_fp8, pow2_scales, use_ue8m0, stats is not None, cost is not None)
            launched = k.dispatch_fused[(self._fused_grid(variant, rows * num_c),)](
                x, topk, area.local, area.delta16, area.state, status, out, scales_arg, count, stats_arg, item_map,
                cost_arg, x.shape[0], x.stride(0), topk.stride(0), self.rank, self.timeout_ns, **offsets,
                POW2_SCALES=pow2_scales, C=num_c, CHUNK=_CHUNK, HW_FP8=self.hw_fp8, **recv_opts, **shape)
            self._note_occupancy(variant, launched, 4)
            area.calls.book(0, e, hook, self.rank)
            return recv_x, count, item_map, e, None

        ticket = torch.empty(1, dtype=torch.int64, device=self.device)
        k.dispatch_send[(n, num_c)](
            x, topk, area.local, area.delta16, area.state, ticket, status, x.shape[0], x.stride(0), topk.stride(0),
            self.rank, self.timeout_ns, **offsets, POW2_SCALES=pow2_scales, CHUNK=_CHUNK, HW_FP8=self.hw_fp8, **shape)
        received = area.calls.book(0, e, hook, self.rank)

        def launch() -> None:
            k.dispatch_recv[(rows, num_c)](
                area.local, area.delta16, area.state, ticket, status, out, scales_arg, count, stats_arg, item_map,
                cost_arg, self.rank, self.timeout_ns, **offsets, **recv_opts, **shape)

        return recv_x, count, item_map, e, self._once(launch, received)

    # -- combine -----------------------------------------------------------------------------------
    def combine(self, area: Area, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, item_map: Tensor, out: Tensor,
                hook: bool, cost: Optional[Tensor] = None):
        """Launch the call (one fused kernel, or the send kernel now and `receive()` later, as `dispatch`); the
        weighted sums land in `out` ([T, H] bf16) and the waits for each rank add to `cost` (as `dispatch`).
        Returns `receive` or None."""
        from .kernels import _lowlatency_triton as k

        e = area.calls.next_call(1, self.rank)
        lay = area.layout
        x = x if x.is_contiguous() else x.contiguous()
        target = out if out.stride(1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
        send_block = min(2048, next_pow2(lay.hidden))
        num_ch = next_pow2(ceil_div(lay.hidden, send_block))
        kp = _ROWS_PER_PROGRAM
        num_kb = ceil_div(lay.num_topk, kp)
        self._check_items(area, 1, num_kb)
        recv_block = min(1024, next_pow2(lay.hidden))
        num_hc = ceil_div(lay.hidden, recv_block)
        topk = topk_idx if topk_idx.stride(1) == 1 else topk_idx.contiguous()
        weights = topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous()
        num_tokens = topk.shape[0]
        status = self.status.data_ptr()
        offsets = dict(comb_off=lay.comb_off, arr_off=lay.arr_off, crow_bytes=lay.crow_bytes)
        cost_arg = cost if cost is not None else self._no_cost  # not read without HAS_COST
        if not hook:
            num_items = max(self.num_ranks * lay.num_max_tokens * num_kb, num_tokens * num_hc)
            variant = ("combine", lay, cost is not None)
            grid = self._fused_grid(variant, num_items)
            senders = grid if self._props is None else _COMBINE_SENDERS_PER_SM * self._props.multi_processor_count
            launched = k.combine_fused[(grid,)](
                x, item_map, topk, weights, target, area.local, area.delta16, area.state, status, cost_arg, num_tokens,
                topk.stride(0), weights.stride(0), target.stride(0), self.rank, self.timeout_ns, senders, **offsets,
                SEND_BLOCK_H=send_block, NUM_CH=num_ch, KP=kp, KB=num_kb, BLOCK_H=recv_block, HC=num_hc,
                HAS_COST=cost is not None, num_warps=4, enable_fp_fusion=False, **self._common(lay))
            self._note_occupancy(variant, launched, 4)
            area.calls.book(1, e, hook, self.rank)
            if target is not out:
                out.copy_(target)
            return None

        ticket = torch.empty(1, dtype=torch.int64, device=self.device)
        k.combine_send[(self.num_ranks * lay.num_max_tokens, num_kb)](
            x, item_map, area.local, area.delta16, area.state, ticket, status, self.rank, self.timeout_ns, **offsets,
            BLOCK_H=send_block, NUM_CH=num_ch, KP=kp, num_warps=4, **self._common(lay))
        received = area.calls.book(1, e, hook, self.rank)

        def launch() -> None:
            k.combine_recv[(max(num_tokens, 1), num_hc)](
                topk, weights, target, area.local, area.delta16, area.state, ticket, status, cost_arg, num_tokens,
                topk.stride(0), weights.stride(0), target.stride(0), self.rank, self.timeout_ns, **offsets,
                BLOCK_H=recv_block, KB=num_kb, HAS_COST=cost is not None, num_warps=4, enable_fp_fusion=False, **self._common(lay))
            if target is not out:
                out.copy_(target)

        return self._once(launch, received)

    def _fused_grid(self, variant: tuple, num_items: int) -> int:
        """Programs of a fused kernel. Each waits for every program's sends, so all must be resident at once: the
        first launch of a variant (kernel, layout, options) uses one program per SM (always resident), later ones
        as many as the compiled kernel's registers and shared memory let every SM hold (`_note_occupancy`), at
        most `_FUSED_PROGRAMS_PER_SM`. The interpreter runs programs one after another, so it gets one."""
        if self.device.type != "cuda":
            return 1
        if self._props is None:
            self._props = torch.cuda.get_device_properties(self.device)
        per_sm = min(_FUSED_PROGRAMS_PER_SM, self._per_sm.get(variant, 1))
        return max(1, min(num_items, per_sm * self._props.multi_processor_count))

    def _note_occupancy(self, variant: tuple, launched, num_warps: int) -> None:
        """Programs of `launched` (a compiled Triton kernel) that one SM holds at once, by threads, registers and
        shared memory (registers rounded up to whole 256-register warp allocations)."""
        regs = getattr(launched, "n_regs", None)
        if regs is None or self._props is None:
            return
        threads = 32 * num_warps
        props = self._props
        max_threads = getattr(props, "max_threads_per_multi_processor", 2048)
        regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
        smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
        warp_regs = -(-max(regs, 1) * 32 // 256) * 256
        shared = getattr(getattr(launched, "metadata", None), "shared", 0) or 0
        fit = min(max_threads // threads, regs_per_sm // (warp_regs * num_warps),
                  smem_per_sm // shared if shared else max_threads // threads)
        self._per_sm[variant] = max(1, fit)
