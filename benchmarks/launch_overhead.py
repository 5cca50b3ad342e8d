"""Host cost of one small eager torch op and of one Triton launch on this machine (explains small-op overheads)."""

import time

import torch

x = torch.zeros(1024, device="cuda")
for n in (10, 1000):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
print(f"eager add_: {1e6 * (t1 - t0) / n:.1f} us host per op, {1e6 * (t2 - t0) / n:.1f} us per op incl. device")
idx = torch.arange(4096, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(1000):
    y = torch.where(idx >= 0, idx, -1)
torch.cuda.synchronize()
print(f"torch.where on 4096 int64: {1e6 * (time.perf_counter() - t0) / 1000:.1f} us per op")
for name, fn in [("where(scalar)", lambda: torch.where(idx >= 0, idx, -1)),
                 ("masked_fill", lambda: idx.masked_fill(idx < 0, -1)),
                 ("index_select 8192x14336 B", lambda: big.index_select(0, rows)),
                 ("cumsum dim0 [4096,3]", lambda: small.cumsum(0))]:
    big = torch.empty(8192, 14336, dtype=torch.uint8, device="cuda")
    rows = torch.randperm(8192, device="cuda")
    small = torch.ones(4096, 3, dtype=torch.int64, device="cuda")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    print(f"{name}: {1e6 * (time.perf_counter() - t0) / 100:.1f} us per op")
t0 = time.perf_counter()
for _ in range(100):
    torch.cuda.synchronize()
print(f"synchronize (idle): {1e6 * (time.perf_counter() - t0) / 100:.1f} us")
t0 = time.perf_counter()
for _ in range(100):
    int(idx[0])
print(f"item() host sync: {1e6 * (time.perf_counter() - t0) / 100:.1f} us")
