"""The CPU suite's checks on CUDA tensors with NCCL (run with `pytest -m multigpu` on a machine with >= 2 GPUs)."""

import pytest
import torch

import device_timeout_script
import ep_cases
from test_modes import MODES, _mode_id

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


@pytest.fixture(scope="module")
def nccl(pools):
    return pools.get(2, "nccl")


TRANSPORTS = ["collective", "nvlink"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", MODES, ids=[_mode_id(m) for m in MODES])
def test_mode_matches_reference_on_gpu(nccl, mode, transport):
    nccl.run(ep_cases.check_mode, seed=7, device="cuda", transport=transport, **mode)


@pytest.mark.parametrize("case", [
    dict(tokens=(12, 0)),
    dict(routing=ep_cases.routing_all_to_rank0),
    dict(routing=ep_cases.routing_all_masked),
    dict(routing=ep_cases.routing_alignment_counts, num_experts=10, expert_alignment=4),
    dict(num_topk=32, num_experts=64, hidden=16),
    dict(async_op=True, do_expand=True, num_bias=2),
    dict(tokens=(4096, 4001), hidden=7168, num_experts=256, num_topk=8, dtype="bf16", do_expand=True,
         expert_alignment=128, num_bias=1),
    dict(tokens=(4096, 4096), hidden=7168, num_experts=256, num_topk=8, dtype="fp8", col_major_sf=True),
], ids=["empty-rank", "recv-nothing", "all-masked", "alignment-counts", "top32", "async", "dsv3-expand",
        "dsv3-fp8"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_edge_cases_on_gpu(nccl, case, transport):
    for sync in (True, False):
        nccl.run(ep_cases.check_mode, device="cuda", do_cpu_sync=sync, transport=transport, **case)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_streams_on_gpu(nccl, transport):
    assert all(nccl.run(ep_cases.gpu_streams, transport))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_calls_on_several_streams_keep_their_order(nccl, transport):
    assert all(nccl.run(ep_cases.stream_order, transport))


def test_auto_picks_nvlink_on_one_host(nccl):
    assert nccl.run(ep_cases.transport_name) == ["nvlink", "nvlink"]


@pytest.mark.parametrize("case", [
    dict(),
    dict(dtype="fp8", do_expand=True, expert_alignment=4, emit_expert_ids=True, col_major_sf=True),
    dict(dtype="fp32", do_expand=True, num_topk=6, with_stats=False),
    dict(dtype="fp16", hidden=70, with_weights=False, num_experts=10, num_topk=10, n=100),
    dict(num_tokens=(128, 128), n=128, hidden=7168, num_experts=256, num_topk=8, do_expand=True),
    dict(num_tokens=(128, 1), n=128, hidden=7168, num_experts=256, num_topk=8, dtype="fp8"),
], ids=["bf16", "fp8-expand-ids", "fp32-expand", "fp16-odd", "decode-bf16-expand", "decode-fp8"])
def test_fused_sync_free_dispatch_matches_generic(nccl, case):
    """syncfree_nvlink.py against the generic sync-free path: outputs, stats, handle, plan, combine, cached."""
    assert nccl.run(ep_cases.fused_matches_generic, **case) == [3, 3]


@pytest.mark.parametrize("case", [
    dict(),
    dict(dtype="fp8", do_expand=True, expert_alignment=4, emit_expert_ids=True, col_major_sf=True),
    dict(dtype="fp32", do_expand=True, num_topk=6, with_stats=False),
    dict(dtype="fp16", hidden=70, with_weights=False, num_experts=10, num_topk=10, n=100),
    dict(num_tokens=(4096, 4001), n=4096, hidden=7168, num_experts=256, num_topk=8, do_expand=True,
         expert_alignment=128),
    dict(num_tokens=(4096, 4096), n=4096, hidden=7168, num_experts=256, num_topk=8, dtype="fp8"),
], ids=["bf16", "fp8-expand-ids", "fp32-expand", "fp16-odd", "dsv3-bf16-expand", "dsv3-fp8"])
def test_fused_exact_dispatch_matches_generic(nccl, case):
    """exact_nvlink.py against the generic CPU-synced path: outputs, stats, handle, plan, combine, cached."""
    assert nccl.run(ep_cases.fused_matches_generic, sync=True, **case) == [3, 3]


@pytest.mark.parametrize("fused", ["1", "0"])
def test_bad_topk_values_raise_on_every_rank(nccl, fused):
    """A CPU-synced nvlink dispatch with a bad topk_idx value on one rank raises on both ranks, before any row
    moves, with the same messages on the fused path (device flags published with the counts) as on the generic one
    (host check); the buffer works afterwards."""
    out = nccl.run(ep_cases.bad_values_raise_everywhere, fused)
    assert [len(m) for m in out] == [3, 3]


@pytest.mark.parametrize("transport", TRANSPORTS + ["nvlink-generic"])
def test_cuda_graph_replay_with_new_routings(nccl, transport):
    """Sync-free dispatch + cached dispatch + combine in one CUDA graph, replayed with new inputs and routings."""
    assert nccl.run(ep_cases.graph_replay, transport) == [4, 4]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cuda_graph_replay_of_cached_calls(nccl, transport):
    """A CPU-synced handle's cached dispatch and combine in one CUDA graph, replayed with new inputs, with eager
    calls in between."""
    assert nccl.run(ep_cases.graph_replay_exact, transport) == [4, 4]


@pytest.mark.parametrize("dtype,pull_chunks,hidden", [("fp8", "", 192), ("fp8", "3", 192), ("bf16", "3", 192),
                                                      ("fp8", "", 1024), ("bf16", "3", 1024)])
def test_cuda_graph_replay_of_cached_calls_in_chunks(nccl, dtype, pull_chunks, hidden):
    """As above on nvlink, FP8 rows with their scales and the pull in several chunks. In a graph, fields of at most
    512 bytes a row (scales, weights, and here the rows themselves at hidden 192) are read out of the peers by the
    SMs after the last chunk; wider rows (hidden 1024) are pulled per chunk by the copy engines beside them
    (transport/pull.py)."""
    assert nccl.run(ep_cases.graph_replay_exact, "nvlink", dtype=dtype, pull_chunks=pull_chunks,
                    hidden=hidden) == [4, 4]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_captured_handle_then_eager_before_replay(nccl, transport):
    """Index tensors a handle first builds inside a capture are not reused by eager calls before the first replay."""
    assert nccl.run(ep_cases.captured_before_eager, transport) == [2, 2]


@pytest.mark.parametrize("chunks", ["1", "2", "5"])
def test_combine_return_push_in_chunks(nccl, chunks):
    """The nvlink combine of CPU-synced handles (transport/push_back.py) with the rows written in chunks, each
    reduced as soon as it lands (eager and captured), bitwise against the reference; empty ranks and tokens
    without items included."""
    assert nccl.run(ep_cases.return_in_chunks, chunks) == [int(chunks)] * 2


def test_nvlink_device_barrier_names_missing_rank():
    """Issue 3 item 4 on the nvlink transport: a peer that never reaches a device barrier (here: never makes a
    sync-free dispatch) ends the wait after num_gpu_timeout_secs with a message naming it, and the kernel aborts
    (docs/decisions.md, "Errors and timeouts")."""
    device_timeout_script.check_timeout_names_rank_1("sync-free", 29562)

