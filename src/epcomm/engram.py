"""`EngramBuffer`: fetch rows of a sharded embedding table by global index (DeepEP V2.5 behaviour, §15).

Each rank holds one shard of every layer's table (`[N_l, hidden]`); the global index space of layer `l` is
`[0, R * N_l)`, owner `idx // N_l`, row `idx % N_l`. `fetch(indices)` returns one hook per layer; hook `l`
returns `[T, E * hidden]` (entries concatenated per token), bitwise `global_table_l[indices[l]]`.

The reference reads remote rows one-sided over RDMA. epcomm has owners serve them instead, so **fetch is
collective** (every rank calls it, in the same order as the other buffer calls):

    counts + status -> all_to_all (host read of the counts)   requests grouped by owner, stable order
    row ids         -> all_to_all                             the owner gathers its rows (+ their FP8 scales)
    rows            -> all_to_all                             placed at their (layer, token, entry) slot

FP8 tables come with the global replicated scale table; each rank keeps the scales of its own rows and serves
them with the rows, so `num_gpu_bytes` holds one shard of scales (the reference's formula with one host).
RDMA-only arguments (QPs, QP depth, relaxed ordering, CPU RDMA storage, service level) are accepted and have no
effect. Shape legend (docs/shapes.md): L layers, T tokens, E entries per token, R ranks, P scale packs.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import sizing
from .comm import ContextLifecycle, CommContext, new_comm_stream
from .epilogue import place_sf
from .events import EventHandle

__all__ = ["EngramBuffer"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
_DTYPE_CODES = {d: i + 1 for i, d in enumerate(DTYPES)}
_OPS = {1: "set_config", 2: "write", 3: "fetch"}
_EXC = {1: TypeError, 2: ValueError}
# NOTE: the reference's model (§15): 90 Mpps NIC reads with fast atomics, 10 us round trip, 32768 slots max.
_NIC_MPPS, _RTT_S, _MAX_QP_DEPTH = 90.0, 1e-5, 32768


def _widest_word(*sizes: int) -> torch.dtype:
    """The widest integer dtype whose size divides every non-zero byte count in `sizes`."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if all(n % dtype.itemsize == 0 for n in sizes):
            return dtype
    return torch.uint8


def _group_size(group) -> int:
    return group if isinstance(group, int) else (group or dist.group.WORLD).size()


def _needs(entries: Sequence[int], hidden: int, num_max_tokens: int, num_entries_per_token: int, elem: int,
           num_sf_packs: int) -> tuple:
    """(receive-area bytes, scale-shard bytes, table-shard bytes), unaligned."""
    total = sum(entries)
    return (len(entries) * num_max_tokens * num_entries_per_token * hidden * elem, total * num_sf_packs * 4,
            total * hidden * elem)


def _check_config(who: str, entries, hidden, num_max_tokens, num_entries_per_token, dtype, num_sf_packs) -> list:
    if isinstance(entries, int) or not all(isinstance(n, int) and not isinstance(n, bool) for n in entries):
        raise TypeError(f"{who}: num_entries_per_layer must be a list of ints (one per layer), got {entries!r}")
    entries = list(entries)
    if not entries or min(entries) <= 0:
        raise ValueError(f"{who}: num_entries_per_layer must list at least one layer, each > 0, got {entries}")
    for name, v in (("hidden", hidden), ("num_max_tokens", num_max_tokens),
                    ("num_entries_per_token", num_entries_per_token)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{who}: {name} must be an int > 0, got {v!r}")
    if dtype not in DTYPES:
        raise TypeError(f"{who}: dtype must be one of {DTYPES}, got {dtype}")
    fp8 = dtype == torch.float8_e4m3fn
    if isinstance(num_sf_packs, bool) or not isinstance(num_sf_packs, int) or num_sf_packs < 0 \
            or (num_sf_packs > 0) != fp8:
        raise ValueError(f"{who}: num_sf_packs must be > 0 for FP8 tables and 0 otherwise, got {num_sf_packs} with "
                         f"dtype {dtype}")
    return entries


class EngramBuffer(ContextLifecycle):
    """A sharded embedding table and a receive area for `fetch` (collective construction).

    Args:
        group: the process group; None for the default group. Messages use group ranks.
        num_gpu_bytes: int -- receive area plus this rank's scale shard; a positive multiple of 2 MiB
            (`get_storage_size_hint()[0]`).
        num_rdma_storage_bytes: int -- this rank's table shard; a positive multiple of 2 MiB (hint `[1]`). The
            legacy keyword `num_rdma_storage_size` is an alias.
        use_cpu_rdma_storage: accepted; no effect (the shard lives on the buffer's device; warns once if True).
        num_allocated_qps, qp_depth: accepted, no effect; when given they must be > 0 (reference §15).
        restrict_rd_atomic, allow_hybrid_mode, sl_idx: accepted, no effect.
        num_gpu_timeout_secs: accepted; device waits are bounded by the group's NCCL timeout.
        explicitly_destroy: warn at garbage collection when `destroy()` was not called.
        num_rdma_storage_size: legacy alias of `num_rdma_storage_bytes`.
        num_cpu_timeout_secs: bound on every host wait (epcomm keyword). Default 300.

    Raises:
        TypeError: both `num_rdma_storage_bytes` and `num_rdma_storage_size`, or neither.
        ValueError: sizes that are not positive multiples of 2 MiB; QP arguments <= 0.
        TimeoutError: a peer did not construct within `num_cpu_timeout_secs`.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], num_gpu_bytes: int,
                 num_rdma_storage_bytes: Optional[int] = None, use_cpu_rdma_storage: bool = False,
                 num_allocated_qps: Optional[int] = None, qp_depth: Optional[int] = None,
                 restrict_rd_atomic: bool = False, allow_hybrid_mode: bool = True, sl_idx: Optional[int] = None,
                 num_gpu_timeout_secs: float = 100, explicitly_destroy: bool = False, *,
                 num_rdma_storage_size: Optional[int] = None, num_cpu_timeout_secs: float = 300):
        self.explicitly_destroy = explicitly_destroy
        self._destroyed = True  # until construction succeeds
        group = group if group is not None else dist.group.WORLD
        who = f"EngramBuffer: rank {group.rank()}"
        if num_rdma_storage_bytes is not None and num_rdma_storage_size is not None:
            raise TypeError(f"{who}: pass num_rdma_storage_bytes or its legacy alias num_rdma_storage_size, not both")
        if num_rdma_storage_bytes is None:
            num_rdma_storage_bytes = num_rdma_storage_size
        if num_rdma_storage_bytes is None:
            raise TypeError(f"{who}: num_rdma_storage_bytes is required (see EngramBuffer.get_storage_size_hint)")
        for name, v in (("num_gpu_bytes", num_gpu_bytes), ("num_rdma_storage_bytes", num_rdma_storage_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % sizing.ALLOCATION_ALIGNMENT:
                raise ValueError(f"{who}: {name} must be a positive multiple of 2 MiB "
                                 f"({sizing.ALLOCATION_ALIGNMENT}), got {v}")
        for name, v in (("num_allocated_qps", num_allocated_qps), ("qp_depth", qp_depth)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{who}: {name} must be > 0 (take it from EngramBuffer.get_theoretical_config), "
                                 f"got {v}")
        self.num_gpu_bytes, self.num_rdma_storage_bytes = num_gpu_bytes, num_rdma_storage_bytes
        self.use_cpu_rdma_storage, self.num_allocated_qps, self.qp_depth = use_cpu_rdma_storage, num_allocated_qps, \
            qp_depth
        self.restrict_rd_atomic, self.allow_hybrid_mode, self.sl_idx = restrict_rd_atomic, allow_hybrid_mode, sl_idx
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self._warned: set = set()
        if use_cpu_rdma_storage:
            self._warn_once("cpu", "epcomm: EngramBuffer use_cpu_rdma_storage has no effect; the table shard lives on "
                                   "the buffer's device")
        self.context = CommContext(group, owner="EngramBuffer", num_cpu_timeout_secs=num_cpu_timeout_secs)
        self.contexts = [self.context]
        self.rank, self.num_ranks, self.device = self.context.rank, self.context.num_ranks, self.context.device
        self.context.comm_stream = new_comm_stream(self.device)
        self.gpu_storage = torch.empty(num_gpu_bytes, dtype=torch.uint8, device=self.device)
        self.rdma_storage = torch.empty(num_rdma_storage_bytes, dtype=torch.uint8, device=self.device)
        self._config: Optional[dict] = None
        self._written = False
        self.context.barrier(with_cpu_sync=True, call="EngramBuffer")
        self._destroyed = False

    # -- static hints --------------------------------------------------------------------------------
    @staticmethod
    def get_storage_size_hint(group, num_entries_per_layer: Sequence[int], hidden: int, num_max_tokens: int,
                              num_entries_per_token: int, dtype: torch.dtype = torch.bfloat16,
                              num_sf_packs: int = 0) -> tuple:
        """`(num_gpu_bytes, num_rdma_storage_bytes)` for this table shape (reference §15); allocates nothing.

        `gpu = align(L * T * E * hidden * elem, 2 MiB) + (align(sum(N) * P * 4, 2 MiB) if P else 0)`,
        `storage = align(sum(N) * hidden * elem, 2 MiB)`; the reference's formula with one host (each rank keeps
        the scales of its own rows).

        Args:
            group: the group (or its size); the formula does not depend on it.
            num_entries_per_layer: [L] ints > 0 -- rows per rank of each layer's shard (N_l).
            hidden: elements per row; `hidden * elem % 64 == 0` (reference precondition).
            num_max_tokens: T, tokens per fetch; num_entries_per_token: E, rows per token.
            dtype: bf16 (default), fp16, fp32 or FP8 e4m3. num_sf_packs: P, 4-byte scale packs per row (FP8 only).

        Returns:
            `(num_gpu_bytes, num_rdma_storage_bytes)` -- ints, multiples of 2 MiB.

        Raises:
            TypeError: bad dtype or list. ValueError: non-positive sizes; packs without FP8; row bytes % 64.
        """
        who = "EngramBuffer.get_storage_size_hint"
        entries = _check_config(who, num_entries_per_layer, hidden, num_max_tokens, num_entries_per_token, dtype,
                                num_sf_packs)
        if hidden * dtype.itemsize % 64:
            raise ValueError(f"{who}: hidden * element size must be a multiple of 64 bytes, got {hidden} x "
                             f"{dtype.itemsize}")
        area, scales, table = _needs(entries, hidden, num_max_tokens, num_entries_per_token, dtype.itemsize,
                                     num_sf_packs)
        a = sizing.ALLOCATION_ALIGNMENT
        return sizing.align(area, a) + (sizing.align(scales, a) if num_sf_packs else 0), sizing.align(table, a)

    @staticmethod
    def get_theoretical_config(group, num_layers: int, num_max_tokens: int, num_entries_per_token: int,
                               num_max_read_requests_per_qp: int = 16) -> tuple:
        """`(num_qps, qp_depth, restrict_rd_atomic)` of the reference's NIC model (§15); no effect in epcomm.

        Args:
            group: the group or its size; peers = R - 1 (at least 1).
            num_layers, num_max_tokens, num_entries_per_token: L, T, E (> 0).
            num_max_read_requests_per_qp: outstanding reads per QP (> 0). Default 16.

        Returns:
            `(num_qps, qp_depth, restrict_rd_atomic)` -- int, int (<= 32768), bool.

        Raises:
            ValueError: non-positive arguments.
        """
        for name, v in (("num_layers", num_layers), ("num_max_tokens", num_max_tokens),
                        ("num_entries_per_token", num_entries_per_token),
                        ("num_max_read_requests_per_qp", num_max_read_requests_per_qp)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"EngramBuffer.get_theoretical_config: {name} must be an int > 0, got {v!r}")
        peers = max(1, _group_size(group) - 1)
        qps = max(1, math.ceil(_NIC_MPPS * 1e6 * _RTT_S / num_max_read_requests_per_qp / peers))
        reads = num_layers * num_max_tokens * num_entries_per_token
        slots = math.ceil(reads / (qps * peers))
        if slots > _MAX_QP_DEPTH:
            return int(math.ceil(reads / (_MAX_QP_DEPTH * peers)) * 1.05), _MAX_QP_DEPTH, True
        depth = 1024
        while depth < slots and depth < _MAX_QP_DEPTH:
            depth *= 2
        return qps, depth, False

    def get_physical_domain_size(self) -> tuple:
        """`(num_rdma_ranks, num_nvlink_ranks)`: hosts and ranks per host of the group (reference §2)."""
        return self.context.num_rdma_ranks, self.context.num_nvlink_ranks

    def get_logical_domain_size(self, allow_hybrid_mode: Optional[bool] = None) -> tuple:
        """Always `(1, world)`: one logical domain (docs/decisions.md decision 4)."""
        return 1, self.num_ranks

    # -- configuration and table -----------------------------------------------------------------------
    def set_config(self, num_entries_per_layer: Sequence[int], hidden: int, num_max_tokens: int,
                   num_entries_per_token: int, dtype: torch.dtype = torch.bfloat16, num_sf_packs: int = 0) -> None:
        """Fix the table shape (collective; every rank passes the same values). Arguments as the size hint.

        Raises:
            TypeError / ValueError: bad values, or a shape that does not fit `num_gpu_bytes` /
                `num_rdma_storage_bytes` (the message gives both sizes and the hint call); ranks that disagree
                (every rank raises).
            TimeoutError: a peer did not arrive.
        """
        call = "EngramBuffer.set_config"
        c = self.context.checker(call)
        err, signature = None, [0] * 7
        try:
            entries = _check_config(f"{call}: rank {self.rank}", num_entries_per_layer, hidden, num_max_tokens,
                                    num_entries_per_token, dtype, num_sf_packs)
            area, scales, table = _needs(entries, hidden, num_max_tokens, num_entries_per_token, dtype.itemsize,
                                         num_sf_packs)
            if area + scales > self.num_gpu_bytes or table > self.num_rdma_storage_bytes:
                c.fail(ValueError, f"the table needs num_gpu_bytes >= {area + scales} (receive area {area} + scales "
                                   f"{scales}) and num_rdma_storage_bytes >= {table}, but the buffer has "
                                   f"{self.num_gpu_bytes} and {self.num_rdma_storage_bytes}; size it with "
                                   f"EngramBuffer.get_storage_size_hint(group, {entries}, {hidden}, {num_max_tokens}, "
                                   f"{num_entries_per_token}, {dtype}, {num_sf_packs})")
            signature = [len(entries), sum(entries), hidden, num_max_tokens, num_entries_per_token,
                         _DTYPE_CODES[dtype], num_sf_packs]
        except (TypeError, ValueError) as e:
            err = e
        self._agree(call, 1, err, signature, ("layers", "total entries", "hidden", "num_max_tokens",
                                              "num_entries_per_token", "dtype", "num_sf_packs"))
        offsets = [0]
        for n in entries:
            offsets.append(offsets[-1] + n)
        row = hidden * dtype.itemsize
        self._config = dict(entries=entries, offsets=offsets, hidden=hidden, num_max_tokens=num_max_tokens,
                            num_entries_per_token=num_entries_per_token, dtype=dtype, packs=num_sf_packs, row=row)
        self._table = self.rdma_storage[:offsets[-1] * row].view(offsets[-1], row)
        area = len(entries) * num_max_tokens * num_entries_per_token * row
        self._area = self.gpu_storage[:area]
        self._scales = self.gpu_storage[area:area + offsets[-1] * num_sf_packs * 4].view(offsets[-1],
                                                                                          num_sf_packs * 4)
        self._sf_dtype = torch.float32
        self._written = False

    def write(self, storages: Sequence[Tensor], sfs: Optional[Sequence[Tensor]] = None) -> None:
        """Store this rank's shard of every layer (collective; barriers before and after).

        Args:
            storages: L tensors, `storages[l]`: [N_l, hidden] of the configured dtype -- this rank's rows.
            sfs: FP8 only: L tensors, `sfs[l]`: [R * N_l, P] fp32 or int32 -- the global replicated scale table;
                this rank keeps rows `[rank * N_l, (rank + 1) * N_l)`.

        Raises:
            TypeError / ValueError: no config, wrong count/shape/dtype/device (every rank raises).
            TimeoutError: a peer did not arrive.
        """
        call = "EngramBuffer.write"
        c = self.context.checker(call)
        err = None
        try:
            cfg = self._require_config(c)
            if not isinstance(storages, (list, tuple)) or len(storages) != len(cfg["entries"]):
                c.fail(ValueError, f"storages must be a list of {len(cfg['entries'])} tensors (one per layer)")
            fp8 = cfg["packs"] > 0
            if fp8 != (sfs is not None):
                c.fail(ValueError, "sfs (the replicated scale tables) are required for FP8 tables and must be None "
                                   "otherwise")
            if fp8 and (not isinstance(sfs, (list, tuple)) or len(sfs) != len(storages)):
                c.fail(ValueError, f"sfs must be a list of {len(storages)} tensors (one per layer)")
            for layer, (t, n) in enumerate(zip(storages, cfg["entries"])):
                self._check_tensor(c, f"storages[{layer}]", t, (cfg["dtype"],), (n, cfg["hidden"]))
                if fp8:
                    self._check_tensor(c, f"sfs[{layer}]", sfs[layer], (torch.float32, torch.int32),
                                       (self.num_ranks * n, cfg["packs"]))
        except (TypeError, ValueError) as e:
            err = e
        self._agree(call, 2, err, [], ())
        offsets = cfg["offsets"]
        for layer, t in enumerate(storages):
            self._table[offsets[layer]:offsets[layer + 1]].copy_(t.contiguous().view(torch.uint8))
            if sfs is not None:
                n = cfg["entries"][layer]
                mine = sfs[layer][self.rank * n:(self.rank + 1) * n].contiguous()
                self._scales[offsets[layer]:offsets[layer + 1]].copy_(mine.view(torch.uint8))
                self._sf_dtype = sfs[layer].dtype
        self._written = True
        self.context.barrier(call=call)

    # -- fetch ---------------------------------------------------------------------------------------
    def fetch(self, indices: Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = True) -> list:
        """Fetch `global_table_l[indices[l]]` for every layer (collective: every rank calls it).

        Host-blocking once (the request counts); on CUDA the moves run on the communication stream and hook `l`
        makes the current stream wait. Naive equivalent per layer (a full copy of the table on every rank):
            table = torch.cat(all_gather(shard_l)); out_l = table[indices[l]].view(T, E * hidden)

        Args:
            indices: [L, T, E] int32 or int64 -- global row ids of each layer, in `[0, R * N_l)`; `L` the
                configured layers, `T <= num_max_tokens`, `E` the configured entries per token.
            num_qps: accepted, no effect (warns once when not 0).
            use_tma_aligned_col_major_sf: FP8 scales column-major with pack stride `align(T, 4)`. Default True.

        Returns:
            [L] callables; hook `l()` returns `[T, E * hidden]` of the table's dtype, or for FP8
            `(data [T, E * hidden], scales [T, E * P])`. Hooks may be called in any order; the data are views
            into the receive area, overwritten by the next fetch.

        Raises:
            TypeError / ValueError: no config or table, bad indices (shape, dtype, device, out of range; every
                rank raises, naming the offender). TimeoutError: a peer did not arrive.
        """
        call = "EngramBuffer.fetch"
        c = self.context.checker(call)
        cuda = self.device.type == "cuda"
        if cuda:
            self.context.comm_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.context.comm_stream) if cuda else contextlib.nullcontext():
            err, counts_R = None, torch.zeros(self.num_ranks, dtype=torch.int64, device=self.device)
            try:
                cfg = self._require_config(c)
                if not self._written:
                    c.fail(ValueError, "the table was never written; call write(storages) after set_config")
                if num_qps:
                    self._warn_once("num_qps", "epcomm: EngramBuffer.fetch num_qps has no effect; it is ignored")
                owner_X, row_X, num_tokens = self._plan(c, cfg, indices)
                order_X = torch.argsort(owner_X, stable=True)
                counts_R = torch.bincount(owner_X, minlength=self.num_ranks)
            except (TypeError, ValueError) as e:
                err = e
            recv_counts = self._agree(call, 3, err, [], (), counts_R)
            send_counts = counts_R.tolist()
            ids = torch.empty(sum(recv_counts), dtype=torch.int64, device=self.device)
            self.context.complete(dist.all_to_all_single(ids, row_X[order_X], recv_counts, send_counts,
                                                         group=self.context.group, async_op=True), call)
            # NOTE: rows move as the widest integer words that divide them: uint8 advanced indexing of 512-byte
            # rows ran at ~0.5 GB/s on CPU (2 ranks, 2048 rows, 1.8 ms per index_put); int64 words are ~8x faster.
            row, sf_bytes = cfg["row"], cfg["packs"] * 4
            wide = _widest_word(row, sf_bytes)
            served = self._table.view(wide).index_select(0, ids)
            if sf_bytes:
                served = torch.cat([served, self._scales.view(wide).index_select(0, ids)], dim=1)
            got = torch.empty(len(order_X), served.shape[1], dtype=wide, device=self.device)
            self.context.complete(dist.all_to_all_single(got, served, send_counts, recv_counts,
                                                         group=self.context.group, async_op=True), call)
            words = row // wide.itemsize
            area = self._area[:len(order_X) * row].view(len(order_X), row)
            area.view(wide).index_copy_(0, order_X, got[:, :words])
            sf = None
            if sf_bytes:
                sf = torch.empty(len(order_X), sf_bytes, dtype=torch.uint8, device=self.device)
                sf.view(wide).index_copy_(0, order_X, got[:, words:])
        event = EventHandle(stream=self.context.comm_stream) if cuda else None
        L, E = len(cfg["entries"]), cfg["num_entries_per_token"]
        per_layer = num_tokens * E

        def hook(layer: int):
            if event is not None:
                event.current_stream_wait()
                if sf is not None:  # made on the comm stream, read on this one
                    sf.record_stream(torch.cuda.current_stream(self.device))
            data = area[layer * per_layer:(layer + 1) * per_layer].view(cfg["dtype"]).view(num_tokens,
                                                                                            E * cfg["hidden"])
            if sf is None:
                return data
            scales = sf[layer * per_layer:(layer + 1) * per_layer].view(self._sf_dtype).view(num_tokens,
                                                                                              E * cfg["packs"])
            return data, place_sf(scales, use_tma_aligned_col_major_sf)
        return [lambda layer=layer: hook(layer) for layer in range(L)]

    def _plan(self, c, cfg: dict, indices) -> tuple:
        """Owner and owner-local table row of every (layer, token, entry), flat; reads the indices (host)."""
        L, E = len(cfg["entries"]), cfg["num_entries_per_token"]
        idx = self._check_tensor(c, "indices", indices, (torch.int32, torch.int64), (L, None, E))
        num_tokens = idx.shape[1]
        if num_tokens > cfg["num_max_tokens"]:
            c.fail(ValueError, f"indices has {num_tokens} tokens but num_max_tokens is {cfg['num_max_tokens']} "
                               "(set_config)")
        idx = idx.to(torch.int64)
        n_L = torch.tensor(cfg["entries"], dtype=torch.int64, device=self.device).view(L, 1, 1)
        bad = (idx < 0) | (idx >= n_L * self.num_ranks)
        if num_tokens and bool(bad.any()):
            lt, t, e = (int(v) for v in bad.nonzero()[0])
            c.fail(ValueError, f"indices[{lt}, {t}, {e}] = {int(idx[lt, t, e])} is outside layer {lt}'s global index "
                               f"space [0, {self.num_ranks * cfg['entries'][lt]}) (R x num_entries_per_layer[{lt}])")
        offset_L = torch.tensor(cfg["offsets"][:-1], dtype=torch.int64, device=self.device).view(L, 1, 1)
        return (idx // n_L).reshape(-1), (idx % n_L + offset_L).reshape(-1), num_tokens

    # -- helpers -------------------------------------------------------------------------------------
    def _agree(self, call: str, op: int, err, signature: list, names: tuple,
               counts_R: Optional[Tensor] = None) -> list:
        """Exchange `[status, op, signature..., count]` with every rank; raise together; return received counts."""
        status = 0 if err is None else (1 if isinstance(err, TypeError) else 2)
        head = torch.tensor([status, op, *signature], dtype=torch.int64, device=self.device)
        send = torch.cat([head.expand(self.num_ranks, -1),
                          (counts_R if counts_R is not None else torch.zeros(self.num_ranks, dtype=torch.int64,
                                                                             device=self.device)).view(-1, 1)], 1)
        rows = self.context.exchange(send.contiguous(), call).tolist()
        if err is not None:
            raise err
        for r, row in enumerate(rows):
            if row[0]:
                raise _EXC[row[0]](f"{call}: rank {self.rank}: group rank {r} rejected the call (see its message)")
        for r, row in enumerate(rows):
            if row[1] != op:
                raise ValueError(f"{call}: rank {self.rank}: group rank {r} is in EngramBuffer.{_OPS.get(row[1])} "
                                 f"while this rank is in {call}; every rank makes the same calls in the same order")
        for i, name in enumerate(names):
            values = [row[2 + i] for row in rows]
            if len(set(values)) > 1:
                raise ValueError(f"{call}: rank {self.rank}: ranks disagree on {name} ("
                                 + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)) + ")")
        return [row[-1] for row in rows]

    def _require_config(self, c) -> dict:
        if self._config is None:
            c.fail(ValueError, "call set_config(...) first (it fixes the table shape)")
        return self._config

    def _check_tensor(self, c, name: str, t, dtypes: tuple, shape: tuple) -> Tensor:
        return c.tensor(name, t, ndim=len(shape), dtypes=dtypes, shape=shape)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=3)

    # -- lifecycle -----------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release the buffer (collective: a barrier). A second call is a no-op."""
        if self._destroyed:
            return
        if self.context.broken is None:
            self.context.barrier(call="EngramBuffer.destroy")
        self.context.destroyed = self._destroyed = True
        self.gpu_storage = self.rdma_storage = self._table = self._area = self._scales = None

