"""MoE gates, synthetic routing scores and model presets for tests and benchmarks.

Gates turn router outputs into DeepEP's `(topk_idx int64 [T, K], topk_weights float32 [T, K])` pair:
`topk_from_scores` (plain top-k of positive scores), `softmax_topk` (Mixtral / Qwen3) and `deepseek_v3_gate`
(sigmoid scores, bias-corrected group-limited selection). `uniform_scores` and `zipf_scores` draw synthetic
scores, `PRESETS` names model shapes, and `make_routing` produces one rank's routing for a preset.
Every random draw takes an optional `torch.Generator`, so results are reproducible from a seed.
"""

from __future__ import annotations

import dataclasses
import types

import torch
from torch import Tensor

__all__ = ["MoEPreset", "PRESETS", "deepseek_v3_gate", "get_preset", "make_routing", "softmax_topk",
           "topk_from_scores", "uniform_scores", "zipf_scores"]

ROUTING_KINDS = ("uniform", "grouped", "softmax")
GROUPED_BIAS_STD = 0.01  # std of the random score-correction bias make_routing draws for "grouped" presets


def _check_scores(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [T, E], got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [T, E], got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {t.dtype}")
    return t


def _check_int(name: str, v: object, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name} must be " + (f">= {lo}" if hi is None else f"in [{lo}, {hi}]") + f", got {v}")
    return v


def _normalise(w: torch.Tensor) -> torch.Tensor:
    return w / w.sum(dim=-1, keepdim=True)


def topk_from_scores(scores: torch.Tensor, num_topk: int, *, sorted: bool = False) -> tuple[Tensor, Tensor]:
    """Pick the `num_topk` highest-scoring experts per token; weights are those scores normalised to sum 1.

    Args:
        scores: [T, E] floating -- per-token expert scores; constraint: positive where selected (weights divide
            by their sum).
        num_topk: int -- experts per token (K); constraint: 1 <= K <= E.
        sorted: bool -- return each row's picks in descending score order; default False (order unspecified).

    Returns:
        topk_idx: [T, K] int64 -- distinct expert ids in [0, E) per row.
        topk_weights: [T, K] float32 -- the selected scores (in fp32) divided by their row sum.

    Raises:
        TypeError: `scores` is not a floating tensor, or `num_topk` is not an int.
        ValueError: `scores` is not 2-D, or `num_topk` is out of range.
    """
    _check_scores("scores", scores)
    _check_int("num_topk", num_topk, 1, scores.shape[1])
    vals, idx = torch.topk(scores.float(), num_topk, dim=-1, sorted=sorted)
    return idx.to(torch.int64), _normalise(vals)


def softmax_topk(logits: torch.Tensor, num_topk: int, *, renormalize: bool = True) -> tuple[Tensor, Tensor]:
    """Mixtral / Qwen3-MoE gate: fp32 softmax over experts, top-k, optionally renormalised.

    Args:
        logits: [T, E] floating -- router logits.
        num_topk: int -- experts per token (K); constraint: 1 <= K <= E.
        renormalize: bool -- divide the K selected probabilities by their sum (Mixtral; Qwen3 `norm_topk_prob`);
            default True. When False the weights are the raw softmax probabilities.

    Returns:
        topk_idx: [T, K] int64 -- expert ids, descending probability per row.
        topk_weights: [T, K] float32 -- the selected probabilities (renormalised if `renormalize`).

    Raises:
        TypeError: `logits` is not a floating tensor, or `num_topk` is not an int.
        ValueError: `logits` is not 2-D, or `num_topk` is out of range.
    """
    _check_scores("logits", logits)
    _check_int("num_topk", num_topk, 1, logits.shape[1])
    probs = torch.softmax(logits.float(), dim=-1)
    vals, idx = torch.topk(probs, num_topk, dim=-1, sorted=True)
    return idx.to(torch.int64), (_normalise(vals) if renormalize else vals)


def deepseek_v3_gate(
    logits: torch.Tensor,
    num_topk: int,
    *,
    n_group: int,
    topk_group: int,
    bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 gate: sigmoid scores, bias-corrected selection limited to the best expert groups.

    `s = sigmoid(logits)` (fp32) and selection scores `c = s + bias`. Experts form `n_group` contiguous groups
    of `E / n_group`; a group's score is the sum of its top-2 `c` (top-1 when groups have one expert). Only the
    `topk_group` best groups stay eligible; the top-`num_topk` `c` among them are chosen, and their weights are
    the original `s`, normalised to sum 1, times `routed_scaling_factor`.

    Args:
        logits: [T, E] floating -- router logits.
        num_topk: int -- experts per token (K); constraint: 1 <= K <= topk_group * E / n_group.
        n_group: int -- number of expert groups; constraint: >= 1 and E % n_group == 0.
        topk_group: int -- groups kept per token; constraint: 1 <= topk_group <= n_group.
        bias: [E] floating or None -- score-correction bias, used for selection only; default None (zeros).
        routed_scaling_factor: float -- multiplies the normalised weights; default 1.0.

    Returns:
        topk_idx: [T, K] int64 -- expert ids, descending selection score per row.
        topk_weights: [T, K] float32 -- normalised sigmoid scores times `routed_scaling_factor`.

    Raises:
        TypeError: `logits`/`bias` is not a floating tensor, or an int argument is not an int.
        ValueError: shapes disagree, or `num_topk`, `n_group`, `topk_group` violate the constraints above.
    """
    _check_scores("logits", logits)
    t, e = logits.shape
    _check_int("n_group", n_group, 1, max(e, 1))
    if e % n_group:
        raise ValueError(f"num_experts (logits.shape[1] = {e}) must be divisible by n_group = {n_group}")
    _check_int("topk_group", topk_group, 1, n_group)
    group_size = e // n_group
    _check_int("num_topk", num_topk, 1, topk_group * group_size)
    s = torch.sigmoid(logits.float())
    c = s
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            got = bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise TypeError(f"bias must be a floating torch.Tensor [E] or None, got {got}")
        if tuple(bias.shape) != (e,):
            raise ValueError(f"bias must have shape ({e},) to match logits [T, E], got {tuple(bias.shape)}")
        c = s + bias.float()
    grouped = c.view(t, n_group, group_size)
    group_scores = grouped.topk(min(2, group_size), dim=-1).values.sum(dim=-1)  # [T, n_group]
    keep = torch.topk(group_scores, topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    eligible = group_mask.unsqueeze(-1).expand(t, n_group, group_size).reshape(t, e)
    idx = torch.topk(c.masked_fill(~eligible, float("-inf")), num_topk, dim=-1, sorted=True).indices
    weights = _normalise(s.gather(1, idx)) * routed_scaling_factor
    return idx.to(torch.int64), weights


def uniform_scores(num_tokens: int, num_experts: int, *, generator: torch.Generator | None = None,
                   device: str | torch.device = "cpu") -> torch.Tensor:
    """Scores `|randn| + 1` as in DeepEP's tests; their top-k spreads load evenly over experts.

    Args:
        num_tokens: int -- rows (T); constraint: >= 0.
        num_experts: int -- columns (E); constraint: >= 1.
        generator: torch.Generator or None -- RNG to draw from (must live on `device`); default None (global RNG).
        device: str or torch.device -- where to create the scores; default "cpu".

    Returns:
        [T, E] float32 -- values >= 1.

    Raises:
        TypeError: a count is not an int.
        ValueError: a count is out of range.
    """
    _check_int("num_tokens", num_tokens, 0)
    _check_int("num_experts", num_experts, 1)
    return torch.randn(num_tokens, num_experts, generator=generator, device=device).abs() + 1


def zipf_scores(num_tokens: int, num_experts: int, *, exponent: float = 1.2,
                generator: torch.Generator | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
    """Scores whose top-k draws experts without replacement from a Zipf(`exponent`) popularity law.

    Exactly: (1) `perm = randperm(E)` ranks the experts, expert `perm[r]` getting rank `r + 1`; (2) popularity
    `p_e = rank_e ** -exponent / sum_r r ** -exponent`; (3) `scores[t, e] = p_e / X[t, e]` with `X` i.i.d.
    Exp(1) (drawn as `-log1p(-rand)`, floored at the smallest normal fp32). This is the exponential race
    (the Gumbel-top-k trick in linear space): the top-1 of a row is expert `e` with probability exactly `p_e`,
    and the top-k is an ordered sample of k distinct experts drawn successively with probabilities `p`
    (Plackett-Luce). At E=256, K=8, exponent 1.2 the hottest expert is in ~93% of rows, ~30x the
    mean load.

    Args:
        num_tokens: int -- rows (T); constraint: >= 0.
        num_experts: int -- columns (E); constraint: >= 1.
        exponent: float -- Zipf exponent; default 1.2; constraint: >= 0 (0 gives uniform popularity).
        generator: torch.Generator or None -- RNG (must live on `device`); default None (global RNG).
        device: str or torch.device -- where to create the scores; default "cpu".

    Returns:
        [T, E] float32 -- positive scores; usable with `topk_from_scores` or, after `log`, as logits.

    Raises:
        TypeError: a count is not an int.
        ValueError: a count or `exponent` is out of range.
    """
    _check_int("num_tokens", num_tokens, 0)
    _check_int("num_experts", num_experts, 1)
    if not exponent >= 0:
        raise ValueError(f"exponent must be >= 0, got {exponent}")
    perm = torch.randperm(num_experts, generator=generator, device=device)
    by_rank = torch.arange(1, num_experts + 1, dtype=torch.float64, device=device).pow(-float(exponent))
    prior = torch.empty_like(by_rank)
    prior[perm] = by_rank / by_rank.sum()  # expert perm[r] has rank r + 1
    prior = prior.float()
    u = torch.rand(num_tokens, num_experts, generator=generator, device=device)
    x = (-torch.log1p(-u)).clamp(min=torch.finfo(torch.float32).tiny)
    return prior / x


@dataclasses.dataclass(frozen=True)
class MoEPreset:
    """One MoE layer's shape and routing, per rank.

    Attributes:
        name: str -- key in `PRESETS`.
        num_tokens: int -- tokens per rank (T).
        hidden: int -- hidden size (H).
        num_experts: int -- routed experts in the whole EP group (E).
        num_topk: int -- experts per token (K).
        routing: str -- "uniform" (`uniform_scores` + `topk_from_scores`), "grouped" (`deepseek_v3_gate`) or
            "softmax" (`softmax_topk`).
        n_group: int or None -- expert groups for "grouped"; default None.
        topk_group: int or None -- groups kept per token for "grouped"; default None.
        fp8_dispatch: bool -- dispatch activations as 1x128 block FP8; default False.
        description: str -- where the numbers come from; default "".
    """

    name: str
    num_tokens: int
    hidden: int
    num_experts: int
    num_topk: int
    routing: str
    n_group: int | None = None
    topk_group: int | None = None
    fp8_dispatch: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_KINDS:
            raise ValueError(f"routing must be one of {ROUTING_KINDS}, got {self.routing!r}")
        if self.routing == "grouped" and (self.n_group is None or self.topk_group is None):
            raise ValueError(f"routing 'grouped' needs n_group and topk_group, got n_group={self.n_group}, "
                             f"topk_group={self.topk_group}")
        if not 1 <= self.num_topk <= self.num_experts:
            raise ValueError(f"num_topk must be in [1, num_experts={self.num_experts}], got {self.num_topk}")


PRESETS: types.MappingProxyType[str, MoEPreset] = types.MappingProxyType({p.name: p for p in (
    MoEPreset("dsv3", 4096, 7168, 256, 8, "uniform",
              description="DeepSeek-V3/R1 MoE layer (prefill), DeepEP-test style uniform |randn|+1 scores"),
    MoEPreset("dsv3-grouped", 4096, 7168, 256, 8, "grouped", n_group=8, topk_group=4,
              description="DeepSeek-V3/R1 MoE layer with its own gate: 8 groups, top-4 groups, sigmoid + bias"),
    MoEPreset("dsv3-decode", 128, 7168, 256, 8, "uniform", fp8_dispatch=True,
              description="DeepSeek-V3/R1 decode (low-latency) batch of 128 tokens per rank, FP8 dispatch"),
    MoEPreset("qwen3-30b-a3b", 4096, 2048, 128, 8, "softmax",
              description="Qwen3-30B-A3B: 128 experts, top-8, softmax with norm_topk_prob"),
    MoEPreset("mixtral-8x7b", 4096, 4096, 8, 2, "softmax",
              description="Mixtral-8x7B: 8 experts, top-2, softmax renormalised over the two picks"),
)})


def get_preset(name: str) -> MoEPreset:
    """Look up a preset by name.

    Args:
        name: str -- a key of `PRESETS`.

    Returns:
        MoEPreset -- the preset.

    Raises:
        ValueError: `name` is not a preset; the message lists the valid names.
    """
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown MoE preset {name!r}; valid names: {', '.join(PRESETS)}") from None


def make_routing(
    preset_or_name: MoEPreset | str,
    num_tokens: int,
    *,
    skew: str | None = None,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
    masked_ratio: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Draw one rank's routing for a preset.

    "uniform": `topk_from_scores(uniform_scores)`. "softmax": `softmax_topk(randn logits)`. "grouped":
    `deepseek_v3_gate(randn logits, bias=0.01 * randn(E))` with the preset's groups and scaling factor 1.
    With `skew="zipf"` the scores are `zipf_scores(exponent=1.2)` instead, used directly ("uniform") or as
    logits `log(zipf_scores)` (the gates are monotonic in the logits, so "softmax" keeps the exact Zipf sample
    and "grouped" a group-limited version of it). Finally `round(masked_ratio * T * K)` entries, chosen
    uniformly without replacement, become `-1` with weight 0. Draw order: scores/logits, bias, mask.

    Args:
        preset_or_name: MoEPreset or str -- the preset, or its name in `PRESETS`.
        num_tokens: int -- tokens on this rank (T); constraint: >= 0.
        skew: None or "zipf" -- expert popularity; default None (as the routing kind gives).
        generator: torch.Generator or None -- RNG (must live on `device`); default None (global RNG).
        device: str or torch.device -- where to create the tensors; default "cpu".
        masked_ratio: float -- fraction of `topk_idx` entries set to -1; default 0.0; constraint: in [0, 1].

    Returns:
        topk_idx: [T, K] int64 -- expert ids in [0, E), no repeats in a row, or -1 where masked.
        topk_weights: [T, K] float32 -- each row sums to 1 over its unmasked entries; 0 where masked.

    Raises:
        TypeError: `preset_or_name` is neither a MoEPreset nor a str, or `num_tokens` is not an int.
        ValueError: unknown preset name, or `num_tokens`, `skew`, `masked_ratio` out of range.
    """
    if isinstance(preset_or_name, str):
        preset = get_preset(preset_or_name)
    elif isinstance(preset_or_name, MoEPreset):
        preset = preset_or_name
    else:
        got = type(preset_or_name).__name__
        raise TypeError(f"preset_or_name must be a MoEPreset or a preset name, got {got}")
    _check_int("num_tokens", num_tokens, 0)
    if skew not in (None, "zipf"):
        raise ValueError(f"skew must be None or 'zipf', got {skew!r}")
    if not 0.0 <= masked_ratio <= 1.0:
        raise ValueError(f"masked_ratio must be in [0, 1], got {masked_ratio}")
    t, e, k = num_tokens, preset.num_experts, preset.num_topk
    kw = dict(generator=generator, device=device)
    if skew == "zipf":
        scores = zipf_scores(t, e, **kw)
        logits = scores.log()
    elif preset.routing == "uniform":
        scores = uniform_scores(t, e, **kw)
    else:
        logits = torch.randn(t, e, **kw)
    if preset.routing == "uniform":
        idx, w = topk_from_scores(scores, k)
    elif preset.routing == "softmax":
        idx, w = softmax_topk(logits, k)
    else:
        bias = GROUPED_BIAS_STD * torch.randn(e, **kw)
        idx, w = deepseek_v3_gate(logits, k, n_group=preset.n_group, topk_group=preset.topk_group, bias=bias)
    n_masked = round(masked_ratio * t * k)
    if n_masked:
        flat = torch.randperm(t * k, **kw)[:n_masked]
        idx.view(-1)[flat] = -1
        w.view(-1)[flat] = 0.0
    return idx, w
