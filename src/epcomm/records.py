"""Packed token records: the bytes one row carries between ranks (DeepEP V2.5 EPBuffer behaviour, §4.2).

A record is `[field_0 | field_1 | ...]`, each field padded to 16 bytes so that it can be viewed back as its
dtype in place. Dispatch records carry `x` (or FP8 data + scales), the sender's `topk_idx` row, its
`topk_weights` row and the token key `g`; cached dispatch records carry only the data and weights; combine
records carry the row and the weights going back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .sizing import align

_FIELD_ALIGN = 16
# NOTE: records are padded to 64 bytes (as DeepEP's): row strides that are multiples of 16 words let Triton prove
# 16-byte alignment and emit vector stores in the push kernel.
_RECORD_ALIGN = 64


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    shape: tuple  # per-row shape

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


class RecordSpec:
    """Byte layout of one record; `pack` gathers tokens into rows, `unpack` views rows back as fields."""

    def __init__(self, fields: list):
        self.fields = [f for f in fields if f is not None]
        self.offsets = {}
        off = 0
        for f in self.fields:
            self.offsets[f.name] = off
            off += align(f.nbytes, _FIELD_ALIGN)
        self.nbytes = align(max(off, _FIELD_ALIGN), _RECORD_ALIGN)

    def pack(self, tensors: dict, src_X: Tensor, holes: bool) -> Tensor:
        """[X, B] uint8: row x is the record of token `src_X[x]` (one gather per field, no staging copy).

        Rows with `src_X == -1` (only when `holes`), padding bytes and fields not given are left unspecified:
        nobody reads them.
        """
        num_rows = src_X.shape[0]
        out = torch.empty(num_rows, self.nbytes, dtype=torch.uint8, device=src_X.device)
        idx = src_X.clamp(min=0) if holes else src_X
        for f in self.fields:
            t = tensors.get(f.name)
            if t is None or t.shape[0] == 0 or num_rows == 0:
                continue
            off = self.offsets[f.name]
            as_bytes = t.reshape(t.shape[0], -1).contiguous().view(torch.uint8)
            out[:, off: off + f.nbytes] = as_bytes.index_select(0, idx)
        return out

    def view(self, rows_XB: Tensor, name: str) -> Tensor:
        """[X, *shape] dtype: field `name` of every row as a strided view (no copy)."""
        f = next(f for f in self.fields if f.name == name)
        off = self.offsets[name]
        raw = rows_XB[:, off: off + f.nbytes]
        if rows_XB.shape[0] == 0:
            return raw.contiguous().view(f.dtype).view(0, *f.shape)
        return raw.view(f.dtype).view(rows_XB.shape[0], *f.shape)

    def unpack(self, rows_XB: Tensor, name: str, idx_Y: Optional[Tensor] = None, holes: bool = False) -> Tensor:
        """[Y, *shape] dtype: a fresh tensor holding field `name` of rows `idx_Y` (all rows when None).

        With `holes`, rows whose index is -1 are zero.
        """
        f = next(f for f in self.fields if f.name == name)
        off = self.offsets[name]
        raw = rows_XB[:, off: off + f.nbytes]
        if idx_Y is None:
            out = raw.contiguous()
        elif rows_XB.shape[0] == 0:
            out = raw.new_zeros(idx_Y.shape[0], f.nbytes)
        else:
            out = raw.index_select(0, idx_Y.clamp(min=0) if holes else idx_Y)
            if holes:
                out.masked_fill_((idx_Y < 0).unsqueeze(1), 0)
        return out.view(f.dtype).view(out.shape[0], *f.shape)

    def has(self, name: str) -> bool:
        return name in self.offsets


def scatter_index(dst_X: Tensor, num_rows: int) -> Tensor:
    """Invert a partial map: for each of `num_rows` targets, the source position mapped to it, else -1.

    `dst_X[x]` is the target of source x, or -1 (dropped). No host sync.
    """
    src = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=dst_X.device)
    trash = torch.full_like(dst_X, num_rows)
    src.scatter_(0, torch.where(dst_X >= 0, dst_X, trash), torch.arange(dst_X.numel(), device=dst_X.device))
    return src[:num_rows]
