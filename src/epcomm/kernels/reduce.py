"""The canonical combine reduction (docs/decisions.md decision 4; DeepEP V2.5 EPBuffer behaviour, §11.2).

For every output token `t`: `acc = 0`, then `acc += bias_0[t]`, `acc += bias_1[t]` (when given), then
`acc += rows[item_row[t, p]]` for each position `p` in ascending order whose `item_row` is not -1; the sum is
kept in fp32 (fp64 when the rows are fp64) and rounded once to the output dtype. The same op forms the per-rank
partials of an expand-layout combine (`item_row` = the expanded row of each top-k position).

Worked example (fp32 rows, no bias):
    rows     = [[1.], [2.], [4.]]
    item_row = [[2, -1, 0], [-1, -1, -1]]
    out      = [[5.], [0.]]
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import sizing


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 rows, fp32 for every other float type."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def canonical_reduce_torch(
    rows_XH: Tensor,
    item_row_TP: Tensor,
    bias_0: Optional[Tensor] = None,
    bias_1: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    own: Optional[tuple] = None,
) -> Tensor:
    """Sum `rows_XH[item_row_TP[t, p]]` over positions `p` in ascending order, after the biases.

    Args:
        rows_XH: [X, H] float -- the rows to sum.
        item_row_TP: [T, P] int64 -- row of `rows_XH` at position p of token t, -1 for none.
        bias_0, bias_1: [T, H] float or None -- added first, in this order.
        out_dtype: dtype of the result; default `rows_XH.dtype`.
        own: None, or `(own_NH, lo)`: rows `lo .. lo + N - 1` of `rows_XH` are `own_NH` (a rank's rows for itself,
            which the nvlink return push leaves where they are).

    Returns:
        [T, H] out_dtype -- the sums, rounded once.
    """
    if own is not None:
        own_NH, lo = own
        rows_XH = rows_XH.clone()
        rows_XH[lo: lo + own_NH.shape[0]] = own_NH
    out_dtype = out_dtype or rows_XH.dtype
    acc_dtype = accumulate_dtype(rows_XH.dtype)
    num_tokens = item_row_TP.shape[0]
    acc_TH = torch.zeros(num_tokens, rows_XH.shape[1], dtype=acc_dtype, device=rows_XH.device)
    for bias in (bias_0, bias_1):
        if bias is not None:
            acc_TH += bias.to(acc_dtype)
    if rows_XH.shape[0] == 0:
        return acc_TH.to(out_dtype)
    for p in range(item_row_TP.shape[1]):
        item_T = item_row_TP[:, p]
        if rows_XH.is_cuda:
            # No host sync (graph-capturable): gather every token, keep the sum where an item exists.
            row_TH = rows_XH[item_T.clamp(min=0)].to(acc_dtype)
            acc_TH = torch.where((item_T >= 0).unsqueeze(1), acc_TH + row_TH, acc_TH)
        else:
            tokens = (item_T >= 0).nonzero().squeeze(1)
            acc_TH[tokens] += rows_XH[item_T[tokens]].to(acc_dtype)
    return acc_TH.to(out_dtype)


def canonical_reduce(
    rows_XH: Tensor,
    item_row_TP: Tensor,
    bias_0: Optional[Tensor] = None,
    bias_1: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    *,
    use_triton: Optional[bool] = None,
    num_sms: int = 0,
    own: Optional[tuple] = None,
) -> Tensor:
    """Launcher: the Triton kernel on CUDA (one pass, no host sync), the torch twin elsewhere.

    Same arguments and result as `canonical_reduce_torch`; `use_triton` forces the choice (tests run the kernel
    on CPU under `TRITON_INTERPRET=1`); `num_sms` > 0 caps the kernel's grid at that many programs, so at most
    that many SMs run it (0: one program per token and block of channels).
    """
    if use_triton is None:
        use_triton = rows_XH.is_cuda
    if not use_triton or rows_XH.shape[0] == 0 or item_row_TP.shape[0] == 0:
        return canonical_reduce_torch(rows_XH, item_row_TP, bias_0, bias_1, out_dtype, own)
    from . import _reduce_triton

    rows, item, bias_0, bias_1, out, num_sms, tile = _kernel_args(rows_XH, item_row_TP, bias_0, bias_1, out_dtype,
                                                                   num_sms)
    return _reduce_triton.launch(rows, item, bias_0, bias_1, out, num_programs=num_sms, **tile, **_own_args(own))


def canonical_reduce_chunks(
    rows_XH: Tensor,
    item_row_TP: Tensor,
    bias_0: Optional[Tensor],
    bias_1: Optional[Tensor],
    out_dtype: torch.dtype,
    *,
    tokens_T: Tensor,
    bounds_C: Tensor,
    ready: list,
    num_sms: int = 0,
    own: Optional[tuple] = None,
) -> Tensor:
    """`canonical_reduce` (the Triton kernel, CUDA) one chunk of tokens at a time, each after its rows arrive:
    the combine's reduction while its rows still travel (transport/push_back.py; order as docs/decisions.md
    decision 4, DeepEP V2.5 EPBuffer behaviour §11.2).

    Args:
        rows_XH, item_row_TP, bias_0, bias_1, out_dtype, num_sms, own: as `canonical_reduce`.
        tokens_T: [T] int64 -- every token once, grouped by chunk.
        bounds_C: [C + 1] int64 (device) -- chunk c is `tokens_T[bounds_C[c]:bounds_C[c + 1]]`.
        ready: C CUDA events; chunk c's kernel waits for `ready[c]` (its tokens' rows have arrived).

    Returns:
        [T, H] out_dtype -- the same bits as `canonical_reduce`: each token is summed by one program, in order.
    """
    from . import _reduce_triton

    rows, item, bias_0, bias_1, out, num_sms, tile = _kernel_args(rows_XH, item_row_TP, bias_0, bias_1, out_dtype,
                                                                   num_sms)
    stream = torch.cuda.current_stream(rows.device)
    for c, event in enumerate(ready):
        stream.wait_event(event)
        _reduce_triton.launch(rows, item, bias_0, bias_1, out, num_programs=num_sms, tokens=tokens_T,
                              bounds=bounds_C, chunk=c, num_chunks=len(ready), **tile, **_own_args(own))
    return out


def _own_args(own: Optional[tuple]) -> dict:
    if own is None:
        return {}
    own_NH, lo = own
    return dict(own=own_NH if own_NH.stride(-1) == 1 else own_NH.contiguous(), own_lo=lo)


def _kernel_args(rows_XH, item_row_TP, bias_0, bias_1, out_dtype, num_sms) -> tuple:
    """Contiguous operands, the output, the grid cap and the tile of the reduction kernel."""
    rows = rows_XH if rows_XH.stride(1) == 1 else rows_XH.contiguous()
    bias_0 = None if bias_0 is None else bias_0.contiguous()
    bias_1 = None if bias_1 is None else bias_1.contiguous()
    out = torch.empty(item_row_TP.shape[0], rows.shape[1], dtype=out_dtype or rows.dtype, device=rows.device)
    if num_sms and rows.is_cuda and num_sms >= sizing.device_sms(rows.device):
        num_sms = 0  # a cap at every SM binds nothing: one program per tile is faster (90 vs 106 us below)
    # Tiles measured on H200 (benchmarks/reduce_sweep.py, dsv3 combine shape, items left-packed): 4 tokens x 1024
    # channels x 8 warps with one program per tile (90 us); a capped grid needs more loads in flight per SM:
    # 32 x 1024 x 32 warps for BF16. Graph combine on 2x H200, 8 calls per graph: 274-278 / 249 us at 24 / 28 SMs,
    # against 300-303 / 265 us for 8 x 2048 x 32 warps and 308-320 / 280-291 us for 32 x 1024 x 16 warps (session 11 had
    # 8 x 2048 x 32 against 16 x 2048 x 16: 290 / 262 against 328-339 / 299 us; loading the next tile's items ahead,
    # or the own rows by a second masked load, was slower).
    # fp64 rows: 16 tokens (one launch on one H200 at 28 / 24 programs: 328 / 352 us, against 479 / 551 us with 32
    # and 506 / 562 us with 8); fp32 rows keep 32 (178 / 213 us, against 221 / 261 us with 16).
    capped = dict(block_t=16 if rows.element_size() == 8 else 32, block_h=1024, num_warps=32)
    tile = capped if num_sms > 0 else dict(block_t=4, block_h=1024, num_warps=8)
    return rows, item_row_TP.contiguous(), bias_0, bias_1, out, num_sms, tile


def weighted_reduce_torch(rows_XH: Tensor, item_row_TP: Tensor, weights_TP: Tensor, out_dtype: torch.dtype) -> Tensor:
    """`out[t] = round(sum_p w[t, p] * rows[item[t, p]])`, p ascending, fp32 products and sums (fp64 for fp64 rows).

    The low-latency combine's order (docs/decisions.md): each product and each partial sum is an fp32 operation,
    one rounding to `out_dtype` at the end. Worked example: rows [[2.], [4.]], item [[1, 0]], w [[0.5, 0.25]]
    -> [[2.5]].
    """
    acc_dtype = accumulate_dtype(rows_XH.dtype)
    acc_TH = torch.zeros(item_row_TP.shape[0], rows_XH.shape[1], dtype=acc_dtype, device=rows_XH.device)
    if rows_XH.shape[0] == 0:
        return acc_TH.to(out_dtype)
    w_TP = weights_TP.to(acc_dtype)
    for p in range(item_row_TP.shape[1]):
        item_T = item_row_TP[:, p]
        if rows_XH.is_cuda:
            term_TH = w_TP[:, p: p + 1] * rows_XH[item_T.clamp(min=0)].to(acc_dtype)
            acc_TH = torch.where((item_T >= 0).unsqueeze(1), acc_TH + term_TH, acc_TH)
        else:
            tokens = (item_T >= 0).nonzero().squeeze(1)
            acc_TH[tokens] += w_TP[tokens, p: p + 1] * rows_XH[item_T[tokens]].to(acc_dtype)
    return acc_TH.to(out_dtype)
