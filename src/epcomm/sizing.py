"""Buffer sizing and the SM-count model (DeepEP V2.5 EPBuffer behaviour, §4.2-4.3 and §8.2).

`get_buffer_size_hint` follows the reference's record layout so that callers that compare sizes to decide
whether to reuse a buffer keep working. epcomm always reports the logical domain `(1, world)` (docs/decisions.md
decision 4), so only the direct-mode branch of the formula applies.
"""

from __future__ import annotations

import functools
import math
import os

import torch

ALLOCATION_ALIGNMENT = 2 * 1024 * 1024  # every registered region is a multiple of 2 MiB (reference §1)
RDMA_ALIGNMENT = 64  # the reference's RDMA granularity: bucket-session allocations (reference §1, §14.3)
TMA_ALIGNMENT = 32  # the reference's TMA granularity (reference §1); reduce-scatter buckets start on it (§14.2)


def get_num_allocation_alignment() -> int:
    """2 MiB (2,097,152 bytes): the granularity of every registered region (reference §1)."""
    return ALLOCATION_ALIGNMENT


def get_num_rdma_alignment() -> int:
    """64 bytes: the reference's RDMA alignment, the bucket session's allocation granularity (reference §1)."""
    return RDMA_ALIGNMENT


def get_num_tma_alignment() -> int:
    """32 bytes: the reference's TMA alignment (reference §1)."""
    return TMA_ALIGNMENT
MAX_TOPK = 32
# DeepEP caps experts at 2048 (reference §1); epcomm's kernels have no such limit, but every layout keeps tables
# per (row, local expert) or per expert, so an absurd count would exhaust memory or stall rather than raise.
MAX_EXPERTS = 65536
MAX_CHANNELS = 1280


def device_sms(device: torch.device) -> int:
    """The number of SMs of CUDA `device` (its index, or the current device when it has none), read once per device:
    a `get_device_properties` call costs ~10 us of host time, and calls read it on every launch."""
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def align(x: int, a: int) -> int:
    """Round `x` up to a multiple of `a` (a >= 1)."""
    return (x + a - 1) // a * a


def ceil_div(x: int, a: int) -> int:
    return (x + a - 1) // a


def contiguous_strides(shape: tuple) -> tuple:
    """Row-major strides (in elements) of a tensor of `shape`, for `as_strided` views of one allocation."""
    if len(shape) == 1:
        return (1,)
    if len(shape) == 2:
        return (shape[1], 1)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def dense_strides(t):
    """`t` with the strides the transports' byte views need, without a copy: anything else as it is (the same
    object). Torch calls a tensor contiguous whatever the strides of its size-1 dims, and every empty tensor
    contiguous whatever its strides, but a byte view (`.view(torch.uint8)`) needs the last dim's stride to be 1; such
    inputs failed after the peers had met this rank in the header exchange (the peers then timed out):
    * empty with strides that are not the dense ones (a [0, 1] weight tensor of strides (1, 0) after a broadcast op,
      on a rank with no tokens): a new dense tensor;
    * contiguous with a last dim of size 1 and a stride other than 1 (column-major FP8 scales of one pack, [T, 1] of
      strides (1, T); a [1, 1] slice): a view of the same elements with the dense strides.
    """
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or not t.dim():
        return t
    if t.numel() == 0:
        if t.stride() != contiguous_strides(tuple(t.shape)):
            return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    elif t.stride(-1) != 1 and t.is_contiguous():
        return t.as_strided(t.shape, contiguous_strides(tuple(t.shape)), t.storage_offset())
    return t


# Byte alignment of a row payload's start: the transports move rows as words of up to 8 bytes (moves.as_words).
PAYLOAD_ALIGN = 16


def word_aligned(t):
    """`t`, or a contiguous copy of it when its first element does not start on a `PAYLOAD_ALIGN`-byte boundary of
    its storage (a view into a packed flat buffer, `flat[1:].view(T, H)`): a word view of such rows fails, and it
    failed after the header exchange, which broke the buffer and the process group. Anything else as it is."""
    if (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel()
            and t.storage_offset() * t.element_size() % PAYLOAD_ALIGN):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n (0 for 0), as `triton.next_power_of_2`. Host code calls this one: Triton's is a
    constexpr function since Triton 3.5, and a call from Python costs ~3-5 us of host time (an H200 host)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def record_bytes(hidden_bytes: int, sf_bytes: int, num_topk: int, with_metadata: bool) -> int:
    """Bytes of one token record: `[hidden | SF | metadata]`, each part padded to 32 B, record to 64 B (§4.2)."""
    meta = num_topk * 8 + (1 + num_topk) * 4 if with_metadata else num_topk * 8
    return align(align(hidden_bytes, 32) + align(sf_bytes, 32) + align(meta, 32), 64)


def num_nvlink_ranks(num_ranks: int) -> int:
    """Ranks that share a host (the reference's NVLink domain), from `LOCAL_WORLD_SIZE` when torchrun sets it."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_ranks) or num_ranks)
    return num_ranks if local >= num_ranks or num_ranks % local else local


def required_bytes(
    num_ranks: int,
    num_max_tokens_per_rank: int,
    hidden: int,
    num_topk: int = 0,
    use_fp8_dispatch: bool = False,
    allow_multiple_reduction: bool = True,
    elem_size: int = 2,
    which: str = "both",
) -> int:
    """Bytes a dispatch/combine of this shape needs (reference §4.3, direct mode), before 2 MiB alignment.

    `elem_size` is the element size of the non-FP8 payload (2 for bf16, the reference's only type); `which`
    is "dispatch", "combine" or "both" (the buffer size: the larger of the two).
    """
    n, h, r = num_max_tokens_per_rank, hidden, num_ranks
    k = num_topk if num_topk > 0 else MAX_TOPK
    nvl = num_nvlink_ranks(r) == r
    sf = ceil_div(h, 32) * 4 if use_fp8_dispatch else 0
    d = record_bytes(h * (1 if use_fp8_dispatch else elem_size), sf, k, True)
    b = record_bytes(h * elem_size, 0, k, False)
    dispatch = d * n * ((0 if nvl else 1) + r)
    combine = b * n * (1 if allow_multiple_reduction else k) * (0 if nvl else r)
    combine += b * n * (min(r, k) if allow_multiple_reduction else k)
    return {"dispatch": dispatch, "combine": combine, "both": max(dispatch, combine)}[which]


def buffer_size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, **kwargs) -> int:
    return align(required_bytes(num_ranks, num_max_tokens_per_rank, hidden, **kwargs), ALLOCATION_ALIGNMENT)


def max_tokens_that_fit(num_bytes: int, num_ranks: int, hidden: int, **kwargs) -> int:
    """Largest `num_max_tokens_per_rank` whose requirement fits in `num_bytes` (requirement is linear in it)."""
    per_token = required_bytes(num_ranks, 1, hidden, **kwargs)
    return num_bytes // per_token if per_token else 0


def _expected_distinct_groups(num_experts: int, num_topk: int, num_groups: int) -> float:
    """Expected number of distinct groups hit by `num_topk` distinct experts drawn from `num_groups` groups."""
    per_group = num_experts // num_groups
    return num_groups * (1 - math.comb(num_experts - per_group, num_topk) / math.comb(num_experts, num_topk))


def theoretical_num_sms(
    num_ranks: int,
    num_experts: int,
    num_topk: int,
    nvlink_gbs: float,
    device_sms: int,
    *,
    sm_read_gbs: float = 180.0,
    sm_write_gbs: float = 45.0,
    prefer_overlap_with_compute: bool = True,
) -> int:
    """SM count that keeps the NVLink bottleneck busy under a balanced gate (reference §8.2, direct mode).

    A hint only: the collective transport runs no persistent SM-limited kernels; the NVLink transport uses it
    as its default grid size.
    """
    if num_ranks <= 1 or nvlink_gbs <= 0:
        sms = float(device_sms)
    else:
        t = _expected_distinct_groups(num_experts, min(num_topk, num_experts), num_ranks)
        read = 1 / t
        write = 1.0  # num_nvl / num_ranks with every rank on one host
        nvl = 1 - 1 / num_ranks
        scale = nvlink_gbs / nvl
        sms = max(
            scale * read / sm_read_gbs,
            scale * write / sm_write_gbs,
            scale * (write - nvl) / sm_read_gbs,
            scale * (read + nvl) / sm_write_gbs,
        )
    sms_i = align(max(4, math.ceil(1.3 * sms)), 4)
    if not prefer_overlap_with_compute:
        sms_i = max(sms_i, 64)
    return min(sms_i, device_sms // 2 * 2) if device_sms > 0 else sms_i


def default_nvlink_gbs(device: torch.device) -> float:
    """Usable NVLink bandwidth per direction (GB/s) assumed for `device`: 0.9 x nominal for the GPUs we know."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    # NOTE: H100/H200 SXM have 18 links of 26.56 GB/s per direction (478 GB/s); DeepEP's model uses 0.9x nominal.
    if "H100" in name or "H200" in name or "H800" in name or "H20" in name:
        return 0.9 * 18 * 26.5625
    if "A100" in name or "A800" in name:
        return 0.9 * 12 * 25.0
    return 0.0
