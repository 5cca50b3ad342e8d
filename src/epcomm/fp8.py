"""Per-token 1x128 block FP8 casts (the format DeepSeek-V3 and DeepEP's `per_token_cast_to_fp8` use).

Format
------
A token row `x[t, :]` of `H` elements is cut into `ceil(H / 128)` blocks of 128 consecutive columns; the last
block is partial when `H % 128 != 0`. Every block has its own scale::

    amax  = max(|x[t, 128*b : 128*(b+1)]|) clamped to >= 1e-4
    scale = amax / 448            # 448 is the largest finite float8_e4m3fn value
    data  = (x / scale).to(torch.float8_e4m3fn)      # computed in fp32

so every block uses the full e4m3 range and `x ~= data.float() * scale`. Both divisions are correctly rounded
fp32 divisions on every device, so CPU and CUDA give bit-identical results for finite inputs (a block holding
inf or NaN gets an inf/NaN scale and NaN or zero data; NaN bit patterns may differ between devices).

Scales come in two layouts:

* fp32 (default): `scales` is float32 `[T, ceil(H / 128)]`.
* UE8M0 (`use_ue8m0=True`): each scale is first rounded *up* to a power of two (so `|x / scale| <= 448` still
  holds), and only its biased 8-bit fp32 exponent `e` is kept (value `2 ** (e - 127)`). Four exponents are
  packed per int32, little-endian: byte `k` (bits `8k .. 8k+7`, `k = 0` least significant) of pack `i` holds
  block `4 * i + k`; bytes past the last block are 0. `scales` is int32 `[T, ceil(ceil(H / 128) / 4)]`.

The packing is arithmetic (not a memory reinterpretation), so it does not depend on the host's byte order.
"""

from __future__ import annotations

import torch

__all__ = [
    "BLOCK_SIZE",
    "FP8_E4M3_MAX",
    "num_sf_packs",
    "pack_ue8m0",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
    "unpack_ue8m0",
]

BLOCK_SIZE = 128
FP8_E4M3_MAX = 448.0
AMAX_MIN = 1e-4
_FLOAT_INPUTS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_tensor(name: str, t: object, ndim: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {what}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-D tensor {what}, got shape {tuple(t.shape)}")
    return t


def _check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must have dtype {names}, got {t.dtype}")


def num_sf_packs(hidden: int, use_ue8m0: bool = False) -> int:
    """Number of scale-factor columns per token for a row of `hidden` elements.

    Args:
        hidden: int -- elements per token row (H); constraint: >= 0.
        use_ue8m0: bool -- count packed UE8M0 int32 columns instead of fp32 scales; default False.

    Returns:
        int -- `ceil(hidden / 128)` (fp32 scales) or `ceil(ceil(hidden / 128) / 4)` (UE8M0 int32 packs).

    Raises:
        TypeError: `hidden` is not an int.
        ValueError: `hidden` is negative.
    """
    if isinstance(hidden, bool) or not isinstance(hidden, int):
        raise TypeError(f"hidden must be an int, got {type(hidden).__name__}")
    if hidden < 0:
        raise ValueError(f"hidden must be >= 0, got {hidden}")
    blocks = _ceil_div(hidden, BLOCK_SIZE)
    return _ceil_div(blocks, 4) if use_ue8m0 else blocks


def pack_ue8m0(scales_pow2: torch.Tensor) -> torch.Tensor:
    """Pack power-of-two fp32 scales into UE8M0 int32 words, four biased exponents per word.

    Args:
        scales_pow2: [T, nblocks] float32 -- per-block scales; constraint: each a positive power of two
            (fp32 mantissa bits zero, sign bit clear).

    Returns:
        [T, ceil(nblocks / 4)] int32 -- byte k (k = 0 least significant) of word i is the fp32 exponent field
        of `scales_pow2[:, 4 * i + k]`; unused bytes are 0. Same device as the input.

    Raises:
        TypeError: `scales_pow2` is not a tensor or not float32.
        ValueError: `scales_pow2` is not 2-D or holds values that are not positive powers of two.
    """
    _check_tensor("scales_pow2", scales_pow2, 2, "[T, nblocks]")
    _check_dtype("scales_pow2", scales_pow2, (torch.float32,))
    bits = scales_pow2.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if bool(((bits & 0x807FFFFF) != 0).any()):
        raise ValueError("scales_pow2 must hold positive powers of two (zero mantissa, clear sign bit), "
                         "got other values")
    exps = bits >> 23  # [T, nblocks] in 0..255
    t, nb = exps.shape
    packs = _ceil_div(nb, 4)
    exps = torch.nn.functional.pad(exps, (0, packs * 4 - nb)).view(t, packs, 4)
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=exps.device)
    words = (exps << shifts).sum(-1)  # unsigned 32-bit value in int64, bytes do not overlap
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Expand UE8M0 int32 packs back into fp32 power-of-two scales.

    Args:
        packed: [T, P] int32 -- packed exponents as made by `pack_ue8m0`; constraint: P == ceil(num_blocks / 4).
        num_blocks: int -- blocks per token (`ceil(H / 128)`); constraint: >= 0.

    Returns:
        [T, num_blocks] float32 -- `2 ** (e - 127)` for each exponent byte `e` (the byte shifted into the fp32
        exponent field; `e == 0` gives 0.0 and `e == 255` gives inf). Same device as `packed`.

    Raises:
        TypeError: `packed` is not a tensor or not int32, or `num_blocks` is not an int.
        ValueError: `packed` is not 2-D, `num_blocks` is negative, or P does not match `num_blocks`.
    """
    _check_tensor("packed", packed, 2, "[T, P]")
    _check_dtype("packed", packed, (torch.int32,))
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
        raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
    if num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
    if packed.shape[1] != _ceil_div(num_blocks, 4):
        raise ValueError(f"packed must have ceil(num_blocks / 4) = {_ceil_div(num_blocks, 4)} columns for "
                         f"num_blocks={num_blocks}, got shape {tuple(packed.shape)}")
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=packed.device)
    exps = (words.unsqueeze(-1) >> shifts) & 0xFF  # [T, P, 4]
    exps = exps.reshape(packed.shape[0], packed.shape[1] * 4)[:, :num_blocks]
    return (exps << 23).to(torch.int32).contiguous().view(torch.float32)


def _blocks(x32: torch.Tensor) -> torch.Tensor:
    """[T, H] -> [T, nblocks, 128], zero-padding the last partial block."""
    t, h = x32.shape
    nb = _ceil_div(h, BLOCK_SIZE)
    return torch.nn.functional.pad(x32, (0, nb * BLOCK_SIZE - h)).view(t, nb, BLOCK_SIZE)


def _round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= each positive fp32 `scale` (exact, by bit manipulation); inf/NaN -> inf."""
    bits = scale.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = (exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)).clamp(max=255)  # NaN/overflow -> inf
    return (exp << 23).view(torch.float32)


def per_token_cast_to_fp8(x: torch.Tensor, *, use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each token row to float8_e4m3fn with one scale per 1x128 block.

    Args:
        x: [T, H] float16 | bfloat16 | float32 | float64 -- token rows; any device; T and H may be 0; H need not
            be a multiple of 128 (the last block is partial). Converted to fp32 before any arithmetic.
        use_ue8m0: bool -- round scales up to powers of two and return them packed as UE8M0 int32; default False.

    Returns:
        data: [T, H] float8_e4m3fn -- `(x / scale).to(float8_e4m3fn)`, contiguous, on `x.device`.
        scales: [T, ceil(H / 128)] float32 (default), or [T, ceil(ceil(H / 128) / 4)] int32 packed UE8M0
            (`use_ue8m0=True`); see the module docstring.

    Raises:
        TypeError: `x` is not a tensor or not one of the accepted floating dtypes.
        ValueError: `x` is not 2-D.
    """
    _check_tensor("x", x, 2, "[T, H]")
    _check_dtype("x", x, _FLOAT_INPUTS)
    t, h = x.shape
    xb = _blocks(x.to(torch.float32))
    amax = xb.abs().amax(dim=-1).clamp(min=AMAX_MIN)  # [T, nblocks]
    # A tensor divisor keeps the division correctly rounded on every device: on CUDA, PyTorch turns `t / 448.0`
    # into `t * fl(1 / 448)`, which differs from `amax / 448` in the last bit for about half of all inputs.
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    if use_ue8m0:
        scale = _round_up_pow2(scale)
    data = (xb / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    data = data.view(t, xb.shape[1] * BLOCK_SIZE)[:, :h].contiguous()
    return data, (pack_ue8m0(scale) if use_ue8m0 else scale)


def per_token_cast_back(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise blockwise FP8 rows: `data.float() * scale` for each 1x128 block.

    Args:
        data: [T, H] float8_e4m3fn -- quantised rows, as returned by `per_token_cast_to_fp8`.
        scales: [T, ceil(H / 128)] float32, or [T, ceil(ceil(H / 128) / 4)] int32 packed UE8M0 -- the block
            scales; must be on the same device as `data`.

    Returns:
        [T, H] float32 -- the dequantised rows, on `data.device`.

    Raises:
        TypeError: an argument is not a tensor, `data` is not float8_e4m3fn, or `scales` is neither float32
            nor int32.
        ValueError: an argument is not 2-D, or the shapes of `data` and `scales` disagree.
    """
    _check_tensor("data", data, 2, "[T, H]")
    _check_dtype("data", data, (torch.float8_e4m3fn,))
    _check_tensor("scales", scales, 2, "[T, nblocks] or [T, P]")
    _check_dtype("scales", scales, (torch.float32, torch.int32))
    t, h = data.shape
    nb = _ceil_div(h, BLOCK_SIZE)
    int_packed = scales.dtype == torch.int32
    expected = (t, _ceil_div(nb, 4) if int_packed else nb)
    if tuple(scales.shape) != expected:
        raise ValueError(f"scales must have shape {expected} for data of shape {(t, h)} "
                         f"({scales.dtype} scales), got {tuple(scales.shape)}")
    if int_packed:
        scales = unpack_ue8m0(scales, nb)
    out = _blocks(data.to(torch.float32)) * scales.unsqueeze(-1)
    return out.view(t, nb * BLOCK_SIZE)[:, :h].contiguous()
