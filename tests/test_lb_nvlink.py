"""The NVLink path of the LB calls (lb_nvlink.py, lb_sum.py): the symmetric LB region, owners pushing weights into
the replicas' slots and pulling their gradients through peer views, the ordered sum, the path choice and the
collective fallback (DeepEP V2.5 behaviour, §6-7, §13; docs/decisions.md "LB gradient reduction").

On CPU the region is `lb_nvlink_cases.FileSymm` (shared files between gloo ranks) or, in one process, a list of
tensors; on 2 GPUs (`-m multigpu`) it is the nvlink transport's symmetric memory.
"""

import math
from collections import OrderedDict

import lb_nvlink_cases as cases
import pytest
import torch
from lb_cases import make_mapping, ramp

from epcomm import lb_nvlink
from epcomm.lb import lb_routes
from epcomm.lb_nvlink import LBRegion, PeerMoves, lb_moves, pull_grads, push_weights
from epcomm.lb_sum import ordered_accumulate

# Bytes per expert: odd sizes (byte words), word-aligned ones, and rows above the bulk threshold when it is lowered.
PAYLOADS = [(4104, 36, 6), (96, 64, 32), (20480,)]


def test_moves_worked_example():
    mapping = [[2, 3], [0, -1]]
    assert lb_moves(mapping, 2, 1, prefetch=True) == [PeerMoves(0, [0, 1], [0, 1], [(0, 0, 2)])]
    assert lb_moves(mapping, 2, 0, prefetch=True) == [PeerMoves(1, [0], [0], [(0, 0, 1)])]
    # reduce: rows number the pulled rows in ascending (rank, slot), the order of lb_routes' send_rows
    mapping = [[-1, -1, 5, 4], [1, 0, 2, -1], [6, 0, 0, 1]]
    moves = lb_moves(mapping, 4, 0, prefetch=False)
    assert [(m.peer, m.rows, m.slots, m.runs) for m in moves] == [
        (1, [0, 1, 2], [0, 1, 2], [(0, 0, 3)]), (2, [3, 4, 5], [1, 2, 3], [(3, 1, 3)])]
    assert lb_routes(mapping, 4, 0).send_rows == [1, 0, 2, 0, 0, 1]
    pushes = lb_moves(mapping, 4, 0, prefetch=True)
    assert [(m.rows, m.runs, m.slots_contiguous) for m in pushes] == [
        ([1, 0, 2], [(1, 0, 1), (0, 1, 1), (2, 2, 1)], True), ([0, 0, 1], [(0, 1, 1), (0, 2, 2)], True)]


def test_ordered_sum_worked_example():
    # experts [1, 0, 1]: round 0 adds rows 0, 1 into experts 1, 0; round 1 adds row 2 into expert 1
    grads = torch.tensor([[1.0], [2.0]])
    rows = torch.tensor([[10.0], [20.0], [30.0]]).view(torch.uint8)
    ordered_accumulate([grads], [rows], [1, 0, 1], OrderedDict())
    assert torch.equal(grads, torch.tensor([[21.0], [42.0]]))
    # bf16: summed in fp32 and rounded once (a sequential bf16 sum would round 256 + 1 back to 256 twice)
    grads = torch.tensor([[256.0]], dtype=torch.bfloat16)
    rows = torch.tensor([[1.0], [1.0]], dtype=torch.bfloat16).view(torch.uint8)
    ordered_accumulate([grads], [rows], [0, 0], OrderedDict())
    assert grads.item() == 258.0


class _Symm:
    """R regions in one process (ranks simulated one after another; barriers are no-ops)."""

    def __init__(self, storages, rank):
        self.storages, self.local = storages, storages[rank]

    def peer(self, rank, offset, shape, dtype):
        return self.storages[rank][offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def barrier(self, channel=0, timeout_ms=0):
        pass


def _simulate(mapping, num_local, nbytes, prefetch, offset=64):
    world, num_slots = len(mapping), len(mapping[0])
    storages = [torch.zeros(offset + num_slots * nbytes, dtype=torch.uint8) for _ in range(world)]
    regions = [LBRegion(_Symm(storages, r)) for r in range(world)]
    reds = [s[offset:].view(num_slots, nbytes) for s in storages]
    assert all(regions[r].offset_of(reds[r]) == offset for r in range(world))
    assert regions[0].offset_of(torch.zeros(4)) == -1 and regions[0].offset_of(storages[0][:0]) == -1
    ops = []
    if prefetch:
        origs = [torch.stack([ramp(r * num_local + i, 0, nbytes) for i in range(num_local)]) for r in range(world)]
        for r in range(world):
            moves = regions[r].moves(mapping, num_local, r, True)
            ops.append(push_weights(regions[r], moves, [reds[r]], [origs[r]], [[offset] * world]))
        for r, row in enumerate(mapping):
            for c, e in enumerate(row):
                want = ramp(e, 0, nbytes) if e >= 0 else torch.zeros(nbytes, dtype=torch.uint8)
                assert torch.equal(reds[r][c], want), (r, c, e)
        return ops
    gen = torch.Generator().manual_seed(nbytes)
    for red in reds:
        red.view(torch.float32).copy_(torch.randn(num_slots, nbytes // 4, generator=gen))
    for r in range(world):
        grads = torch.randn(num_local, nbytes // 4, generator=gen)
        want = grads.clone()
        for s, row in enumerate(mapping):  # ascending (rank, slot)
            for c, e in enumerate(row):
                if e >= 0 and e // num_local == r:
                    want[e % num_local] += reds[s][c].view(torch.float32)
        rows, num_ops = pull_grads(regions[r], regions[r].moves(mapping, num_local, r, False), [reds[r]],
                                   [[offset] * world])
        ordered_accumulate([grads], rows, lb_routes(mapping, num_local, r).send_rows, OrderedDict())
        assert torch.equal(grads, want), r
        ops.append(num_ops)
    return ops


def test_one_op_per_peer_and_payload(monkeypatch):
    ring = make_mapping("ring", 3, 4, 4, empty_ratio=0.0).tolist()
    assert _simulate(ring, 4, 4096, prefetch=True) == [1, 1, 1]  # one run each: one copy-engine write
    assert _simulate(ring, 4, 4096, prefetch=False) == [1, 1, 1]
    # rank 1 -> rank 0: slots 0, 1, 3 (not contiguous): gather + index_copy_; rank 0 -> rank 1: slots 0-3
    # (contiguous, rows out of order): gather + one copy-engine write
    mixed = [[5, 4, -1, 6], [1, 0, 2, 3]]
    assert _simulate(mixed, 4, 4096, prefetch=True) == [2, 2]
    assert _simulate(mixed, 4, 4096, prefetch=False) == [1, 1]  # one index_select into the staging rows
    monkeypatch.setattr(lb_nvlink, "BULK_ROW_BYTES", 1024)  # rows above it: one copy-engine op per run
    assert _simulate(mixed, 4, 4096, prefetch=True) == [3, 3]
    assert _simulate(mixed, 4, 4096, prefetch=False) == [1, 2]


@pytest.mark.parametrize("nbytes", [6, 36, 4096, 4104])
def test_simulated_patterns(nbytes):
    for pattern in ("random", "ring", "spread", "repeat"):
        for seed in range(3):
            mapping = make_mapping(pattern, 4, 3, 5, seed=seed).tolist()
            _simulate(mapping, 3, nbytes, prefetch=True)
            if nbytes % 4 == 0:
                _simulate(mapping, 3, nbytes, prefetch=False)


# ----------------------------------------------------------------------------------------------------------
# end to end through EPBuffer on CPU ranks (FileSymm)
# ----------------------------------------------------------------------------------------------------------
EXPECTED_PATHS = {"region": lambda k: (k, 0), "outside": lambda k: (0, k), "mixed": lambda k: ((k + 1) // 2, k // 2)}


@pytest.mark.parametrize("placement", sorted(EXPECTED_PATHS))
@pytest.mark.parametrize("pattern", ["random", "ring", "spread", "repeat"])
def test_prefetch_through_the_symmetric_region(run_ranks, pattern, placement):
    for i, payload in enumerate(PAYLOADS):
        for bulk in (None, 1024):
            paths = run_ranks(3, cases.check_prefetch_paths, pattern=pattern, payload_bytes=payload,
                              placement=placement, seed=i, bulk_row_bytes=bulk)
            assert paths == [EXPECTED_PATHS[placement](len(payload))] * 3


@pytest.mark.parametrize("placement", sorted(EXPECTED_PATHS))
@pytest.mark.parametrize("pattern", ["random", "ring", "spread", "repeat"])
def test_reduce_through_the_symmetric_region(run_ranks, pattern, placement):
    for hidden, bulk in ((24, None), (3064, None), (3064, 1024)):
        paths = run_ranks(3, cases.check_reduce_paths, pattern=pattern, hidden=hidden, placement=placement,
                          random=pattern == "spread", seed=hidden, bulk_row_bytes=bulk)
        assert paths == [EXPECTED_PATHS[placement](2)] * 3


def test_reduce_dtypes_through_the_symmetric_region(run_ranks):
    for dtype in (torch.bfloat16, torch.float64, torch.float16):
        run_ranks(2, cases.check_reduce_paths, pattern="spread", hidden=40, dtype=dtype, random=True,
                  num_payloads=3)


def test_region_sizes_that_differ_fall_back(run_ranks):
    for rank, (no_region, messages, paths) in enumerate(run_ranks(2, cases.lb_region_sizes_differ)):
        assert no_region and paths == (0, 1), (rank, no_region, paths)
        assert len(messages) == 1 and f"rank {rank}: the ranks' LB regions differ in size ([2097152, 4194304] " \
                                      "bytes by group rank)" in messages[0], messages


# ----------------------------------------------------------------------------------------------------------
# GPU: the nvlink transport's symmetric memory, copy engines
# ----------------------------------------------------------------------------------------------------------
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.multigpu
@two_gpus
@pytest.mark.parametrize("placement", sorted(EXPECTED_PATHS))
@pytest.mark.parametrize("pattern", ["random", "ring", "spread", "repeat"])
def test_nvlink_prefetch_on_gpu(pools, pattern, placement):
    for i, payload in enumerate([(1 << 20, 16384, 4096), (4 << 20, 36, 6), (12320, 12256, 32), (96, 64, 32)]):
        paths = pools.get(2, "nccl").run(cases.check_prefetch_paths, pattern=pattern, payload_bytes=payload,
                                         placement=placement, num_local=8, num_slots=8, device="cuda", seed=i,
                                         bulk_row_bytes=1024 if i == 3 else None)  # i == 3: one copy_ per run
        assert paths == [EXPECTED_PATHS[placement](len(payload))] * 2


@pytest.mark.multigpu
@two_gpus
@pytest.mark.parametrize("placement", sorted(EXPECTED_PATHS))
@pytest.mark.parametrize("pattern", ["random", "ring", "spread", "repeat"])
def test_nvlink_reduce_on_gpu(pools, pattern, placement):
    # small integers (exact sums), random fp32 (only the ascending (rank, slot) order matches), 4 MiB rows (bulk)
    for hidden, random in ((24, False), (3072, False), (3072, True), ((1 << 20) + 8, False)):
        paths = pools.get(2, "nccl").run(cases.check_reduce_paths, pattern=pattern, hidden=hidden,
                                         placement=placement, num_local=8, num_slots=8, random=random,
                                         device="cuda", seed=hidden)
        assert paths == [EXPECTED_PATHS[placement](2)] * 2


@pytest.mark.multigpu
@two_gpus
def test_nvlink_reduce_dtypes_on_gpu(pools):
    for dtype in (torch.bfloat16, torch.float64, torch.float16):
        pools.get(2, "nccl").run(cases.check_reduce_paths, pattern="spread", hidden=3000, dtype=dtype, random=True,
                                 num_payloads=3, device="cuda")


@pytest.mark.multigpu
@two_gpus
def test_nvlink_region_sizes_that_differ_fall_back_on_gpu(pools):
    for no_region, messages, paths in pools.get(2, "nccl").run(cases.lb_region_sizes_differ, device="cuda"):
        assert no_region and paths == (0, 1) and len(messages) == 1, (no_region, messages, paths)
