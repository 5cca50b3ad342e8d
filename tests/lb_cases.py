"""Rank-side bodies of the load-balancing tests (importable by the worker processes).

DeepEP V2.5 behaviour, §13.4 style: redundancy mappings (random / ring / spread, with empty slots) identical on
every rank, payloads with byte ramps keyed by (global expert, payload), sentinel-filled slots, fp32 small-integer
gradients so sums are exact, and an end-to-end check that dispatch/combine through physical expert ids gives the
same output and gradients as the logical ids. Each function runs as `fn(rank, world_size, ...)`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from epcomm.allocator import BufferAllocator
from epcomm.buffer import EPBuffer
from epcomm.eplb import plan_redundant_experts
from epcomm.lb import LoadBalancingMixin

MiB = 1 << 20
SENTINEL = 0xA5

if issubclass(EPBuffer, LoadBalancingMixin):
    LBBuffer = EPBuffer
else:
    class LBBuffer(LoadBalancingMixin, EPBuffer):
        """EPBuffer with the LB mixin and plan support, until buffer.py inherits the mixin itself."""

        def __init__(self, *args, lb_allocation_plan_or_num_bytes=0, **kwargs):
            super().__init__(*args, **kwargs)
            self._init_lb_region(lb_allocation_plan_or_num_bytes)


def make_buffer(device: str = "cpu", plan=0, **kwargs) -> EPBuffer:
    kwargs.setdefault("num_bytes", 2 * MiB)
    kwargs.setdefault("num_cpu_timeout_secs", 30)
    return LBBuffer(None, lb_allocation_plan_or_num_bytes=plan, **kwargs)


def make_mapping(pattern: str, num_ranks: int, num_local: int, num_slots: int, empty_ratio: float = 0.25,
                 seed: int = 0) -> torch.Tensor:
    """[R, C] int32, identical on every rank (a function of the arguments): no rank hosts its own experts."""
    gen = torch.Generator().manual_seed(seed)
    mapping = torch.full((num_ranks, num_slots), -1, dtype=torch.int32)
    for r in range(num_ranks):
        others = [e for e in range(num_ranks * num_local) if e // num_local != r]
        if pattern == "random":
            picks = [others[i] for i in torch.randperm(len(others), generator=gen)[:num_slots].tolist()]
        elif pattern == "ring":  # the experts of the next ranks, in order
            picks = sorted(others, key=lambda e: ((e // num_local - r) % num_ranks, e))[:num_slots]
        elif pattern == "spread":  # every rank hosts the lowest ids it may: many contributors per expert
            picks = others[:num_slots]
        elif pattern == "repeat":  # each expert in two adjacent slots: several contributions from one rank
            picks = [others[(c // 2) % len(others)] for c in range(num_slots)]
        else:
            raise ValueError(pattern)
        mapping[r, :len(picks)] = torch.tensor(picks, dtype=torch.int32)
    empty = torch.rand(num_ranks, num_slots, generator=gen) < empty_ratio
    return mapping.masked_fill(empty, -1)


def ramp(expert: int, payload: int, nbytes: int) -> torch.Tensor:
    """The bytes of (global expert, payload): a ramp that differs for every pair and offset."""
    i = torch.arange(nbytes, dtype=torch.int64)
    return ((i * 7 + expert * 31 + payload * 101 + 1) % 251).to(torch.uint8)


def _as(t_bytes: torch.Tensor, dtype, shape) -> torch.Tensor:
    return t_bytes.view(dtype).view(shape)


def check_prefetch(rank: int, world: int, *, pattern: str, payload_bytes: tuple, num_local: int = 3,
                   num_slots: int = 4, shaped: bool = False, use_event: bool = False, device: str = "cpu",
                   seed: int = 0) -> int:
    """Push byte ramps into sentinel-filled slots of an LB region; check every slot; then a weights-only call
    leaves the other payloads untouched. Returns the number of filled slots on this rank."""
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    mapping = make_mapping(pattern, world, num_local, num_slots, seed=seed)
    dtypes = [torch.float8_e4m3fn, torch.float32, torch.int32, torch.bfloat16, torch.uint8]
    plan = BufferAllocator()
    reds, origs = [], []
    for k, nbytes in enumerate(payload_bytes):
        dtype = dtypes[k % len(dtypes)] if nbytes % dtypes[k % len(dtypes)].itemsize == 0 else torch.uint8
        n = nbytes // dtype.itemsize
        shape = (num_slots, 2, n // 2) if shaped and n % 2 == 0 else (num_slots, n)
        reds.append(plan.allocate(shape, dtype))
        expert_bytes = torch.stack([ramp(rank * num_local + i, k, nbytes) for i in range(num_local)])
        orig_shape = (num_local, n) if shaped else (num_local,) + shape[1:]
        origs.append(_as(expert_bytes.to(dev), dtype, orig_shape))
    buf = make_buffer(device, plan)
    assert reds[0].device == dev and (plan.num_bytes == 0 or reds[0].data_ptr() == buf.lb_storage.data_ptr())
    for t in reds:
        t.view(torch.uint8).fill_(SENTINEL)
    event = buf.capture() if use_event else None
    buf.lb_prefetch_weights(reds if len(reds) > 1 else reds[0], origs if len(origs) > 1 else origs[0],
                            mapping.to(dev), previous_event=event).current_stream_wait()
    row = mapping[rank].tolist()
    for k, (t, nbytes) in enumerate(zip(reds, payload_bytes)):
        got = t.reshape(num_slots, -1).view(torch.uint8).cpu() if t.numel() else torch.empty(num_slots, 0)
        for c, e in enumerate(row):
            want = ramp(e, k, nbytes) if e >= 0 else torch.full((nbytes,), SENTINEL, dtype=torch.uint8)
            assert torch.equal(got[c], want), f"rank {rank} payload {k} slot {c} (expert {e}) differs"
    if len(reds) > 1:  # omitted payloads stay untouched
        for t in reds:
            t.view(torch.uint8).fill_(SENTINEL)
        buf.lb_prefetch_weights([reds[0]], [origs[0]], mapping).current_stream_wait()
        for k, t in enumerate(reds[1:], start=1):
            assert bool((t.view(torch.uint8) == SENTINEL).all()), f"rank {rank}: omitted payload {k} was written"
    buf.destroy()
    return sum(e >= 0 for e in row)


def _grad_value(rank: int, slot: int, hidden: int, dtype, random: bool) -> torch.Tensor:
    if random:
        g = torch.Generator().manual_seed(1000 * rank + slot)
        return torch.randn(hidden, generator=g, dtype=torch.float64).to(dtype)
    return ((torch.arange(hidden) * 3 + rank * 17 + slot * 5) % 13 - 6).to(dtype)


def check_reduce(rank: int, world: int, *, pattern: str, hidden: int, num_local: int = 3, num_slots: int = 4,
                 dtype: torch.dtype = torch.float32, random: bool = False, num_payloads: int = 1,
                 empty_ratio: float = 0.25, device: str = "cpu", seed: int = 0) -> None:
    """Seed + replicas' gradients in ascending (rank, slot), bitwise; the redundant pool is unchanged."""
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    mapping = make_mapping(pattern, world, num_local, num_slots, empty_ratio, seed=seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    reds, grads, expected = [], [], []
    for k in range(num_payloads):
        h = hidden + k
        red = torch.stack([_grad_value(rank, c + 100 * k, h, dtype, random) for c in range(num_slots)])
        seed_g = torch.stack([_grad_value(rank, 50 + i + 100 * k, h, dtype, random) for i in range(num_local)])
        want = seed_g.to(acc, copy=True)  # a copy: the seed tensor itself goes to the call
        for r, row in enumerate(mapping.tolist()):  # ascending (rank, slot): the contract
            for c, e in enumerate(row):
                if e >= 0 and e // num_local == rank:
                    want[e % num_local] += _grad_value(r, c + 100 * k, h, dtype, random).to(acc)
        reds.append(red.view(num_slots, 1, h).to(dev) if k == 1 else red.to(dev))
        grads.append(seed_g.to(dev))
        expected.append(want.to(dtype))
    before = [t.clone() for t in reds]
    buf = make_buffer(device)
    buf.lb_reduce_grads(reds if num_payloads > 1 else reds[0], grads if num_payloads > 1 else grads[0], mapping,
                        num_sms=0).current_stream_wait()
    for k in range(num_payloads):
        assert torch.equal(reds[k], before[k]), f"rank {rank}: redundant_expert_grads[{k}] was modified"
        got = grads[k].cpu()
        if not torch.equal(got, expected[k]):
            bad = (got != expected[k]).nonzero()[0].tolist()
            raise AssertionError(f"rank {rank} payload {k}: expert_grads differ first at {bad}: "
                                 f"{got[tuple(bad)]} vs {expected[k][tuple(bad)]}")
    buf.destroy()


# ----------------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------------
L, C = 2, 2


def _good(rank: int):
    mapping = make_mapping("ring", 2, L, C, empty_ratio=0.0)
    return torch.zeros(C, 8), torch.ones(L, 8), mapping


def error_scenarios() -> dict:
    """name -> fn(buf, rank) making one LB call; rank 1's arguments are wrong unless the name says otherwise."""
    def bad(rank, good, wrong):
        return wrong if rank == 1 else good

    def pre(f):
        def run(buf, rank):
            red, orig, mapping = _good(rank)
            args = f(rank, dict(redundant_expert_weights=red, expert_weights=orig, redundancy_mapping=mapping))
            return buf.lb_prefetch_weights(**args)
        return run

    def red(f):
        def run(buf, rank):
            r, o, mapping = _good(rank)
            args = f(rank, dict(redundant_expert_grads=r, expert_grads=o, redundancy_mapping=mapping))
            return buf.lb_reduce_grads(**args)
        return run

    def set_(key, value):
        return lambda rank, a: {**a, key: bad(rank, a[key], value)}

    self_host = torch.tensor([[2, 3], [0, 3]], dtype=torch.int32)  # rank 1 holds expert 3 (its own)
    # 2 x 40 slots (80 values: more than one row of the exchange that brings the mappings for the message).
    long_map = torch.tensor([[2 + c % 2 for c in range(40)], [c % 2 for c in range(40)]], dtype=torch.int32)
    long_odd = long_map.clone()
    long_odd[1, 37] = -1
    return {
        "payload_type": pre(set_("redundant_expert_weights", "weights")),
        "payload_none": pre(set_("expert_weights", [torch.ones(L, 8), None])),
        "too_many_payloads": pre(lambda rank, a: {**a, "redundant_expert_weights": bad(rank, a[
            "redundant_expert_weights"], [torch.zeros(C, 8)] * 17), "expert_weights": bad(rank, a["expert_weights"],
                                                                                          [torch.ones(L, 8)] * 17)}),
        "length_mismatch": pre(set_("expert_weights", [torch.ones(L, 8), torch.ones(L, 8)])),
        "slot_rows": pre(set_("redundant_expert_weights", torch.zeros(C + 1, 8))),
        "bytes_per_expert": pre(set_("expert_weights", torch.ones(L, 4))),
        "zero_local": pre(set_("expert_weights", torch.ones(0, 8))),
        "non_contiguous": pre(set_("expert_weights", torch.ones(8, L).t())),
        "meta_device": pre(set_("redundant_expert_weights", torch.zeros(C, 8, device="meta"))),
        "mapping_dtype": pre(set_("redundancy_mapping", torch.zeros(2, C))),
        "mapping_shape": pre(set_("redundancy_mapping", torch.zeros(3, C, dtype=torch.int32))),
        "mapping_range": pre(set_("redundancy_mapping", torch.tensor([[2, 4], [0, 1]], dtype=torch.int32))),
        "self_host": pre(set_("redundancy_mapping", self_host)),
        "num_sms_type": pre(lambda rank, a: {**a, "num_sms": bad(rank, 0, 1.5)}),
        "event_type": pre(lambda rank, a: {**a, "previous_event": bad(rank, None, "event")}),
        "grad_dtype": red(lambda rank, a: {**a, "redundant_expert_grads": bad(rank, a["redundant_expert_grads"],
                                                                             torch.zeros(C, 8, dtype=torch.int32)),
                                           "expert_grads": bad(rank, a["expert_grads"],
                                                               torch.zeros(L, 8, dtype=torch.int32))}),
        "grad_pair_dtype": red(set_("expert_grads", torch.ones(L, 8, dtype=torch.float64))),
        "grad_elements": red(set_("expert_grads", torch.ones(L, 4))),
        "disagree_mapping": pre(set_("redundancy_mapping", torch.tensor([[2, -1], [0, 1]], dtype=torch.int32))),
        "disagree_op": lambda buf, rank: (pre(lambda r, a: a) if rank == 0 else red(lambda r, a: a))(buf, rank),
        "disagree_bytes": pre(lambda rank, a: {**a, "redundant_expert_weights": bad(rank, a[
            "redundant_expert_weights"], torch.zeros(C, 4)), "expert_weights": bad(rank, a["expert_weights"],
                                                                                   torch.ones(L, 4))}),
        "disagree_bytes_payloads": pre(lambda rank, a: {
            **a, "redundant_expert_weights": [a["redundant_expert_weights"], torch.zeros(C, 3 + rank)],
            "expert_weights": [a["expert_weights"], torch.ones(L, 3 + rank)]}),
        "disagree_grad_dtype": red(lambda rank, a: {**a, "redundant_expert_grads": bad(rank, a[
            "redundant_expert_grads"], torch.zeros(C, 8, dtype=torch.float64)), "expert_grads": bad(
            rank, a["expert_grads"], torch.ones(L, 8, dtype=torch.float64))}),
        "disagree_long_mapping": pre(lambda rank, a: {**a, "redundant_expert_weights": torch.zeros(40, 8),
                                                      "redundancy_mapping": bad(rank, long_map, long_odd)}),
    }


def run_error_scenarios(rank: int, world: int) -> dict:
    """Every scenario on one buffer; name -> (exception class name, message) or None. Then a good call works."""
    buf = make_buffer()
    results = {}
    for name, fn in error_scenarios().items():
        try:
            fn(buf, rank)
            results[name] = None
        except (TypeError, ValueError) as e:
            results[name] = (type(e).__name__, str(e))
    red, orig, mapping = _good(rank)
    buf.lb_prefetch_weights(red, orig, mapping).current_stream_wait()
    assert bool((red == 1).all()), "the buffer must stay usable after rejected calls"
    buf.destroy()
    return results


def lb_missing_peer(rank: int, world: int, timeout_s: float):
    """Rank 1 never calls: rank 0 raises TimeoutError naming it within the bound."""
    buf = make_buffer(num_cpu_timeout_secs=timeout_s)
    red, orig, mapping = _good(rank)
    if rank == 1:
        return "skipped"
    start = time.monotonic()
    try:
        buf.lb_reduce_grads(red, orig, mapping)
    except TimeoutError as e:
        return str(e), time.monotonic() - start
    return None


def constructor_errors(rank: int, world: int) -> list:
    out = []
    used = BufferAllocator()
    used.allocate(4, torch.float32)
    used.materialize(torch.empty(used.num_bytes, dtype=torch.uint8))
    for arg in ("plan", 3 * MiB, used):
        try:
            make_buffer(plan=arg)
            out.append(None)
        except (TypeError, ValueError) as e:
            out.append((type(e).__name__, str(e)))
    buf = make_buffer(plan=4 * MiB)
    out.append((buf.num_lb_bytes, tuple(buf.lb_storage.shape), buf.lb_allocation_plan))
    buf.destroy()
    return out


# ----------------------------------------------------------------------------------------------------------
# end to end: physical ids through dispatch/combine
# ----------------------------------------------------------------------------------------------------------
def check_physical_equivalence(rank: int, world: int, *, num_tokens: int = 24, hidden: int = 16,
                               num_local: int = 3, num_slots: int = 2, num_topk: int = 3, do_expand: bool = True,
                               device: str = "cpu", seed: int = 0) -> dict:
    """Linear experts `y = w * (x * W_e)` in fp32 on small integers: combine through physical ids (weights
    prefetched into the slots) equals combine through logical ids bitwise, and the weight gradients summed back
    with lb_reduce_grads equal the logical ones. Returns per-rank loads before and after (selections)."""
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    num_experts = world * num_local
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randint(-3, 4, (num_tokens, hidden), generator=gen).float()
    hot = torch.zeros(num_experts)
    hot[0] = 8.0  # expert 0 is hot: every token picks it with high probability
    scores = torch.rand(num_tokens, num_experts, generator=gen) + hot * (torch.rand(num_tokens, 1, generator=gen) < 0.8)
    topk_idx = scores.topk(num_topk, dim=1).indices
    topk_idx[torch.rand(num_tokens, num_topk, generator=gen) < 0.1] = -1
    w = torch.randint(1, 4, (num_tokens, num_topk), generator=gen).float()
    dy = torch.randint(-2, 3, (num_tokens, hidden), generator=gen).float()
    counts = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).float().to(dev)
    dist.all_reduce(counts)  # on the device: NCCL reduces CUDA tensors only
    counts = counts.cpu()
    plan = plan_redundant_experts(counts[None], world, num_slots)
    weights = torch.stack([(torch.arange(hidden) % 3 + 1 + (rank * num_local + i) % 2).float()
                           for i in range(num_local)])  # W_e: [L, H] small integers
    alloc = BufferAllocator()
    red_w = alloc.allocate((num_slots, hidden), torch.float32)
    red_g = alloc.allocate((num_slots, hidden), torch.float32)
    buf = make_buffer(device, alloc, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_bytes=None,
                      dtype=torch.float32)
    mapping = plan.redundancy_mapping[0]
    buf.lb_prefetch_weights(red_w, weights.to(dev), mapping).current_stream_wait()
    phys_idx = plan.map_topk_idx(topk_idx, rank=rank)
    out = {}
    for name, idx, n_exp in (("logical", topk_idx, num_experts), ("physical", phys_idx, plan.num_physical_experts)):
        per_rank = n_exp // world
        table = torch.cat([weights, red_w.cpu()]) if name == "physical" else weights  # [per_rank, H]
        grads = torch.zeros(per_rank, hidden)
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x.to(dev), idx.to(dev), w.to(dev), num_experts=n_exp,
                                                           do_expand=do_expand)
        recv_x, recv_w = recv_x.cpu(), recv_w.cpu()
        if do_expand:
            seg = handle.num_recv_tokens_per_expert_list
            local = torch.repeat_interleave(torch.arange(per_rank), torch.tensor(seg, dtype=torch.int64))
            y = recv_w[:, None] * recv_x * table[local]
        else:
            y = torch.zeros_like(recv_x)
            for j in range(recv_idx.shape[1]):
                col = recv_idx[:, j].cpu()
                ok = col >= 0
                y[ok] += recv_w[ok, j, None] * recv_x[ok] * table[col[ok]]
        combined, _, _ = buf.combine(y.to(dev), handle)
        # d/dW_e of <dy, combine(y)>: the rows of expert e carry w * x * dy[token]; dispatch dy the same way.
        recv_dy = buf.dispatch(dy.to(dev), handle=handle)[0].cpu()
        if do_expand:
            grads.index_add_(0, local, recv_w[:, None] * recv_x * recv_dy)
        else:
            for j in range(recv_idx.shape[1]):
                col = recv_idx[:, j].cpu()
                ok = col >= 0
                grads.index_add_(0, col[ok], recv_w[ok, j, None] * recv_x[ok] * recv_dy[ok])
        if name == "physical":
            red_g.copy_(grads[num_local:])
            own = grads[:num_local].to(dev)
            buf.lb_reduce_grads(red_g, own, mapping).current_stream_wait()
            grads = own.cpu()
        loads = torch.bincount(idx[idx >= 0] // per_rank, minlength=world).float().to(dev)
        dist.all_reduce(loads)
        out[name] = (combined.cpu(), grads, loads.cpu().tolist())
    buf.destroy()
    assert torch.equal(out["logical"][0], out["physical"][0]), f"rank {rank}: combined outputs differ"
    assert torch.equal(out["logical"][1], out["physical"][1]), f"rank {rank}: summed weight gradients differ"
    return dict(before=out["logical"][2], after=out["physical"][2], planned=plan.rank_load[0].tolist())
