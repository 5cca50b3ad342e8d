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
