"""The dispatch/combine mode matrix against `epcomm.reference`, bitwise (reference §21, §24 items 2-17)."""

import pytest
import torch

import ep_cases

# (layout, alignment, dtype, bias count, CPU sync, multiple reduction, deferred): a pairwise-style cover of the
# option matrix for the CPU suite; the GPU suite runs the same cases with NCCL.
MODES = [
    dict(do_expand=False, expert_alignment=1, dtype="bf16", num_bias=0, do_cpu_sync=True),
    dict(do_expand=False, expert_alignment=4, dtype="fp32", num_bias=1, do_cpu_sync=False),
    dict(do_expand=False, expert_alignment=1, dtype="fp16", num_bias=2, do_cpu_sync=True, defer=True),
    dict(do_expand=False, expert_alignment=1, dtype="fp64", num_bias=1, do_cpu_sync=True),
    dict(do_expand=False, expert_alignment=8, dtype="fp8", do_cpu_sync=True, col_major_sf=True),
    dict(do_expand=False, expert_alignment=1, dtype="fp8", use_ue8m0=True, do_cpu_sync=False),
    dict(do_expand=True, expert_alignment=1, dtype="bf16", num_bias=2, do_cpu_sync=True),
    dict(do_expand=True, expert_alignment=4, dtype="bf16", num_bias=1, do_cpu_sync=False, defer=True),
    dict(do_expand=True, expert_alignment=8, dtype="fp32", num_bias=0, do_cpu_sync=True,
         allow_multiple_reduction=False),
    dict(do_expand=True, expert_alignment=3, dtype="fp16", num_bias=2, do_cpu_sync=False,
         allow_multiple_reduction=False),
    dict(do_expand=True, expert_alignment=2, dtype="fp64", num_bias=0, do_cpu_sync=True),
    dict(do_expand=True, expert_alignment=16, dtype="fp8", do_cpu_sync=True, col_major_sf=True),
    dict(do_expand=True, expert_alignment=1, dtype="fp8", use_ue8m0=True, do_cpu_sync=False),
    dict(do_expand=False, expert_alignment=1, dtype="bf16", num_bias=0, topk_idx_dtype=torch.int32),
    dict(do_expand=True, expert_alignment=4, dtype="bf16", num_bias=1, topk_idx_dtype=torch.int32),
]


def _mode_id(m):
    parts = ["expand" if m["do_expand"] else "nonexpand", f"a{m['expert_alignment']}", m["dtype"]]
    parts += ["ue8m0"] if m.get("use_ue8m0") else []
    parts += [f"bias{m.get('num_bias', 0)}", "sync" if m.get("do_cpu_sync", True) else "nosync"]
    parts += ["nomr"] if m.get("allow_multiple_reduction") is False else []
    parts += ["defer"] if m.get("defer") else []
    parts += ["colsf"] if m.get("col_major_sf") else []
    parts += ["idx32"] if m.get("topk_idx_dtype") == torch.int32 else []
    return "-".join(parts)


@pytest.mark.parametrize("mode", MODES, ids=[_mode_id(m) for m in MODES])
def test_mode_matches_reference(run_ranks, mode):
    run_ranks(2, ep_cases.check_mode, seed=hash(_mode_id(mode)) % 1000, **mode)


@pytest.mark.parametrize("world", [1, 3, 4])
def test_world_sizes(run_ranks, world):
    tokens = (9, 0, 13, 5)[:world]
    for expand in (False, True):
        run_ranks(world, ep_cases.check_mode, seed=world, tokens=tokens, num_experts=12, num_topk=3,
                  do_expand=expand, expert_alignment=2, num_bias=1)


def test_combine_of_ones_counts_destinations(run_ranks):
    run_ranks(2, ep_cases.combine_counts_ranks)


@pytest.mark.parametrize("mode", MODES[::2], ids=[_mode_id(m) for m in MODES[::2]])
def test_blocked_layout_matches_reference(run_ranks, mode):
    """The layout the nvlink transport uses (rows in per-sender blocks, also with CPU sync), checked on CPU."""
    run_ranks(2, ep_cases.check_mode, seed=3, force_blocked=True, **mode)


def test_eight_ranks(pools):
    """EP8 logic on 8 gloo ranks (the shape of an 8-GPU node), both layouts, with an empty rank."""
    pool = pools.get(8)
    try:
        for expand in (False, True):
            pool.run(ep_cases.check_mode, seed=8, tokens=(7, 0, 12, 3, 9, 1, 5, 11), num_experts=32, num_topk=6,
                     hidden=32, do_expand=expand, expert_alignment=4, num_bias=2, timeout=240)
    finally:
        pool.close()  # eight processes are heavy on a 2-core machine: do not keep them for later tests


@pytest.mark.parametrize("mode", [dict(dtype="fp8", do_expand=True, expert_alignment=4, do_cpu_sync=False),
                                  dict(dtype="bf16")], ids=["fp8-expand-nosync", "bf16"])
def test_per_rank_options_may_differ(run_ranks, mode):
    """docs/decisions.md "What ranks must agree on": the per-rank options, set differently on each rank."""
    run_ranks(2, ep_cases.check_mode_per_rank_options, **mode)


def test_per_rank_dispatch_flags_may_differ(run_ranks):
    assert run_ranks(2, ep_cases.per_rank_dispatch_flags) == [True, True]


@pytest.mark.parametrize("mode", [
    dict(do_cpu_sync=True, expert_alignment=4),
    dict(do_cpu_sync=False, expert_alignment=3, num_bias=1),
    dict(do_cpu_sync=True, expert_alignment=1, dtype="fp8"),
    dict(do_cpu_sync=False, expert_alignment=8, dtype="fp8", use_ue8m0=True),
    dict(do_cpu_sync=True, expert_alignment=2, defer=True, num_bias=2),
], ids=["sync-a4", "nosync-a3", "fp8-sync-a1", "fp8-ue8m0-nosync-a8", "sync-a2-defer"])
def test_recv_expert_ids_match_reference(run_ranks, mode):
    """`emit_expert_ids=True` (reference §9.12): `handle.recv_expert_ids` is [S] int32 with the local expert id of
    every real row of each segment and -1 on padding and on the sync-free tail, at the rows the reference's row
    pointers name; a cached dispatch keeps it. Both sync modes, deferred, FP8; 2 and 3 ranks (one empty)."""
    run_ranks(2, ep_cases.check_mode, seed=21, do_expand=True, emit_expert_ids=True, **mode)
    if mode.get("dtype", "bf16") == "bf16":
        run_ranks(3, ep_cases.check_mode, seed=22, tokens=(9, 0, 14), num_experts=12, num_topk=3, do_expand=True,
                  emit_expert_ids=True, **mode)


@pytest.mark.parametrize("num_sf_packs, sf_dtype", [(1, "fp32"), (2, "fp32"), (3, "fp32"), (11, "fp32"),
                                                    (1, "int32"), (5, "int32")])
@pytest.mark.parametrize("do_expand, do_cpu_sync", [(False, True), (True, False)], ids=["nonexpand-sync",
                                                                                       "expand-nosync"])
def test_fp8_scale_columns_are_not_tied_to_hidden(run_ranks, num_sf_packs, sf_dtype, do_expand, do_cpu_sync):
    """FP8 x = (data [T, H], scales [T, P]) (reference §9.11): P is not checked against hidden (256: 2 fp32
    columns of 1x128 blocks, 1 packed UE8M0 int32); the scales are opaque bytes, so any P >= 1 (fewer, as many,
    more than H / 32) arrives bitwise where the reference puts it, and a cached dispatch replays it."""
    rows = run_ranks(2, ep_cases.fp8_scale_columns, num_sf_packs=num_sf_packs, sf_dtype=sf_dtype,
                     do_expand=do_expand, do_cpu_sync=do_cpu_sync)
    assert all(r > 0 for r in rows), rows
