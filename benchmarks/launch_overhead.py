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
t0 = time.perf_counter()
for _ in range(100):
    torch.cuda.synchronize()
print(f"synchronize (idle): {1e6 * (time.perf_counter() - t0) / 100:.1f} us")
t0 = time.perf_counter()
for _ in range(100):
    int(idx[0])
print(f"item() host sync: {1e6 * (time.perf_counter() - t0) / 100:.1f} us")
