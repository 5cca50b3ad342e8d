"""Rank-side bodies of the tests of the NVLink path of the LB calls (lb_nvlink.py; DeepEP V2.5 behaviour, §13).

On CUDA the buffer's nvlink transport gives the LB region its symmetric memory; on CPU `FileSymm` stands in for it
(shared file mappings between gloo ranks of one host), so the same bodies check the pushes, pulls, offsets from
the headers, the path choice and the fallback on both. Each function runs as `fn(rank, world_size, ...)`.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from lb_cases import SENTINEL, MiB, _grad_value, make_buffer, make_mapping, ramp

from epcomm import lb_nvlink
from epcomm.allocator import BufferAllocator


class FileSymm:
    """CPU stand-in for `transport.symm.SymmetricRegion`: each rank's region is a shared file mapping that every
    rank of the host opens, so the NVLink path runs between gloo ranks (peer views alias the peer's memory; the
    device barrier is a host barrier, which orders CPU work)."""

    def __init__(self, group, nbytes: int, device, timeout_s: float = 0.0):
        rank = group.rank()
        name = [tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) if rank == 0 else None]
        dist.broadcast_object_list(name, src=0, group=group)
        self.dir, self.group, self.num_barriers = name[0], group, 0
        torch.from_file(f"{self.dir}/r{rank}", shared=True, size=nbytes, dtype=torch.uint8)  # creates the file
        dist.barrier(group=group)
        self.maps = [torch.from_file(f"{self.dir}/r{r}", shared=True, size=nbytes, dtype=torch.uint8)
                     for r in range(group.size())]
        self.local = self.maps[rank]
        dist.barrier(group=group)  # every rank has mapped every file: the mappings outlive the files
        if rank == 0:
            shutil.rmtree(self.dir, ignore_errors=True)

    def peer(self, rank: int, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        assert offset % dtype.itemsize == 0 and offset + n <= self.local.numel()
        return self.maps[rank][offset:offset + n].view(dtype).view(shape)

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        self.num_barriers += 1
        dist.barrier(group=self.group)


def _lb_buffer(device: str, plan):
    """A buffer whose LB region is symmetric: on CUDA the nvlink transport's own, on CPU shared files."""
    buf = make_buffer(device, plan)
    if device == "cuda":
        assert buf.transport.name == "nvlink", f"expected the nvlink transport, got {buf.transport.name}"
    else:
        buf._lb_region = lb_nvlink.attach_lb_region(buf, FileSymm)
    assert buf._lb_region is not None and buf.lb_storage.data_ptr() == buf._lb_region.local.data_ptr()
    return buf


def _plan_tensors(rank: int, specs: list, inside: list):
    """Allocate `specs` [(shape, dtype)] that are `inside` from one plan, plus a 1-byte pad first on even ranks
    and last on odd ones: same region size everywhere, different offsets (peers' offsets come from the headers)."""
    plan, planned = BufferAllocator(), {}
    if rank % 2 == 0:
        plan.allocate(1, torch.uint8)
    for k, (shape, dtype) in enumerate(specs):
        if inside[k]:
            planned[k] = plan.allocate(shape, dtype)
    if rank % 2 == 1:
        plan.allocate(1, torch.uint8)
    return plan, planned


def check_prefetch_paths(rank: int, world: int, *, pattern: str, payload_bytes: tuple, placement: str = "region",
                         num_local: int = 4, num_slots: int = 4, device: str = "cpu", seed: int = 0,
                         bulk_row_bytes: Optional[int] = None) -> tuple:
    """Byte ramps pushed into sentinel-filled slots; redundant tensors in the symmetric LB region ("region"),
    outside it ("outside": the collective fallback) or alternating ("mixed"). Returns the call's
    (payloads on the nvlink path, payloads on the collective path)."""
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    mapping = make_mapping(pattern, world, num_local, num_slots, seed=seed)
    dtypes = [torch.bfloat16, torch.float32, torch.uint8, torch.int64]
    specs, origs = [], []
    for k, nbytes in enumerate(payload_bytes):
        dtype = dtypes[k % len(dtypes)] if nbytes % dtypes[k % len(dtypes)].itemsize == 0 else torch.uint8
        specs.append(((num_slots, nbytes // dtype.itemsize), dtype))
        expert_bytes = torch.stack([ramp(rank * num_local + i, k, nbytes) for i in range(num_local)])
        origs.append(expert_bytes.to(dev).view(dtype))
    inside = [placement == "region" or (placement == "mixed" and k % 2 == 0) for k in range(len(specs))]
    plan, planned = _plan_tensors(rank, specs, inside)
    buf = _lb_buffer(device, plan)
    reds = [planned[k] if inside[k] else torch.empty(specs[k][0], dtype=specs[k][1], device=dev)
            for k in range(len(specs))]
    old_bulk = lb_nvlink.BULK_ROW_BYTES
    lb_nvlink.BULK_ROW_BYTES = bulk_row_bytes if bulk_row_bytes is not None else old_bulk
    try:
        for t in reds:
            t.view(torch.uint8).fill_(SENTINEL)
        buf.lb_prefetch_weights(reds, origs, mapping, previous_event=buf.capture()).current_stream_wait()
        paths = buf._lb_paths
        # a second call on the same mapping reuses the cached moves and index tensors
        buf.lb_prefetch_weights(reds, origs, mapping).current_stream_wait()
    finally:
        lb_nvlink.BULK_ROW_BYTES = old_bulk
    for k, (t, nbytes) in enumerate(zip(reds, payload_bytes)):
        assert (buf._lb_region.offset_of(t) >= 0) == inside[k], f"rank {rank}: payload {k} placement"
        got = t.view(torch.uint8).view(num_slots, nbytes).cpu()
        for c, e in enumerate(mapping[rank].tolist()):
            want = ramp(e, k, nbytes) if e >= 0 else torch.full((nbytes,), SENTINEL, dtype=torch.uint8)
            assert torch.equal(got[c], want), f"rank {rank} payload {k} slot {c} (expert {e}) differs"
    buf.destroy()
    return paths


def check_reduce_paths(rank: int, world: int, *, pattern: str, hidden: int, placement: str = "region",
                       num_local: int = 4, num_slots: int = 4, dtype: torch.dtype = torch.float32,
                       random: bool = False, num_payloads: int = 2, device: str = "cpu", seed: int = 0,
                       bulk_row_bytes: Optional[int] = None) -> tuple:
    """Seed + the replicas' gradients in ascending (rank, slot), bitwise, with the redundant gradients in the
    symmetric LB region, outside it, or alternating; the redundant gradients stay unchanged. Returns the paths."""
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    mapping = make_mapping(pattern, world, num_local, num_slots, seed=seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    specs = [((num_slots, hidden + k), dtype) for k in range(num_payloads)]
    inside = [placement == "region" or (placement == "mixed" and k % 2 == 0) for k in range(num_payloads)]
    plan, planned = _plan_tensors(rank, specs, inside)
    buf = _lb_buffer(device, plan)
    reds, grads, expected = [], [], []
    for k in range(num_payloads):
        h = hidden + k
        values = torch.stack([_grad_value(rank, c + 100 * k, h, dtype, random) for c in range(num_slots)])
        red = planned[k] if inside[k] else torch.empty(specs[k][0], dtype=specs[k][1], device=dev)
        red.copy_(values)
        seed_g = torch.stack([_grad_value(rank, 50 + i + 100 * k, h, dtype, random) for i in range(num_local)])
        want = torch.empty(num_local, h, dtype=acc)  # fresh: never an alias of the tensor under test
        want.copy_(seed_g)
        for r, row in enumerate(mapping.tolist()):  # ascending (rank, slot): the contract
            for c, e in enumerate(row):
                if e >= 0 and e // num_local == rank:
                    want[e % num_local] += _grad_value(r, c + 100 * k, h, dtype, random).to(acc)
        reds.append(red)
        grads.append(seed_g.to(dev, copy=True))
        expected.append(want.to(dtype, copy=True))
    before = [t.clone() for t in reds]
    old_bulk = lb_nvlink.BULK_ROW_BYTES
    lb_nvlink.BULK_ROW_BYTES = bulk_row_bytes if bulk_row_bytes is not None else old_bulk
    try:
        buf.lb_reduce_grads(reds, grads, mapping, previous_event=buf.capture()).current_stream_wait()
    finally:
        lb_nvlink.BULK_ROW_BYTES = old_bulk
    paths = buf._lb_paths
    for k in range(num_payloads):
        assert torch.equal(reds[k], before[k]), f"rank {rank}: redundant_expert_grads[{k}] was modified"
        got = grads[k].cpu()
        if not torch.equal(got, expected[k]):
            bad = (got != expected[k]).nonzero()[0].tolist()
            raise AssertionError(f"rank {rank} payload {k}: expert_grads differ first at {bad}: "
                                 f"{got[tuple(bad)]} vs {expected[k][tuple(bad)]}")
    buf.destroy()
    return paths


def lb_region_sizes_differ(rank: int, world: int, device: str = "cpu") -> tuple:
    """Ranks whose LB regions differ in size warn, keep local regions, and LB calls take the collective path."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf = make_buffer(device, (2 + 2 * rank) * MiB)
        if device != "cuda":
            buf._lb_region = lb_nvlink.attach_lb_region(buf, FileSymm)
    messages = [str(w.message) for w in caught if "LB regions differ in size" in str(w.message)]
    region = buf._lb_region
    dev = buf.lb_storage.device
    red = buf.lb_storage[:2 * 8].view(torch.float32).view(2, 2)
    mapping = make_mapping("ring", world, 2, 2, empty_ratio=0.0)
    orig = torch.full((2, 2), float(rank + 1), device=dev)
    buf.lb_prefetch_weights(red, orig, mapping).current_stream_wait()
    paths = buf._lb_paths
    assert bool((red.cpu() == float((rank + 1) % world + 1)).all()), f"rank {rank}: {red}"
    buf.destroy()
    return region is None, messages, paths
