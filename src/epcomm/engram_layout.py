"""Shapes and placement of `EngramBuffer`, shared by its two transports (DeepEP V2.5 behaviour, §15).

* `check_config` / `needs`: the table shape a buffer is configured for, and the bytes it takes.
* `plan`: owner and owner-local row of every requested (layer, token, entry), and the rows per owner, with one
  host read (the index range check needs it; the counts ride along).
* `place` / `make_hooks`: rows fetched in owner order go to their request slot of the receive area, scales to a
  fresh tensor; one hook per layer returns the views. Both transports call these, so their results are bitwise
  identical.

Shape legend (docs/shapes.md): L layers, T tokens, E entries per token, R ranks, P scale packs, X = L * T * E
requested rows.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .epilogue import place_sf

__all__ = ["DTYPES", "check_config", "make_hooks", "needs", "place", "plan"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def needs(entries: Sequence[int], hidden: int, num_max_tokens: int, num_entries_per_token: int, elem: int,
          num_sf_packs: int) -> tuple:
    """(receive-area bytes, scale-shard bytes, table-shard bytes), unaligned."""
    total = sum(entries)
    return (len(entries) * num_max_tokens * num_entries_per_token * hidden * elem, total * num_sf_packs * 4,
            total * hidden * elem)


def check_config(who: str, entries, hidden, num_max_tokens, num_entries_per_token, dtype, num_sf_packs) -> list:
    """The per-layer entry counts as a list, after checking every shape argument (TypeError / ValueError)."""
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


def plan(c, cfg: dict, indices, num_ranks: int, device: torch.device) -> tuple:
    """Owner and owner-local table row of every (layer, token, entry), flat, and the rows per owner.

    One host read, `[any index out of range, rows per owner...]`: the range check needs it and the counts ride
    along (on CUDA it waits for the current stream's work queued so far).

    Args:
        c: the call's `Checker`. cfg: the buffer's configuration (set_config).
        indices: [L, T, E] int32 or int64 -- global row ids (checked here).

    Returns:
        `(owner_X [X] int64, row_X [X] int64 (row in the shard, layer offset included), T, counts_R [R] int64,
        counts_R as a list of ints)`.

    Raises:
        TypeError / ValueError: bad dtype, shape, device, too many tokens, an index out of range.
    """
    L, E = len(cfg["entries"]), cfg["num_entries_per_token"]
    idx = c.tensor("indices", indices, ndim=3, dtypes=(torch.int32, torch.int64), shape=(L, None, E))
    num_tokens = idx.shape[1]
    if num_tokens > cfg["num_max_tokens"]:
        c.fail(ValueError, f"indices has {num_tokens} tokens but num_max_tokens is {cfg['num_max_tokens']} "
                           "(set_config)")
    idx = idx.to(torch.int64)
    n_L = torch.tensor(cfg["entries"], dtype=torch.int64, device=device).view(L, 1, 1)
    bad = (idx < 0) | (idx >= n_L * num_ranks)
    owner_X = (idx // n_L).reshape(-1)
    # Counted without bincount (on CUDA it reads the value range on the host) and clamped: bad ids raise below.
    counts_R = torch.zeros(num_ranks, dtype=torch.int64, device=device).scatter_add_(
        0, owner_X.clamp(0, num_ranks - 1), torch.ones_like(owner_X))
    stats = torch.cat([bad.any().view(1).to(torch.int64), counts_R]).tolist()
    if stats[0]:
        lt, t, e = (int(v) for v in bad.nonzero()[0])
        c.fail(ValueError, f"indices[{lt}, {t}, {e}] = {int(idx[lt, t, e])} is outside layer {lt}'s global index "
                           f"space [0, {num_ranks * cfg['entries'][lt]}) (R x num_entries_per_layer[{lt}])")
    offset_L = torch.tensor(cfg["offsets"][:-1], dtype=torch.int64, device=device).view(L, 1, 1)
    return owner_X, (idx % n_L + offset_L).reshape(-1), num_tokens, counts_R, stats[1:]


def place(area_bytes: Tensor, cfg: dict, order_X: Tensor, got: Tensor, got_sf: Optional[Tensor]) -> tuple:
    """Put fetched row x at request slot `order_X[x]` (flat (layer, token, entry) order); scales alike.

    Args:
        area_bytes: [>= X * row] uint8 -- the receive area.
        order_X: [X] int64 -- request slot of each fetched row (a permutation).
        got: [X, row words] -- fetched rows as any integer word dtype (a bit copy).
        got_sf: [X, P * 4 bytes in words] or None -- their scales.

    Returns:
        `(area [X, row] uint8 (a view of area_bytes), scales [X, P * 4] uint8 (fresh) or None)`.
    """
    num_rows, row = len(order_X), cfg["row"]
    area = area_bytes[:num_rows * row].view(num_rows, row)
    area.view(got.dtype).index_copy_(0, order_X, got)
    sf = None
    if got_sf is not None:
        sf = torch.empty(num_rows, cfg["packs"] * 4, dtype=torch.uint8, device=area.device)
        sf.view(got_sf.dtype).index_copy_(0, order_X, got_sf)
    return area, sf


def make_hooks(cfg: dict, area: Tensor, sf: Optional[Tensor], sf_dtype: torch.dtype, num_tokens: int, event,
               use_tma_aligned_col_major_sf: bool) -> list:
    """One hook per layer: hook `l()` makes the current stream wait for the fetch (`event`, None on CPU) and
    returns `[T, E * hidden]` of the table's dtype, or `(data, scales [T, E * P] of sf_dtype)` for FP8."""
    L, E = len(cfg["entries"]), cfg["num_entries_per_token"]
    per_layer = num_tokens * E

    def hook(layer: int):
        if event is not None:
            event.current_stream_wait()
            if sf is not None:  # made on the comm stream, read on this one
                sf.record_stream(torch.cuda.current_stream(sf.device))
        data = area[layer * per_layer:(layer + 1) * per_layer].view(cfg["dtype"]).view(num_tokens, E * cfg["hidden"])
        if sf is None:
            return data
        scales = sf[layer * per_layer:(layer + 1) * per_layer].view(sf_dtype).view(num_tokens, E * cfg["packs"])
        return data, place_sf(scales, use_tma_aligned_col_major_sf)
    return [lambda layer=layer: hook(layer) for layer in range(L)]
