"""The receive side of both fused nvlink dispatches: the plan kernels' launcher (`plan_rows`), the placement kernel
(`place`, also the expand placement of moved fields on a GPU, pipeline._place) and the dispatch's outputs.

`syncfree_nvlink.py` runs them on the sync-free receive area (R blocks of N records), `exact_nvlink.py` on the
fields a CPU-synced pull moved (rows packed by source); the kernels are `kernels/_syncfree_triton.py`'s
`dispatch_plan_rows`, `dispatch_plan_experts` and `dispatch_place`, which write every tensor of the handle and its
plan as the generic path (pipeline.py) defines it.

Shape legend (docs/shapes.md): K top-k, R ranks, L local experts, M received rows, S expanded rows, P scale packs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import epilogue, layout, pipeline
from .debug import phase
from .kernels.launch import launch
from .moves import row_bytes
from .sizing import align, ceil_div, contiguous_strides, next_pow2

WORDS_PER_PROGRAM = 1024  # int32 words of a data row per program of the send and place kernels
_FILL = 1024  # expanded rows initialised per step by the plan kernel
_TOTALS_IN_ROWS = True  # non-expand: the per-expert totals in plan_rows' last program (False: a launch of their own)
# One-hot elements ([rows, local experts]) per program of the plan kernels: 16 rows of 128 local experts, so that
# a chunk is a few us of work and the chunks run in parallel.
_PLAN_ELEMS = 2048
_PLAN_WARPS = 4
_SCAN_ELEMS = 1 << 25  # per-expert chunk counts the expand plan reads in all (plan_chunks)


def outputs(buf, call: pipeline.DispatchCall, plan: pipeline.Plan, p: dict, recv_x, aligned_list: list,
            dst_slot_TK: Tensor) -> tuple:
    """Dispatch's `(recv_x, recv_topk_idx, recv_topk_weights, handle)` from the plan kernels' tensors `p`."""
    handle = pipeline.new_handle(
        buf, call, plan, num_recv_tokens_per_expert_list=aligned_list, psum_rank=p["psum_rank"],
        psum_expert=p["psum_expert"], unaligned=p["unaligned32"], recv_src_metadata=p["meta"],
        dst_buffer_slot_idx=dst_slot_TK, recv_expert_ids=p["expert_ids"])
    return recv_x, p["recv_topk_idx"], p["w_out"], handle  # recv_topk_idx: not the plan's local ids


def plan_rows(call: pipeline.DispatchCall, rank: int, num_ranks: int, *, num_rows: int, num_expanded: int,
              blocked: bool, counts: tuple, routing: tuple, weights: tuple, done: Optional[Tensor] = None) -> dict:
    """Launch `dispatch_plan_rows` and `dispatch_plan_experts` over `num_rows` received rows (`num_expanded`
    expanded rows); returns every tensor they write, and the `RecvLayout` (`recv`). Without expand, given `done`
    (an int64 counter at zero, left at zero: `SymmetricRegion.programs_done("totals")`), `dispatch_plan_rows` writes the
    per-expert totals in its last program and `dispatch_plan_experts` is not launched.

    Where the kernels read (tensor, byte offset, ...): `counts` = (t, off, row stride in int64): row s holds what
    rank s sent here; `routing` = (t, off, stride, top-k offset, key offset) of received row b; `weights` = (t, off,
    stride). `blocked`: R blocks of N rows (sync-free) rather than rows packed by source.
    """
    from .kernels import _syncfree_triton as k

    num_topk, num_local = call.topk_idx.shape[1], call.num_experts // num_ranks
    m, s, device = num_rows, num_expanded, call.topk_idx.device
    l_pow2 = next_pow2(num_local)
    rows_per_block, chunk_rows, num_chunks = plan_chunks(m, l_pow2)
    expand, ids = call.do_expand, call.emit_expert_ids
    # Two allocations carved into the int64 and int32 tensors (an allocation costs host time on every call).
    out = dict(zip(("counts_R", "out_src_M", "buf_out_X", "src_rank_M", "local_idx_MK", "unaligned_L", "start_L",
                    "row_ptr_MK", "pair_S"), carve(torch.int64, device, (num_ranks,), (m,), (m,), (m,), (m, num_topk),
                                                   (num_local,), (num_local,), (m, num_topk) if expand else None,
                                                   (s,) if expand else None)))
    out.update(zip(("meta", "psum_rank", "psum_expert", "unaligned32", "expert_ids", "chunk_counts"), carve(
        torch.int32, device, (m, num_topk + 2), (num_ranks,), (num_local,), (num_local,), (s,) if ids else None,
        (num_chunks, l_pow2))))
    out["valid_M"] = torch.empty(m, dtype=torch.bool, device=device)
    w = call.topk_weights
    out["w_out"] = None if w is None else torch.empty((s,) if expand else (m, num_topk), dtype=w.dtype,
                                                      device=device)
    out["recv_topk_idx"] = None if expand else torch.empty(m, num_topk, dtype=call.topk_idx.dtype, device=device)
    meta, chunk_counts = out["meta"], out.pop("chunk_counts")
    stats = call.stats if call.stats is None or call.stats.is_contiguous() else call.stats.contiguous()
    w_bits = dict(w_in_ptr=as_bits(w) if w is not None else meta,
                  w_out_ptr=as_bits(out["w_out"]) if w is not None else meta)
    w_rec = dict(wr_ptr=weights[0], wr_off=weights[1], wr_stride=weights[2])
    shape = dict(K=num_topk, L=num_local, EXPAND=call.do_expand, HAS_W=w is not None,
                 EMIT_IDS=out["expert_ids"] is not None, K_POW2=next_pow2(num_topk), L_POW2=l_pow2,
                 MC=rows_per_block, num_warps=_PLAN_WARPS)
    common = dict(local_idx_ptr=out["local_idx_MK"], meta_ptr=meta, chunk_counts_ptr=chunk_counts,
                  pair_ptr=ptr_or(out["pair_S"], meta), expert_ids_ptr=ptr_or(out["expert_ids"], meta), num_rows=m,
                  chunk_rows=chunk_rows)
    recv_idx = out["recv_topk_idx"]
    totals = dict(unaligned_ptr=out["unaligned_L"], start_ptr=out["start_L"], psum_expert_ptr=out["psum_expert"],
                  unaligned32_ptr=out["unaligned32"], stats_ptr=ptr_or(stats, out["unaligned32"]),
                  alignment=call.expert_alignment, HAS_STATS=stats is not None, GC=max(1, min(64, 4096 // l_pow2)))
    in_rows = done is not None and not call.do_expand and _TOTALS_IN_ROWS  # in plan_rows' last program
    with phase("plan_kernels"):
        launch(k.dispatch_plan_rows, (num_chunks,),
            counts[0], routing[0], counts_ptr=out["counts_R"], out_src_ptr=out["out_src_M"],
            buf_out_ptr=out["buf_out_X"], src_rank_ptr=out["src_rank_M"], valid_ptr=out["valid_M"],
            psum_rank_ptr=out["psum_rank"], recv_idx_ptr=ptr_or(recv_idx, meta), WRITE_IDX=recv_idx is not None,
            me=rank, num_expanded=s, cnt_off=counts[1], rt_off=routing[1],
            rt_stride=routing[2], topk_off=routing[3], g_off=routing[4], N=call.n, R=num_ranks, HDR_COLS=counts[2],
            BLOCKED=blocked, R_POW2=next_pow2(num_ranks), FILL=_FILL, done_ptr=done if in_rows else meta,
            TOTALS=in_rows, **totals, **common, **w_rec, **w_bits, **shape)
        if not in_rows:
            launch(k.dispatch_plan_experts, (num_chunks if call.do_expand else 1,),
                out_src_ptr=out["out_src_M"], row_ptr_ptr=ptr_or(out["row_ptr_MK"], meta), num_chunks=num_chunks,
                **totals, **common, **w_rec, **w_bits, **shape)
    if stats is not call.stats:  # the kernel added into a contiguous copy of strided stats
        call.stats.copy_(stats)
    out["recv"] = layout.RecvLayout(local_idx_MK=out["local_idx_MK"], num_unaligned_L=out["unaligned_L"],
                                    aligned_start_L=out["start_L"], row_ptr_MK=out["row_ptr_MK"],
                                    num_expanded_rows=s)
    return out


def plan_chunks(num_rows: int, l_pow2: int) -> tuple:
    """(rows per block MC, rows per chunk, chunks) of the plan kernels: a program takes a chunk of rows, MC at a time
    (one-hot blocks of _PLAN_ELEMS elements). With expand, every chunk's program sums the per-expert counts of all
    chunks (chunks^2 * L elements in all), so the chunks are at most sqrt(_SCAN_ELEMS / L): a bound that leaves
    dsv3's ~8k rows of 128 local experts at one block per chunk and keeps 32k rows of 1024 local experts to ~10^8
    elements rather than ~10^11."""
    mc = max(1, min(64, _PLAN_ELEMS // l_pow2))
    blocks = max(1, -(-num_rows // mc))
    max_chunks = max(1, math.isqrt(_SCAN_ELEMS // l_pow2))
    chunk_rows = -(-blocks // min(blocks, max_chunks)) * mc
    return mc, chunk_rows, max(1, -(-num_rows // chunk_rows))  # program 0 also writes the per-rank counts


def carve(dtype: torch.dtype, device: torch.device, *shapes) -> list:
    """Fresh contiguous tensors of `shapes` (None: no tensor) as views of one allocation, each starting on 16 bytes:
    one allocation and one `as_strided` per tensor, since every torch call costs host time on every call."""
    per16 = 16 // dtype.itemsize
    starts, total = [], 0
    for shape in shapes:
        starts.append(total)
        total += 0 if shape is None else align(math.prod(shape), per16)
    base = torch.empty(total, dtype=dtype, device=device)
    return [None if shape is None else base.as_strided(shape, contiguous_strides(shape), start)
            for shape, start in zip(shapes, starts)]


def ptr_or(t: Optional[Tensor], placeholder: Tensor) -> Tensor:
    """A tensor argument the kernel does not touch under its constexpr flags still needs a pointer."""
    return placeholder if t is None else t


def field_sources(fields: dict) -> dict:
    """`place`'s sources for fields a packed move landed in their own row-contiguous tensors: received row b of
    field "x", "sf" or "w" is row b of its tensor."""
    return {name: (t.view(torch.uint8), 0, row_bytes(t)) for name, t in fields.items() if name in ("x", "sf", "w")}


def place(call: pipeline.DispatchCall, plan: pipeline.Plan, sources: dict, with_weights: bool = False):
    """(recv_x, recv_topk_weights or None): the data rows (and scales) in the output layout, zeros where no token
    lands; with `with_weights`, the weights too (cached dispatch; a full one gets them from the plan kernels).
    `sources[name] = (tensor, byte offset, byte stride)`: field `name` of received row b (`plan.out_src_M`) is at
    `offset + b * stride` bytes of the tensor ("x", "sf", "w")."""
    from .kernels import _syncfree_triton as k

    x, num_topk = call.x, call.topk_idx.shape[1]
    rows = plan.pair_S.shape[0] if call.do_expand else plan.out_src_M.shape[0]
    device = plan.out_src_M.device
    out = torch.empty(rows, x.hidden, dtype=x.data.dtype, device=device)
    words = out.shape[1] * out.element_size() // 4
    num_packs = x.sf.shape[1] if x.is_fp8 else 1
    sf_out = torch.empty(rows, num_packs, dtype=x.sf.dtype, device=device) if x.is_fp8 else None
    w_out = None
    if with_weights and call.topk_weights is not None:
        w_out = torch.empty((rows,) if call.do_expand else (rows, num_topk), dtype=call.topk_weights.dtype,
                            device=device)
    if rows:
        (x_src, x_off, x_stride), (sf_src, sf_off, sf_stride), (w_src, w_off, w_stride) = (
            sources.get(name, sources["x"]) for name in ("x", "sf", "w"))
        launch(k.dispatch_place, (rows, ceil_div(words, WORDS_PER_PROGRAM)),
            x_src, sf_src, w_src, plan.out_src_M, ptr_or(plan.pair_S, plan.out_src_M),
            out.view(torch.uint8).view(torch.int32), sf_out.view(torch.int32) if sf_out is not None else out,
            as_bits(w_out) if w_out is not None else out, plan.recv.local_idx_MK,
            x_off, x_stride, sf_off, sf_stride, w_off, w_stride,
            X_WORDS=words, P=num_packs, K=num_topk, EXPAND=call.do_expand, HAS_SF=x.is_fp8, HAS_W=w_out is not None,
            K_POW2=next_pow2(num_topk), P_POW2=next_pow2(num_packs),
            BLOCK_W=WORDS_PER_PROGRAM, num_warps=4)
    recv_x = out if sf_out is None else (out, epilogue.place_sf(sf_out, call.col_major_sf))
    return recv_x, w_out


def as_bits(t: Tensor) -> Tensor:
    """A float tensor as the integers of its width (the kernels move weights and scales as bits)."""
    return t.view({8: torch.int64, 4: torch.int32}[t.element_size()])
