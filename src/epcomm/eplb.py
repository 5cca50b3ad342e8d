"""Expert-parallel load balancing (EPLB): place redundant experts from measured per-expert load.

Two planners, both pure functions of a load table `[layers, E]` (tokens per expert over some recent steps),
deterministic, on the CPU, no communication (every rank computes the same plan from the same table):

* `plan_redundant_experts(load, num_ranks, num_redundant_slots)` keeps every expert on its owner rank
  (`e // L`) and fills the `C` redundant slots of every rank with replicas of the heaviest experts, never on
  their own rank. It returns the `redundancy_mapping` that `EPBuffer.lb_prefetch_weights` and
  `EPBuffer.lb_reduce_grads` take, and the physical-expert view for dispatch (`map_topk_idx`).
* `hierarchical_placement(load, num_physical_experts, num_groups=, num_nodes=, num_gpus=)` is the full
  placement DeepSeek describes for EPLB, for users who migrate weights themselves: expert groups packed onto
  nodes evenly, the heaviest experts replicated inside each node, physical experts packed onto GPUs evenly.
  Owners move; it is not the input of the LB calls.

Physical experts (docs/load_balancing.md): with R ranks, L local experts and C slots per rank there are
`R * (L + C)` physical experts; rank r hosts ids `[r * (L + C), (r + 1) * (L + C))`: first its own L experts
(physical `r * (L + C) + i` is logical `r * L + i`), then its slots (physical `r * (L + C) + L + c` is
`redundancy_mapping[r, c]`). Dispatch with `num_experts = R * (L + C)` and `plan.map_topk_idx(topk_idx)` sends
tokens to replicas directly.

Shape legend: E logical experts, R ranks, L = E / R local experts, C redundant slots per rank, P physical
experts, G GPUs, T tokens, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

__all__ = ["HierarchicalPlacement", "RedundancyPlan", "hierarchical_placement", "plan_redundant_experts"]

_REL_EPS = 1e-12  # moves smaller than this fraction of the layer's total load are not worth making


# ----------------------------------------------------------------------------------------------------------
# owners fixed: redundant slots
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RedundancyPlan:
    """Replicas of the heaviest experts in every rank's redundant slots; owners unchanged.

    Fields:
        num_ranks: R. num_local_experts: L. num_redundant_slots: C.
        redundancy_mapping: [layers, R, C] int32 -- expert held by slot c of rank r (the LB calls take
            `redundancy_mapping[layer]`); every slot is filled when C > 0, never with one of r's experts.
        replica_counts: [layers, E] int64 -- copies of each expert, the owner's included (>= 1).
        logical_to_physical: [layers, E, max_copies] int64 -- physical ids of each expert's copies, the owner's
            first, then its replicas in ascending (rank, slot); -1 pads.
        copy_shares: [layers, E, max_copies] float64 -- fraction of the expert's tokens each copy receives
            (sums to 1; 0 on padding and on spare copies); `map_topk_idx` follows it.
        physical_to_logical: [layers, R * (L + C)] int64 -- logical expert of each physical expert.
        rank_load: [layers, R] float64 -- planned load per rank (`load` split by `copy_shares`).
        baseline_rank_load: [layers, R] float64 -- load per rank without replicas.

    Equality: `plan_a == plan_b` compares every field, tensors by shape, dtype, device and values
    (`torch.equal`), so two plans from the same load are equal and a replan can be checked against the plan in
    use; a plan is hashable, consistently with that. `plan_a is plan_b` is identity.
    """

    num_ranks: int
    num_local_experts: int
    num_redundant_slots: int
    redundancy_mapping: Tensor
    replica_counts: Tensor
    logical_to_physical: Tensor
    copy_shares: Tensor
    physical_to_logical: Tensor
    rank_load: Tensor
    baseline_rank_load: Tensor

    def __eq__(self, other) -> bool:
        return _fields_equal(self, other)

    def __hash__(self) -> int:
        return hash((self.num_ranks, self.num_local_experts, self.num_redundant_slots,
                     tuple(self.redundancy_mapping.reshape(-1).tolist())))

    @property
    def num_layers(self) -> int:
        return self.redundancy_mapping.shape[0]

    @property
    def num_experts(self) -> int:
        """E = R * L logical experts."""
        return self.num_ranks * self.num_local_experts

    @property
    def num_physical_experts(self) -> int:
        """R * (L + C): the `num_experts` to dispatch physical ids with."""
        return self.num_ranks * (self.num_local_experts + self.num_redundant_slots)

    def map_topk_idx(self, topk_idx: Tensor, layer: int = 0, *, rank: int = 0) -> Tensor:
        """Map router picks (logical experts) to physical experts, spreading each expert over its copies.

        The j-th of the `n_e` selections of expert e in `topk_idx` (row-major order) goes to the copy whose
        cumulative-share interval holds `u = frac((j + 0.5) / n_e + rank / R)`, so each copy receives
        `n_e * share` selections to within one, and ranks start at different phases (a rank with one token
        for e does not always pick the same copy). Distinct experts map to distinct physical ids, so rows stay
        free of repeats; -1 stays -1. Deterministic; local.

        Args:
            topk_idx: [T, K] int64 or int32 -- logical expert ids in [-1, E), any device.
            layer: int -- which layer's plan; default 0.
            rank: int -- the calling group rank (phase of the spreading); default 0.

        Returns:
            [T, K] topk_idx's dtype and device -- physical expert ids in [-1, R * (L + C)).

        Raises:
            TypeError: `topk_idx` is not an int32/int64 tensor, or `layer`/`rank` is not an int.
            ValueError: `topk_idx` not 2-D, ids outside [-1, E), `layer` or `rank` out of range.
        """
        if not isinstance(topk_idx, Tensor) or topk_idx.dtype not in (torch.int64, torch.int32):
            got = topk_idx.dtype if isinstance(topk_idx, Tensor) else type(topk_idx).__name__
            raise TypeError(f"RedundancyPlan.map_topk_idx: topk_idx must be an int64 or int32 tensor, got {got}")
        if topk_idx.dim() != 2:
            raise ValueError(f"RedundancyPlan.map_topk_idx: topk_idx must be 2-D [T, K] (tokens x top-k), got shape "
                             f"{tuple(topk_idx.shape)}")
        _check_int("RedundancyPlan.map_topk_idx", "layer", layer, 0, self.num_layers - 1)
        _check_int("RedundancyPlan.map_topk_idx", "rank", rank, 0, self.num_ranks - 1)
        dev, num_experts = topk_idx.device, self.num_experts
        flat = topk_idx.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < -1 or int(flat.max()) >= num_experts):
            bad = int(flat.min()) if int(flat.min()) < -1 else int(flat.max())
            raise ValueError(f"RedundancyPlan.map_topk_idx: topk_idx holds {bad}; logical ids must be in "
                             f"[-1, E={num_experts}) (map router picks, not physical ids)")
        valid = flat >= 0
        e = flat[valid]
        counts = torch.bincount(e, minlength=num_experts)
        order = torch.argsort(e, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        j = torch.empty_like(e)
        j[order] = torch.arange(e.numel(), device=dev) - starts[e[order]]
        u = torch.frac((j.double() + 0.5) / counts[e].double() + rank / self.num_ranks)
        shares = self.copy_shares[layer].to(dev)
        cum = torch.cumsum(shares, 1)
        # Copies from the last one with a positive share onward end at +inf: u never falls past them.
        positive = shares > 0
        last = (positive.long() * torch.arange(shares.shape[1], device=dev)).amax(1, keepdim=True)
        cum = torch.where(torch.arange(shares.shape[1], device=dev) >= last, torch.inf, cum)
        copy = torch.searchsorted(cum[e], u.unsqueeze(1), right=True).squeeze(1)
        phys = self.logical_to_physical[layer].to(dev)[e, copy]
        out = torch.full_like(flat, -1)
        out[valid] = phys
        return out.view(topk_idx.shape).to(topk_idx.dtype)


def plan_redundant_experts(load: Tensor, num_ranks: int, num_redundant_slots: int) -> RedundancyPlan:
    """Fill every rank's redundant slots with replicas that lower the most loaded rank's load.

    Per layer, starting from the owners (expert e on rank `e // L` with all its load): R * C times, take the
    most loaded rank m (lowest id on ties) and the move that takes the most load off it: a new replica of an
    expert x with load on m, on a rank r with a free slot, lower load, that neither owns nor holds x, taking
    `min(x's load on m, (load_m - load_r) / 2)` (ties: the heavier x, then lower ids). When no such move
    helps, the slot gets a spare replica (share 0) of the expert with the most load per copy, on the least
    loaded rank with a free slot. Then shares are rebalanced along existing copies the same way until no move
    helps. No step raises the maximum, so the planned maximum is never above the baseline's; it is strictly
    lower whenever R >= 2, C >= 1 and one expert's load exceeds twice the mean load per rank (`total / R`).

    Args:
        load: [layers, E] float or int, on any device -- load per expert (e.g. tokens routed to it), >= 0,
            finite; E a multiple of `num_ranks`.
        num_ranks: R >= 1.
        num_redundant_slots: C, redundant slots per rank, in [0, (R - 1) * L] (a rank can only hold experts
            of other ranks, each at most once).

    Returns:
        RedundancyPlan -- on the CPU; see its fields.

    Raises:
        TypeError: `load` is not a real tensor, or a count is not an int.
        ValueError: `load` not 2-D, negative or non-finite values, E not a multiple of R, C out of range.
    """
    call = "plan_redundant_experts"
    _check_int(call, "num_ranks", num_ranks, 1)
    rows = _check_load(call, load)
    num_experts = load.shape[1]
    if num_experts % num_ranks:
        raise ValueError(f"{call}: load has E={num_experts} experts, not a multiple of num_ranks={num_ranks}")
    num_local = num_experts // num_ranks
    _check_int(call, "num_redundant_slots", num_redundant_slots, 0, (num_ranks - 1) * num_local)
    layers = [_plan_layer(row, num_ranks, num_local, num_redundant_slots) for row in rows]
    max_copies = max([1] + [len(h) for lay in layers for h in lay.hosts])
    stride = num_local + num_redundant_slots
    n = len(layers)
    mapping = torch.full((n, num_ranks, num_redundant_slots), -1, dtype=torch.int32)
    l2p = torch.full((n, num_experts, max_copies), -1, dtype=torch.int64)
    shares = torch.zeros(n, num_experts, max_copies, dtype=torch.float64)
    p2l = torch.full((n, num_ranks * stride), -1, dtype=torch.int64)
    for i, lay in enumerate(layers):
        for r, slots in enumerate(lay.slots):
            for c, x in enumerate(slots):
                mapping[i, r, c] = x
                p2l[i, r * stride + num_local + c] = x
        for x in range(num_experts):
            owner = x // num_local
            p2l[i, owner * stride + x % num_local] = x
            copies = sorted(lay.hosts[x], key=lambda r: (r != owner, r))  # the owner first
            amount = lay.hosts[x]
            for k, r in enumerate(copies):
                l2p[i, x, k] = r * stride + (x % num_local if r == owner else num_local + lay.slots[r].index(x))
                shares[i, x, k] = amount[r] / rows[i][x] if rows[i][x] > 0 else 1.0 / len(copies)
    return RedundancyPlan(
        num_ranks=num_ranks, num_local_experts=num_local, num_redundant_slots=num_redundant_slots,
        redundancy_mapping=mapping, replica_counts=(l2p >= 0).sum(2), logical_to_physical=l2p, copy_shares=shares,
        physical_to_logical=p2l, rank_load=torch.tensor([lay.rank_load for lay in layers], dtype=torch.float64),
        baseline_rank_load=torch.tensor([lay.baseline for lay in layers], dtype=torch.float64))


@dataclass
class _Layer:
    slots: list  # [R] lists of expert ids, slot order
    hosts: list  # [E] dicts rank -> load share (amount) of that copy
    rank_load: list
    baseline: list


def _plan_layer(load: list, num_ranks: int, num_local: int, num_slots: int) -> _Layer:
    num_experts = num_ranks * num_local
    hosts = [{x // num_local: float(load[x])} for x in range(num_experts)]
    on_rank = [list(range(r * num_local, (r + 1) * num_local)) for r in range(num_ranks)]
    slots = [[] for _ in range(num_ranks)]
    rank_load = [sum(float(v) for v in load[r * num_local:(r + 1) * num_local]) for r in range(num_ranks)]
    baseline = list(rank_load)
    eps = _REL_EPS * sum(float(v) for v in load)

    def place(x: int, r: int, amount: float, m: int) -> None:
        slots[r].append(x)
        on_rank[r].append(x)
        hosts[x][r] = 0.0
        move(x, m, r, amount)

    def move(x: int, src: int, dst: int, amount: float) -> None:
        hosts[x][src] -= amount
        hosts[x][dst] += amount
        rank_load[src] -= amount
        rank_load[dst] += amount

    for _ in range(num_ranks * num_slots):
        m = max(range(num_ranks), key=lambda r: (rank_load[r], -r))
        best, best_key = None, (eps, 0.0)
        for x in on_rank[m]:
            a = hosts[x][m]
            if a <= 0:
                continue
            for r in range(num_ranks):
                if len(slots[r]) == num_slots or r in hosts[x] or rank_load[r] >= rank_load[m]:
                    continue
                key = (min(a, (rank_load[m] - rank_load[r]) / 2), a)
                if key > best_key:
                    best, best_key = (x, r), key
        if best is not None:
            place(best[0], best[1], best_key[0], m)
            continue
        # Spare replica: the least loaded rank with room, the expert with the most load per copy it can take.
        r = min((r for r in range(num_ranks) if len(slots[r]) < num_slots), key=lambda r: (rank_load[r], r))
        x = max((x for x in range(num_experts) if r not in hosts[x]),
                key=lambda x: (float(load[x]) / len(hosts[x]), -x))
        place(x, r, 0.0, x // num_local)
    for _ in range(4 * (num_experts + num_ranks * num_slots)):  # rebalance shares along existing copies
        m = max(range(num_ranks), key=lambda r: (rank_load[r], -r))
        best, best_key = None, (eps, 0.0)
        for x in on_rank[m]:
            a = hosts[x][m]
            if a <= 0:
                continue
            for r in sorted(hosts[x]):
                if rank_load[r] < rank_load[m]:
                    key = (min(a, (rank_load[m] - rank_load[r]) / 2), a)
                    if key > best_key:
                        best, best_key = (x, r), key
        if best is None:
            break
        move(best[0], m, best[1], best_key[0])
    final = [sum(a for x in on_rank[r] for a in [hosts[x][r]]) for r in range(num_ranks)]
    if max(final, default=0.0) > max(baseline, default=0.0):  # float rounding only: keep the guarantee exact
        for x in range(num_experts):
            for r in hosts[x]:
                hosts[x][r] = float(load[x]) if r == x // num_local else 0.0
        final = list(baseline)
    return _Layer(slots, hosts, final, baseline)


# ----------------------------------------------------------------------------------------------------------
# owners move: hierarchical placement
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class HierarchicalPlacement:
    """A full placement of physical experts on GPUs (EPLB's hierarchical policy).

    Fields:
        physical_to_logical: [layers, P] int64 -- logical expert of each physical expert; GPU g hosts
            physical ids `[g * P / G, (g + 1) * P / G)`, node n hosts GPUs `[n * G / N, (n + 1) * G / N)`.
        logical_to_physical: [layers, E, max_copies] int64 -- physical ids of each expert, ascending; -1 pads.
        replica_counts: [layers, E] int64 -- copies of each expert (>= 1).
        node_of_group: [layers, num_groups] int64 -- the node each expert group was packed onto.
        gpu_load: [layers, G] float64 -- planned load per GPU, each copy carrying `load / replica_count`.

    Equality: as `RedundancyPlan`'s, field by field with `torch.equal`; hashable, consistently with it.
    """

    physical_to_logical: Tensor
    logical_to_physical: Tensor
    replica_counts: Tensor
    node_of_group: Tensor
    gpu_load: Tensor

    def __eq__(self, other) -> bool:
        return _fields_equal(self, other)

    def __hash__(self) -> int:
        return hash(tuple(self.physical_to_logical.reshape(-1).tolist()))


def hierarchical_placement(load: Tensor, num_physical_experts: int, *, num_groups: int, num_nodes: int,
                           num_gpus: int) -> HierarchicalPlacement:
    """Pack expert groups onto nodes, replicate the heaviest experts, pack physical experts onto GPUs.

    Per layer: (1) the `num_groups` contiguous expert groups go to nodes, `num_groups / num_nodes` each,
    heaviest group first onto the least loaded node with room; (2) each node's `P / N` physical slots hold
    its experts once, and every extra slot goes to the expert with the highest load per copy; (3) each node's
    physical experts (each carrying `load / copies`) go to its GPUs, `P / G` each, heaviest first onto the
    least loaded GPU with room (two copies may share a GPU: load-wise that is one copy with both shares).
    When `num_groups` is not a multiple of `num_nodes`, steps (1)-(3) run as one node (global policy).
    Ties go to the lower id. Deterministic, local.

    Args:
        load: [layers, E] float or int -- load per logical expert, >= 0, finite.
        num_physical_experts: P >= E, a multiple of `num_gpus`.
        num_groups: expert groups, E a multiple of it (DeepSeek-V3: 8 groups of 32).
        num_nodes: N >= 1, `num_gpus` a multiple of it.
        num_gpus: G >= 1.

    Returns:
        HierarchicalPlacement -- on the CPU; see its fields.

    Raises:
        TypeError: `load` is not a real tensor, or a count is not an int.
        ValueError: counts out of range or not dividing as stated.
    """
    call = "hierarchical_placement"
    rows = _check_load(call, load)
    num_experts = load.shape[1]
    for name, v in (("num_physical_experts", num_physical_experts), ("num_groups", num_groups),
                    ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        _check_int(call, name, v, 1)
    for what, a, b in (("E (load.shape[1])", num_experts, num_groups), ("num_gpus", num_gpus, num_nodes),
                       ("num_physical_experts", num_physical_experts, num_gpus)):
        if a % b:
            raise ValueError(f"{call}: {what}={a} must be a multiple of {b}")
    if num_physical_experts < num_experts:
        raise ValueError(f"{call}: num_physical_experts={num_physical_experts} must be >= E={num_experts}")
    nodes = num_nodes if num_groups % num_nodes == 0 else 1
    out = [_place_layer(row, num_physical_experts, num_groups, nodes, num_gpus) for row in rows]
    n, per_gpu = len(out), num_physical_experts // num_gpus
    p2l = torch.tensor([o[0] for o in out], dtype=torch.int64).view(n, num_physical_experts)
    counts = torch.stack([torch.bincount(p2l[i], minlength=num_experts) for i in range(n)]) if n else \
        torch.zeros(0, num_experts, dtype=torch.int64)  # a table of no layers: an empty placement
    l2p = torch.full((n, num_experts, int(counts.max()) if n else 1), -1, dtype=torch.int64)
    for i in range(n):
        seen = [0] * num_experts
        for p, x in enumerate(out[i][0]):
            l2p[i, x, seen[x]] = p
            seen[x] += 1
    gpu_load = torch.zeros(n, num_gpus, dtype=torch.float64)
    for i in range(n):
        for p, x in enumerate(out[i][0]):
            gpu_load[i, p // per_gpu] += rows[i][x] / int(counts[i, x])
    return HierarchicalPlacement(physical_to_logical=p2l, logical_to_physical=l2p, replica_counts=counts,
                                 node_of_group=torch.tensor([o[1] for o in out], dtype=torch.int64).view(n, num_groups),
                                 gpu_load=gpu_load)


def _pack(weights: list, num_bins: int, per_bin: int) -> list:
    """Bin of each item: heaviest first (ties: lower index) onto the least loaded bin with room (ties: lower
    bin)."""
    loads, sizes, where = [0.0] * num_bins, [0] * num_bins, [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        b = min((b for b in range(num_bins) if sizes[b] < per_bin), key=lambda b: (loads[b], b))
        where[i] = b
        loads[b] += weights[i]
        sizes[b] += 1
    return where


def _place_layer(load: list, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int) -> tuple:
    num_experts = len(load)
    group_size = num_experts // num_groups
    group_load = [sum(load[g * group_size:(g + 1) * group_size]) for g in range(num_groups)]
    node_of_group = _pack(group_load, num_nodes, num_groups // num_nodes)
    gpus_per_node, per_gpu = num_gpus // num_nodes, num_physical // num_gpus
    p2l = [0] * num_physical
    for node in range(num_nodes):
        experts = [x for g in range(num_groups) if node_of_group[g] == node
                   for x in range(g * group_size, (g + 1) * group_size)]
        copies = {x: 1 for x in experts}
        for _ in range(num_physical // num_nodes - len(experts)):
            x = max(experts, key=lambda x: (load[x] / copies[x], -x))
            copies[x] += 1
        items = [x for x in experts for _ in range(copies[x])]
        weights = [load[x] / copies[x] for x in items]
        gpu_of = _pack(weights, gpus_per_node, per_gpu)
        filled = [0] * gpus_per_node
        for i in sorted(range(len(items)), key=lambda i: (-weights[i], i)):  # the packing order
            g = gpu_of[i]
            p2l[(node * gpus_per_node + g) * per_gpu + filled[g]] = items[i]
            filled[g] += 1
    return p2l, node_of_group


# ----------------------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------------------
def _fields_equal(a, b):
    """`a == b` for the plans (dataclasses of tensors): the same class and every field equal, tensors by shape,
    dtype, device and values (`torch.equal`; the fields hold no NaN). NotImplemented for another class."""
    if b.__class__ is not a.__class__:
        return NotImplemented
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            if not (isinstance(x, Tensor) and isinstance(y, Tensor) and x.dtype == y.dtype and x.device == y.device
                    and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _check_int(call: str, name: str, v, lo: int, hi=None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{call}: {name} must be an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{call}: {name} must be {rng}, got {v}")
    return v


def _check_load(call: str, load) -> list:
    """The load table as host lists of floats, after the checks every planner shares."""
    if not isinstance(load, Tensor) or load.is_complex() or load.dtype == torch.bool:
        got = load.dtype if isinstance(load, Tensor) else type(load).__name__
        raise TypeError(f"{call}: load must be a real tensor [layers, E], got {got}")
    if load.dim() != 2 or load.shape[1] == 0:
        raise ValueError(f"{call}: load must be 2-D [layers, E] with E >= 1, got shape {tuple(load.shape)}; "
                         "pass load[None] for one layer")
    values = load.detach().to("cpu", torch.float64)
    if values.numel() and (not bool(torch.isfinite(values).all()) or float(values.min()) < 0):
        raise ValueError(f"{call}: load must be finite and >= 0, got min {float(values.min())} and "
                         f"max {float(values.max())}")
    return values.tolist()
