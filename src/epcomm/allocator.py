"""`BufferAllocator`: plan tensors inside one region before the region exists (DeepEP V2.5 behaviour, §6).

A plan hands out *meta* placeholders, each at a 2 MiB-aligned offset of a region that does not exist yet;
`materialize(storage)` later turns every placeholder, in place, into a real view of `storage`, so every
reference the caller kept becomes usable without re-binding names. `EPBuffer(lb_allocation_plan_or_num_bytes=
plan)` allocates the load-balancing region (`buffer.lb_storage`) of `plan.num_bytes` bytes on the buffer's
device and materializes the plan on it (reference §7); `BucketBuffer(groups, plan)` does the same with its storage
(reference §14.1).

    plan = epcomm.BufferAllocator()
    w = plan.allocate((num_redundant_slots, 4096, 7168), torch.float8_e4m3fn)   # meta, for now
    buffer = epcomm.EPBuffer(group, ..., lb_allocation_plan_or_num_bytes=plan)
    w.device                                                                      # the buffer's device

Layout: tensor i starts at `offset_i = align(end_{i-1}, 2 MiB)` (`end_{-1} = 0`) and `num_bytes =
align(end_last, 2 MiB)`, so every tensor starts on a 2 MiB boundary and the region is a multiple of 2 MiB.
Ranks that exchange through the region use identical plans (same shapes, dtypes, order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

import torch
from torch import Tensor

from .sizing import ALLOCATION_ALIGNMENT, align

__all__ = ["BufferAllocator", "PlannedTensor"]


@dataclass(frozen=True, eq=False)
class PlannedTensor:
    """One entry of a plan.

    Fields:
        tensor: the placeholder (meta until `materialize`, then a view of the storage; same Python object).
        offset: int -- byte offset of the tensor in the region, a multiple of the plan's alignment.
        num_bytes: int -- bytes of the tensor (`numel * element size`).

    Entries compare and hash by identity (`a == b` is `a is b`): an entry is one place in one plan, and its
    placeholder has no values to compare (comparing the tensors element-wise made `==` raise).
    """

    tensor: Tensor
    offset: int
    num_bytes: int


class BufferAllocator:
    """A plan of tensors inside one region that does not exist yet (reference §6). Local: no communication.

    Fields:
        alignment: int -- start alignment of every tensor and of the plan size, in bytes (2 MiB).
        allocations: list of `PlannedTensor`, in allocation order.
        num_bytes: int -- bytes the region needs, a multiple of `alignment` (0 for an empty plan).
        materialized: bool -- True after `materialize`; a plan is materialized at most once.
    """

    def __init__(self):
        self.alignment = ALLOCATION_ALIGNMENT
        self.allocations: list = []
        self.num_bytes = 0
        self.materialized = False

    def __repr__(self) -> str:
        state = "materialized" if self.materialized else "planned"
        return f"BufferAllocator({len(self.allocations)} tensors, num_bytes={self.num_bytes}, {state})"

    def allocate(self, shape: Union[int, Sequence[int], torch.Size], dtype: torch.dtype) -> Tensor:
        """Reserve a tensor in the plan and return its meta placeholder.

        Args:
            shape: int or sequence of ints >= 0 -- the tensor's shape.
            dtype: torch.dtype -- its element type (any; bytes are reinterpreted at `materialize`).

        Returns:
            Tensor -- a contiguous meta tensor of `shape` and `dtype`; after `materialize` the same object is a
            view of the storage at the planned offset. Do not take views of it before then (they stay meta and
            block the in-place swap).

        Raises:
            TypeError: `shape` is not an int or a sequence of ints, or `dtype` is not a torch.dtype.
            ValueError: a negative dimension, or the plan is already materialized.
        """
        if self.materialized:
            raise ValueError("BufferAllocator.allocate: the plan is already materialized; plan every tensor before "
                             "passing the plan to EPBuffer (or calling materialize)")
        dims = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
        if isinstance(dims, (str, bytes)) or not isinstance(dims, (Sequence, torch.Size)) or \
                not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            raise TypeError(f"BufferAllocator.allocate: shape must be an int or a sequence of ints, got {shape!r}")
        if any(d < 0 for d in dims):
            raise ValueError(f"BufferAllocator.allocate: shape must have dimensions >= 0, got {tuple(dims)}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"BufferAllocator.allocate: dtype must be a torch.dtype, got {type(dtype).__name__}")
        placeholder = torch.empty(tuple(dims), dtype=dtype, device="meta")
        offset = align(self.num_bytes, self.alignment)
        nbytes = math.prod(dims) * dtype.itemsize
        self.allocations.append(PlannedTensor(placeholder, offset, nbytes))
        self.num_bytes = align(offset + nbytes, self.alignment)
        return placeholder

    def materialize(self, storage: Tensor) -> None:
        """Turn every placeholder, in place, into the view `storage[offset : offset + num_bytes]` (its dtype and
        shape) with `torch.utils.swap_tensors`. Local; called by `EPBuffer` on its LB region.

        Args:
            storage: [num_bytes] uint8 contiguous -- the region, on any real device (CPU for a CPU buffer, the
                buffer's GPU for a CUDA buffer; docs/decisions.md decision 2). It must stay alive as long as the
                tensors are used (the views keep it alive).

        Raises:
            TypeError: `storage` is not a uint8 tensor.
            ValueError: the plan is already materialized; `storage` is not 1-D, not contiguous, on the meta
                device, or does not hold exactly `num_bytes` bytes; a placeholder cannot be swapped (it has
                views or other holders of its implementation).
        """
        call = "BufferAllocator.materialize"
        if self.materialized:
            raise ValueError(f"{call}: the plan is already materialized (a plan is used once); make a new "
                             "BufferAllocator for another buffer")
        self._swap_into(storage, call, "do not take views of placeholders before materialize")
        self.materialized = True

    def release(self) -> None:
        """Turn every tensor of a materialized plan back into its meta placeholder (same Python objects) and mark
        the plan planned again: a buffer whose construction failed after it materialized the plan calls it, so that
        every rank's plan is as the caller passed it. Local.

        Raises:
            ValueError: the plan is not materialized, or a tensor cannot be swapped (views were taken of it).
        """
        call = "BufferAllocator.release"
        if not self.materialized:
            raise ValueError(f"{call}: the plan is not materialized")
        for i, p in enumerate(self.allocations):
            try:
                torch.utils.swap_tensors(p.tensor, torch.empty(p.tensor.shape, dtype=p.tensor.dtype, device="meta"))
            except RuntimeError as exc:
                raise ValueError(f"{call}: planned tensor #{i} cannot be swapped back: another tensor shares it") \
                    from exc
        self.materialized = False

    def rebind(self, storage: Tensor) -> None:
        """Move every tensor of a materialized plan, in place, onto `storage` (same layout, same Python objects).
        Local; `EPBuffer` calls it, before returning, when its LB region moves into symmetric memory. Values are
        not copied, and views taken of the tensors earlier keep pointing at the old storage.

        Args:
            storage: [num_bytes] uint8 contiguous -- the new region, as for `materialize`.

        Raises:
            TypeError: `storage` is not a uint8 tensor.
            ValueError: the plan is not materialized yet; `storage` is not a valid region (as `materialize`); a
                tensor cannot be swapped; the plan then stays on its old storage.
        """
        call = "BufferAllocator.rebind"
        if not self.materialized:
            raise ValueError(f"{call}: the plan is not materialized yet; call materialize first")
        self._swap_into(storage, call, "the plan stays on its old storage")

    def _swap_into(self, storage: Tensor, call: str, hint: str) -> None:
        if not isinstance(storage, Tensor):
            raise TypeError(f"{call}: storage must be a torch.Tensor, got {type(storage).__name__}")
        if storage.dtype != torch.uint8:
            raise TypeError(f"{call}: storage must have dtype torch.uint8, got {storage.dtype}")
        if storage.dim() != 1 or not storage.is_contiguous():
            raise ValueError(f"{call}: storage must be a 1-D contiguous tensor, got shape {tuple(storage.shape)} "
                             f"and strides {storage.stride()}")
        if storage.device.type == "meta":
            raise ValueError(f"{call}: storage must be on a real device (cpu or cuda), got {storage.device}")
        if storage.numel() != self.num_bytes:
            raise ValueError(f"{call}: storage holds {storage.numel()} bytes but the plan needs num_bytes="
                             f"{self.num_bytes}; allocate exactly plan.num_bytes bytes")
        views = [storage[p.offset:p.offset + p.num_bytes].view(p.tensor.dtype).view(p.tensor.shape)
                 for p in self.allocations]
        for i, (p, view) in enumerate(zip(self.allocations, views)):
            try:
                torch.utils.swap_tensors(p.tensor, view)
            except RuntimeError as exc:
                for q, done in zip(self.allocations[:i], views[:i]):
                    torch.utils.swap_tensors(q.tensor, done)  # undo: the plan stays whole where it was
                raise ValueError(
                    f"{call}: planned tensor #{i} (shape {tuple(p.tensor.shape)}, {p.tensor.dtype}) cannot be "
                    f"swapped in place: another tensor shares it; {hint} (torch's reason is the cause below)") from exc
