"""Tests for epcomm.fp8 (per-token 1x128 block FP8 casts)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from epcomm.fp8 import (
    num_sf_packs,
    pack_ue8m0,
    per_token_cast_back,
    per_token_cast_to_fp8,
    unpack_ue8m0,
)

E4M3 = torch.float8_e4m3fn


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _roundtrip_bound(x, scale_per_elem):
    # e4m3 keeps 3 mantissa bits: round-to-nearest of a normal value is off by at most half an ulp, i.e.
    # 2**-4 relative. Below the smallest normal (2**-6) the spacing is the subnormal step 2**-9, so the absolute
    # error in the scaled domain is at most 2**-10, i.e. 2**-10 * scale in the original domain. A small slack
    # covers the fp32 division/multiplication around the cast.
    return 2.0**-4 * x.abs() * (1 + 1e-6) + 2.0**-10 * scale_per_elem * (1 + 1e-6) + 1e-30


def _expand(scales, h):
    return scales.repeat_interleave(128, dim=1)[:, :h]


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "hidden, fp32, ue8m0",
    [(0, 0, 0), (1, 1, 1), (128, 1, 1), (129, 2, 1), (200, 2, 1), (512, 4, 1), (640, 5, 2), (7168, 56, 14)],
)
def test_num_sf_packs(hidden, fp32, ue8m0):
    assert num_sf_packs(hidden) == fp32
    assert num_sf_packs(hidden, use_ue8m0=True) == ue8m0


def test_num_sf_packs_errors():
    with pytest.raises(ValueError, match=r"hidden must be >= 0, got -1"):
        num_sf_packs(-1)
    with pytest.raises(TypeError, match=r"hidden must be an int, got float"):
        num_sf_packs(128.0)


# ---------------------------------------------------------------- hand-worked examples


def test_hand_worked_fp32_scales():
    # amax = 896 -> scale = 896 / 448 = 2 exactly; x / 2 = [448, -1.5, 0.3, 17].
    # e4m3: 448 and -1.5 are exact; 0.3 lies between 0.28125 and 0.3125 (step 2**-5) -> 0.3125;
    # 17 is the tie between 16 (mantissa 000) and 18 (mantissa 001) -> round-to-even gives 16.
    x = torch.tensor([[896.0, -3.0, 0.6, 34.0]])
    data, scales = per_token_cast_to_fp8(x)
    assert data.dtype == E4M3 and data.shape == (1, 4)
    assert scales.dtype == torch.float32 and scales.shape == (1, 1)
    assert scales.item() == 2.0
    assert data.float().tolist() == [[448.0, -1.5, 0.3125, 16.0]]
    assert per_token_cast_back(data, scales).tolist() == [[896.0, -3.0, 0.625, 32.0]]


def test_hand_worked_ue8m0():
    # amax = 1000 -> scale = 2.232.. -> rounded up to 4 = 2**2 -> biased exponent 127 + 2 = 129.
    # x / 4 = [250, 1, -1.5, 0.125]; 250 lies between 240 and 256 (step 16) -> 256.
    x = torch.tensor([[1000.0, 4.0, -6.0, 0.5]])
    data, packed = per_token_cast_to_fp8(x, use_ue8m0=True)
    assert packed.dtype == torch.int32 and packed.tolist() == [[129]]
    assert data.float().tolist() == [[256.0, 1.0, -1.5, 0.125]]
    assert per_token_cast_back(data, packed).tolist() == [[1024.0, 4.0, -6.0, 0.5]]


def test_zero_block_uses_amax_floor():
    data, scales = per_token_cast_to_fp8(torch.zeros(2, 130))
    torch.testing.assert_close(scales, torch.full((2, 2), 1e-4 / 448))
    assert data.float().abs().sum() == 0


def test_blocks_are_independent():
    x = torch.zeros(1, 256)
    x[0, :128] = 1.0
    x[0, 128:] = 100.0
    data, scales = per_token_cast_to_fp8(x)
    torch.testing.assert_close(scales, torch.tensor([[1.0 / 448, 100.0 / 448]]))
    assert (data.float() == 448).all()


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("hidden", [1, 7, 128, 200, 7168])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_roundtrip_error_bound(hidden, use_ue8m0):
    x = torch.randn(16, hidden, generator=_gen(hidden)) * torch.logspace(-3, 3, 16).unsqueeze(1)
    data, scales = per_token_cast_to_fp8(x, use_ue8m0=use_ue8m0)
    assert data.shape == (16, hidden) and data.dtype == E4M3 and data.is_contiguous()
    assert scales.shape == (16, num_sf_packs(hidden, use_ue8m0))
    y = per_token_cast_back(data, scales)
    assert y.dtype == torch.float32 and y.shape == x.shape
    s = unpack_ue8m0(scales, num_sf_packs(hidden)) if use_ue8m0 else scales
    assert ((y - x).abs() <= _roundtrip_bound(x, _expand(s, hidden))).all()
    assert torch.isfinite(data.float()).all() and (data.float().abs() <= 448).all()


@settings(max_examples=30, deadline=None)
@given(
    t=st.integers(0, 4),
    h=st.integers(1, 300),
    log_scale=st.floats(-20, 20),
    seed=st.integers(0, 2**31 - 1),
    use_ue8m0=st.booleans(),
)
def test_roundtrip_property(t, h, log_scale, seed, use_ue8m0):
    x = torch.randn(t, h, generator=_gen(seed)) * 2.0**log_scale
    data, scales = per_token_cast_to_fp8(x, use_ue8m0=use_ue8m0)
    y = per_token_cast_back(data, scales)
    s = unpack_ue8m0(scales, num_sf_packs(h)) if use_ue8m0 else scales
    assert ((y - x).abs() <= _roundtrip_bound(x, _expand(s, h))).all()


def test_ue8m0_scales_are_pow2_and_not_smaller():
    x = torch.randn(32, 1000, generator=_gen(1)) * torch.logspace(-5, 5, 32).unsqueeze(1)
    _, s32 = per_token_cast_to_fp8(x)
    _, packed = per_token_cast_to_fp8(x, use_ue8m0=True)
    s8 = unpack_ue8m0(packed, s32.shape[1])
    mant, _ = torch.frexp(s8)
    assert (mant == 0.5).all()  # powers of two
    assert (s8 >= s32).all() and (s8 < 2 * s32).all()  # smallest power of two >= the fp32 scale


def test_ue8m0_exact_power_of_two_not_rounded_up():
    x = torch.full((1, 128), 448.0 * 8)  # scale exactly 8
    _, packed = per_token_cast_to_fp8(x, use_ue8m0=True)
    assert packed.item() == 127 + 3


# ---------------------------------------------------------------- packing


def test_pack_layout_little_endian():
    exps = [127, 1, 254, 200, 130]  # byte 3 >= 128 makes the int32 negative
    s = torch.tensor([[2.0 ** (e - 127) for e in exps]], dtype=torch.float32)
    packed = pack_ue8m0(s)
    word0 = 127 | (1 << 8) | (254 << 16) | (200 << 24)
    assert packed.tolist() == [[word0 - 2**32, 130]]
    assert torch.equal(unpack_ue8m0(packed, 5), s)


def test_pack_unpack_roundtrip_random():
    g = _gen(3)
    for nb in [0, 1, 3, 4, 5, 56]:
        e = torch.randint(1, 255, (6, nb), generator=g, dtype=torch.int32)
        s = (e << 23).view(torch.float32)
        packed = pack_ue8m0(s)
        assert packed.shape == (6, math.ceil(nb / 4)) and packed.dtype == torch.int32
        assert torch.equal(unpack_ue8m0(packed, nb), s)


def test_unpack_zero_byte_is_zero():
    assert unpack_ue8m0(torch.tensor([[127]], dtype=torch.int32), 2).tolist() == [[1.0, 0.0]]


def test_pack_rejects_non_pow2():
    with pytest.raises(ValueError, match=r"scales_pow2 must hold positive powers of two"):
        pack_ue8m0(torch.tensor([[3.0]]))
    with pytest.raises(ValueError, match=r"scales_pow2 must hold positive powers of two"):
        pack_ue8m0(torch.tensor([[-2.0]]))
    with pytest.raises(TypeError, match=r"scales_pow2 must have dtype float32, got torch.float64"):
        pack_ue8m0(torch.ones(1, 1, dtype=torch.float64))


# ---------------------------------------------------------------- shapes and dtypes


@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_empty_tokens(use_ue8m0):
    data, scales = per_token_cast_to_fp8(torch.empty(0, 7168), use_ue8m0=use_ue8m0)
    assert data.shape == (0, 7168) and data.dtype == E4M3
    assert scales.shape == (0, 14 if use_ue8m0 else 56)
    assert per_token_cast_back(data, scales).shape == (0, 7168)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_input_dtypes_match_fp32_path(dtype, use_ue8m0):
    x = (torch.randn(5, 300, generator=_gen(2)) * 10).to(dtype)
    data, scales = per_token_cast_to_fp8(x, use_ue8m0=use_ue8m0)
    ref_data, ref_scales = per_token_cast_to_fp8(x.float(), use_ue8m0=use_ue8m0)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(scales, ref_scales)


def test_non_contiguous_input():
    x = torch.randn(300, 6, generator=_gen(4)).t()
    d1, s1 = per_token_cast_to_fp8(x)
    d2, s2 = per_token_cast_to_fp8(x.contiguous())
    assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(s1, s2)


# ---------------------------------------------------------------- errors


def test_cast_errors():
    with pytest.raises(ValueError, match=r"x must be a 2-D tensor \[T, H\], got shape \(4,\)"):
        per_token_cast_to_fp8(torch.ones(4))
    with pytest.raises(TypeError, match=r"x must have dtype float16, bfloat16, float32, float64, got torch.int32"):
        per_token_cast_to_fp8(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor \[T, H\], got list"):
        per_token_cast_to_fp8([[1.0]])


def test_cast_back_errors():
    data, scales = per_token_cast_to_fp8(torch.randn(3, 640))
    _, packed = per_token_cast_to_fp8(torch.randn(3, 640), use_ue8m0=True)
    with pytest.raises(TypeError, match=r"data must have dtype float8_e4m3fn, got torch.float32"):
        per_token_cast_back(data.float(), scales)
    with pytest.raises(TypeError, match=r"scales must have dtype float32, int32, got torch.float16"):
        per_token_cast_back(data, scales.half())
    with pytest.raises(ValueError, match=r"scales must have shape \(3, 5\) .* got \(3, 4\)"):
        per_token_cast_back(data, scales[:, :4])
    with pytest.raises(ValueError, match=r"scales must have shape \(3, 2\) .*int32.* got \(3, 5\)"):
        per_token_cast_back(data, scales.to(torch.int32))
    with pytest.raises(ValueError, match=r"scales must be a 2-D tensor"):
        per_token_cast_back(data, scales[0])
    assert per_token_cast_back(data, packed).shape == (3, 640)


def test_unpack_errors():
    packed = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"packed must have ceil\(num_blocks / 4\) = 1 columns .* got shape \(2, 2\)"):
        unpack_ue8m0(packed, 3)
    with pytest.raises(ValueError, match=r"num_blocks must be >= 0, got -1"):
        unpack_ue8m0(packed, -1)
    with pytest.raises(TypeError, match=r"packed must have dtype int32, got torch.int64"):
        unpack_ue8m0(packed.long(), 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_cuda_matches_cpu(use_ue8m0):
    x = torch.randn(64, 7168, generator=_gen(5)).to(torch.bfloat16)
    d_cpu, s_cpu = per_token_cast_to_fp8(x, use_ue8m0=use_ue8m0)
    d_gpu, s_gpu = per_token_cast_to_fp8(x.cuda(), use_ue8m0=use_ue8m0)
    assert d_gpu.is_cuda and s_gpu.is_cuda
    assert torch.equal(d_gpu.cpu().view(torch.uint8), d_cpu.view(torch.uint8))
    assert torch.equal(s_gpu.cpu(), s_cpu)
    torch.testing.assert_close(per_token_cast_back(d_gpu, s_gpu).cpu(), per_token_cast_back(d_cpu, s_cpu))
