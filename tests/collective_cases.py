"""Rank-side bodies of the bucket / PP / Engram / barrier tests (importable by the worker processes).

Each function runs on every rank as `fn(rank, world_size, ...)`, compares epcomm with plain `torch.distributed`
or with a table every rank can rebuild from the seed, and returns a small summary or raises. Reference §14.4,
§15, §16, §17 test shapes, scaled down for CPU.
"""

from __future__ import annotations

import math
import os
import random
import time

import torch
import torch.distributed as dist

from epcomm import comm
from epcomm.bucket import BucketBuffer
from epcomm.engram import EngramBuffer
from epcomm.fp8 import per_token_cast_to_fp8
from epcomm.pp import PPBuffer

MIB = 1 << 20
GUARD = 0xA5


def outcome(fn, *args, **kwargs) -> tuple:
    """(exception class name, message) of `fn(*args, **kwargs)`, or None when it returned."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- the caller pins the class and message
        return type(e).__name__, str(e)
    return None


# ---------------------------------------------------------------------------------------------------------
# buckets
# ---------------------------------------------------------------------------------------------------------
def small_ints(gen, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Values in [-8, 8): sums and power-of-two scales are exact in fp32, so comparisons can be bitwise."""
    return torch.randint(-8, 8, (n,), generator=gen).to(dtype)


def carve(buf: BucketBuffer, rng: random.Random, sizes: list, align: int = 64) -> list:
    """Byte ranges `(start, nbytes)` for `sizes`, each after a random guard gap; the storage is filled with GUARD."""
    buf.storage.fill_(GUARD)
    out, pos = [], 0
    for n in sizes:
        pos += rng.randrange(1, 4) * align
        out.append((pos, n))
        pos = (pos + n + align - 1) // align * align
    assert pos + align <= buf.num_bytes, f"buckets need {pos} bytes"
    return out


def check_guards(buf: BucketBuffer, used: list) -> None:
    mask = torch.ones(buf.num_bytes, dtype=torch.bool)
    for start, n in used:
        mask[start:start + n] = False
    bad = (buf.storage.cpu()[mask] != GUARD).nonzero()
    assert len(bad) == 0, f"{len(bad)} guard bytes changed, first at {int(mask.nonzero()[bad[0]])}"


def bucket_all_gather(rank: int, world: int, seed: int, with_dsts: bool, dtype_name: str = "fp32",
                      device: str = "cpu"):
    """20 random-size buckets gathered two per call, in place or into dsts; pointer rule, bitwise, guards."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int32": torch.int32, "uint8": torch.uint8}[dtype_name]
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed * 31 + rank)
    buf = BucketBuffer(None, 4 * MIB, explicitly_destroy=True, num_cpu_timeout_secs=60)
    shards = [rng.randint(1, 1 << 10) * 8 for _ in range(20)]
    ranges = carve(buf, rng, [world * n * dtype.itemsize for n in shards])
    for pair in range(0, 20, 2):
        srcs, dsts, expected, starts = [], [], [], []
        for (start, nbytes), n in zip(ranges[pair:pair + 2], shards[pair:pair + 2]):
            region = buf.storage[start:start + nbytes].view(dtype)
            shard = small_ints(gen, n, dtype).to(device)
            expected.append(torch.empty(world * n, dtype=dtype, device=device))
            dist.all_gather_into_tensor(expected[-1], shard)
            if with_dsts:
                srcs.append(shard if pair % 4 else region[rank * n:(rank + 1) * n].copy_(shard))
                dsts.append(region)
            else:
                srcs.append(region[rank * n:(rank + 1) * n].copy_(shard))
            starts.append(buf.storage.data_ptr() + start)
        event = buf.all_gather(srcs, dsts if with_dsts else None)
        assert event.num_sms == 0
        results = event.wait()
        assert event.wait() is None, "a second wait returns None"
        for got, want, ptr in zip(results, expected, starts):
            assert got.data_ptr() == ptr, "the result starts at the gathered tensor"
            assert got.dtype == dtype and torch.equal(got.view(-1), want), "all_gather differs from torch"
    check_guards(buf, ranges)
    buf.destroy()
    return len(ranges)


def bucket_reduce(rank: int, world: int, seed: int, op: str, scale: float, exact: bool, device: str = "cpu"):
    """Buckets of R*4096 and R*(3*1024+8) fp32 elements: pointer rule, values vs torch, guards."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed * 17 + rank)
    buf = BucketBuffer(None, 2 * MIB, explicitly_destroy=True, num_cpu_timeout_secs=60)
    sizes = [world * 4096, world * (3 * 1024 + 8)]
    ranges = carve(buf, rng, [n * 4 for n in sizes])
    srcs, expected = [], []
    for (start, nbytes), n in zip(ranges, sizes):
        data = (small_ints(gen, n, torch.float32) if exact else torch.randn(n, generator=gen)).to(device)
        srcs.append(buf.storage[start:start + nbytes].view(torch.float32).view(world, -1).copy_(data.view(world, -1)))
        want = data.clone()
        if op == "reduce_scatter":
            out = torch.empty(n // world, device=device)
            dist.reduce_scatter_tensor(out, want)
            want = out
        else:
            dist.all_reduce(want)
        expected.append(want * scale)
    event = getattr(buf, op)(srcs, scale=scale)
    assert event.num_sms == buf.get_theoretical_num_sms(op), "num_sms=None gives the model's value"
    for got, want, src in zip(event.wait(), expected, srcs):
        if op == "reduce_scatter":
            assert got.data_ptr() == src.data_ptr() + rank * got.nbytes, "the shard is in place in src"
        else:
            assert got is src
        assert torch.equal(got.reshape(-1), want) if exact else torch.allclose(got.reshape(-1), want, 1e-5, 1e-5)
    check_guards(buf, ranges)
    buf.destroy()
    return True


def bucket_session(rank: int, world: int, seed: int, device: str = "cpu"):
    """Sessions: external sources and destinations for all three ops, in-place tensors from allocate, errors."""
    gen = torch.Generator().manual_seed(seed + rank)
    buf = BucketBuffer(None, 2 * MIB, explicitly_destroy=True, num_cpu_timeout_secs=60)
    x = small_ints(gen, 96, torch.bfloat16).to(device)
    y = small_ints(gen, world * 40, torch.float32).view(world, 40).to(device)
    gathered = torch.empty(world * 96, dtype=torch.bfloat16, device=device)
    dist.all_gather_into_tensor(gathered, x)
    summed = y.clone()
    dist.all_reduce(summed)
    with buf.session() as s:
        assert buf.all_gather.__self__ is s, "the session shadows the buffer's collectives"
        got = buf.all_gather(x).wait()  # staged; the staging view comes back
        assert torch.equal(got, gathered) and buf.offset_of(got) is not None
        dst = torch.empty(world * 96, dtype=torch.bfloat16, device=device)
        assert buf.all_gather([x], [dst]).wait()[0] is dst and torch.equal(dst, gathered)
        in_storage_dst = s.allocate(world * 96, torch.bfloat16)
        assert buf.all_gather(x.view(8, 12), in_storage_dst).wait() is in_storage_dst
        assert torch.equal(in_storage_dst, gathered)
        shard = torch.empty(40, device=device)
        assert s.reduce_scatter(y, dsts=shard, scale=0.5).wait() is shard
        assert torch.equal(shard, summed[rank] * 0.5)
        out = s.all_reduce(y.t(), scale=2.0).wait()  # a non-contiguous external source is staged too
        assert torch.equal(out, (summed * 2.0).t())
        back = y.clone()  # collectives.md: `dsts=src` writes the result back into an outside src
        assert s.all_reduce(back, dsts=back, scale=0.5).wait() is back and torch.equal(back, summed * 0.5)
        a, b = s.allocate([(world, 8), (world * 16,)])
        a.copy_(y[:, :8])
        b.copy_(y.reshape(-1)[:world * 16])
        ra, rb = s.all_reduce([a, b]).wait()
        assert ra is a and rb is b and torch.equal(a, summed[:, :8])
        errors = {
            "nested": outcome(lambda: buf.session().__enter__()),
            "out_of_storage": outcome(s.allocate, (MIB,)),
            "dst_dtype": outcome(s.all_gather, x, torch.empty(world * 96, device=device)),
        }
    assert "all_gather" not in buf.__dict__, "exit restores the buffer's methods"
    errors["outside"] = outcome(buf.all_gather, x)
    errors["closed"] = outcome(s.allocate, 4)
    buf.destroy()
    return errors


def bucket_mixed(rank: int, world: int, seed: int, rounds: int = 12, device: str = "cpu"):
    """Randomised schedule over two groups, ops, dtypes and scales; sessions every 3rd round; guards intact."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed * 7 + rank)
    dup = dist.new_group(list(range(world)))
    buf = BucketBuffer([dist.group.WORLD, dup], 2 * MIB, explicitly_destroy=bool(seed % 2), num_cpu_timeout_secs=60)
    assert buf.get_context_idx(dup) == 1 and len(buf.contexts) == 2
    for r in range(rounds):
        group = rng.choice(buf.groups)
        op = rng.choice(["all_reduce", "reduce_scatter", "all_gather", "rs_ag"])
        n = world * 8 * rng.randint(1, 64)
        scale = rng.choice([1.0, 0.0, 0.25, -0.5, 2.0])
        if r % 3 == 2:
            with buf.session() as s:
                data = small_ints(gen, n, torch.float32).to(device)
                want = data.clone()
                dist.all_reduce(want, group=group)
                assert torch.equal(s.all_reduce(data, scale=scale, group=group).wait(), want * scale)
            continue
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int32, torch.uint8]) if op == "all_gather" \
            else torch.float32
        ranges = carve(buf, rng, [n * dtype.itemsize])
        region = buf.storage[ranges[0][0]:ranges[0][0] + n * dtype.itemsize].view(dtype)
        data = small_ints(gen, n, dtype) if dtype != torch.uint8 else torch.randint(0, 255, (n,), generator=gen,
                                                                                  dtype=torch.uint8)
        data = data.to(device)
        region.copy_(data)
        if op == "all_gather":
            m = n // world
            want = torch.empty(n, dtype=dtype, device=device)
            dist.all_gather_into_tensor(want, data[rank * m:(rank + 1) * m].clone(), group=group)
            got = buf.all_gather(region[rank * m:(rank + 1) * m], group=group).wait()
        elif op == "all_reduce":
            want = data.clone()
            dist.all_reduce(want, group=group)
            want, got = want * scale, buf.all_reduce(region, scale, group).wait()
        else:
            want = torch.empty(n // world, device=device)
            dist.reduce_scatter_tensor(want, data.clone(), group=group)
            want, got = want * scale, buf.reduce_scatter(region, scale=scale, group=group).wait()
            if op == "rs_ag":
                full = torch.empty(n, device=device)
                dist.all_gather_into_tensor(full, want, group=group)
                want, got = full, buf.all_gather(got, group=group).wait()
        assert torch.equal(got.reshape(-1), want), f"round {r}: {op} differs from torch"
        check_guards(buf, ranges)
        buf.barrier(group=group)
    comm.barrier(buf, context_idx=1)
    if buf.explicitly_destroy:
        buf.destroy()
    return True


# ---------------------------------------------------------------------------------------------------------
# pipeline send/recv
# ---------------------------------------------------------------------------------------------------------
def _message(seed: int, s: int, d: int, k: int, max_bytes: int) -> torch.Tensor:
    """The k-th message s -> d as int32 words (every rank can rebuild it)."""
    gen = torch.Generator().manual_seed(hash((seed, s, d, k)) & 0xFFFFFFFF)
    n = int(torch.randint(1, max_bytes // 4 + 1, (1,), generator=gen))
    return torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int32)


def pp_schedule(seed: int, world: int, inflight: int, steps: int) -> list:
    """A global script of (action, src, dst) that keeps every FIFO within `inflight` and ends drained."""
    rng = random.Random(seed)
    pairs = sorted({(s, (s + o) % world) for s in range(world) for o in (1, -1)})
    pending = {p: 0 for p in pairs}
    script = []
    for _ in range(steps):
        p = rng.choice(pairs)
        if pending[p] < inflight and (pending[p] == 0 or rng.random() < 0.5):
            script.append(("send", *p))
            pending[p] += 1
        elif pending[p]:
            script.append(("recv", *p))
            pending[p] -= 1
    script += [("recv", *p) for p, n in pending.items() for _ in range(n)]
    return script


def pp_random_schedule(rank: int, world: int, seed: int, inflight: int, steps: int = 120, max_bytes: int = 4096,
                       device: str = "cpu"):
    """Every rank runs its part of one script; every recv equals its send bitwise (FIFO per directed pair)."""
    pp = PPBuffer(None, max_bytes, inflight, explicitly_destroy=True, num_cpu_timeout_secs=30)
    counts: dict = {}
    for action, s, d in pp_schedule(seed, world, inflight, steps):
        k = counts.get((action, s, d), 0)
        counts[(action, s, d)] = k + 1
        if action == "send" and s == rank:
            x = _message(seed, s, d, k, max_bytes).to(device)
            pp.send(x.view(torch.float32) if k % 2 else x, d)
            x.fill_(-1)  # the sender may reuse x at once
        elif action == "recv" and d == rank:
            want = _message(seed, s, d, k, max_bytes).to(device)
            y = torch.empty(want.nbytes, dtype=torch.uint8, device=device) if k % 3 == 0 else torch.empty_like(want)
            got = pp.recv(y, s)
            assert got is y and torch.equal(y.view(torch.int32), want), f"recv #{k} {s}->{d} differs"
    pp.destroy()
    return sum(n for (a, s, _), n in counts.items() if a == "send" and s == rank)


def pp_subgroup(rank: int, world: int, members=(1, 2)):
    """A PPBuffer on a group that is not the default one (its channels are made by the members only)."""
    sub = dist.new_group(list(members))
    if rank not in members:
        return None
    pp = PPBuffer(sub, 256, 2, explicitly_destroy=True, num_cpu_timeout_secs=30)
    me, peer = sub.rank(), 1 - sub.rank()
    for k in range(5):
        pp.send(torch.full((8,), float(10 * me + k)), peer)
        got = pp.recv(torch.empty(8), peer)
        assert torch.equal(got, torch.full((8,), float(10 * peer + k))), got
    pp.destroy()
    return me


def pp_seeded_groups(rank: int, world: int):
    """Two pipeline groups ([0, 1] and [2, 3]) on ranks that seed Python's `random` alike: each group's channels are
    its own (their store keys once came from that seeded draw, and one group received the other's tensors)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    random.seed(1234)
    pp = PPBuffer(groups[rank // 2], 256, 2, explicitly_destroy=True, num_cpu_timeout_secs=30)
    got = []
    for k in range(3):
        if pp.rank == 0:
            pp.send(torch.full((4,), float(100 * rank + k)), 1)
        else:
            got.append(pp.recv(torch.empty(4), 0)[0].item())
    uids = [None] * world
    dist.all_gather_object(uids, pp.context.uid)
    pp.destroy()
    return got, uids


def pp_errors(rank: int, world: int):
    pp = PPBuffer(None, 64, 2, explicitly_destroy=True, num_cpu_timeout_secs=30)
    peer = (rank + 1) % world
    out = {
        "not_neighbour": outcome(pp.send, torch.ones(4), rank),
        "too_large": outcome(pp.send, torch.ones(17), peer),
        "empty": outcome(pp.recv, torch.ones(0), peer),
        "non_contiguous": outcome(pp.send, torch.ones(4, 2).t(), peer),
        "not_tensor": outcome(pp.send, [1.0], peer),
        "conjugate_view": outcome(pp.send, torch.ones(4, dtype=torch.complex64).conj(), peer),
        "bad_sizes": outcome(PPBuffer, None, 0, 2),
        "float_peer": outcome(pp.send, torch.ones(4), float(peer)),
        "timeout_zero": outcome(PPBuffer, None, 64, 2, num_cpu_timeout_secs=0),
        "timeout_type": outcome(PPBuffer, None, 64, 2, num_gpu_timeout_secs="5"),
    }
    pp.send(torch.arange(8, dtype=torch.int32), peer)
    out["size_mismatch"] = outcome(pp.recv, torch.empty(4, dtype=torch.int32), (rank - 1) % world)
    pp.send(torch.full((3,), 7.0), peer)
    out["requires_grad"] = outcome(pp.recv, torch.zeros(3, requires_grad=True), (rank - 1) % world)  # consumes none
    out["after_mismatch"] = pp.recv(torch.empty(3), (rank - 1) % world).tolist()
    pp.send(torch.full((2,), 5.0), peer)
    leaf = torch.zeros(2, requires_grad=True)
    with torch.no_grad():  # as an optimizer's in-place update
        pp.recv(leaf, (rank - 1) % world)
    out["no_grad_leaf"] = leaf.tolist()
    pp.destroy()
    out["destroyed"] = outcome(pp.send, torch.ones(4), peer)
    return out


# ---------------------------------------------------------------------------------------------------------
# Engram
# ---------------------------------------------------------------------------------------------------------
def engram_table(seed: int, world: int, entries: list, hidden: int, fp8: bool):
    """Global tables (and, for FP8, the replicated int32 scale tables) every rank can rebuild."""
    gen = torch.Generator().manual_seed(seed)
    tables, sfs = [], []
    for n in entries:
        x = torch.randn(world * n, hidden, generator=gen)
        if fp8:
            data, scales = per_token_cast_to_fp8(x, use_ue8m0=True)
            tables.append(data)
            sfs.append(scales)
        else:
            tables.append(x.bfloat16())
    return tables, (sfs if fp8 else None)


def engram_indices(gen, world: int, rank: int, entries: list, tokens: int, per_token: int, kind: str):
    """[L, T, E] int64 ids: "random" over every owner, "local" owned by this rank, "remote" by the others."""
    out = []
    for n in entries:
        if kind == "random" or world == 1:
            out.append(torch.randint(0, world * n, (tokens, per_token), generator=gen))
            continue
        owner = torch.full((tokens, per_token), rank) if kind == "local" else \
            (rank + 1 + torch.randint(0, world - 1, (tokens, per_token), generator=gen)) % world
        out.append(owner * n + torch.randint(0, n, (tokens, per_token), generator=gen))
    return torch.stack(out)


def engram_check(hooks, order: str, idx, tables, sfs, num_tokens: int, per_token: int, hidden: int, what: str):
    """Every layer's hook output equals the global table's rows bitwise; hooks called in `order`."""
    packs = 0 if sfs is None else sfs[0].shape[1]
    layers = range(len(tables)) if order == "forward" else reversed(range(len(tables)))
    for layer in layers:
        got, rows = hooks[layer](), idx[layer].reshape(-1)
        want = tables[layer][rows].view(num_tokens, per_token * hidden)
        if sfs is not None:
            data, scales = got
            assert torch.equal(data.view(torch.uint8), want.view(torch.uint8)), f"{what}: layer {layer} data differs"
            assert torch.equal(scales, sfs[layer][rows].view(num_tokens, per_token * packs)), \
                f"{what}: layer {layer} scales differ"
            if order == "reverse":  # fetched with use_tma_aligned_col_major_sf=True
                assert scales.stride() == (1, (num_tokens + 3) // 4 * 4), scales.stride()
        else:
            assert torch.equal(got, want), f"{what}: layer {layer} ({order}) differs"


def engram_fetch(rank: int, world: int, seed: int, fp8: bool, entries=(1000, 1021), hidden: int = 256,
                 tokens: int = 64, per_token: int = 24, device: str = "cpu", transport: str = "auto",
                 expect_transport: str = "", col_major_sf: bool = False):
    """Rows fetched equal global_table[indices] bitwise: hooks in forward and reverse order, random, all-local
    and all-remote rows, empty fetches, and a second write of a new table seen by the next fetch. `col_major_sf`:
    the scale tables written are laid out column-major (one pack a row: strides (1, rows), which torch calls
    contiguous but a byte view refuses)."""
    entries = list(entries)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    tables, sfs = engram_table(seed, world, entries, hidden, fp8)
    tables = [t.to(device) for t in tables]
    sfs = None if sfs is None else [t.to(device) for t in sfs]
    packs = sfs[0].shape[1] if fp8 else 0
    gpu, storage = EngramBuffer.get_storage_size_hint(None, entries, hidden, tokens, per_token, dtype, packs)
    qps, depth, _ = EngramBuffer.get_theoretical_config(None, len(entries), tokens, per_token)
    buf = EngramBuffer(None, gpu, storage, False, qps, depth, explicitly_destroy=True, num_cpu_timeout_secs=60,
                       transport=transport)
    want = expect_transport or (transport if transport != "auto" else "collective" if device == "cpu" else None)
    assert want is None or buf.transport == want, (buf.transport, want)
    buf.set_config(entries, hidden, tokens, per_token, dtype, packs)
    if col_major_sf:
        assert sfs[0].shape[1] == 1, sfs[0].shape
    written = None if sfs is None else [torch.empty_strided(s.shape, (1, s.shape[0]), dtype=s.dtype, device=device)
                                        .copy_(s) if col_major_sf else s.clone() for s in sfs]
    buf.write([t[rank * n:(rank + 1) * n] for t, n in zip(tables, entries)], written)
    gen = torch.Generator().manual_seed(seed * 13 + rank)
    rounds = (("forward", tokens - 3 * rank, "random"), ("reverse", 0 if rank == 1 else tokens, "random"),
              ("forward", tokens, "local"), ("reverse", tokens - rank, "remote"))
    for order, num_tokens, kind in rounds:
        idx = engram_indices(gen, world, rank, entries, num_tokens, per_token, kind).to(device)
        hooks = buf.fetch(idx.int(), use_tma_aligned_col_major_sf=order == "reverse")
        engram_check(hooks, order, idx, tables, sfs, num_tokens, per_token, hidden, f"{kind} {order}")
    # A second table: write waits for every peer's reads of the first, and the next fetch sees only the new rows.
    tables, sfs = engram_table(seed + 1, world, entries, hidden, fp8)
    tables = [t.to(device) for t in tables]
    sfs = None if sfs is None else [t.to(device) for t in sfs]
    buf.write([t[rank * n:(rank + 1) * n] for t, n in zip(tables, entries)], sfs)
    idx = engram_indices(gen, world, rank, entries, tokens, per_token, "random").to(device)
    engram_check(buf.fetch(idx), "forward", idx, tables, sfs, tokens, per_token, hidden, "after rewrite")
    buf.destroy()
    return True


def engram_errors(rank: int, world: int):
    entries, hidden = [16, 8], 64
    gpu, storage = EngramBuffer.get_storage_size_hint(None, entries, hidden, 4, 2)
    buf = EngramBuffer(None, gpu, storage, explicitly_destroy=True, num_cpu_timeout_secs=30)
    out = {"fetch_before_config": outcome(buf.fetch, torch.zeros(2, 1, 2, dtype=torch.int32))}
    out["capacity"] = outcome(buf.set_config, entries, hidden, 4 * 1024 * 1024, 2)
    out["disagree"] = outcome(buf.set_config, entries, hidden * (1 + rank), 4, 2)
    out["disagree_layers"] = outcome(buf.set_config, entries[::-1] if rank else entries, hidden, 4, 2)
    buf.set_config(entries, hidden, 4, 2)
    out["fetch_before_write"] = outcome(buf.fetch, torch.zeros(2, 1, 2, dtype=torch.int32))
    out["write_shape"] = outcome(buf.write, [torch.zeros(16, hidden + rank, dtype=torch.bfloat16),
                                             torch.zeros(8, hidden, dtype=torch.bfloat16)])
    buf.write([torch.zeros(n, hidden, dtype=torch.bfloat16) for n in entries])
    idx = torch.zeros(2, 3, 2, dtype=torch.int32)
    if rank == 1:
        idx[1, 2, 1] = world * 8
    out["out_of_range"] = outcome(buf.fetch, idx)
    out["float_indices"] = outcome(buf.fetch, torch.zeros(2, 3, 2))
    out["too_many_tokens"] = outcome(buf.fetch, torch.zeros(2, 5, 2, dtype=torch.int32))
    other = EngramBuffer(None, gpu, storage, explicitly_destroy=True, num_cpu_timeout_secs=30)
    other.set_config(entries, hidden, 4, 2)
    other.write([torch.ones(n, hidden, dtype=torch.bfloat16) for n in entries])
    out["other_buffer"] = outcome((buf if rank == 0 else other).fetch, torch.zeros(2, 3, 2, dtype=torch.int32))
    other.destroy()
    out["alias_both"] = outcome(EngramBuffer, None, gpu, storage, num_rdma_storage_size=storage)
    out["timeout_zero"] = outcome(EngramBuffer, None, gpu, storage, num_cpu_timeout_secs=0)
    out["timeout_type"] = outcome(EngramBuffer, None, gpu, storage, num_gpu_timeout_secs="5")
    buf.destroy()
    return out


def bad_groups(rank: int, world: int, kind: str):
    """A `group` that is no ProcessGroup: a string on every rank, then `dist.new_group([1])`'s value on rank 0
    (outside the new group; rank 1 constructs on its one-rank group). Returns {case: outcome} per rank."""
    def make(group):
        if kind == "pp":
            return PPBuffer(group, 64, 2, num_cpu_timeout_secs=30)
        return EngramBuffer(group, 2 * MIB, 2 * MIB, num_cpu_timeout_secs=30)

    out = {"string": outcome(make, "x")}
    sub = dist.new_group([1])
    if rank == 0:
        out["outside"] = outcome(make, sub)
    else:
        try:
            make(sub).destroy()
            out["outside"] = None
        except (TypeError, ValueError) as e:  # PP: a one-rank group is no ring
            out["outside"] = type(e).__name__, str(e)
    return out


def _engram_transport(**kw):
    """The transport a small buffer gets (the buffer is destroyed), or (exception class name, message)."""
    try:
        buf = EngramBuffer(None, 2 * MIB, 2 * MIB, explicitly_destroy=True, num_cpu_timeout_secs=30, **kw)
    except Exception as e:  # noqa: BLE001 -- the caller pins the class and message
        return type(e).__name__, str(e)
    transport = buf.transport
    buf.destroy()
    return transport


def engram_transports(rank: int, world: int):
    """Which transport each request gets; an unknown name on one rank and a disagreement raise on every rank."""
    out = {asked: _engram_transport(transport=asked) for asked in ("auto", "collective", "nvlink")}
    out["unknown"] = _engram_transport(transport="nvshmem" if rank == 1 else "auto")
    out["disagree"] = _engram_transport(transport="collective" if rank == 1 else "auto")
    return out


def engram_nvlink_local_errors(rank: int, world: int, device: str = "cuda"):
    """nvlink fetch is one-sided: a bad index raises on its rank only, and a rank may fetch alone."""
    entries, hidden = [16, 8], 64
    gpu, storage = EngramBuffer.get_storage_size_hint(None, entries, hidden, 4, 2)
    buf = EngramBuffer(None, gpu, storage, explicitly_destroy=True, num_cpu_timeout_secs=30, transport="nvlink")
    buf.set_config(entries, hidden, 4, 2)
    tables = [(torch.arange(world * n * hidden).view(world * n, hidden) % 251).bfloat16().to(device)
              for n in entries]
    buf.write([t[rank * n:(rank + 1) * n] for t, n in zip(tables, entries)])
    idx = torch.zeros(2, 3, 2, dtype=torch.int32, device=device)
    if rank == 1:
        idx[1, 2, 1] = world * 8
    out = {"out_of_range": outcome(buf.fetch, idx), "alone": None}
    if rank == 0:  # rank 1 makes no call meanwhile
        gen = torch.Generator().manual_seed(5)
        idx = torch.stack([torch.randint(0, world * n, (4, 2), generator=gen) for n in entries]).to(device)
        hooks = buf.fetch(idx)
        out["alone"] = all(torch.equal(hooks[layer](), tables[layer][idx[layer].reshape(-1)].view(4, 2 * hidden))
                           for layer in (1, 0))
    buf.destroy()
    return out


class FileRegion:
    """CPU stand-in for `SymmetricRegion` (tests only): each rank's region is a file in /dev/shm that every rank
    maps, so a peer view reads another process's memory, as the NVLink views do; the barrier is a gloo barrier."""

    def __init__(self, group, nbytes: int, device, timeout_s: float = 0.0):
        tag = [random.getrandbits(48) if group.rank() == 0 else None]
        dist.broadcast_object_list(tag, src=dist.get_global_rank(group, 0), group=group)
        paths = [f"/dev/shm/epcomm-test-{tag[0]:x}-{r}" for r in range(group.size())]
        self.group, self.nbytes = group, nbytes
        self.local = torch.from_file(paths[group.rank()], shared=True, size=nbytes, dtype=torch.uint8)
        dist.barrier(group=group)
        self._regions = [torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8) for path in paths]
        dist.barrier(group=group)
        os.unlink(paths[group.rank()])  # the mappings outlive the name

    def peer(self, rank: int, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        return self._regions[rank][offset:offset + nbytes].view(dtype).view(shape)

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        dist.barrier(group=self.group)


def engram_on_file_regions(rank: int, world: int, case: str, *args, **kwargs):
    """Run the Engram case named `case` with the nvlink path forced onto CPU ranks through `FileRegion`."""
    import epcomm.engram as engram
    import epcomm.engram_nvlink as engram_nvlink
    saved = engram.choose_transport, engram_nvlink.SymmetricRegion
    engram.choose_transport, engram_nvlink.SymmetricRegion = (lambda context, asked: "nvlink"), FileRegion
    try:
        return globals()[case](rank, world, *args, **kwargs)
    finally:  # the worker processes are reused by later tests
        engram.choose_transport, engram_nvlink.SymmetricRegion = saved


# ---------------------------------------------------------------------------------------------------------
# barrier and timeouts
# ---------------------------------------------------------------------------------------------------------
def barriers(rank: int, world: int, device: str = "cpu"):
    """comm.barrier / get_comm_stream on every buffer kind, every option."""
    import epcomm
    ep = epcomm.EPBuffer(None, num_max_tokens_per_rank=8, hidden=64, explicitly_destroy=True)
    dup = dist.new_group(list(range(world)))
    bucket = BucketBuffer([dist.group.WORLD, dup], 2 * MIB, explicitly_destroy=True)
    pp = PPBuffer(None, 64, 1, explicitly_destroy=True)
    engram = EngramBuffer(None, 2 * MIB, 2 * MIB, explicitly_destroy=True)
    for buf in (ep, bucket, pp, engram):
        assert (comm.get_comm_stream(buf) is None) == (device == "cpu")
        for wait, sync, seq in ((True, False, True), (False, True, False), (True, True, True)):
            comm.barrier(buf, wait, sync, seq)
    comm.barrier(bucket, context_idx=1)
    errors = {"ep_context": outcome(comm.barrier, ep, True, False, True, 1),
              "bucket_context": outcome(comm.barrier, bucket, True, False, True, 2),
              "not_buffer": outcome(comm.barrier, object()),
              "ambiguous_group": outcome(bucket.barrier)}
    for buf in (ep, bucket, pp, engram):
        buf.destroy()
    errors["destroyed"] = outcome(comm.barrier, bucket)
    return errors


def timeouts(rank: int, world: int, timeout_s: float):
    """Bounded waits: an unreceived PP send, a PP recv with no send, a barrier a peer skips. Rank 1 skips."""
    a = PPBuffer(None, 64, 1, num_cpu_timeout_secs=timeout_s)
    b = PPBuffer(None, 64, 1, num_cpu_timeout_secs=timeout_s)
    bucket = BucketBuffer(None, 2 * MIB, num_cpu_timeout_secs=timeout_s)
    start = time.monotonic()
    if rank == 1:
        msg = outcome(a.recv, torch.empty(4), 0)  # rank 0 never sends on `a`
        elapsed = time.monotonic() - start
        time.sleep(2 * timeout_s + 2)  # stay away from the barrier until rank 0 gave up on it
        return msg, elapsed, None
    b.send(torch.ones(4), 1)
    msg = outcome(b.send, torch.ones(4), 1)  # the one slot is still in flight: rank 1 never receives
    elapsed = time.monotonic() - start
    barrier_msg = outcome(bucket.barrier)  # rank 1 never arrives
    after = outcome(b.send, torch.ones(4), 1)
    return msg, elapsed, (barrier_msg, after)


def pp_send_after_the_neighbour_gave_up(rank: int, world: int, timeout_s: float):
    """Rank 0's recv times out (rank 1 is late) and closes its side of the channel; rank 1's send then finds it
    closed: PeerFailed naming the call, not gloo's bare RuntimeError. Returns (class name, message) per rank."""
    pp = PPBuffer(None, 64, 2, num_cpu_timeout_secs=timeout_s)
    if rank == 0:
        return outcome(pp.recv, torch.empty(4), 1)
    time.sleep(timeout_s + 2)
    return outcome(pp.send, torch.ones(4), 0)


def construct_one_bad(rank: int, world: int, kind: str):
    """Rank 1 alone passes a bad size to a constructor: every rank raises at once (no timeout), rank 0 naming
    rank 1. Returns (exception class name, message, seconds)."""
    import time

    from epcomm import BucketBuffer, EngramBuffer, PPBuffer
    mib2 = 2 << 20
    bad = rank == 1
    make = {
        "bucket": lambda: BucketBuffer(None, 100 if bad else mib2, num_cpu_timeout_secs=60),
        "pp": lambda: PPBuffer(None, -1 if bad else 1024, 2, num_cpu_timeout_secs=60),
        "engram": lambda: EngramBuffer(None, 5 if bad else mib2, mib2, num_cpu_timeout_secs=60),
    }[kind]
    start = time.monotonic()
    try:
        make()
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return None, None, time.monotonic() - start


def bucket_disagreements(rank: int, world: int):
    """Ranks that pass different sizes, or one rank whose check fails: every rank raises at the call, and the
    buffer stays usable. Returns the messages of the three failing calls."""
    from epcomm import BucketBuffer
    bb = BucketBuffer(None, 2 << 20, num_cpu_timeout_secs=60)
    floats = bb.storage.view(torch.float32)
    messages = []
    for make in (lambda: bb.all_reduce(floats[: world * 8 * (rank + 1)]),           # sizes differ
                 lambda: bb.reduce_scatter(floats[: world * 8 * (rank + 1)]),
                 lambda: bb.all_reduce(floats[1: 1 + world * 8] if rank == 1 else floats[: world * 8])):  # rank 1
        try:
            make().wait()
            messages.append(None)
        except (TypeError, ValueError) as e:
            messages.append(str(e))
    src = floats[: world * 8]
    src.copy_(torch.arange(world * 8, dtype=torch.float32) + rank)
    got = bb.all_reduce(src).wait()
    want = sum(torch.arange(world * 8, dtype=torch.float32) + r for r in range(world))
    assert torch.equal(got, want), "the buffer is usable after the rejected calls"
    bb.destroy()
    return messages


def barriers_of_two_buffers(rank: int, world: int):
    """Two buffers of one class on a group: rank 0 calls the first one's barrier, rank 1 the second's (they paired
    silently). Returns {class name: outcome}; both buffers stay usable."""
    from epcomm import BucketBuffer, EngramBuffer

    out = {}
    for make in (lambda: BucketBuffer(None, 2 * MIB, explicitly_destroy=True, num_cpu_timeout_secs=30),
                 lambda: EngramBuffer(None, 2 * MIB, 2 * MIB, explicitly_destroy=True, num_cpu_timeout_secs=30)):
        a, b = make(), make()
        out[type(a).__name__] = outcome((a if rank == 0 else b).barrier)
        out[type(a).__name__ + " waits"] = [x.contexts[0]._call_id if hasattr(x, "contexts") else x.context._call_id
                                            for x in (a, b)]  # in step on every rank after the mismatch
        a.barrier()
        b.destroy()  # the destroys' order between buffers is free
        a.destroy()
    return out


def engram_scale_dtypes(rank: int, world: int):
    """FP8 Engram writes: ranks that pass the scales in different dtypes raise on every rank (each rank's fetch
    returned its own dtype for the same table), as does one rank mixing dtypes across layers; then a good write
    works. Returns the three outcomes."""
    entries, hidden, tokens, per_token = [8, 4], 128, 4, 2
    gpu, storage = EngramBuffer.get_storage_size_hint(None, entries, hidden, tokens, per_token,
                                                      torch.float8_e4m3fn, 1)
    buf = EngramBuffer(None, gpu, storage, explicitly_destroy=True, num_cpu_timeout_secs=30)
    buf.set_config(entries, hidden, tokens, per_token, torch.float8_e4m3fn, 1)
    tables, sfs = engram_table(7, world, entries, hidden, True)
    mine = [t[rank * n:(rank + 1) * n] for t, n in zip(tables, entries)]
    other = [s.view(torch.int32) for s in sfs] if sfs[0].dtype == torch.float32 else [s.view(torch.float32)
                                                                                        for s in sfs]
    differ = outcome(buf.write, mine, other if rank == 1 else sfs)
    mixed = outcome(buf.write, mine, [sfs[0], other[1]] if rank == 0 else sfs)
    after = outcome(buf.write, mine, sfs)  # None: the buffer stays usable
    buf.destroy()
    return differ, mixed, after
