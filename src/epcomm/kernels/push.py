"""Push packed records straight into peers' receive areas (the nvlink transport's row mover).

Send row `x` of a blocked plan goes to rank `x // cap`, at row `rank * cap + x % cap` of that rank's receive
area, where `rank` is the sender; rows whose source index is -1 are holes and are skipped. A record is the
token's data row followed by its small fields (scales, top-k row, key, weights), laid out by a `RecordSpec` whose
first field is the data row.

Worked example (cap 2, sender rank 1, two ranks, 4-byte records):
    src_X = [0, -1, 2, 1]      -> rank 0 gets token 0 at row 2; rank 1 gets token 2 at row 2, token 1 at row 3
    area_0 rows 2..3 = [rec(0), untouched], area_1 rows 2..3 = [rec(2), rec(1)]

The Triton kernel reads each token's row once and stores it into the peer's memory through the pointer table
(`SymmetricRegion.ptrs`, as 16-byte offsets from the local region); `push_rows_torch` is its twin for tests and the fallback for rows that are not a whole
number of 4-byte words.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import sizing
from ..records import RecordSpec


def split_record(spec: RecordSpec, tensors: dict, num_tokens: int, device: torch.device) -> tuple:
    """The data row as bytes [T, D] and every other field packed as bytes [T, B - D] (records minus the data)."""
    data = tensors["x"].reshape(num_tokens, -1).view(torch.uint8)
    data_bytes = spec.offsets.get(spec.fields[1].name, spec.nbytes) if len(spec.fields) > 1 else spec.nbytes
    small = spec.pack({k: v for k, v in tensors.items() if k != "x"},
                      torch.arange(num_tokens, device=device), holes=False)[:, data_bytes:]
    return data, small.contiguous(), data_bytes


def push_rows_torch(areas: list, area_offset: int, spec: RecordSpec, tensors: dict, src_X: Tensor, cap: int,
                    rank: int) -> None:
    """Twin: `areas[r]` is rank r's region as a flat uint8 tensor; records land at `area_offset + row * B`."""
    num_tokens = tensors["x"].shape[0]
    rec = spec.nbytes
    if num_tokens == 0:
        return
    records = spec.pack(tensors, torch.arange(num_tokens, device=src_X.device), holes=False)
    for dest, area in enumerate(areas):
        block = src_X[dest * cap: (dest + 1) * cap]
        rows = (block >= 0).nonzero().squeeze(1)
        view = area[area_offset: area_offset + len(areas) * cap * rec].view(len(areas) * cap, rec)
        view[rank * cap + rows] = records[block[rows]].to(area.device)


def region_deltas(ptrs: Tensor, rank: int) -> Tensor:
    """[R] int64: each rank's region base relative to `rank`'s, in 16-byte units (bases are 16-byte aligned)."""
    delta = ptrs - ptrs[rank]
    assert bool((delta % 16 == 0).all()), "symmetric regions must be 16-byte aligned"
    return torch.div(delta, 16, rounding_mode="floor")


def push_rows(local: Tensor, delta16: Tensor, area_offset: int, spec: RecordSpec, tensors: dict, src_X: Tensor,
              cap: int, rank: int, num_programs: int = 0, block: int = 1024, num_warps: int = 4) -> None:
    """Launcher: one persistent grid; every record is read once from the sender's tensors.

    Args:
        local: [bytes] uint8 -- this rank's region (peers' regions are addressed relative to it).
        delta16: [R] int64 -- `region_deltas` of the regions' base addresses (device).
        area_offset: byte offset of the receive area inside each region (a multiple of 16).
        spec: the record layout; its first field is the data row `x`.
        tensors: the fields by name; `x` is [T, H] of any dtype.
        src_X: [R * cap] int64 -- token of each send row, -1 for holes.
        cap: rows per sender block in every receive area.
        rank: the sender.
        num_programs: grid size (0: 4 per SM).
    """
    from . import _push_triton

    num_tokens = tensors["x"].shape[0]
    if num_tokens == 0 or src_X.numel() == 0:
        return
    data, small, data_bytes = split_record(spec, tensors, num_tokens, src_X.device)
    if num_programs <= 0:
        num_programs = 4 * sizing.device_sms(src_X.device) \
            if src_X.is_cuda else 4
    _push_triton.launch(local, delta16, area_offset, spec.nbytes, data, small, data_bytes, src_X, cap, rank,
                        num_programs, block, num_warps)


def can_push_words(spec: RecordSpec, tensors: dict) -> bool:
    """The kernel moves 4-byte words: the data row and the record must be whole words (else use the twin path)."""
    x = tensors["x"]
    return (x.shape[1] * x.dtype.itemsize) % 4 == 0 and spec.nbytes % 16 == 0
