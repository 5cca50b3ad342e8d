"""`EngramBuffer`: fetch rows of a sharded embedding table by global index (DeepEP V2.5 behaviour, §15).

Each rank holds one shard of every layer's table (`[N_l, hidden]`); the global index space of layer `l` is
`[0, R * N_l)`, owner `idx // N_l`, row `idx % N_l`. `fetch(indices)` returns one hook per layer; hook `l`
returns `[T, E * hidden]` (entries concatenated per token), bitwise `global_table_l[indices[l]]`.

The reference reads remote rows one-sided over RDMA. epcomm has two transports, chosen at construction
(`transport="auto"`: nvlink when every rank is a CUDA GPU of one host with symmetric memory, else collective):

* **nvlink** (engram_nvlink.py): the shards live in torch symmetric memory and each rank reads the rows it needs
  straight from the owners' memory (`index_select` on peer views), as the reference does over RDMA. fetch is
  not collective: no exchange, no work on the owners.
* **collective** (CPU, several hosts): owners serve the rows, so **fetch is collective** (every rank calls it,
  in the same order as the other buffer calls):

    counts + status -> all_to_all (host read of the counts)   requests grouped by owner, stable order
    row ids         -> all_to_all                             the owner gathers its rows (+ their FP8 scales)
    rows            -> all_to_all                             placed at their (layer, token, entry) slot

Both place rows and scales with the same code, so results are bitwise identical.
FP8 tables come with the global replicated scale table; each rank keeps the scales of its own rows and serves
them with the rows, so `num_gpu_bytes` holds one shard of scales (the reference's formula with one host).
RDMA-only arguments (QPs, QP depth, relaxed ordering, CPU RDMA storage, service level) are accepted and have no
effect. Shape legend (docs/shapes.md): L layers, T tokens, E entries per token, R ranks, P scale packs.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import sizing
from .agreement import digest, gather_messages, rejected
from .comm import ContextLifecycle, CommContext, new_comm_stream
from .compile_guard import eager_under_compile
from .engram_layout import DTYPES, check_config, make_hooks, needs, place, plan
from .moves import transfer_word
from .engram_nvlink import NVLinkTable, choose_transport
from .events import EventHandle
from .validate import Checker, construction_timeout, process_group, warn_caller

__all__ = ["EngramBuffer"]

_DTYPE_CODES = {d: i + 1 for i, d in enumerate(DTYPES)}
_OPS = {1: "set_config", 2: "write", 3: "fetch"}
_EXC = {1: TypeError, 2: ValueError}
# NOTE: the reference's model (§15): 90 Mpps NIC reads with fast atomics, 10 us round trip, 32768 slots max.
_NIC_MPPS, _RTT_S, _MAX_QP_DEPTH = 90.0, 1e-5, 32768


def _group_size(group) -> int:
    return group if isinstance(group, int) else (group or dist.group.WORLD).size()


class EngramBuffer(ContextLifecycle):
    """A sharded embedding table and a receive area for `fetch` (collective construction).

    Args:
        group: the process group; None for the default group. Messages use group ranks.
        num_gpu_bytes: int -- receive area plus this rank's scale shard; a positive multiple of 2 MiB
            (`get_storage_size_hint()[0]`).
        num_rdma_storage_bytes: int -- this rank's table shard; a positive multiple of 2 MiB (hint `[1]`). The
            legacy keyword `num_rdma_storage_size` is an alias. On nvlink both sizes bound the configuration as
            on collective, and the table and scale shards live in a symmetric region `set_config` allocates.
        use_cpu_rdma_storage: accepted; no effect (the shard lives on the buffer's device; warns once if True).
        num_allocated_qps, qp_depth: accepted, no effect; when given they must be > 0 (reference §15).
        restrict_rd_atomic, allow_hybrid_mode, sl_idx: accepted, no effect.
        num_gpu_timeout_secs: bound on the device barriers of the nvlink transport (seconds, > 0); on the
            collective transport device waits are bounded by the group's NCCL timeout. Default 100.
        explicitly_destroy: warn at garbage collection when `destroy()` was not called.
        num_rdma_storage_size: legacy alias of `num_rdma_storage_bytes`.
        num_cpu_timeout_secs: bound on every host wait (epcomm keyword). Default 300.
        transport: "auto" (default), "nvlink" or "collective" (epcomm keyword; every rank passes the same).
            "auto" picks nvlink when every rank of the group is a CUDA GPU on one host with torch symmetric
            memory and peer access, else collective (CPU, several hosts).

    Fields:
        transport: str -- the transport chosen, "nvlink" or "collective".
        rdma_storage: [num_rdma_storage_bytes] uint8 (collective); on nvlink None until `set_config`, then the
            symmetric region holding the table and scale shards.

    Raises:
        TypeError: `group` not a ProcessGroup or None (raised on this rank only, before any exchange); both
            `num_rdma_storage_bytes` and `num_rdma_storage_size`, or neither; a timeout that is not a number.
        ValueError: sizes that are not positive multiples of 2 MiB; QP arguments <= 0; a timeout <= 0; an
            unknown transport or ranks that disagree on it, or "nvlink" where it cannot run (every rank raises;
            the message says why).
        TimeoutError: a peer did not construct within `num_cpu_timeout_secs`.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], num_gpu_bytes: int,
                 num_rdma_storage_bytes: Optional[int] = None, use_cpu_rdma_storage: bool = False,
                 num_allocated_qps: Optional[int] = None, qp_depth: Optional[int] = None,
                 restrict_rd_atomic: bool = False, allow_hybrid_mode: bool = True, sl_idx: Optional[int] = None,
                 num_gpu_timeout_secs: float = 100, explicitly_destroy: bool = False, *,
                 num_rdma_storage_size: Optional[int] = None, num_cpu_timeout_secs: float = 300,
                 transport: str = "auto"):
        self.explicitly_destroy = explicitly_destroy
        self._destroyed = True  # until construction succeeds
        group = process_group("EngramBuffer", group)
        who = f"EngramBuffer: rank {group.rank()}"
        err = None  # a failed check still joins the construction exchange, so that every rank raises
        try:
            Checker("EngramBuffer", group.rank(), None).timeouts(num_cpu_timeout_secs, num_gpu_timeout_secs)
            if num_rdma_storage_bytes is not None and num_rdma_storage_size is not None:
                raise TypeError(f"{who}: pass num_rdma_storage_bytes or its legacy alias num_rdma_storage_size, "
                                "not both")
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
        except (TypeError, ValueError) as e:
            err = e
        self.num_gpu_bytes, self.num_rdma_storage_bytes = num_gpu_bytes, num_rdma_storage_bytes
        self.use_cpu_rdma_storage, self.num_allocated_qps, self.qp_depth = use_cpu_rdma_storage, num_allocated_qps, \
            qp_depth
        self.restrict_rd_atomic, self.allow_hybrid_mode, self.sl_idx = restrict_rd_atomic, allow_hybrid_mode, sl_idx
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self._warned: set = set()
        if use_cpu_rdma_storage:
            self._warn_once("cpu", "epcomm: EngramBuffer use_cpu_rdma_storage has no effect; the table shard lives on "
                                   "the buffer's device")
        self.context = CommContext(group, owner="EngramBuffer", error=err,
                                   num_cpu_timeout_secs=construction_timeout(num_cpu_timeout_secs, err))
        self.contexts = [self.context]
        self.rank, self.num_ranks, self.device = self.context.rank, self.context.num_ranks, self.context.device
        self.transport = choose_transport(self.context, transport)
        self.context.comm_stream = new_comm_stream(self.device)
        self.gpu_storage = torch.empty(num_gpu_bytes, dtype=torch.uint8, device=self.device)
        # nvlink: the shards go to a symmetric region sized from the configuration (set_config), not here.
        self.rdma_storage = torch.empty(num_rdma_storage_bytes, dtype=torch.uint8, device=self.device) \
            if self.transport == "collective" else None
        self._nvlink: Optional[NVLinkTable] = None
        self._config: Optional[dict] = None
        self._written = False
        self.context.barrier(with_cpu_sync=True, call="EngramBuffer", same_buffer=False)
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
            hidden: elements per row, any size (the reference requires `hidden * elem % 64 == 0`; epcomm's
                transports do not, and `set_config` accepts what this accepts).
            num_max_tokens: T, tokens per fetch; num_entries_per_token: E, rows per token.
            dtype: bf16 (default), fp16, fp32 or FP8 e4m3. num_sf_packs: P, 4-byte scale packs per row (FP8 only).

        Returns:
            `(num_gpu_bytes, num_rdma_storage_bytes)` -- ints, multiples of 2 MiB.

        Raises:
            TypeError: bad dtype or list. ValueError: non-positive sizes; packs without FP8.
        """
        who = "EngramBuffer.get_storage_size_hint"
        entries = check_config(who, num_entries_per_layer, hidden, num_max_tokens, num_entries_per_token, dtype,
                               num_sf_packs)
        area, scales, table = needs(entries, hidden, num_max_tokens, num_entries_per_token, dtype.itemsize,
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

    def _memory_regions(self) -> dict:
        regions = {"gpu_storage": self.gpu_storage.nbytes}
        if self.rdma_storage is not None:
            regions["rdma_storage"] = self.rdma_storage.nbytes
        return regions

    # -- configuration and table -----------------------------------------------------------------------
    @eager_under_compile
    def set_config(self, num_entries_per_layer: Sequence[int], hidden: int, num_max_tokens: int,
                   num_entries_per_token: int, dtype: torch.dtype = torch.bfloat16, num_sf_packs: int = 0) -> None:
        """Fix the table shape (collective; every rank passes the same values). Arguments as the size hint.

        On nvlink this allocates the symmetric region of the table and scale shards (collective; reused while the
        new shape fits). Capacity is checked against `num_gpu_bytes` / `num_rdma_storage_bytes` on both
        transports, so a configuration that works on one works on the other.

        Raises:
            TypeError / ValueError: bad values, or a shape that does not fit `num_gpu_bytes` /
                `num_rdma_storage_bytes` (the message gives both sizes and the hint call); ranks that disagree
                (every rank raises).
            TimeoutError: a peer did not arrive.
        """
        call = "EngramBuffer.set_config"
        c = self.context.checker(call)
        err, signature = None, [0] * 8
        try:
            entries = check_config(f"{call}: rank {self.rank}", num_entries_per_layer, hidden, num_max_tokens,
                                   num_entries_per_token, dtype, num_sf_packs)
            area, scales, table = needs(entries, hidden, num_max_tokens, num_entries_per_token, dtype.itemsize,
                                        num_sf_packs)
            if area + scales > self.num_gpu_bytes or table > self.num_rdma_storage_bytes:
                c.fail(ValueError, f"the table needs num_gpu_bytes >= {area + scales} (receive area {area} + scales "
                                   f"{scales}) and num_rdma_storage_bytes >= {table}, but the buffer has "
                                   f"{self.num_gpu_bytes} and {self.num_rdma_storage_bytes}; size it with "
                                   f"EngramBuffer.get_storage_size_hint(group, {entries}, {hidden}, {num_max_tokens}, "
                                   f"{num_entries_per_token}, {dtype}, {num_sf_packs})")
            signature = [len(entries), sum(entries), digest(entries), hidden, num_max_tokens, num_entries_per_token,
                         _DTYPE_CODES[dtype], num_sf_packs]
        except (Exception, KeyboardInterrupt) as e:  # it travels in the header
            err = e
        self._agree(call, 1, err, signature, ("layers", "total entries",
                                              "num_entries_per_layer (a digest of the list)", "hidden",
                                              "num_max_tokens", "num_entries_per_token", "dtype", "num_sf_packs"))
        offsets = [0]
        for n in entries:
            offsets.append(offsets[-1] + n)
        row = hidden * dtype.itemsize
        self._config = dict(entries=entries, offsets=offsets, hidden=hidden, num_max_tokens=num_max_tokens,
                            num_entries_per_token=num_entries_per_token, dtype=dtype, packs=num_sf_packs, row=row)
        rows, sf_bytes = offsets[-1], num_sf_packs * 4
        area = len(entries) * num_max_tokens * num_entries_per_token * row
        self._area = self.gpu_storage[:area]
        if self.transport == "nvlink":
            self._configure_nvlink(call, rows, row, sf_bytes)
            self._table, self._scales = self._nvlink.table, self._nvlink.scales
        else:
            self._table = self.rdma_storage[:rows * row].view(rows, row)
            self._scales = self.gpu_storage[area:area + rows * sf_bytes].view(rows, sf_bytes)
        self._sf_dtype = torch.float32
        self._written = False

    def _configure_nvlink(self, call: str, rows: int, row: int, sf_bytes: int) -> None:
        """Reuse or allocate the symmetric region for this shape (collective: every rank has the same history)."""
        need = NVLinkTable.region_bytes(rows, row, sf_bytes)
        if self._nvlink is None or self._nvlink.region.nbytes < need:
            if self._nvlink is not None:  # peers may still be reading the old region: drain every rank first
                self.context.barrier(with_cpu_sync=True, call=call)
                self._nvlink.release()
                self._table = self._scales = self.rdma_storage = None
            self._nvlink = NVLinkTable(self.context.group, self.device, need, self.num_gpu_timeout_secs)
        self._nvlink.configure(rows, row, sf_bytes, transfer_word(row), transfer_word(sf_bytes))
        self.rdma_storage = self._nvlink.region.local

    @eager_under_compile
    def write(self, storages: Sequence[Tensor], sfs: Optional[Sequence[Tensor]] = None) -> None:
        """Store this rank's shard of every layer (collective; barriers before and after).

        On nvlink the barriers are device barriers (bounded by `num_gpu_timeout_secs`): the first waits until
        every peer has finished reading this rank's old rows, the second makes the new rows visible to peers.

        Args:
            storages: L tensors, `storages[l]`: [N_l, hidden] of the configured dtype -- this rank's rows.
            sfs: FP8 only: L tensors, `sfs[l]`: [R * N_l, P] fp32 or int32 (one dtype for every layer and rank) --
                the global replicated scale table; this rank keeps rows `[rank * N_l, (rank + 1) * N_l)`.

        Raises:
            TypeError / ValueError: no config, wrong count/shape/dtype/device (every rank raises).
            TimeoutError: a peer did not arrive.
        """
        call = "EngramBuffer.write"
        c = self.context.checker(call)
        err, sf_code = None, 0
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
                    # one scale format for the table: fetch returns every layer's scales in it
                    c.require(sfs[layer].dtype == sfs[0].dtype, f"sfs[{layer}] has dtype {sfs[layer].dtype} but "
                                                                f"sfs[0] {sfs[0].dtype}; pass every layer's scales "
                                                                "in one dtype")
            sf_code = 0 if not fp8 else (1 if sfs[0].dtype == torch.float32 else 2)
        except (Exception, KeyboardInterrupt) as e:  # it travels in the header
            err = e
        self._agree(call, 2, err, [sf_code], ("the scales' dtype (1: torch.float32, 2: torch.int32)",))
        try:
            self._store(call, cfg, storages, sfs)
        except (Exception, KeyboardInterrupt) as e:
            self.context.after_agreement(call, e)

    def _store(self, call: str, cfg: dict, storages: Sequence[Tensor], sfs: Optional[Sequence[Tensor]]) -> None:
        """`write` once the ranks agreed on it: barrier (nvlink), this rank's rows into its shard, barrier."""
        if self._nvlink is not None:
            self._nvlink.begin_write(self.context.comm_stream)
        elif self.device.type == "cuda":  # this rank's own fetches read the table on the communication stream
            torch.cuda.current_stream(self.device).wait_stream(self.context.comm_stream)
        offsets = cfg["offsets"]
        for layer, t in enumerate(storages):
            self._table[offsets[layer]:offsets[layer + 1]].copy_(sizing.dense_strides(t.contiguous()).view(torch.uint8))
            if sfs is not None:
                n = cfg["entries"][layer]
                mine = sizing.dense_strides(sfs[layer][self.rank * n:(self.rank + 1) * n].contiguous())
                self._scales[offsets[layer]:offsets[layer + 1]].copy_(mine.view(torch.uint8))
                self._sf_dtype = sfs[layer].dtype
        self._written = True
        if self._nvlink is not None:
            self._nvlink.end_write(self.context.comm_stream)
        else:
            self.context.barrier(call=call)

    # -- fetch ---------------------------------------------------------------------------------------
    @eager_under_compile
    def fetch(self, indices: Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = True) -> list:
        """Fetch `global_table_l[indices[l]]` for every layer.

        Collective on the collective transport (every rank calls it, in the same order as the other buffer
        calls). One-sided on nvlink: each rank reads the rows it needs from the owners' memory, with no
        exchange, so a rank may fetch alone (portable code calls it on every rank). Host-blocking once on both:
        one read of `[any index out of range, rows per owner]` (the range check needs it; the counts ride along
        and size the per-owner reads). On CUDA the moves run on the communication stream and hook `l` makes the
        current stream wait. Not graph-capturable (the host read). Naive equivalent per layer:
            table = torch.cat(all_gather(shard_l)); out_l = table[indices[l]].view(T, E * hidden)

        Errors: on the collective transport every rank raises (the status rides with the count exchange): the
        offending rank its own message, the others "group rank r rejected the call". On nvlink only the
        offending rank raises: no peer waits for it or serves it, so nothing hangs, and an exchange made only to
        share the error would add a host-synchronised collective to every fetch (docs/collectives.md).

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
            TypeError / ValueError: no config or table, bad indices (shape, dtype, device, out of range); every
                rank raises on the collective transport (naming the offender), the offending rank on nvlink.
            TimeoutError: a peer did not arrive (collective transport).
        """
        call = "EngramBuffer.fetch"
        c = self.context.checker(call)
        cuda = self.device.type == "cuda"
        if cuda:
            self.context.comm_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.context.comm_stream) if cuda else contextlib.nullcontext():
            if self.transport == "nvlink":
                cfg = self._fetch_config(c, num_qps)
                owner_X, row_X, num_tokens, _, counts = plan(c, cfg, indices, self.num_ranks, self.device)
                order_X = torch.argsort(owner_X, stable=True)
                got, got_sf = self._nvlink.read(row_X[order_X], counts)
            else:
                cfg, order_X, got, got_sf, num_tokens = self._serve(c, call, indices, num_qps)
            area, sf = place(self._area, cfg, order_X, got, got_sf)
        event = EventHandle(stream=self.context.comm_stream) if cuda else None
        return make_hooks(cfg, area, sf, self._sf_dtype, num_tokens, event, use_tma_aligned_col_major_sf)

    def _fetch_config(self, c, num_qps) -> dict:
        cfg = self._require_config(c)
        if not self._written:
            c.fail(ValueError, "the table was never written; call write(storages) after set_config")
        if num_qps:
            self._warn_once("num_qps", "epcomm: EngramBuffer.fetch num_qps has no effect; it is ignored")
        return cfg

    def _serve(self, c, call: str, indices, num_qps) -> tuple:
        """The collective data path: counts + status, then row ids, then the rows the owners gather.

        Returns `(cfg, order_X, rows [X, words], scales [X, sf words] or None, T)`, rows grouped by owner."""
        err, counts_R = None, torch.zeros(self.num_ranks, dtype=torch.int64, device=self.device)
        try:
            cfg = self._fetch_config(c, num_qps)
            owner_X, row_X, num_tokens, counts_R, send_counts = plan(c, cfg, indices, self.num_ranks, self.device)
            order_X = torch.argsort(owner_X, stable=True)
        except (Exception, KeyboardInterrupt) as e:  # it travels in the header
            err = e
        recv_counts = self._agree(call, 3, err, [], (), counts_R)
        try:
            return self._move(call, cfg, order_X, row_X, num_tokens, send_counts, recv_counts)
        except (Exception, KeyboardInterrupt) as e:
            self.context.after_agreement(call, e)

    def _move(self, call: str, cfg: dict, order_X, row_X, num_tokens: int, send_counts: list,
              recv_counts: list) -> tuple:
        """The row ids to their owners, the rows back (`_serve`'s result)."""
        ids = torch.empty(sum(recv_counts), dtype=torch.int64, device=self.device)
        self.context.complete(dist.all_to_all_single(ids, row_X[order_X], recv_counts, send_counts,
                                                     group=self.context.group, async_op=True), call)
        # NOTE: rows move as the widest integer words that divide them: uint8 advanced indexing of 512-byte
        # rows ran at ~0.5 GB/s on CPU (2 ranks, 2048 rows, 1.8 ms per index_put); int64 words are ~8x faster.
        row, sf_bytes = cfg["row"], cfg["packs"] * 4
        wide = transfer_word(row, sf_bytes)
        served = self._table.view(wide).index_select(0, ids)
        if sf_bytes:
            served = torch.cat([served, self._scales.view(wide).index_select(0, ids)], dim=1)
        got = torch.empty(len(order_X), served.shape[1], dtype=wide, device=self.device)
        self.context.complete(dist.all_to_all_single(got, served, send_counts, recv_counts,
                                                     group=self.context.group, async_op=True), call)
        words = row // wide.itemsize
        return cfg, order_X, got[:, :words], (got[:, words:] if sf_bytes else None), num_tokens

    # -- helpers -------------------------------------------------------------------------------------
    def _agree(self, call: str, op: int, err, signature: list, names: tuple,
               counts_R: Optional[Tensor] = None) -> list:
        """Exchange `[status, op, buffer id, signature..., count]` with every rank; raise together; return received
        counts. The buffer id tells two EngramBuffers of one group apart (their calls would pair and read each
        other's tables)."""
        status = 0 if err is None else (1 if isinstance(err, TypeError) else 2)
        head = torch.tensor([status, op, self.context.uid, *signature], dtype=torch.int64, device=self.device)
        send = torch.cat([head.expand(self.num_ranks, -1),
                          (counts_R if counts_R is not None else torch.zeros(self.num_ranks, dtype=torch.int64,
                                                                             device=self.device)).view(-1, 1)], 1)
        try:
            rows = self.context.exchange(send.contiguous(), call, kind="EngramBuffer header").tolist()
        except (Exception, KeyboardInterrupt) as e:  # an interrupt while waiting: the peers may be in the exchange
            self.context.after_agreement(call, e, every_rank=(TypeError, ValueError))
        failed = [r for r, row in enumerate(rows) if row[0]]
        if failed:  # every rank learns the first failing rank's message (one more exchange, on failure only)
            messages = gather_messages(lambda t: self.context.exchange(t, f"{call} messages", kind="error messages",
                                                                       label=call),
                                       str(err) if err is not None else "", self.num_ranks, self.device)
            if err is not None:
                raise err
            raise _EXC[rows[failed[0]][0]](rejected(call, self.rank, failed, messages, group=self.context.group))
        if len({row[2] for row in rows}) > 1:
            self.context.take_back_call_id()
            same = [r for r, row in enumerate(rows) if row[2] == self.context.uid]
            raise ValueError(f"{call}: rank {self.rank}: ranks are in calls of different EngramBuffers on this group "
                             f"(group ranks {same} in this one); every rank must call the same buffer in the same "
                             "order")
        for r, row in enumerate(rows):
            if row[1] != op:
                raise ValueError(f"{call}: rank {self.rank}: group rank {r} is in EngramBuffer.{_OPS.get(row[1])} "
                                 f"while this rank is in {call}; every rank makes the same calls in the same order")
        for i, name in enumerate(names):
            values = [row[3 + i] for row in rows]
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
            warn_caller(msg)

    # -- lifecycle -----------------------------------------------------------------------------------
    @eager_under_compile
    def destroy(self) -> None:
        """Release the buffer (collective: a barrier, skipped when a timeout or a mid-call failure broke the group; on
        nvlink drained on the host first, so no peer is still reading the region when it is freed). A second call is
        a no-op."""
        if self._destroyed:
            return
        if self.context.can_meet_peers():
            self.context.barrier(with_cpu_sync=self._nvlink is not None, call="EngramBuffer.destroy",
                                 same_buffer=False)
        self.context.destroyed = self._destroyed = True
        if self._nvlink is not None:
            self._nvlink.release()
            self._nvlink = None
        self.gpu_storage = self.rdma_storage = self._table = self._area = self._scales = None

