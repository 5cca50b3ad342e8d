"""The device barrier kernel (`kernels/_signal_triton.barrier`) under TRITON_INTERPRET=1, ranks simulated in one
process: every rank's flag area is a CPU tensor, addressed through the same 16-byte deltas as on GPU. The
interpreter runs one rank at a time, so each barrier runs as every rank's signal half, then every rank's wait
half (on GPU one launch does both). Run as a script: `python barrier_sim.py CASE`.
"""

import sys

import torch

from epcomm.kernels._signal_triton import barrier

NUM_RANKS = 3
FLAGS_OFF = 256  # the flags follow other bytes of the region, as in SymmetricRegion


def ranks():
    regions = [torch.zeros(FLAGS_OFF + 256, dtype=torch.uint8) for _ in range(NUM_RANKS)]
    ptrs = torch.tensor([t.data_ptr() for t in regions], dtype=torch.int64)
    deltas = [torch.div(ptrs - ptrs[r], 16, rounding_mode="floor") for r in range(NUM_RANKS)]
    status = [torch.zeros(1, dtype=torch.int64) for _ in range(NUM_RANKS)]
    return regions, deltas, status


def half(regions, deltas, status, r, signal, timeout_ns=10**10):
    barrier[(1,)](regions[r], deltas[r], status[r].data_ptr(), r, timeout_ns, FLAGS_OFF, R=NUM_RANKS, R_POW2=4,
                  SIGNAL=signal, WAIT=not signal, USE_TIMER=False, num_warps=1)


def flags(region):
    return region[FLAGS_OFF:].view(torch.int64)[:NUM_RANKS + 1].tolist()


def run(case: str) -> None:
    regions, deltas, status = ranks()
    gen = torch.Generator().manual_seed(0)
    if case == "barriers":
        for b in range(1, 5):
            order = torch.randperm(NUM_RANKS, generator=gen).tolist()  # arrival order does not matter
            for r in order:
                half(regions, deltas, status, r, signal=True)
            for r in order:
                half(regions, deltas, status, r, signal=False)
            for r in range(NUM_RANKS):
                assert flags(regions[r]) == [b] * NUM_RANKS + [b], (b, r, flags(regions[r]))
                assert int(status[r][0]) == 0
    elif case == "timeout":  # rank 1 never arrives at the second barrier: rank 0's wait ends and names it
        for signal in (True, False):
            for r in range(NUM_RANKS):
                half(regions, deltas, status, r, signal=signal)
        half(regions, deltas, status, 0, signal=True)
        half(regions, deltas, status, 2, signal=True)
        half(regions, deltas, status, 0, signal=False, timeout_ns=50_000_000)
        assert int(status[0][0]) == 2, status[0]  # 1 + the missing rank
        assert flags(regions[0]) == [2, 1, 2, 2]
    else:
        raise SystemExit(f"unknown case {case}")
    print("ok")


if __name__ == "__main__":
    run(sys.argv[1])
