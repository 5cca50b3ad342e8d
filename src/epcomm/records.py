"""Packed token records: the bytes one row carries between ranks (DeepEP V2.5 EPBuffer behaviour, §4.2).

A record is `[field_0 | field_1 | ...]`, each field padded to 16 bytes so that it can be viewed back as its
dtype in place. Dispatch records carry `x` (or FP8 data + scales), the sender's `topk_idx` row, its
`topk_weights` row and the token key `g`; cached dispatch records carry only the data and weights; combine
records carry the row and the weights going back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .sizing import align

_FIELD_ALIGN = 16


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
        self.nbytes = max(off, _FIELD_ALIGN)

    def records(self, tensors: dict, num_tokens: int, device: torch.device) -> Tensor:
        """[T, B] uint8: one record per token (fields not given stay zero)."""
        rec_TB = torch.zeros(num_tokens, self.nbytes, dtype=torch.uint8, device=device)
        for f in self.fields:
            t = tensors.get(f.name)
            if t is None or num_tokens == 0:
                continue
            off = self.offsets[f.name]
            rec_TB[:, off : off + f.nbytes] = t.reshape(num_tokens, -1).contiguous().view(torch.uint8)
        return rec_TB

    @staticmethod
    def gather(rec_TB: Tensor, src_token_X: Tensor) -> Tensor:
        """[X, B]: row x is record `src_token_X[x]`; rows with -1 are zero."""
        if rec_TB.shape[0] == 0:
            return rec_TB.new_zeros(src_token_X.shape[0], rec_TB.shape[1])
        rows = rec_TB[src_token_X.clamp(min=0)]
        return rows.masked_fill_((src_token_X < 0).unsqueeze(1), 0)

    def unpack(self, rows_XB: Tensor, name: str) -> Tensor:
        """[X, *shape] dtype: a fresh tensor holding field `name` of every row."""
        f = next(f for f in self.fields if f.name == name)
        off = self.offsets[name]
        raw = rows_XB[:, off : off + f.nbytes].contiguous()
        return raw.view(f.dtype).view(rows_XB.shape[0], *f.shape)

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
