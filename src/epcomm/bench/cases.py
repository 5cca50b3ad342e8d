"""What one benchmark point is: the case (preset, tokens, routing, dtype), its inputs, and its byte counts.

A `Case` is one routing draw and one payload type; every provider of a table block (epcomm in each layout and
transport, the torch-native dispatcher, the raw all-to-all) runs on the same inputs, made by `make_inputs` from
the case and the run's seed alone, so every task (and every rank) can rebuild them without sending tensors.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import Tensor

from ..fp8 import per_token_cast_to_fp8
from ..routing import MoEPreset, get_preset, make_routing

DTYPES = ("bf16", "fp8")
LAYOUTS = ("non-expand", "expand")
FP8_ROW_FACTOR = 1 + 4 / 128  # DeepEP's byte count of an FP8 row per element: data + one fp32 scale per 128

# Provider names. The raw all-to-all is named after the backend that runs it.
TORCH_NATIVE = "torch-native"
PEER_COPY = "copy-engine"


def epcomm_provider(transport: str) -> str:
    return f"epcomm-{transport}"


def raw_provider(backend: str) -> str:
    return f"{backend}-a2a"


@dataclass(frozen=True)
class Case:
    """One routing draw and payload type, shared by every provider of a table block.

    Fields:
        preset: name in `epcomm.routing.PRESETS` (hidden size, experts, top-k, gate).
        tokens: tokens per rank (T); every rank has the same number.
        dtype: "bf16" or "fp8": the dispatch payload. Combine is always BF16 (it runs in the "bf16" case only).
        skew: None (the preset's routing) or "zipf" (expert popularity ~ Zipf(1.2)).
        seed: the run's seed; the inputs of a rank depend on (seed, preset, tokens, skew, rank) only, so the
            "bf16" and "fp8" cases of one shape route identically.
    """

    preset: str
    tokens: int
    dtype: str
    skew: Optional[str]
    seed: int

    @property
    def moe(self) -> MoEPreset:
        return get_preset(self.preset)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "fp8"

    @property
    def label(self) -> str:
        skew = f" {self.skew}" if self.skew else ""
        return f"{self.preset}{skew} T={self.tokens} {self.dtype}"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EpcommConfig:
    """One epcomm configuration: a case in a layout over a transport with an SM count (0 = epcomm's default)."""

    case: Case
    layout: str
    transport: str
    num_sms: int

    @property
    def do_expand(self) -> bool:
        return self.layout == "expand"

    @property
    def label(self) -> str:
        sms = f" sms={self.num_sms}" if self.num_sms else ""
        return f"{self.case.label} {self.layout} {epcomm_provider(self.transport)}{sms}"


@dataclass
class Inputs:
    """One rank's inputs: x as dispatched (bf16 tensor or FP8 pair), its bf16 source, and the routing."""

    x: object
    x_bf16: Tensor
    topk_idx: Tensor
    topk_weights: Tensor


def _generator(case: Case, rank: int, stream: str) -> torch.Generator:
    key = f"{case.seed}/{case.preset}/{case.tokens}/{case.skew}/{rank}/{stream}".encode()
    return torch.Generator().manual_seed(zlib.crc32(key))


def make_inputs(case: Case, rank: int, device: torch.device) -> Inputs:
    """Fresh random inputs of one rank (never zeros or ones): x ~ randn in bf16, routing from the preset's gate."""
    moe = case.moe
    gen = _generator(case, rank, "inputs")
    topk_idx, topk_weights = make_routing(moe, case.tokens, skew=case.skew, generator=gen)
    x_bf16 = torch.randn(case.tokens, moe.hidden, generator=gen).to(torch.bfloat16)
    x_bf16, topk_idx, topk_weights = x_bf16.to(device), topk_idx.to(device), topk_weights.to(device)
    x = per_token_cast_to_fp8(x_bf16) if case.is_fp8 else x_bf16
    return Inputs(x=x, x_bf16=x_bf16, topk_idx=topk_idx, topk_weights=topk_weights)


def random_like_rows(case: Case, rank: int, rows: int, hidden: int, device: torch.device, stream: str) -> Tensor:
    """Random bf16 expert outputs [rows, hidden] (what an expert would return), deterministic per case/rank."""
    gen = _generator(case, rank, stream)
    return torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).to(device)


def dedup_send_counts(topk_idx: Tensor, num_experts: int, num_ranks: int) -> list:
    """Tokens this rank sends to each rank when every token goes once to every rank holding one of its experts."""
    num_local = num_experts // num_ranks
    dest = torch.where(topk_idx >= 0, torch.div(topk_idx.long(), num_local, rounding_mode="floor"), num_ranks)
    hit = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, dest, True)
    return hit[:, :num_ranks].sum(0).tolist()


def deepep_row_bytes(hidden: int, dtype: str) -> float:
    """Bytes DeepEP's bandwidth figures count per row: hidden*2 for BF16, hidden*(1 + 4/128) for FP8."""
    return hidden * (FP8_ROW_FACTOR if dtype == "fp8" else 2)
