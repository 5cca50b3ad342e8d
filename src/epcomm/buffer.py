"""`EPBuffer`: DeepEP's expert-parallel buffer API on any process group (DeepEP V2.5 EPBuffer behaviour, §7-11).

The buffer resolves and validates arguments, runs the stream/event protocol, and drives the data path of
`pipeline.py` (layout -> transport -> epilogue). It lives on one device, fixed at construction from the group's
backend: CPU with gloo, the current CUDA device with NCCL (docs/decisions.md decision 2).

Argument checks live in `resolve.py`, the stream protocol in `streams.py`, the data path in `pipeline.py`; this
file is over the ~500-line guide only because dispatch and combine document every argument (the field's docstring convention: every argument with shape, dtype, default and errors).
"""

from __future__ import annotations

import contextlib
import operator
import secrets
import socket
import warnings
import zlib
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import (agreement, debug, deepep_v1, envs, exact_nvlink, pipeline, resolve, sizing, streams, syncfree_nvlink,
               waits)
from .allocator import BufferAllocator
from .comm import group_device, new_comm_stream
from .compile_guard import eager_under_compile
from .events import EventHandle
from .handle import EPHandle
from .lb import LoadBalancingMixin
from .lowlatency import LowLatencyMixin
from .lowlatency_nvlink import CallBook
from .transport import TransportTimeout, resolve_transport
from .waits import PeerFailed
from .transport import symm
from .transport.collective import CollectiveTransport
from .validate import (Checker, check_event_options, check_topk_values, construction_timeout, process_group,
                       warn_caller)

DEFAULT_DTYPE = torch.bfloat16
_TRANSPORT_CODES = {"auto": 0, "collective": 1, "nvlink": 2}
# Construction arguments every rank must pass alike, checked in this order: the MoE shape and options the caller
# passed, then the region size they imply (a caller who passed none sees the argument that differs, not num_bytes).
# DeepEP V1's Buffer(group, num_nvl_bytes, num_rdma_bytes) binds its byte counts to num_bytes and
# num_max_tokens_per_rank here: messages about those arguments say so.
_V1_HINT = ("; DeepEP V1's Buffer(group, num_nvl_bytes, num_rdma_bytes) does not map argument by argument: "
            "EPBuffer(group, num_max_tokens_per_rank=N, hidden=H, num_topk=K) sizes itself (docs/porting.md)")

_AGREED_OPTIONS = ("num_max_tokens_per_rank", "hidden", "num_topk", "dtype", "use_fp8_dispatch",
                   "allow_multiple_reduction", "num_bytes")
_FLAGS = ("use_fp8_dispatch", "allow_multiple_reduction")


class EPBuffer(LoadBalancingMixin, LowLatencyMixin):
    """Expert-parallel dispatch/combine buffer for one process group (collective: every rank constructs it).

    Every rank passes the same `num_max_tokens_per_rank`, `hidden`, `num_topk`, `dtype`, `use_fp8_dispatch`,
    `allow_multiple_reduction`, `num_bytes` and `transport` (what sizes or lays out the buffer; checked here, a
    `ValueError` on every rank); the others, such as the timeouts, `deterministic`, `allow_hybrid_mode`, `sl_idx` and
    `num_allocated_qps`, may differ between ranks (docs/decisions.md "What ranks must agree on").

    Args:
        group: the EP process group; None for the default (world) group. Messages use group ranks.
        num_bytes: capacity in bytes, a positive multiple of 2 MiB; None to size it from the MoE shape below
            with `get_buffer_size_hint`. The nvlink transport allocates three areas of this size in symmetric
            memory (the sync-free receive area and two staging areas that CPU-synced calls use in turn).
        num_max_tokens_per_rank: default capacity `N` of later calls (tokens per rank), in
            [0, (2**31 - 1) // group size] (0: pass it to each dispatch); with `num_bytes=None` it must be > 0.
        hidden: hidden size used for sizing (with `num_bytes=None`, must be > 0).
        num_topk: top-k used for sizing; 0 sizes for 32.
        use_fp8_dispatch: size dispatch records for FP8 data + scales.
        lb_allocation_plan_or_num_bytes: the load-balancing region (reference §6-7): a byte count (a multiple of
            2 MiB, >= 0), or an `epcomm.BufferAllocator` plan, not yet materialized, whose tensors become views
            of the region. The buffer allocates it as `lb_storage` ([num_lb_bytes] uint8, zero-filled, on its
            device) and materializes the plan on it; see docs/load_balancing.md.
        deterministic: accepted; epcomm is always deterministic (docs/decisions.md decision 4).
        allow_hybrid_mode: accepted; epcomm reports one logical domain `(1, world)`.
        allow_multiple_reduction: expand-layout combine sums each rank's rows before sending them back
            (default); False sends every row back and reduces once at the origin.
        prefer_overlap_with_compute: input of the SM-count model (`get_theoretical_num_sms`).
        sl_idx: RDMA service level; accepted, no effect (no RDMA layer).
        num_allocated_qps: accepted for API compatibility (0 = automatic); `num_qps` of calls must not exceed it.
        num_cpu_timeout_secs: bound on every host wait for peers; a peer that does not arrive raises
            `TimeoutError` naming the missing group ranks. Default 300.
        num_gpu_timeout_secs: bound on device-side waits of GPU transports. Default 100.
        explicitly_destroy: warn at garbage collection when `destroy()` was not called.
        transport: "auto" (fastest that applies) or a name ("collective", "nvlink"). epcomm keyword.
        dtype: element type the buffer is sized for (default bf16, the reference's); a larger dtype needs
            more bytes. epcomm keyword.

    Attributes (besides the arguments): `rank`, `num_ranks`, `device`; `uid`, an id every rank of the buffer
    shares (messages about calls on two buffers of one group show it).

    Raises:
        TypeError: `lb_allocation_plan_or_num_bytes` is neither an int nor a `BufferAllocator`.
        ValueError: bad sizes, a materialized plan, a transport that cannot run here.
        TimeoutError: a peer did not construct its buffer within `num_cpu_timeout_secs`.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        num_bytes: Optional[int] = None,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        lb_allocation_plan_or_num_bytes: Union[int, BufferAllocator] = 0,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: Optional[int] = None,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: float = 300,
        num_gpu_timeout_secs: float = 100,
        explicitly_destroy: bool = False,
        *,
        transport: str = "auto",
        dtype: torch.dtype = DEFAULT_DTYPE,
    ):
        self.group = process_group("EPBuffer", group)
        self.rank_idx = self.rank = self.group.rank()
        # A construction is collective: on a group holding a pending collective it would meet that one.
        waits.require_group_usable(self.group, f"EPBuffer construction: rank {self.rank}")
        self.num_ranks = self.group.size()
        self.device = group_device(self.group)
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.sl_idx = sl_idx
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self.explicitly_destroy = explicitly_destroy
        self.dtype = dtype
        self._destroyed = False
        c = Checker("EPBuffer", self.rank, self.device)
        err = None
        try:  # local checks; the rendezvous below makes every rank raise together
            c.timeouts(num_cpu_timeout_secs, num_gpu_timeout_secs)
            if dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
                c.fail(TypeError, f"dtype must be a float dtype the buffer is sized for (bf16, fp16, fp32, fp64), "
                                  f"got {dtype}")
            c.require(transport in _TRANSPORT_CODES, f"transport={transport!r} is unknown; expected one of "
                                                     f"{sorted(_TRANSPORT_CODES)}")
            num_topk = c.integer("num_topk", num_topk)
            num_max_tokens_per_rank = c.integer("num_max_tokens_per_rank", num_max_tokens_per_rank)
            most = (2 ** 31 - 1) // self.num_ranks  # token keys src_rank * N + src_token are int32
            c.require(0 <= num_max_tokens_per_rank <= most,
                      f"num_max_tokens_per_rank must be in [0, {most}] (0: pass it to each dispatch; token keys "
                      f"src_rank * N + src_token are int32), got {num_max_tokens_per_rank}"
                      + (_V1_HINT if num_max_tokens_per_rank > most else ""))
            hidden = c.integer("hidden", hidden)
            num_bytes = None if num_bytes is None else c.integer("num_bytes", num_bytes)
            num_allocated_qps = c.integer("num_allocated_qps", num_allocated_qps)
            c.require(num_allocated_qps >= 0, f"num_allocated_qps must be >= 0 (0 = automatic), got "
                                              f"{num_allocated_qps}")
            c.require(0 <= num_topk <= sizing.MAX_TOPK, f"num_topk must be in [0, {sizing.MAX_TOPK}] (0 sizes for "
                                                        f"{sizing.MAX_TOPK}; every call's top-k is at most "
                                                        f"{sizing.MAX_TOPK}), got {num_topk}")
            if num_bytes is None:
                c.require(num_max_tokens_per_rank > 0 and hidden > 0,
                          f"num_bytes=None sizes the buffer from the MoE shape: num_max_tokens_per_rank (got "
                          f"{num_max_tokens_per_rank}) and hidden (got {hidden}) must be > 0")
                num_bytes = self.get_buffer_size_hint(self.group, num_max_tokens_per_rank, hidden, num_topk,
                                                      use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction,
                                                      dtype=dtype)
            c.require(isinstance(num_bytes, int) and num_bytes > 0
                      and num_bytes % sizing.ALLOCATION_ALIGNMENT == 0,
                      f"num_bytes must be a positive multiple of 2 MiB ({sizing.ALLOCATION_ALIGNMENT}), got "
                      f"{num_bytes} (EPBuffer.get_buffer_size_hint gives one)" + _V1_HINT)
            # Sets num_lb_bytes, lb_allocation_plan and lb_storage; materializes a plan (local, lb.py).
            self._init_lb_region(lb_allocation_plan_or_num_bytes)
            try:
                envs.check_all()
            except ValueError as e:
                c.fail(ValueError, str(e))  # with the call and the rank, as every other message
        except (TypeError, ValueError) as e:
            err = e
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        self.num_topk = num_topk
        self.use_fp8_dispatch = use_fp8_dispatch
        self.num_allocated_qps = num_allocated_qps or (65 if allow_hybrid_mode else 17)
        # Collective construction: agree on a buffer id, learn which ranks share a host and whether every rank
        # can reach every other over NVLink, then pick the transport (every rank decides from the same rows).
        timeout = construction_timeout(num_cpu_timeout_secs, err)
        self.transport = CollectiveTransport(self.group, self.device, timeout, uid=0)
        with self._lb_plan_released_on_failure():  # a failed construction leaves the plan as it was passed
            self.uid, rows = self._rendezvous(err, _TRANSPORT_CODES.get(transport, -1))
            self.transport.uid = self.uid
            hosts = [row[1] for row in rows]
            self.num_nvlink_ranks = sum(1 for h in hosts if h == hosts[self.rank])
            self.num_rdma_ranks = self.num_ranks // self.num_nvlink_ranks \
                if self.num_ranks % self.num_nvlink_ranks == 0 else self.num_ranks
            unavailable = {}
            if len(set(hosts)) > 1:
                unavailable["nvlink"] = "its ranks are on several hosts"
            elif not all(row[3] for row in rows):
                bad = [s for s, row in enumerate(rows) if not row[3]]
                unavailable["nvlink"] = (f"group ranks {bad} have no peer access to every other GPU or no symmetric "
                                         "memory")
            try:
                transport_cls = resolve_transport(transport, self.device, unavailable)
            except ValueError as e:  # every rank decides from the same rows, so every rank raises here
                raise ValueError(str(e).replace("EPBuffer: ", f"EPBuffer: rank {self.rank}: ", 1)) from None
            if transport_cls is not CollectiveTransport:
                # The blocked layout needs R x N records of the widest kind in the receive area.
                blocked_bytes = self.num_ranks * num_max_tokens_per_rank * sizing.record_bytes(
                    hidden * dtype.itemsize, 0, num_topk or sizing.MAX_TOPK, True)
                self.transport = transport_cls(self.group, self.device, num_cpu_timeout_secs, self.uid,
                                               num_bytes=num_bytes, gpu_timeout_s=num_gpu_timeout_secs,
                                               min_rows_bytes=blocked_bytes)
            self._lb_attach_transport()  # collective: on nvlink the LB region moves into symmetric memory (lb.py)
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank
        self._comm_stream = new_comm_stream(self.device)
        self._order = streams.CallOrder(self.device, self._comm_stream)  # which stream each call runs on
        self._call_id = 0
        self.transport.on_calls_differ = self._take_back_call_id
        self._pending_deferred = False
        self._shapes_that_fit: set = set()  # call shapes check_capacity found within num_bytes
        self._broken: Optional[str] = None
        self._warned: set = set()
        self._num_sms_cache: dict = {}
        debug.log(f"EPBuffer rank {self.rank}/{self.num_ranks} on {self.device}: transport={self.transport.name}, "
                  f"num_bytes={num_bytes}, num_max_tokens_per_rank={num_max_tokens_per_rank}, dtype={dtype}")

    # -- construction helpers ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _lb_plan_released_on_failure(self):
        """Release the LB plan this rank materialized (`BufferAllocator.release`) if the collective part of the
        construction raises, so that every rank's plan is as passed and the same plans can be passed again."""
        try:
            yield
        except BaseException:
            plan = getattr(self, "lb_allocation_plan", None)
            if plan is not None and plan.materialized:
                plan.release()
            raise

    def _rendezvous(self, err: Optional[BaseException], transport_code: int) -> tuple:
        """One bounded exchange: rank 0's draw from the OS's entropy names the buffer (not Python's `random`,
        which training scripts seed alike on every rank: two groups' buffers would share an id); each rank
        reports its host, device, whether it can reach every other GPU of the host (peer access and symmetric
        memory), its own check result and the transport it asked for. Every rank raises when one failed or they
        disagree."""
        host = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
        dev = self.device.index if self.device.type == "cuda" else -1
        status = agreement.status_of(err)
        ready = int(err is None and _nvlink_ready(self.device))
        options = [_as_int(v) for v in self._agreed_options().values()] + list(envs.agreed_values().values()) \
            if err is None else [0] * (len(_AGREED_OPTIONS) + len(envs.AGREED))
        mine = torch.tensor([secrets.randbits(62), host, dev, ready, status, transport_code, *options],
                            dtype=torch.int64, device=self.device)
        try:
            rows = self.transport.exchange_counts(mine.expand(self.num_ranks, mine.numel()).contiguous(), wait=True,
                                                  call_id=0, kind="EPBuffer construction",
                                                  label="EPBuffer construction")
        except TimeoutError as e:  # name the call: the transport's message starts with its own step
            raise type(e)(f"EPBuffer construction: {e}") from None
        rows = rows.tolist()
        failed = [s for s, row in enumerate(rows) if row[4] != agreement.STATUS_OK]
        if failed:
            messages = agreement.gather_messages(  # call 1: a timeout here must not see the keys of call 0
                lambda t: self.transport.exchange_counts(t, wait=True, call_id=1, what="error messages",
                                                         label="EPBuffer construction"),
                str(err) if err is not None else "", self.num_ranks, self.device)
            self._destroyed = True
            if err is not None:
                raise err
            exc = TypeError if rows[failed[0]][4] == agreement.STATUS_TYPE else ValueError
            raise exc(agreement.rejected("EPBuffer", self.rank, failed, messages, "the construction",
                                                 group=self.group))
        for col, name in enumerate(_AGREED_OPTIONS, start=6):  # the arguments first, the size they imply last
            values = [row[col] for row in rows]
            sized = [v or sizing.MAX_TOPK for v in values] if name == "num_topk" else values  # 0 sizes for 32
            if len(set(sized)) > 1:  # one region size, one default capacity, one combine layout per buffer
                self._destroyed = True
                shown = [agreement.DTYPE_NAMES.get(v, '?') if name == "dtype" else bool(v) if name in _FLAGS
                         else "0 (sizes for 32)" if name == "num_topk" and v == 0 else v for v in values]
                desc = ", ".join(f"rank {s}: {v}" for s, v in enumerate(shown))
                raise ValueError(f"EPBuffer: rank {self.rank}: ranks disagree on {name} ({desc}); every rank must "
                                 f"construct the buffer with the same {name}")
        asked = [row[5] for row in rows]
        if len(set(asked)) > 1:
            self._destroyed = True
            names = {v: k for k, v in _TRANSPORT_CODES.items()}
            desc = ", ".join(f"rank {s}: {names.get(a, '?')!r}" for s, a in enumerate(asked))
            raise ValueError(f"EPBuffer: rank {self.rank}: ranks disagree on transport ({desc}); every rank must "
                             "pass the same transport")
        for col, name in enumerate(envs.AGREED, start=6 + len(_AGREED_OPTIONS)):
            values = [row[col] for row in rows]
            if len(set(values)) > 1:  # on nvlink they choose kernels and barrier counts (envs.agreed_values)
                self._destroyed = True
                desc = ", ".join(f"rank {s}: {envs.shown(name, v)}" for s, v in enumerate(values))
                raise ValueError(f"EPBuffer: rank {self.rank}: ranks disagree on {name} ({desc}); every rank must set "
                                 f"the same {name} (or leave it unset everywhere)")
        return rows[0][0], rows

    def _agreed_options(self) -> dict:
        """The construction arguments every rank must pass alike (`_AGREED_OPTIONS`, in that order), as ints."""
        values = dict(num_max_tokens_per_rank=self.num_max_tokens_per_rank, hidden=self.hidden, num_topk=self.num_topk,
                      dtype=agreement.dtype_code(self.dtype), use_fp8_dispatch=int(bool(self.use_fp8_dispatch)),
                      allow_multiple_reduction=int(bool(self.allow_multiple_reduction)), num_bytes=self.num_bytes)
        return {name: values[name] for name in _AGREED_OPTIONS}

    # -- sizing and hints ----------------------------------------------------------------------------
    @staticmethod
    def get_buffer_size_hint(
        group: Optional[dist.ProcessGroup],
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        *,
        dtype: torch.dtype = DEFAULT_DTYPE,
    ) -> int:
        """Bytes a buffer needs for this MoE shape (reference §4.3); a multiple of 2 MiB. Allocates nothing.

        Args:
            group: the EP group (only its size is used), or an int number of ranks.
            num_max_tokens_per_rank: tokens per rank per call (> 0).
            hidden: hidden size (> 0).
            num_topk: top-k; 0 sizes for 32.
            use_fp8_dispatch: FP8 data + scales in dispatch records.
            allow_hybrid_mode: accepted (epcomm has one logical domain).
            allow_multiple_reduction: as the constructor argument.
            dtype: element type of the non-FP8 payload (epcomm keyword); bf16 gives the reference's value.

        Returns:
            int -- bytes, a multiple of 2 MiB.

        Raises:
            TypeError: a group that is neither a ProcessGroup, None nor an int; sizes that are not ints.
            ValueError: non-positive sizes or number of ranks, num_topk outside [0, 32], group=None without an
                initialized default process group.
        """
        call = "EPBuffer.get_buffer_size_hint"
        if not isinstance(group, (dist.ProcessGroup, type(None), bool)):
            try:
                group = operator.index(group)  # an int number of ranks (numpy ints too)
            except TypeError:
                pass
        if isinstance(group, bool) or not isinstance(group, (int, dist.ProcessGroup, type(None))):
            raise TypeError(f"{call}: group must be a ProcessGroup, None (the default group) or an int number of "
                            f"ranks, got {type(group).__name__}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{call}: dtype must be a torch.dtype, got {type(dtype).__name__}")
        if group is None and not dist.is_initialized():
            raise ValueError(f"{call}: group=None needs an initialized default process group; pass the number of "
                             "ranks instead")
        num_ranks = group if isinstance(group, int) else (group or dist.group.WORLD).size()
        sizes = {}
        for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden),
                            ("num_topk", num_topk)):
            try:
                sizes[name] = operator.index(value)  # ints, numpy ints
            except TypeError:
                raise TypeError(f"{call}: {name} must be an int, got {type(value).__name__}") from None
            if isinstance(value, bool):
                raise TypeError(f"{call}: {name} must be an int, got bool")
        num_max_tokens_per_rank, hidden, num_topk = sizes.values()
        if num_ranks <= 0 or num_max_tokens_per_rank <= 0 or hidden <= 0:
            raise ValueError(f"{call}: the number of ranks ({num_ranks}), num_max_tokens_per_rank "
                             f"({num_max_tokens_per_rank}) and hidden ({hidden}) must be > 0")
        if not 0 <= num_topk <= sizing.MAX_TOPK:
            raise ValueError(f"{call}: num_topk must be in [0, {sizing.MAX_TOPK}] (0 sizes for {sizing.MAX_TOPK}), "
                             f"got {num_topk}")
        return sizing.buffer_size_hint(num_ranks, num_max_tokens_per_rank, hidden, num_topk=num_topk,
                                       use_fp8_dispatch=use_fp8_dispatch,
                                       allow_multiple_reduction=allow_multiple_reduction, elem_size=dtype.itemsize)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 0,
                                sm_write_gbs: float = 0) -> int:
        """SM count the reference's model suggests for a balanced gate (reference §8.2); a hint.

        On CPU it returns the model's value for an H200-class NVLink (no SMs are used).

        Args:
            num_experts: E; num_topk: K.
            num_scaleout_topk: must be 0 (one logical domain).
            rdma_gbs: accepted, unused (no RDMA layer).
            nvlink_gbs: NVLink GB/s per direction; 0 = 0.9 x nominal for known GPUs.
            sm_read_gbs, sm_write_gbs: per-SM rates; 0 = 180 / 45 GB/s.

        Returns:
            int -- a multiple of 4 in [4, device SMs].

        Raises:
            ValueError: `num_scaleout_topk != 0` (one logical domain).
        """
        if num_scaleout_topk != 0:
            raise ValueError(f"EPBuffer.get_theoretical_num_sms: num_scaleout_topk must be 0, got {num_scaleout_topk}")
        key = (num_experts, num_topk, nvlink_gbs, sm_read_gbs, sm_write_gbs)
        if key not in self._num_sms_cache:
            device_sms = sizing.device_sms(self.device) \
                if self.device.type == "cuda" else 132
            gbs = nvlink_gbs or sizing.default_nvlink_gbs(self.device) or 0.9 * 18 * 26.5625
            self._num_sms_cache[key] = sizing.theoretical_num_sms(
                self.num_ranks, num_experts, num_topk, gbs, device_sms, sm_read_gbs=sm_read_gbs or 180.0,
                sm_write_gbs=sm_write_gbs or 45.0, prefer_overlap_with_compute=self.prefer_overlap_with_compute)
        return self._num_sms_cache[key]

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """`min(num_sms, 9, num_allocated_qps)`: the reference's direct-mode value (§8.3), whatever
        `allow_hybrid_mode`, since epcomm always runs one logical domain; epcomm itself uses no QPs."""
        return min(min(num_sms, 9), self.num_allocated_qps)

    def get_physical_domain_size(self) -> tuple:
        """`(num_rdma_ranks, num_nvlink_ranks)`: hosts and ranks per host of this group (reference §2)."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self, allow_hybrid_mode: Optional[bool] = None) -> tuple:
        """Always `(1, world)`: one logical domain, the canonical order (docs/decisions.md decision 4)."""
        return 1, self.num_ranks

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The buffer's high-priority communication stream; None on CPU."""
        return self._comm_stream

    @staticmethod
    def capture() -> EventHandle:
        """An event on the current stream (completed on CPU), e.g. for `previous_event`."""
        return EventHandle()

    @eager_under_compile
    def barrier(self, wait_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True,
                context_idx: Optional[int] = None) -> None:
        """Barrier over the group (collective; reference §17.1). Blocks the host, at most `num_cpu_timeout_secs`.

        The barrier is a header exchange like dispatch's, so a rank that is in another call (dispatch, combine,
        destroy) makes every rank raise `ValueError` naming the disagreement instead of waiting.

        Args:
            wait_comm_stream: order the comm stream with the current stream on both sides of the barrier (CUDA).
            with_cpu_sync: synchronise the device before and after.
            sequential, context_idx: accepted for API compatibility (one context, one domain).

        Returns:
            None, once every rank has arrived.

        Raises:
            ValueError: use after destroy; ranks in different calls.
            TimeoutError: a peer did not arrive within `num_cpu_timeout_secs`.
        """
        self._barrier("EPBuffer.barrier", agreement.OP_BARRIER, wait_comm_stream, with_cpu_sync)

    def _barrier(self, name: str, op: int, wait_comm_stream: bool = True, with_cpu_sync: bool = False,
                 signature: Optional[dict] = None, err: Optional[BaseException] = None) -> None:
        """The barrier's exchange (on every transport and device) carries `signature` beside the op, and `err`, this
        rank's failed check: every rank raises when one failed or they disagree."""
        self._check_alive(name)
        cuda = self.device.type == "cuda"
        if cuda and with_cpu_sync:
            torch.cuda.synchronize(self.device)
        if cuda and wait_comm_stream:
            torch.cuda.current_stream().wait_stream(self._comm_stream)
        call_id = self._next_call_id()
        head = agreement.header(agreement.status_of(err), call_id, {"op": op} | (signature or {}), self.uid)
        try:
            recv = streams.ordered_exchange(self.transport, self._order, self.device,
                                            agreement.pack(head, None, self.num_ranks, self.device), call_id,
                                            label=name)
        except TimeoutError as e:
            self._mark_broken(name, e)
        self.agree(name, recv.tolist(), err)
        if cuda and wait_comm_stream:
            self._comm_stream.wait_stream(torch.cuda.current_stream())
        if cuda and with_cpu_sync:
            torch.cuda.synchronize(self.device)

    def _mark_broken(self, name: str, e: TimeoutError) -> None:
        """After a timeout the group holds an unmatched collective: the buffer and its group cannot be used again."""
        self._break_group(f"{name} timed out" if not isinstance(e, PeerFailed) else f"{name}: a peer failed during it")
        raise (PeerFailed if isinstance(e, PeerFailed) else TransportTimeout)(f"{name}: {e}") from e

    def _after_agreement(self, name: str, call_id: int, e: BaseException,
                         err: Optional[BaseException] = None) -> None:
        """Raise `e`, an error of call `name` after the ranks agreed on it, the way it calls for: a timeout breaks
        the buffer and its group (`_mark_broken`); `err` (this rank's own error before the header, which every rank
        saw there) and an error every rank raises together (`agreement.every_rank`: nothing is pending) pass as
        they are; any other is this rank's own (`_fail_mid_call`)."""
        if isinstance(e, TimeoutError):
            self._mark_broken(name, e)
        if e is err or agreement.raised_everywhere(e):
            raise e
        self._fail_mid_call(name, call_id, e)

    def _fail_mid_call(self, name: str, call_id: int, e: BaseException) -> None:
        """An error of this rank's own after the ranks agreed on the call (`waits.fail_mid_call`): the buffer and
        its group are broken, the peers learn it from the store; re-raises `e` (or `PeerFailed` for an earlier
        failure of a peer)."""
        waits.fail_mid_call(e, uid=self.uid, call_id=call_id, rank=self.rank, call=name, owner="EPBuffer",
                            group=self.group, mark_broken=self._break_group)

    def _break_group(self, reason: str) -> None:
        """This buffer, and every epcomm buffer on its process group in this process, refuse later calls: the group
        holds a collective that will not complete, and a new one on it would meet it (gloo aborts on that)."""
        self._broken = reason
        waits.break_group(self.group, reason)

    def print_memory_usage(self) -> None:
        """Print the buffer's accounted sizes (GiB)."""
        self._check_alive("EPBuffer.print_memory_usage")
        gib = 1 << 30
        region = getattr(getattr(self.transport, "region", None), "nbytes", 0)
        print(f"EPBuffer rank {self.rank}: buffer {self.num_bytes / gib:.3f} GiB, LB region "
              f"{self.num_lb_bytes / gib:.3f} GiB, transport {self.transport.name} on {self.device}"
              + (f" (symmetric memory {region / gib:.3f} GiB)" if region else ""))

    # -- lifecycle -----------------------------------------------------------------------------------
    @eager_under_compile
    def destroy(self) -> None:
        """Release the buffer (collective: every rank must call it). A second call is a no-op."""
        if self._destroyed:
            return
        if self._broken is None and waits.group_broken(self.group) is None:  # else: no collective can complete there
            self._barrier("EPBuffer.destroy", agreement.OP_DESTROY)
        self.transport.destroy()
        if getattr(self, "_ll_nvlink", None) is not None:
            self._ll_nvlink.closed = True  # pending receive hooks must not launch into freed memory
        for book in (getattr(self, "_ll_calls", None) or {}).values():  # the portable path's hooks and handles
            book.retired = CallBook.DESTROYED
        self._ll_nvlink, self._ll_regions = None, []  # the low-latency areas (lowlatency.py)
        self._destroyed = True

    def __getattr__(self, name: str):
        # Only for names not found: a DeepEP V1 method gets a pointer to its V2.5 call.
        raise deepep_v1.missing("'EPBuffer' object", name, deepep_v1.BUFFER)

    def __enter__(self) -> "EPBuffer":
        return self

    def __exit__(self, *exc) -> None:
        """`with EPBuffer(...) as buf:` ends with the collective `destroy()` when the block completes. When an
        exception leaves the block, only this rank's resources are freed (its peers may never reach a collective
        call); a peer whose block completes then waits in its `destroy()` for this rank until
        `num_cpu_timeout_secs` and raises TimeoutError: an error on one rank ends the job on every rank."""
        if exc[0] is None:
            self.destroy()
        else:  # an exception is propagating: peers may not reach a collective destroy; free local resources
            self.transport.destroy()
            self._destroyed = True

    def __del__(self):
        if getattr(self, "explicitly_destroy", False) and not getattr(self, "_destroyed", True):
            warnings.warn("EPBuffer was created with explicitly_destroy=True but destroy() was never called",
                          ResourceWarning, stacklevel=1)

    def _check_alive(self, call: str) -> None:
        if self._pending_deferred and self.transport.borrows_rows:
            raise ValueError(f"{call}: rank {self.rank}: a deferred epilogue of this buffer is still pending; wait "
                             f"on its event before the next call (the {self.transport.name} transport keeps one "
                             "deferred call in flight)")
        if self._destroyed:
            raise ValueError(f"{call}: rank {self.rank}: the buffer was destroyed; create a new EPBuffer")
        if self._broken is not None:
            raise ValueError(f"{call}: rank {self.rank}: the buffer is unusable after an earlier failure "
                             f"({self._broken}); destroy it and restart the process group")
        waits.require_group_usable(self.group, f"{call}: rank {self.rank}")

    def _next_call_id(self) -> int:
        self._call_id += 1
        return self._call_id

    def _take_back_call_id(self, call_id: int) -> None:
        """The ranks were in different calls at `call_id` (another buffer's call on a peer, found by the transport's
        frames or by the header's buffer id): the peers never made this call, so the next one reuses its id."""
        self._call_id = min(self._call_id, call_id - 1)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_caller(msg)

    def agree(self, call: str, recv_rows: list, local_error: Optional[BaseException]) -> None:
        """Raise on every rank when any rank failed or the ranks disagree (see agreement.py)."""
        col = agreement.BUFFER_COL
        if any(row[col] != recv_rows[self.rank][col] for row in recv_rows):
            # A peer made its call on another buffer of the group: this buffer's call never happened there, so
            # every rank takes its call id back (after any message exchange below) and the next calls are in step.
            mine = recv_rows[self.rank][1]
            try:
                self._agree(call, recv_rows, local_error)
            finally:
                self._take_back_call_id(mine)
            return
        # Ranks that got out of step resume at the furthest call, so a caller that recovers can go on.
        self._call_id = max(self._call_id, max(row[1] for row in recv_rows))
        self._agree(call, recv_rows, local_error)

    def _agree(self, call: str, recv_rows: list, local_error: Optional[BaseException]) -> None:
        def gather(msg: str) -> list:  # a call of its own: a timeout here must not see the header's keys
            call_id = self._next_call_id()
            return agreement.gather_messages(
                lambda t: self.transport.exchange_counts(t, wait=True, call_id=call_id, what="error messages",
                                                         label=call), msg,
                self.num_ranks, self.device)
        agreement.check(call, self.rank, recv_rows, local_error, gather, self.group)

    def _reject_call(self, call: str, err: BaseException) -> None:
        """Raise `err`, found by a wrapper (`TokenDispatcher`) before it reached `call`: on CPU through that call's
        header exchange, so that peers inside `call` raise too ("group rank r rejected the call") instead of waiting
        for the timeout; on GPU on this rank only, as every header-free call."""
        self._check_alive(call)
        self._exchange_header(call, self._next_call_id(), {}, err)
        raise err  # GPU; on CPU the exchange has raised

    def _exchange_header(self, call: str, call_id: int, signature: dict, err: Optional[BaseException],
                         values_R: Optional[Tensor] = None) -> Optional[list]:
        """Header-only exchange for calls without counts (combine, cached dispatch, low-latency calls): CPU only
        (free there); on GPU it raises `err`, if any, on this rank only. `values_R` ([R] int64, CPU only): values
        sent to every rank in the counts' columns.

        Returns:
            CPU: the received rows (host lists, row s from rank s; rank s's `values_R[me]` at `HEADER_LEN + me`);
            GPU: None.
        """
        if self.device.type != "cpu":
            if err is not None:
                raise err
            return None
        head = agreement.header(agreement.status_of(err), call_id, signature, self.uid)
        send_RC = agreement.pack(head, values_R, self.num_ranks, self.device)
        rows = self.transport.exchange_counts(send_RC, wait=True, call_id=call_id, label=call).tolist()
        self.agree(call, rows, err)
        return rows

    # -- dispatch ------------------------------------------------------------------------------------
    @eager_under_compile
    def dispatch(
        self,
        x: Union[Tensor, tuple],
        topk_idx: Optional[Tensor] = None,
        topk_weights: Optional[Tensor] = None,
        cumulative_local_expert_recv_stats: Optional[Tensor] = None,
        num_experts: Optional[int] = None,
        num_max_tokens_per_rank: Optional[int] = None,
        expert_alignment: Optional[int] = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Optional[EventHandle] = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: Optional[EPHandle] = None,
        do_handle_copy: bool = False,
        do_cpu_sync: Optional[bool] = None,
        do_expand: Optional[bool] = None,
        do_zero_padding: bool = False,
        emit_expert_ids: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
        defer_epilogue: bool = False,
    ):
        """Send each token to the ranks owning its top-k experts (collective; reference §9).

        Rows arrive in token-key order: non-expand rows ascending `g = src_rank * N + src_token`; expand rows
        grouped by local expert, ascending `g` in each segment (docs/decisions.md decision 4).

        Args:
            x: [T, H] bf16/fp16/fp32/fp64, or the FP8 tuple `(data [T, H] float8_e4m3fn, scales [T, P] fp32 or
                int32 packed UE8M0, any strides)`. P >= 1 is not checked against H: the scales move as opaque bytes
                (1x128 blocks: `epcomm.fp8.num_sf_packs(H)`, i.e. ceil(H / 128) fp32 or ceil(H / 512) int32).
            topk_idx: [T, K] int64 or int32 -- global expert id per selection, -1 = none; ids in
                `[-1, num_experts)`, no expert twice in a row, K <= 32. Must be None with `handle`.
            topk_weights: [T, K] fp32 (fp64 when x is fp64) or None -- delivered beside the rows.
            cumulative_local_expert_recv_stats: [L] int32 or None -- `+= n_i` (unaligned received pairs per
                local expert); None with `handle`.
            num_experts: E, a multiple of the group size; required unless `handle` is given.
            num_max_tokens_per_rank: N, defaults to the buffer's (or the handle's); `T <= N`.
            expert_alignment: each expert's segment is padded to a multiple of it; default 1.
            num_sms: SM hint for GPU transports (0 = `get_theoretical_num_sms`); ignored on CPU (warns once).
            num_qps: accepted; an int in [0, `num_allocated_qps`].
            previous_event: an `EventHandle` (`EPBuffer.capture()`) or an `EventOverlap` (DeepEP V1 style); the
                comm stream waits for it instead of the current stream; needs `allocate_on_comm_stream=True`.
                Anything else raises TypeError.
            async_with_compute_stream: return without making the current stream wait; wait on the event.
            allocate_on_comm_stream: outputs belong to the comm stream's allocator pool. A call with none of
                `previous_event`, `async_with_compute_stream`, `allocate_on_comm_stream`, `defer_epilogue` runs on
                the current stream (docs/decisions.md "Streams on CUDA"), the others on the comm stream.
            handle: an `EPHandle` from an earlier dispatch of this buffer: replay its routing (cached dispatch).
            do_handle_copy: legacy; must be False.
            do_cpu_sync: True (default) gives exact output sizes (the host waits for counts); False gives the
                worst-case sizes of reference §9.4/9.5 and no host synchronisation. Cached dispatch is sync-free
                (it reuses the handle's sizes). Must be None or False with `handle`.
            do_expand: expand layout (one row per token and local expert) instead of one row per token; default
                False, or the handle's layout with `handle` (a value given must match it).
            do_zero_padding: zero the alignment padding rows (expand only; epcomm always zeroes them).
            emit_expert_ids: fill `handle.recv_expert_ids` (expand, non-cached only).
            use_tma_aligned_col_major_sf: FP8 output scales column-major with pack stride `align(rows, 4)`.
            defer_epilogue: return only the event; its first wait places the rows and returns the results.
                Needs `async_with_compute_stream=True`.

        Returns:
            `(recv_x, recv_topk_idx, recv_topk_weights, handle, event)`, or an `EventOverlap` whose first wait
            returns the first four when `defer_epilogue=True`:
            recv_x: [M, H] (non-expand) or [S, H] (expand), x's dtype; a tuple (data, scales) for FP8.
            recv_topk_idx: [M, K] topk_idx's dtype -- local expert id per column, -1 where not local; None in
                expand layout.
            recv_topk_weights: [M, K] (0 in non-local columns) or [S] (expand); None without `topk_weights`.
            handle: a new `EPHandle`, or the given one for cached dispatch (same object).
            event: `EventOverlap` (event None for synchronous calls).

        Raises:
            TypeError: an argument of the wrong type or dtype (on every rank when counts are exchanged).
            ValueError: wrong shape, value, device, capacity, or inconsistent options; ranks that disagree on
                the call (every rank; see docs/decisions.md "Errors and timeouts").
            TimeoutError: a peer did not arrive within `num_cpu_timeout_secs`, or (`PeerFailed`) a peer stopped with
                an error of its own during this or an earlier call (docs/decisions.md "Errors and timeouts").
            Any other error of this rank's own (out of memory, ...) is re-raised; after the header exchange the
            buffer and its process group then refuse later calls.
        """
        name = "EPBuffer.dispatch"
        self._check_alive(name)
        call_id = self._next_call_id()
        c = Checker(name, self.rank, self.device)
        err, call = None, None
        try:
            check_event_options(c, previous_event=previous_event, allocate_on_comm_stream=allocate_on_comm_stream,
                                async_with_compute_stream=async_with_compute_stream, defer_epilogue=defer_epilogue)
            with debug.phase("resolve"):
                call = resolve.resolve_dispatch(
                    self, c, x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                    num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, handle, do_handle_copy,
                    do_cpu_sync, do_expand, do_zero_padding, emit_expert_ids, use_tma_aligned_col_major_sf,
                    defer_value_checks=exact_nvlink.enabled(self))
            call.call_id = call_id  # a new handle keeps it: ranks that combine other dispatches' handles disagree
        except (Exception, KeyboardInterrupt) as e:  # a bad argument, out of memory, ...: it travels in the header
            err = e
        cached = handle is not None
        direct = self._order.is_direct(previous_event, async_with_compute_stream, allocate_on_comm_stream,
                                       defer_epilogue)
        try:
            with debug.phase("dispatch" + ("_cached" if cached else "")), \
                    self._order.launch(previous_event, direct):
                if cached:
                    self._exchange_header(name, call_id, call.signature(2) if call else {}, err)
                    if syncfree_nvlink.cached_applies(self, call):
                        launched = syncfree_nvlink.dispatch_cached_launch(self, call, call_id)
                        finish = syncfree_nvlink.dispatch_cached_finish
                    else:
                        launched = pipeline.cached_launch(self, call, call_id)
                        finish = pipeline.cached_finish
                elif err is None and exact_nvlink.applies(self, call):  # layouts in kernels, one host read
                    launched = exact_nvlink.dispatch_launch(self, call, call_id)
                    finish = exact_nvlink.dispatch_finish
                elif err is None and syncfree_nvlink.applies(self, call):  # decode sizes: 3-4 kernels, same results
                    launched = syncfree_nvlink.dispatch_launch(self, call, call_id)
                    finish = syncfree_nvlink.dispatch_finish
                else:
                    if err is None and call.do_cpu_sync and exact_nvlink.enabled(self):
                        try:  # the value checks resolve left to the fused path's kernels
                            check_topk_values(c, call.topk_idx, call.num_experts)
                        except ValueError as e:
                            err = e
                    launched = pipeline.dispatch_launch(self, call, call_id, err)
                    finish = pipeline.dispatch_finish
        except (Exception, KeyboardInterrupt) as e:
            self._after_agreement(name, call_id, e, err)
        debug.log_dispatch(self, call, launched)
        inputs = [call.x.data, call.x.sf, call.topk_idx, call.topk_weights]

        def epilogue():
            with debug.phase("dispatch_epilogue"):
                outputs = finish(self, call, launched)
                return resolve.narrowed_outputs(call.handle, outputs) if cached else outputs
        result = self._finish(epilogue, inputs, async_with_compute_stream, defer_epilogue, direct, call.handle,
                              (name, call.topk_idx))
        if defer_epilogue:
            return result
        (recv_x, recv_topk_idx, recv_w, out_handle), event = result
        return recv_x, recv_topk_idx, recv_w, out_handle, event

    # -- combine -------------------------------------------------------------------------------------
    @eager_under_compile
    def combine(
        self,
        x: Tensor,
        handle: EPHandle,
        topk_weights: Optional[Tensor] = None,
        bias: Union[None, Tensor, tuple] = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Optional[EventHandle] = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        defer_epilogue: bool = False,
    ):
        """Bring expert outputs back to their tokens and sum them, unweighted (collective; reference §11).

        The sum is the canonical order (docs/decisions.md decision 4): `acc = 0 (+ bias_0) (+ bias_1)`, then the item
        of each top-k position in ascending order; items are one row per rank (non-expand: the rank's row,
        expand with multiple reduction: the rank's partial sum) at the rank's largest position, or every
        (token, expert) row at its own position (expand without multiple reduction). fp32 accumulation (fp64
        for fp64), one rounding to x's dtype per level. Router weights are not applied.

        Args:
            x: [M, H] (non-expand; M = `handle.recv_src_metadata.shape[0]`) or [S, H] (expand; S =
                `handle.num_expanded_tokens`) bf16/fp16/fp32/fp64 -- expert outputs in the handle's layout;
                rows past the valid extent are ignored.
            handle: the `EPHandle` of the dispatch whose rows these are.
            topk_weights: [M, K] (non-expand) or [S] (expand) fp32 (fp64 for fp64 x) or None -- carried back
                to the owner of each selection; not allowed in expand layout without multiple reduction.
            bias: None, a tensor, or a pair `(bias_0, bias_1)` (either may be None: it adds 0); each [T, H] in
                x's dtype -- added first. With
                `defer_epilogue=True` it is read at the event's first wait, not by the call (reference §3.5).
            num_sms, num_qps: as dispatch (num_sms 0 = the handle's).
            previous_event, async_with_compute_stream, allocate_on_comm_stream, defer_epilogue: as dispatch.

        Returns:
            `(combined_x [T, H] x's dtype, combined_topk_weights [T, K] or None, event)`, or an `EventOverlap`
            whose first wait returns the first two when `defer_epilogue=True`.

        Raises:
            TypeError: wrong types or dtypes.
            ValueError: shapes that do not match the handle, a handle from another buffer, a modified
                `topk_idx`, bad bias, inconsistent options; ranks that disagree (on CPU, every rank).
            TimeoutError: a peer did not arrive within `num_cpu_timeout_secs`, or (`PeerFailed`) a peer stopped
                with an error of its own (as dispatch).
            Any other error of this rank's own is re-raised, as dispatch.
        """
        name = "EPBuffer.combine"
        self._check_alive(name)
        call_id = self._next_call_id()
        c = Checker(name, self.rank, self.device)
        err, call = None, None
        try:
            check_event_options(c, previous_event=previous_event, allocate_on_comm_stream=allocate_on_comm_stream,
                                async_with_compute_stream=async_with_compute_stream, defer_epilogue=defer_epilogue)
            call = resolve.resolve_combine(self, c, x, handle, topk_weights, bias, num_sms, num_qps)
        except (Exception, KeyboardInterrupt) as e:  # as dispatch
            err = e
        direct = self._order.is_direct(previous_event, async_with_compute_stream, allocate_on_comm_stream,
                                       defer_epilogue)
        try:
            with debug.phase("combine"), self._order.launch(previous_event, direct):
                self._exchange_header(name, call_id, call.signature() if call else {}, err)
                call = call if call is None else resolve.padded_if_narrowed(call)
                if call is not None and syncfree_nvlink.combine_applies(self, call):
                    launched = syncfree_nvlink.combine_launch(self, call, call_id)
                else:
                    launched = pipeline.combine_launch(self, call, call_id, defer=defer_epilogue)
        except (Exception, KeyboardInterrupt) as e:
            self._after_agreement(name, call_id, e, err)
        inputs = [call.x, call.topk_weights, call.bias_0, call.bias_1]

        def epilogue():
            with debug.phase("combine_reduce"):
                return pipeline.combine_finish(self, call, launched)
        result = self._finish(epilogue, inputs, async_with_compute_stream, defer_epilogue, direct, call.handle,
                              (name, call.handle._topk_idx))
        if defer_epilogue:
            return result
        (combined_x, combined_w), event = result
        return combined_x, combined_w, event

    # -- streams (reference §3.4-3.5; streams.py) --------------------------------------------------------
    def _finish(self, epilogue, inputs: list, async_op: bool, defer: bool, direct: bool, handle=None,
                routing: Optional[tuple] = None):
        """Run or defer the epilogue (`direct`: on the current stream, `streams.CallOrder`; an asynchronous call
        keeps the `handle` it reads alive until its event completes); a deferred one marks the buffer busy until its
        first wait, and raises there if `routing` (`(call name, topk_idx)`), which it reads then, was modified in
        place since the call (the handle's guard would otherwise record the edited routing as the dispatch's)."""
        if defer:
            self._pending_deferred = True
            inner = epilogue
            name, topk_idx = routing if routing is not None else (None, None)
            version = None if topk_idx is None else EPHandle.capture_version(topk_idx)

            def epilogue():
                self._pending_deferred = False
                if version is not None and EPHandle.capture_version(topk_idx) != version:
                    raise ValueError(
                        f"{name}: rank {self.rank}: topk_idx was modified in place between the call and the first "
                        f"wait() of its deferred epilogue (version {version} -> {EPHandle.capture_version(topk_idx)}), "
                        "which reads it; the call's results are lost. Clone topk_idx before editing it, or wait first")
                return inner()
        return self._order.finish(epilogue, inputs, async_op, defer, direct, handle)


def _as_int(value) -> int:
    """An option as an int for the construction exchange (numpy ints too); -1 for a value that has none."""
    try:
        return operator.index(value)
    except TypeError:
        return -1


def _nvlink_ready(device: torch.device) -> bool:
    """This rank can use the nvlink transport: symmetric memory, Triton, peer access to every other local GPU."""
    return symm.nvlink_unavailable(device) is None
