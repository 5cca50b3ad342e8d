"""`BucketBuffer` / `BucketSession` (reference §14): placement rules, equality with torch.distributed, guard bytes,
sessions, several groups, every user mistake pinned. Rank-side bodies live in collective_cases.py."""

import re

import numpy as np
import pytest
import torch

import collective_cases as cc
from epcomm import BufferAllocator
from epcomm.bucket import BucketBuffer, SessionOutOfStorage, _theoretical_num_sms


@pytest.mark.parametrize("with_dsts", [False, True], ids=["in-place", "dsts"])
def test_all_gather_random_buckets_match_torch(run_ranks, with_dsts):
    assert run_ranks(2, cc.bucket_all_gather, 3, with_dsts) == [20, 20]


@pytest.mark.parametrize("dtype", ["bf16", "int32", "uint8"])
def test_all_gather_any_dtype(run_ranks, dtype):
    run_ranks(2, cc.bucket_all_gather, 4, False, dtype)


@pytest.mark.parametrize("op,scale", [("reduce_scatter", 1.0), ("reduce_scatter", -0.5), ("all_reduce", 0.25)])
@pytest.mark.parametrize("exact", [True, False], ids=["small-ints-bitwise", "randn-fp32"])
def test_reductions_in_place_match_torch(run_ranks, op, scale, exact):
    assert all(run_ranks(2, cc.bucket_reduce, 5, op, scale, exact))


def test_session_external_tensors_and_allocate(run_ranks):
    for rank, errors in enumerate(run_ranks(2, cc.bucket_session, 6)):
        assert errors["nested"][0] == "ValueError" and "sessions do not nest" in errors["nested"][1]
        cls, msg = errors["out_of_storage"]
        assert cls == "SessionOutOfStorage" and re.search(r"session out of storage: staging needs 4194304 bytes", msg)
        assert errors["dst_dtype"][0] == "TypeError" and "dsts must have the src's dtype torch.bfloat16" in \
            errors["dst_dtype"][1]
        assert re.search(rf"rank {rank}: srcs must belong to this BucketBuffer", errors["outside"][1])
        assert "the session is closed" in errors["closed"][1]


def _session_reduce_scatter_neighbours(rank, world):
    """A session reduce-scatter of a src outside the storage into an allocated dst between two other allocations:
    the result lands in dst and the neighbours keep their values (a staging area derived around dst, R x its size,
    overwrote them). Returns (result right, neighbours kept)."""
    buf = BucketBuffer(None, 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=30)
    try:
        with buf.session() as s:
            before, dst, after = s.allocate([(16,), (16,), (16,)])
            before.fill_(7.0)
            after.fill_(9.0)
            src = torch.arange(16.0 * world) + rank
            got = s.reduce_scatter(src, dsts=dst).wait()
            want = (torch.arange(16.0 * world) * world + sum(range(world)))[rank * 16:(rank + 1) * 16]
            return bool(got.data_ptr() == dst.data_ptr() and torch.equal(dst, want)), \
                bool((before == 7.0).all() and (after == 9.0).all())
    finally:
        buf.destroy()


def _session_all_gather_allocated_src(rank, world):
    """A session all-gather of an allocated src (in the storage) into a dst outside it: the gather must not run in
    place around src (it overwrote the allocations next to it, and failed for a first allocation at rank >= 1).
    Returns (result right, neighbours kept, first allocation gathers)."""
    buf = BucketBuffer(None, 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=30)
    want = torch.arange(1.0, world + 1).repeat_interleave(16)
    try:
        with buf.session() as s:
            before, src, after = s.allocate([(16,), (16,), (16,)])
            before.fill_(7.0)
            after.fill_(9.0)
            src.fill_(rank + 1.0)
            dst = torch.zeros(16 * world)
            s.all_gather(src, dsts=dst).wait()
            right, kept = torch.equal(dst, want), bool((before == 7.0).all() and (after == 9.0).all())
        with buf.session() as s:
            first = s.allocate((16,))
            first.fill_(rank + 1.0)
            dst = torch.zeros(16 * world)
            s.all_gather(first, dsts=dst).wait()
            return right, kept, torch.equal(dst, want)
    finally:
        buf.destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_session_all_gather_of_an_allocated_src_into_an_outside_dst(run_ranks, world):
    assert run_ranks(world, _session_all_gather_allocated_src) == [(True, True, True)] * world


@pytest.mark.parametrize("world", [2, 3])
def test_session_reduce_scatter_writes_only_its_dst(run_ranks, world):
    assert run_ranks(world, _session_reduce_scatter_neighbours) == [(True, True)] * world


def test_out_of_storage_is_value_and_runtime_error():
    assert issubclass(SessionOutOfStorage, ValueError) and issubclass(SessionOutOfStorage, RuntimeError)


@pytest.mark.parametrize("seed", [1, 2])
def test_mixed_schedule_two_groups(run_ranks, seed):
    assert all(run_ranks(2, cc.bucket_mixed, seed))


def test_theoretical_num_sms_model():
    h200 = 0.9 * 18 * 26.5625  # 430.3 GB/s
    assert _theoretical_num_sms("all_gather", 8, 1, h200, 45.0) == 0
    # NVLink only: g = 430.3 / 8 = 53.8 -> ceil(53.8 / 45) = 2 -> max(6, 2) = 6
    assert _theoretical_num_sms("reduce_scatter", 8, 1, h200, 45.0) == 6
    # 2 ranks per host: g = 215.2 -> 215.2 / 45 = 4.78 -> max(6, 4.78) = 6
    assert _theoretical_num_sms("reduce_scatter", 2, 1, h200, 45.0) == 6
    assert _theoretical_num_sms("all_reduce", 1, 1, h200, 45.0) == 10  # ceil(430.3 / 45) = 10
    # hybrid: g = min(53.8, 45 * 2 / 1 = 90) = 53.8 -> 1.2 * 2g / 45 = 2.87 -> 8
    assert _theoretical_num_sms("reduce_scatter", 8, 2, h200, 45.0) == 8
    # RDMA only, 4 hosts: a = 45 * 4 / 3 = 60 -> max(60/180, 60/4/45) < 1 -> 6
    assert _theoretical_num_sms("all_reduce", 1, 4, h200, 45.0) == 6


EXPECTED = {
    "not_in_storage": ("ValueError", r"srcs must belong to this BucketBuffer"),
    "gather_out_of_bounds": ("ValueError", r"srcs must be the rank-th \(rank \d\) shard of a gathered tensor inside "
                                           r"the storage: the gathered bytes would span \[-?\d+, \d+\)"),
    "overlap_not_shard": ("ValueError", r"srcs overlaps dsts but is not its rank-th"),
    "dst_size": ("ValueError", r"dsts must have 2 x srcs.nbytes = 16 bytes, got 32"),
    "dst_outside": ("ValueError", r"dsts must belong to this BucketBuffer"),
    "dsts_len": ("ValueError", r"dsts must be a list of 2 tensors \(one per src\), got a list of 1"),
    "empty_list": ("ValueError", r"srcs is an empty list"),
    "not_tensor": ("TypeError", r"srcs must be a tensor or a list of tensors, got int"),
    "sparse": ("TypeError", r"srcs must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    "gather_num_sms": ("ValueError", r"num_sms must be None or 0 for all_gather"),
    "rs_dtype": ("TypeError", r"srcs must be torch.float32, got torch.bfloat16"),
    "rs_size": ("ValueError", r"srcs has 32 bytes; it must be a multiple of R x 32 = 64"),
    "rs_misaligned": ("ValueError", r"srcs starts at storage byte 16; it must start on a 32-byte boundary"),
    "rs_precision": ("ValueError", r"comm_precision must be 'fp32', got 'bf16'"),
    "rs_num_sms": ("ValueError", r"num_sms must be > 0 or None"),
    "ar_non_contiguous": ("ValueError", r"srcs must be contiguous"),
    "ar_list_index": ("TypeError", r"srcs\[1\] must be torch.float32"),
    "scale_type": ("TypeError", r"scale must be a float, got str"),
    "scale_nan": ("ValueError", r"scale must be finite, got nan"),
    "scale_huge_int": ("ValueError", r"scale must be finite, got 1000000000000"),
    "allocate_dtype": ("TypeError", r"dtype must be a torch.dtype, got str 'float'"),
    "allocate_float_size": ("TypeError", r"shapes must be a shape \(an int or a tuple of ints\) or a list of shapes, "
                                         r"got float 2.0 in \(2.0,\)"),
    "allocate_negative_size": ("ValueError", r"shapes must hold non-negative sizes, got \(2, -1\)"),
    "ambiguous_group": ("ValueError", r"group=None is ambiguous with 2 groups registered; pass the group"),
    "unknown_group": ("ValueError", r"the group is not registered with this buffer"),
    # Rank 1 alone passes a group the buffer does not hold: rank 0 raises too (the call's header), in step after.
    "unknown_group_on_one_rank": ("ValueError", r"rank 1: the group is not registered with this buffer"),
    # The buckets of one call run at once: the same bucket twice, or overlapping ones, would race.
    "duplicate_bucket": ("ValueError", r"srcs\[0\] and srcs\[1\] overlap in the storage \(bytes \[64, 320\) and "
                                       r"\[64, 320\)\); the buckets of one call run at once"),
    "overlapping_buckets": ("ValueError", r"srcs\[0\] and srcs\[1\] overlap in the storage \(bytes \[0, 64\) and "
                                          r"\[32, 96\)\)"),
    "session_staging_over_bucket": ("ValueError", r"srcs\[0\] is staged in an area the session carved from the "
                                                  r"start of the storage"),
    # A dst that is not a staging view gets its result at wait(): another bucket's result must not hold its bytes.
    "session_dst_in_staging": ("ValueError", r"srcs\[0\]'s staging and dsts\[1\] overlap in the storage "
                                             r"\(bytes \[64, 576\) and \[68, 132\)\)"),
    "session_dst_staging_named": ("ValueError", r"dsts\[0\] \(the staging of srcs\[0\]\) and srcs\[1\] overlap in "
                                                r"the storage"),
    "session_dsts_share_memory": ("ValueError", r"dsts\[0\] and dsts\[1\] share memory; each bucket's result is "
                                                r"copied into its own dst at wait\(\)"),
    "session_dst_overlaps_src": ("ValueError", r"dsts overlaps srcs but is not its in-place result \(the all_reduce "
                                               r"result of srcs is srcs itself\)"),
    "session_wait_after_next_session": ("ValueError", r"the first wait\(\) of this call came after a later session "
                                                      r"reused the staging area"),
    "session_mixed_groups": ("ValueError", r"all collectives of one session must use the same group"),
    "bad_op": ("ValueError", r"op must be 'all_gather', 'reduce_scatter' or 'all_reduce', got 'broadcast'"),
    "num_bytes": ("ValueError", r"allocation_plan_or_num_bytes must be a positive multiple of 2 MiB"),
    "timeout_zero": ("ValueError", r"num_cpu_timeout_secs must be > 0 seconds, got 0"),
    "plan": ("TypeError", r"allocation_plan_or_num_bytes must be an int byte count or an epcomm.BufferAllocator, got "
                          r"list"),
    "plan_materialized": ("ValueError", r"the BufferAllocator is already materialized \(a plan serves one buffer\)"),
    "plan_empty": ("ValueError", r"the BufferAllocator plans no bytes"),
    "plan_of_empty_tensors": ("ValueError", r"the BufferAllocator plans no bytes"),
    "plan_with_view": ("ValueError", r"allocation_plan_or_num_bytes \(2097152 bytes\): BufferAllocator.materialize: "
                                     r"planned tensor #0 .* cannot be swapped in place"),
    "plans_differ": ("ValueError", r"group ranks disagree on the allocation plan \(its layout's digest; 0: a byte "
                                   r"count\) \(rank 0: \d+, rank 1: \d+\)"),
    "too_many_groups": ("ValueError", r"group_or_groups must hold 1 to 8 groups, got 9"),
    "group_twice": ("ValueError", r"group_or_groups lists a group twice"),
    "group_count_disagree": ("ValueError", r"group ranks disagree on the number of groups \(rank 0: 1, rank 1: 2\)"),
    "destroyed": ("ValueError", r"the BucketBuffer was destroyed"),
    "barrier_destroyed": ("ValueError", r"^BucketBuffer.barrier: rank \d: the BucketBuffer was destroyed"),
    "barrier_unknown_group": ("ValueError", r"^BucketBuffer.barrier: rank \d: the group is not registered"),
    # a failure on one group of a buffer leaves it unusable on the others too (a later call would pair with a peer's
    # stale header and wait out a second timeout)
    "other_group_broken": ("ValueError", r"the BucketBuffer is unusable after an earlier failure on another of its "
                                         r"groups \(a wait timed out \(simulated\)\)"),
}


@pytest.fixture(scope="module")
def bucket_errors(pools):
    return pools.get(2).run(bucket_error_cases, timeout=120)


def test_every_bucket_error_is_pinned(bucket_errors):
    assert set(bucket_errors[0]) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bucket_error(bucket_errors, name):
    cls, pattern = EXPECTED[name]
    for rank, out in enumerate(bucket_errors):
        assert out[name] is not None, f"{name}: rank {rank} raised nothing"
        got_cls, msg = out[name]
        assert got_cls == cls and re.search(pattern, msg), (got_cls, msg)
        assert f"rank {rank}" in msg, msg
        with pytest.raises(getattr(__builtins__, cls, None) or Exception, match=pattern):
            raise {"ValueError": ValueError, "TypeError": TypeError}[cls](msg)


def bucket_error_cases(rank, world):
    import torch.distributed as dist
    out = cc.outcome
    buf = BucketBuffer(None, 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=30)
    st = buf.storage
    f32 = st[64:64 + 256].view(torch.float32)
    dup = dist.new_group([0, 1])
    two = BucketBuffer([dist.group.WORLD, dup], 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=30)
    used_plan, viewed_plan = BufferAllocator(), BufferAllocator()
    used_plan.allocate(4, torch.float32)
    used_plan.materialize(torch.zeros(used_plan.num_bytes, dtype=torch.uint8))
    held = viewed_plan.allocate(4, torch.float32)[:2]  # noqa: F841 (a view that blocks the in-place swap)
    empty_plan = BufferAllocator()
    empty_plan.allocate((0, 8), torch.float32)

    def plan_of(r):  # a layout that differs by rank: a bf16 tensor on rank 1 where rank 0 has fp32
        p = BufferAllocator()
        p.allocate(8, torch.bfloat16 if r else torch.float32)
        return p
    r = {
        "not_in_storage": out(buf.all_gather, torch.ones(4)),
        "gather_out_of_bounds": out(buf.all_gather, st[:16].view(torch.float32) if rank else
                                    st[-16:].view(torch.float32)),
        "overlap_not_shard": out(buf.all_gather, st[64 + 8:64 + 40], st[64:128]),
        "dst_size": out(buf.all_gather, torch.ones(8, dtype=torch.uint8).view(torch.float32), st[0:32]),
        "dst_outside": out(buf.all_gather, st[0:8], torch.empty(16, dtype=torch.uint8)),
        "dsts_len": out(buf.all_gather, [st[0:8], st[8:16]], [st[64:80]]),
        "empty_list": out(buf.all_gather, []),
        "not_tensor": out(buf.all_gather, 3),
        "sparse": out(buf.all_reduce, f32.to_sparse()),
        "gather_num_sms": out(buf.all_gather, st[0:8], None, None, 4),
        "rs_dtype": out(buf.reduce_scatter, st[0:64].view(torch.bfloat16)),
        "rs_size": out(buf.reduce_scatter, f32[:8]),
        "rs_misaligned": out(buf.reduce_scatter, st[16:16 + 64].view(torch.float32)),
        "rs_precision": out(buf.reduce_scatter, f32, "bf16"),
        "rs_num_sms": out(buf.reduce_scatter, f32, "fp32", 1.0, None, 0),
        "ar_non_contiguous": out(buf.all_reduce, f32.view(8, 8).t()),
        "ar_list_index": out(buf.all_reduce, [f32, st[0:64].view(torch.int32)]),
        "scale_type": out(buf.all_reduce, f32, "2"),
        "scale_nan": out(buf.all_reduce, f32, float("nan")),
        "scale_huge_int": out(buf.all_reduce, f32, 10 ** 400),
        "ambiguous_group": out(two.all_reduce, two.storage[:64].view(torch.float32)),
        "unknown_group": out(buf.all_reduce, f32, 1.0, dup),
        "barrier_unknown_group": out(buf.barrier, group=dup),
        "unknown_group_on_one_rank": out(buf.all_reduce, f32, 1.0, dup if rank == 1 else None),
        "duplicate_bucket": out(buf.all_reduce, [f32, f32]),
        "overlapping_buckets": out(buf.all_reduce, [st[0:64].view(torch.float32), st[32:96].view(torch.float32)]),
        "bad_op": out(buf.get_theoretical_num_sms, "broadcast"),
        "num_bytes": out(BucketBuffer, None, 3 << 20),
        "timeout_zero": out(BucketBuffer, None, 2 << 20, num_cpu_timeout_secs=0),
        "plan": out(BucketBuffer, None, [1, 2]),
        "plan_materialized": out(BucketBuffer, None, used_plan),
        "plan_empty": out(BucketBuffer, None, BufferAllocator()),
        "plan_of_empty_tensors": out(BucketBuffer, None, empty_plan),
        "plan_with_view": out(BucketBuffer, None, viewed_plan),
        "plans_differ": out(BucketBuffer, None, plan_of(rank)),
        "too_many_groups": out(BucketBuffer, [dist.group.WORLD] * 9, 2 << 20),
        "group_twice": out(BucketBuffer, [dist.group.WORLD, dist.group.WORLD], 2 << 20),
        "group_count_disagree": out(BucketBuffer, [dist.group.WORLD] + [dup] * rank, 2 << 20),
    }
    with two.session() as s:
        s.all_reduce(torch.ones(16), group=dup).wait()
        r["session_mixed_groups"] = out(s.all_reduce, torch.ones(16), 1.0, dist.group.WORLD)
    # After the rejected calls the ranks are in step: a gather of each rank's value gives every rank's.
    mine = st[rank * 4:(rank + 1) * 4].view(torch.float32).fill_(7.0 + rank)
    assert buf.all_gather(mine).wait().tolist() == [7.0 + s for s in range(world)]
    vals = st[64:64 + 256].view(torch.float32)
    vals.copy_(torch.arange(64.0) + rank)  # small integers: the sum is exact in any order
    assert torch.equal(buf.all_reduce(vals, np.float32(0.5)).wait(),
                       (torch.arange(64.0) * world + sum(range(world))) * 0.5)  # a numpy scale
    dst = torch.zeros(4 * world)
    with buf.session() as s:
        r["session_staging_over_bucket"] = out(s.all_reduce, [torch.ones(16), st[0:64].view(torch.float32)])
        r["session_dst_in_staging"] = out(s.all_reduce, [torch.ones(128), torch.ones(16)],
                                          dsts=[None, st[68:132].view(torch.float32)])
        # an outside src staged in its in-storage dst, which another bucket's src overlaps: the message names the dst
        r["session_dst_staging_named"] = out(s.all_reduce, [torch.ones(16), st[1024:1088].view(torch.float32)],
                                             dsts=[st[1024:1088].view(torch.float32), None])
        shared = torch.zeros(16)  # two outside buckets' results copied into one tensor at wait()
        r["session_dsts_share_memory"] = out(s.all_reduce, [torch.ones(16), torch.ones(16)], dsts=[shared, shared])
        shifted = s.allocate((16 * world + 8,))
        r["session_dst_overlaps_src"] = out(s.all_reduce, shifted[:16 * world], dsts=shifted[8:])
        r["allocate_dtype"] = out(s.allocate, (3,), "float")
        r["allocate_float_size"] = out(s.allocate, (2.0,))
        r["allocate_negative_size"] = out(s.allocate, (2, -1))
        pending = s.all_gather(torch.full((4,), 1.0 + rank), dst)
    with buf.session() as s:
        s.all_gather(torch.full((4,), 50.0 + rank)).wait()
    r["session_wait_after_next_session"] = out(pending.wait)
    two.contexts[1].broken = "a wait timed out (simulated)"  # as after a timeout on the second group
    r["other_group_broken"] = out(two.all_gather, st[0:8], group=dist.group.WORLD)
    two.destroy()
    buf.destroy()
    r["destroyed"] = out(buf.all_reduce, f32)
    r["barrier_destroyed"] = out(buf.barrier)
    return r


# -- the same checks with NCCL on CUDA (pytest -m multigpu on a machine with >= 2 GPUs) ---------------------


@pytest.mark.parametrize("with_dsts", [False, True], ids=["in-place", "dsts"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "uint8"])
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_all_gather_on_gpu(pools, with_dsts, dtype):
    pools.get(2, "nccl").run(cc.bucket_all_gather, 3, with_dsts, dtype, device="cuda")


@pytest.mark.parametrize("op,scale", [("reduce_scatter", 1.0), ("reduce_scatter", -0.5), ("all_reduce", 0.25)])
@pytest.mark.parametrize("exact", [True, False], ids=["small-ints-bitwise", "randn-fp32"])
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_reductions_on_gpu(pools, op, scale, exact):
    pools.get(2, "nccl").run(cc.bucket_reduce, 5, op, scale, exact, device="cuda")


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_session_and_mixed_schedule_on_gpu(pools):
    nccl = pools.get(2, "nccl")
    nccl.run(cc.bucket_session, 6, device="cuda")
    for seed in (1, 2):
        nccl.run(cc.bucket_mixed, seed, device="cuda")


def bucket_with_a_plan(rank, world):
    """Reference §6 test: a plan on a buffer of two groups; the placeholders become views of the storage (first at
    its start), fills round-trip, and an in-place all-gather of a planned tensor equals torch's."""
    import torch.distributed as dist
    plan = BufferAllocator()
    gathered = plan.allocate((world, 1000), torch.float32)
    scales = plan.allocate((3, 5), torch.bfloat16)
    assert gathered.device.type == "meta"
    try:  # rank 1's bad timeout fails the construction on every rank; every plan stays as passed, to pass again
        BucketBuffer(None, plan, num_cpu_timeout_secs=0 if rank == 1 else 30)
        raise AssertionError("the construction must fail")
    except ValueError:
        pass
    retried = not plan.materialized and gathered.device.type == "meta"
    pair = dist.new_group(list(range(world)))
    buf = BucketBuffer([dist.group.WORLD, pair], plan, explicitly_destroy=True, num_cpu_timeout_secs=30)
    out = dict(contexts=len(buf.contexts), num_bytes=buf.storage.numel() == plan.num_bytes == buf.num_bytes,
               first=gathered.data_ptr() == buf.storage.data_ptr(), devices={gathered.device.type, scales.device.type},
               plan=buf.allocation_plan is plan and plan.materialized and retried,
               second=scales.data_ptr() - buf.storage.data_ptr())
    gen = torch.Generator().manual_seed(11 + rank)
    mine = torch.randn(1000, generator=gen)
    gathered[rank].copy_(mine)
    scales.copy_(torch.randn(3, 5, generator=gen))
    out["fill"] = torch.equal(buf.storage[out["second"]:out["second"] + 30].view(torch.bfloat16).view(3, 5), scales)
    got = buf.all_gather(gathered[rank], group=pair).wait()
    want = torch.empty(world * 1000)
    dist.all_gather_into_tensor(want, mine)
    out["gather"] = got.data_ptr() == gathered.data_ptr() and torch.equal(got, want) and torch.equal(gathered.view(-1),
                                                                                                      want)
    buf.destroy()
    return out


def test_bucket_buffer_takes_an_allocation_plan(run_ranks):
    for out in run_ranks(2, bucket_with_a_plan):
        assert out == dict(contexts=2, num_bytes=True, first=True, devices={"cpu"}, plan=True, second=2 << 20,
                           fill=True, gather=True), out


def _scales_differ(rank, world):
    buf = BucketBuffer(None, 2 << 20, explicitly_destroy=True, num_cpu_timeout_secs=30)
    try:
        x = buf.storage[:64 * world].view(torch.float32)
        x.fill_(1.0)
        outcome = cc.outcome(buf.all_reduce, x, scale=float(rank + 1))
        zero = cc.outcome(buf.all_reduce, x, scale=-0.0 if rank else 0.0)  # results would differ in zero's sign
        buf.all_reduce(x, scale=0.5).wait()  # the buffer stays usable
        return outcome, zero, x[:2].tolist()
    finally:
        buf.destroy()


def test_ranks_passing_different_scales_raise_everywhere(run_ranks):
    """scale multiplies the sum afterwards: ranks that pass different ones would get different results of one
    all-reduce, silently; every rank raises instead."""
    for (cls, msg), (zcls, zmsg), after in run_ranks(2, _scales_differ):
        assert cls == "ValueError" and "ranks disagree on scale (rank 0: 1.0, rank 1: 2.0)" in msg, msg
        assert zcls == "ValueError" and "ranks disagree on scale (rank 0: 0.0, rank 1: -0.0)" in zmsg, zmsg
        assert after == [1.0, 1.0], after


def test_ranks_passing_different_sizes_raise_everywhere(run_ranks):
    """CPU: a header before the data (status, operation, bucket sizes): no rank aborts inside gloo."""
    for rank, (sizes_ar, sizes_rs, one_bad) in enumerate(run_ranks(2, cc.bucket_disagreements)):
        assert sizes_ar and "ranks disagree on the total bytes" in sizes_ar, sizes_ar
        assert sizes_rs and "ranks disagree on the total bytes" in sizes_rs, sizes_rs
        if rank == 1:
            assert one_bad and "32-byte boundary" in one_bad, one_bad
        else:
            assert one_bad and "group rank 1 rejected the call" in one_bad, one_bad


def _groups_in_other_orders(rank, world):
    import torch.distributed as dist
    g, h = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    out = []
    for first, second in ((dist.group.WORLD, g), (g, h)):
        try:
            BucketBuffer([first, second] if rank == 0 else [second, first], 2 << 20, num_cpu_timeout_secs=30)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


def test_ranks_listing_groups_in_other_orders_raise_everywhere(run_ranks):
    """The contexts are built in one order on every rank (not the list's), so the index agreement meets and raises
    (it used to wait in two different groups until the timeout)."""
    for rank, msgs in enumerate(run_ranks(2, _groups_in_other_orders)):
        for msg in msgs:
            assert msg == (f"BucketBuffer: rank {rank}: group ranks disagree on the group's index in group_or_groups "
                           "(rank 0: 0, rank 1: 1)"), msg


def _disagreement_in_a_subgroup(rank, world):
    """Ranks 0 and 1 list [WORLD, a] and [a, WORLD] (a = ranks 0-1); rank 2 lists [WORLD, its own group]."""
    import time

    import torch.distributed as dist
    a, own = dist.new_group([0, 1]), dist.new_group([2])
    groups = {0: [dist.group.WORLD, a], 1: [a, dist.group.WORLD], 2: [dist.group.WORLD, own]}[rank]
    start = time.monotonic()
    try:
        BucketBuffer(groups, 2 << 20, num_cpu_timeout_secs=30)
        return None, time.monotonic() - start
    except ValueError as e:
        return str(e), time.monotonic() - start


def test_a_rank_outside_the_failing_group_raises_too(run_ranks):
    """The ranks of the group where the disagreement shows fail their later groups' exchanges too, so rank 2, which
    shares only the world group with them, raises naming them (it waited in that exchange until the timeout)."""
    results = run_ranks(3, _disagreement_in_a_subgroup)
    for rank, (msg, seconds) in enumerate(results):
        assert seconds < 10, (rank, seconds)
        if rank < 2:
            assert msg == (f"BucketBuffer: rank {rank}: group ranks disagree on the group's index in group_or_groups "
                           "(rank 0: 1, rank 1: 0)"), msg
        else:
            assert msg is not None and msg.startswith("BucketBuffer: rank 2: group rank 0 rejected the construction: "
                                                      "BucketBuffer: rank 0: group ranks disagree"), msg
            assert "group rank 1 rejected it too" in msg, msg
