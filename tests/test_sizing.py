"""Buffer size hint (reference §4.3, §24 item 1) on hand-worked numbers, and the SM model (§8.2)."""

import numpy as np
import pytest
import torch

import epcomm
from epcomm import sizing

MIB2 = 2 * 1024 * 1024


def test_record_layout_hand_worked():
    # bf16 hidden 7168, top-8, with metadata: 14336 + align32(8*8 + 9*4 = 100) = 14464, already a multiple of 64.
    assert sizing.record_bytes(14336, 0, 8, True) == 14464
    # FP8: 7168 data + 896 scale bytes + 128 metadata = 8192.
    assert sizing.record_bytes(7168, 896, 8, True) == 8192
    # combine record: 14336 + 64 = 14400.
    assert sizing.record_bytes(14336, 0, 8, False) == 14400


def test_hint_dsv3_ep2_hand_worked():
    # dispatch = 14464 * 4096 * 2 = 118,489,088; combine = 14400 * 4096 * 2 = 117,964,800 -> 57 x 2 MiB.
    assert epcomm.EPBuffer.get_buffer_size_hint(2, 4096, 7168, 8) == 57 * MIB2
    # FP8 dispatch records shrink dispatch (67,108,864) below combine (117,964,800): still 57 x 2 MiB.
    assert epcomm.EPBuffer.get_buffer_size_hint(2, 4096, 7168, 8, use_fp8_dispatch=True) == 57 * MIB2
    assert sizing.required_bytes(2, 4096, 7168, 8, which="dispatch") == 118_489_088
    assert sizing.required_bytes(2, 4096, 7168, 8, which="combine") == 117_964_800
    assert sizing.required_bytes(2, 4096, 7168, 8, use_fp8_dispatch=True, which="dispatch") == 67_108_864


def test_hint_properties():
    for args in [(1, 1, 1), (3, 100, 4096), (8, 4096, 7168)]:
        assert epcomm.EPBuffer.get_buffer_size_hint(*args) % MIB2 == 0
    # num_topk=0 sizes for 32; a wider dtype needs more bytes; no multiple reduction needs more.
    assert epcomm.EPBuffer.get_buffer_size_hint(4, 512, 1024, 0) == epcomm.EPBuffer.get_buffer_size_hint(4, 512, 1024, 32)
    bf16 = epcomm.EPBuffer.get_buffer_size_hint(4, 512, 1024, 8)
    assert epcomm.EPBuffer.get_buffer_size_hint(4, 512, 1024, 8, dtype=torch.float32) > bf16
    assert epcomm.EPBuffer.get_buffer_size_hint(4, 512, 1024, 8, allow_multiple_reduction=False) > bf16


def test_hint_across_hosts(monkeypatch):
    # With 2 ranks per host of 4, dispatch keeps one extra N-row block (reference §4.3, nvl = False).
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    d = sizing.record_bytes(1024 * 2, 0, 8, True)
    assert sizing.required_bytes(4, 100, 1024, 8, which="dispatch") == d * 100 * (1 + 4)


def test_hint_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"num_max_tokens_per_rank \(0\) and hidden \(7168\) must be > 0"):
        epcomm.EPBuffer.get_buffer_size_hint(2, 0, 7168)


def test_max_tokens_that_fit():
    nb = epcomm.EPBuffer.get_buffer_size_hint(2, 4096, 7168, 8)
    fits = sizing.max_tokens_that_fit(nb, 2, 7168, num_topk=8)
    assert fits >= 4096 and sizing.required_bytes(2, fits + 1, 7168, 8) > nb


def test_theoretical_num_sms_model():
    # Balanced gate, EP2, 256 experts top-8: ~5.9 distinct... the model returns a multiple of 4 within [4, SMs].
    sms = sizing.theoretical_num_sms(2, 256, 8, 430.0, 132)
    assert sms % 4 == 0 and 4 <= sms <= 132
    assert sizing.theoretical_num_sms(2, 256, 8, 430.0, 132, prefer_overlap_with_compute=False) >= 64
    assert sizing.theoretical_num_sms(1, 8, 2, 430.0, 132) == 132  # no peers: every SM


def test_next_pow2_and_ceil_div_match_triton():
    """The host helpers the launchers use instead of Triton's constexpr functions give Triton's values."""
    triton = pytest.importorskip("triton")
    values = list(range(0, 300)) + [2 ** k + d for k in range(9, 40) for d in (-1, 0, 1)]
    assert [sizing.next_pow2(n) for n in values] == [triton.next_power_of_2(n) for n in values]
    assert [sizing.ceil_div(a, b) for a in values[:300] for b in (1, 3, 16, 128)] == \
        [triton.cdiv(a, b) for a in values[:300] for b in (1, 3, 16, 128)]


@pytest.mark.parametrize("args, exc, message", [
    ((0, 4096, 7168), ValueError, r"the number of ranks \(0\), num_max_tokens_per_rank \(4096\) and hidden \(7168\) "
                                  r"must be > 0"),
    ((2, 0, 7168), ValueError, r"the number of ranks \(2\), num_max_tokens_per_rank \(0\)"),
    ((2.0, 4096, 7168), TypeError, r"group must be a ProcessGroup, None \(the default group\) or an int number of "
                                   r"ranks, got float"),
    ((2, 4096.0, 7168), TypeError, r"num_max_tokens_per_rank must be an int, got float"),
    ((2, 4096, True), TypeError, r"hidden must be an int, got bool"),
    ((2, 4096, 7168, 33), ValueError, r"num_topk must be in \[0, 32\]"),
    ((None, 4096, 7168), ValueError, r"group=None needs an initialized default process group"),
])
def test_size_hint_checks_its_arguments(args, exc, message):
    """The docstring's errors (0 ranks returned 0; a float group raised AttributeError; top-33 was sized)."""
    with pytest.raises(exc, match=r"^EPBuffer.get_buffer_size_hint: " + message):
        epcomm.EPBuffer.get_buffer_size_hint(*args)
    assert epcomm.EPBuffer.get_buffer_size_hint(2, np.int64(4096), 7168, 8) == 57 * MIB2
