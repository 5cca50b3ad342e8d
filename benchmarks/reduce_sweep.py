"""The canonical-reduce kernel's launch configurations on one GPU, at the dsv3 combine shape (rank 0 of EP2).

Usage: python benchmarks/reduce_sweep.py [--tokens 4096] [--hidden 7168]
Rows: [2 * tokens, hidden] BF16 (a rank's received rows, own share included); every token has 2 items (one per
rank) at random top-k positions out of 8. Median of 20 after 3 warm-up (CUDA events); GB/s counts the rows read
and written once. Checked bitwise against the torch twin first.

The second table is the chunked combine's shape: the own rows read in place (`own`), the tokens in 3 chunks of a
random permutation (ascending within a chunk), one launch per chunk, at a capped grid (`num_sms`), across tiles and warps.
"""

import argparse
import statistics

import torch

from epcomm.kernels import _reduce_triton
from epcomm.kernels.reduce import canonical_reduce_torch


def main(args):
    torch.manual_seed(0)
    t, h = args.tokens, args.hidden
    rows = torch.randn(2 * t, h, device="cuda").bfloat16()
    item = torch.full((t, 8), -1, dtype=torch.int64, device="cuda")
    pos = torch.rand(t, 8, device="cuda").argsort(1)[:, :2]
    item.scatter_(1, pos, torch.stack([torch.arange(t, device="cuda"), t + torch.arange(t, device="cuda")], 1))
    want = canonical_reduce_torch(rows, item)
    moved = 3 * t * h * 2
    # The combine hands the kernel its items left-packed (at most one per rank): 2 columns instead of 8.
    packed = item.gather(1, torch.sort((item < 0).to(torch.int8), dim=1, stable=True).indices)[:, :2].contiguous()
    configs = [  # (items, programs, block_t, block_h, warps); programs 0 = one per tile
        ("8 cols", 0, 4, 1024, 8), ("8 cols", 28, 8, 2048, 16),
        ("packed", 0, 1, 1024, 4), ("packed", 0, 4, 1024, 8), ("packed", 0, 8, 512, 8), ("packed", 0, 8, 1024, 8),
        ("packed", 132, 8, 2048, 16), ("packed", 28, 4, 1024, 8), ("packed", 28, 8, 2048, 16),
        ("packed", 28, 16, 1024, 16), ("packed", 28, 16, 2048, 16), ("packed", 24, 8, 2048, 16),
        ("packed", 24, 16, 2048, 16), ("packed", 28, 8, 2048, 32), ("packed", 24, 8, 2048, 32),
        ("packed", 28, 32, 1024, 32), ("packed", 24, 32, 1024, 32),
    ]
    for cols, programs, bt, bh, warps in configs:
        items = item if cols == "8 cols" else packed
        out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")

        def fn():
            _reduce_triton.launch(rows, items, None, None, out, num_programs=programs, block_t=bt, block_h=bh,
                                  num_warps=warps)
        med, ok = _time(fn, out, want)
        print(f"{cols} programs {programs:4d} block_t {bt:2d} block_h {bh:5d} warps {warps:2d}: {med:8.1f} us "
              f"{moved / med / 1e3:7.0f} GB/s {'ok' if ok else 'MISMATCH'}", flush=True)
    print("chunked, own rows in place:")
    bounds = torch.tensor([0, t // 3, 2 * t // 3, t], device="cuda")
    perm = torch.randperm(t, device="cuda")  # ascending within each chunk, as `pipeline._token_chunks` gives them
    tokens = torch.cat([perm[a:b].sort().values for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())])
    own = rows[:t].clone()
    chunked = [(p, bt, bh, w) for p in (24, 28, 132) for bt, bh, w in (
        (16, 2048, 16), (16, 2048, 32), (8, 2048, 32), (8, 1024, 32), (8, 1024, 16), (4, 2048, 16), (32, 1024, 32))]
    chunked += [(0, 4, 1024, 8), (0, 8, 512, 8)]  # one program per tile, as the combine launches at every SM
    for programs, bt, bh, warps in chunked:
        out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")

        def fn():
            for c in range(3):
                _reduce_triton.launch(rows, packed, None, None, out, num_programs=programs, block_t=bt, block_h=bh,
                                      num_warps=warps, tokens=tokens, bounds=bounds, chunk=c, num_chunks=3, own=own,
                                      own_lo=0)
        med, ok = _time(fn, out, want)
        print(f"programs {programs:4d} block_t {bt:2d} block_h {bh:5d} warps {warps:2d}: "
              f"{med:8.1f} us {moved / med / 1e3:7.0f} GB/s {'ok' if ok else 'MISMATCH'}", flush=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    canonical_reduce_torch(rows, item)
    end.record()
    end.synchronize()
    print(f"torch twin: {start.elapsed_time(end) * 1e3:.1f} us")


def _time(fn, out, want) -> tuple:
    """(median us of 20 calls after 3 warm-up, whether `out` matches `want` bitwise)."""
    out.fill_(float("nan"))
    fn()
    torch.cuda.synchronize()
    ok = torch.equal(out, want)
    times = []
    for it in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if it >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times), ok


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    main(p.parse_args())
