"""`EngramBuffer` (reference §15): sizing hints, write, fetch bitwise equal to global_table[indices] in forward and
reverse layer order, BF16 and FP8 with replicated scales, errors on every rank."""

import os
import re

import pytest
import torch

import collective_cases as cc
from epcomm.engram import EngramBuffer

MIB = 1 << 20


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fetch_matches_global_table(run_ranks, fp8):
    assert all(run_ranks(2, cc.engram_fetch, 11, fp8))


def test_write_with_column_major_scales(run_ranks):
    assert all(run_ranks(2, cc.engram_fetch, 13, True, col_major_sf=True))


def test_odd_hidden_fetches(run_ranks):
    """Rows that are not a multiple of 64 bytes (BF16 hidden 30 and 31): the hint sizes them, fetch returns them bitwise."""
    assert EngramBuffer.get_storage_size_hint(2, [8], 30, 4, 2) == (2 << 20, 2 << 20)
    for hidden in (30, 31):  # 60-byte rows move as int32 words, 62-byte rows as bytes (no int16 in gloo/NCCL)
        assert all(run_ranks(2, cc.engram_fetch, 12, False, (40, 37), hidden, 16, 4))


def test_storage_size_hint_worked_example():
    # 2 layers of 1000 and 1021 rows per rank, hidden 256 bf16, 64 tokens x 24 entries:
    # receive area 2 * 64 * 24 * 512 B = 1.5 MiB -> 2 MiB; table 2021 * 512 B = 0.99 MiB -> 2 MiB.
    assert EngramBuffer.get_storage_size_hint(2, [1000, 1021], 256, 64, 24) == (2 * MIB, 2 * MIB)
    # FP8 with 2 packs: area 0.75 MiB -> 2 MiB, + scales 2021 * 2 * 4 B -> 2 MiB; table 2021 * 256 B -> 2 MiB.
    assert EngramBuffer.get_storage_size_hint(2, [1000, 1021], 256, 64, 24, torch.float8_e4m3fn, 2) == \
        (4 * MIB, 2 * MIB)
    # The reference's test shape: 524288 + 524309 rows, hidden 256, 512 tokens x 24 entries.
    gpu, storage = EngramBuffer.get_storage_size_hint(4, [524288, 524309], 256, 512, 24)
    assert gpu == 12 * MIB and storage == 514 * MIB  # 1048597 rows x 512 B = 512.01 MiB


@pytest.mark.parametrize("args,exc,pattern", [
    (([0], 256, 1, 1), ValueError, r"num_entries_per_layer must list at least one layer, each > 0"),
    ((8, 256, 1, 1), TypeError, r"num_entries_per_layer must be a list of ints"),
    (([8], 256, 1, 1, torch.float8_e4m3fn), ValueError, r"num_sf_packs must be > 0 for FP8 tables"),
    (([8], 256, 1, 1, torch.int8), TypeError, r"dtype must be one of"),
    (([8], 256, 0, 1), ValueError, r"num_max_tokens must be an int > 0, got 0"),
])
def test_storage_size_hint_errors(args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        EngramBuffer.get_storage_size_hint(2, *args)


def test_theoretical_config():
    # 90 Mpps x 10 us = 900 reads in flight / 16 per QP / 3 peers -> 19 QPs; 2*512*24 reads / 57 -> 1024 deep.
    assert EngramBuffer.get_theoretical_config(4, 2, 512, 24) == (19, 1024, False)
    # Beyond 32768 slots per QP the depth saturates and relaxed ordering is requested.
    qps, depth, restrict = EngramBuffer.get_theoretical_config(2, 64, 65536, 64)
    assert (depth, restrict) == (32768, True) and qps == int(-(-64 * 65536 * 64 // 32768) * 1.05)
    with pytest.raises(ValueError, match=r"num_layers must be an int > 0, got 0"):
        EngramBuffer.get_theoretical_config(2, 0, 1, 1)


ENGRAM_ERRORS = {
    "fetch_before_config": ("ValueError", r"call set_config\(\.\.\.\) first", None),
    "capacity": ("ValueError", r"the table needs num_gpu_bytes >= \d+ .* but the buffer has 2097152 and 2097152; "
                               r"size it with EngramBuffer.get_storage_size_hint", None),
    "disagree": ("ValueError", r"ranks disagree on hidden \(rank 0: 64, rank 1: 128\)", None),
    # the same count and total of entries, in another order per layer
    "disagree_layers": ("ValueError", r"ranks disagree on num_entries_per_layer \(a digest of the list\)", None),
    # rank 0 fetches from one buffer, rank 1 from another of the same group: the calls would read each other's tables
    "other_buffer": ("ValueError", r"ranks are in calls of different EngramBuffers on this group", None),
    "fetch_before_write": ("ValueError", r"the table was never written", None),
    "write_shape": ("ValueError", r"storages\[0\] must have shape \[16, 64\], got \(16, 65\)", 1),
    "out_of_range": ("ValueError", r"indices\[1, 2, 1\] = 16 is outside layer 1's global index space \[0, 16\)", 1),
    "float_indices": ("TypeError", r"indices must have dtype in \(torch.int32, torch.int64\), got torch.float32", None),
    "too_many_tokens": ("ValueError", r"indices has 5 tokens but num_max_tokens is 4", None),
    "alias_both": ("TypeError", r"pass num_rdma_storage_bytes or its legacy alias num_rdma_storage_size, not both",
                   None),
    # num_cpu_timeout_secs=0 was accepted (then the construction exchange timed out at once); one check for both
    "timeout_zero": ("ValueError", r"EngramBuffer: rank \d: num_cpu_timeout_secs must be > 0 seconds, got 0", None),
    "timeout_type": ("TypeError", r"EngramBuffer: rank \d: num_gpu_timeout_secs must be a number of seconds, got str",
                     None),
}


def test_engram_errors_on_every_rank(run_ranks):
    """`offender` None: every rank makes the mistake; else the other rank names the offending group rank."""
    outs = run_ranks(2, cc.engram_errors)
    for name, (cls, pattern, offender) in ENGRAM_ERRORS.items():
        for rank, out in enumerate(outs):
            got = out[name]
            assert got is not None and got[0] == cls, (name, rank, got)
            if offender is None or rank == offender:
                with pytest.raises({"ValueError": ValueError, "TypeError": TypeError}[cls], match=pattern):
                    raise ValueError(got[1]) if cls == "ValueError" else TypeError(got[1])
            else:  # the peer quotes the offender's own message
                assert re.search(rf"rank {rank}: group rank {offender} rejected the call: .*{pattern}", got[1]), \
                    got[1]


def test_group_that_is_not_a_process_group(run_ranks):
    """A string, or dist.new_group's value on a rank outside the group: TypeError naming `group` (was an
    AttributeError); rank 1 builds a buffer on its one-rank group."""
    from test_pp import check_bad_groups

    outs = run_ranks(2, cc.bad_groups, "engram")
    check_bad_groups(outs, "EngramBuffer")
    assert outs[1]["outside"] is None, outs[1]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fetch_on_gpu(pools, fp8):
    pools.get(2, "nccl").run(cc.engram_fetch, 11, fp8, (65536, 65557), 256, 512, 24, device="cuda")


def check_transport_errors(outs: list) -> None:
    """An unknown name on rank 1 and a disagreement: every rank raises, naming the offender or both names."""
    for rank, out in enumerate(outs):
        cls, msg = out["unknown"]
        assert cls == "ValueError", (rank, out["unknown"])
        pattern = (r"transport='nvshmem' is unknown; expected one of 'auto', 'collective', 'nvlink'" if rank == 1
                   else r"rank 0: group rank 1 rejected the construction: the transport it passed is not one of "
                        r"'auto', 'collective', 'nvlink'")
        assert re.search(pattern, msg), msg
        cls, msg = out["disagree"]
        assert cls == "ValueError" and re.search(
            r"ranks disagree on transport \(rank 0: 'auto', rank 1: 'collective'\); every rank must pass the same",
            msg), out["disagree"]


def test_transport_choice_on_cpu(run_ranks):
    """CPU ranks take the collective transport; asking for nvlink raises on every rank, saying why."""
    outs = run_ranks(2, cc.engram_transports)
    for out in outs:
        assert out["auto"] == "collective" and out["collective"] == "collective", out
        cls, msg = out["nvlink"]
        assert cls == "ValueError" and re.search(
            r"EngramBuffer: rank \d: transport='nvlink' cannot run for this group: the buffer lives on cpu \(gloo\); "
            r"nvlink needs one CUDA GPU per rank \(NCCL\); pass transport='auto' or 'collective'", msg), msg
    check_transport_errors(outs)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="the stand-in region maps files in /dev/shm")
@pytest.mark.parametrize("world,fp8", [(2, True), (3, False)], ids=["2-fp8", "3-bf16"])
def test_nvlink_path_on_cpu_stand_in(run_ranks, world, fp8):
    """The nvlink data path (one-sided reads of peers' regions, per-owner segments, placement, write barriers)
    on CPU ranks, with one shared-memory file per rank standing in for symmetric memory (FileRegion)."""
    assert all(run_ranks(world, cc.engram_on_file_regions, "engram_fetch", 11, fp8, expect_transport="nvlink"))
    if world == 2:
        outs = run_ranks(2, cc.engram_on_file_regions, "engram_nvlink_local_errors", device="cpu")
        assert outs[0] == {"out_of_range": None, "alone": True}, outs[0]
        assert outs[1]["alone"] is None and outs[1]["out_of_range"][0] == "ValueError", outs[1]


@pytest.mark.parametrize("transport", ["nvlink", "collective"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fetch_on_gpu_transports(pools, fp8, transport):
    """Both transports forced: random, all-local, all-remote rows, both hook orders, rewrite; bitwise."""
    pools.get(2, "nccl").run(cc.engram_fetch, 11, fp8, (65536, 65557), 256, 512, 24, device="cuda",
                             transport=transport, expect_transport=transport)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_transport_choice_on_gpu(pools):
    """Two GPUs of one host: auto picks nvlink; either can be forced; errors as on CPU."""
    outs = pools.get(2, "nccl").run(cc.engram_transports)
    for out in outs:
        assert (out["auto"], out["collective"], out["nvlink"]) == ("nvlink", "collective", "nvlink"), out
    check_transport_errors(outs)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nvlink_fetch_is_one_sided(pools):
    """nvlink fetch: a bad index raises on its rank only; rank 0 fetches alone and gets the right rows."""
    outs = pools.get(2, "nccl").run(cc.engram_nvlink_local_errors)
    assert outs[0]["out_of_range"] is None and outs[0]["alone"] is True, outs[0]
    cls, msg = outs[1]["out_of_range"]
    assert cls == "ValueError" and re.search(r"indices\[1, 2, 1\] = 16 is outside layer 1's global index space "
                                             r"\[0, 16\)", msg), msg


def test_write_scale_dtypes_agree(run_ranks):
    for rank, (differ, mixed, after) in enumerate(run_ranks(2, cc.engram_scale_dtypes)):
        assert differ[0] == "ValueError" and "ranks disagree on the scales' dtype" in differ[1], differ
        assert mixed[0] == "ValueError" and (
            "sfs[1] has dtype" in mixed[1] if rank == 0 else "group rank 0 rejected the call" in mixed[1]), mixed
        assert after is None, after
