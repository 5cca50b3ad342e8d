"""`BucketSession`: bucket collectives on tensors outside a `BucketBuffer`'s storage, staged in it (DeepEP V2.5
behaviour, §14.3).

`with buffer.session() as s:` resets a bump allocator at the start of the storage and shadows the buffer's
collectives with the session's; `allocate` carves tensors from it, and the collectives stage sources through it
(the placement rules themselves are in bucket_placement.py, shared with the buffer). A staging request that does
not fit raises `SessionOutOfStorage`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import sizing
from .bucket_placement import BucketEvent, gather_call, reduce_call
from .comm import CommContext
from .compile_guard import eager_under_compile

if TYPE_CHECKING:
    from .bucket import BucketBuffer

__all__ = ["BucketSession", "SessionOutOfStorage"]

STAGING_ALIGNMENT = sizing.RDMA_ALIGNMENT  # session allocation granularity: the reference's RDMA alignment (§1)


class SessionOutOfStorage(ValueError, RuntimeError):
    """A session's staging does not fit in the storage (a `ValueError`; a `RuntimeError` as in the reference)."""


class BucketSession:
    """`with buffer.session() as s:` -- bucket collectives on tensors outside the storage (reference §14.3).

    Entering resets a bump allocator at the start of `storage` (the caller makes sure that region is free) and
    shadows `buffer.all_gather / reduce_scatter / all_reduce` with this session's methods; exiting restores
    them. Sessions do not nest, and every collective of one session uses the same group. Per input: a `src` in
    the storage is used in place (the buffer's rules); else, when its `dst` is in the storage, the staging area
    is derived from the `dst`; else a staging area is carved (64-byte granularity). Sources outside the storage
    are copied into their staging area. At `wait()`, results are copied into `dsts` that differ from the
    staging views; without `dsts` the staging views are returned (use them before the storage is reused).
    """

    def __init__(self, buffer: BucketBuffer):
        self.buffer = buffer
        self._offset = 0
        self._ctx: Optional[CommContext] = None
        self._open = False

    def __enter__(self) -> "BucketSession":
        b = self.buffer
        _, c = b._begin("BucketBuffer.session", b.groups[0] if b.groups else None)
        if b._session is not None:
            c.fail(ValueError, "a session is already open on this buffer; sessions do not nest")
        b._session, self._open, self._offset, self._ctx = self, True, 0, None
        b._sessions_opened += 1
        b.all_gather, b.reduce_scatter, b.all_reduce = self.all_gather, self.reduce_scatter, self.all_reduce
        return self

    def __exit__(self, *exc) -> None:
        for name in ("all_gather", "reduce_scatter", "all_reduce"):
            self.buffer.__dict__.pop(name, None)
        self.buffer._session, self._open = None, False

    def _context(self, call: str, group):
        ctx, c = self.buffer._begin(call, group)
        if not self._open:
            c.fail(ValueError, "the session is closed; open one with `with buffer.session() as s:`")
        if self._ctx is None:
            self._ctx = ctx
        elif self._ctx is not ctx:
            c.fail(ValueError, f"all collectives of one session must use the same group: the session uses group "
                               f"#{self.buffer.contexts.index(self._ctx)}, this call group "
                               f"#{self.buffer.contexts.index(ctx)}")
        return ctx, c

    def _carve(self, c, nbytes: int) -> Tensor:
        start = sizing.align(self._offset, STAGING_ALIGNMENT)
        if start + nbytes > self.buffer.num_bytes:
            raise SessionOutOfStorage(
                f"{c.call}: rank {c.rank}: session out of storage: staging needs {nbytes} bytes at offset {start} "
                f"but the storage has {self.buffer.num_bytes}; use a larger BucketBuffer or fewer buckets per session")
        self._offset = start + nbytes
        return self.buffer.storage[start:start + nbytes]

    def allocate(self, shapes, dtype: torch.dtype = torch.float32, group: Optional[dist.ProcessGroup] = None):
        """Carve tensors from the session's storage (usable as in-storage inputs).

        Args:
            shapes: one shape (an int, tuple or `torch.Size`) or a list of shapes.
            dtype: element type. Default fp32.
            group: the session's group (sets it when it is the first use).

        Returns:
            One tensor for one shape, a tuple for a list; views into `storage` (64-byte aligned), not zeroed.

        Raises:
            TypeError: bad shapes or dtype. SessionOutOfStorage (a ValueError and a RuntimeError): they do not fit.
        """
        _, c = self._context("BucketSession.allocate", group)
        one = isinstance(shapes, int) or (isinstance(shapes, (tuple, list, torch.Size))
                                           and all(isinstance(d, int) for d in shapes))
        items = [shapes] if one else shapes
        if not isinstance(dtype, torch.dtype):
            c.fail(TypeError, f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
        if not isinstance(items, (list, tuple)):
            c.fail(TypeError, f"shapes must be a shape or a list of shapes, got {type(shapes).__name__}")
        out = []
        for shape in items:
            if not isinstance(shape, (int, tuple, list, torch.Size)):
                c.fail(TypeError, f"shapes must be a shape (an int or a tuple of ints) or a list of shapes, got "
                                  f"{type(shape).__name__} {shape!r} in {shapes!r}")
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
                c.fail(TypeError, f"shapes must hold ints, got {shape}")
            if any(d < 0 for d in shape):
                c.fail(ValueError, f"shapes must hold non-negative sizes, got {shape}")
            numel = math.prod(shape)
            out.append(self._carve(c, numel * dtype.itemsize).view(dtype).view(shape))
        return out[0] if one else tuple(out)

    @eager_under_compile
    def all_gather(self, srcs, dsts=None, group: Optional[dist.ProcessGroup] = None,
                   num_sms: Optional[int] = None) -> BucketEvent:
        """`BucketBuffer.all_gather` accepting tensors outside the storage; `dsts` must have `src.dtype`."""
        return gather_call(self.buffer, srcs, dsts, group, num_sms, self)

    @eager_under_compile
    def reduce_scatter(self, srcs, comm_precision: str = "fp32", scale: float = 1.0,
                       group: Optional[dist.ProcessGroup] = None, num_sms: Optional[int] = None, *,
                       dsts=None) -> BucketEvent:
        """`BucketBuffer.reduce_scatter` accepting tensors outside the storage; fp32 `dsts` of `src.nbytes / R`."""
        return reduce_call(self.buffer, "reduce_scatter", srcs, dsts, comm_precision, scale, group, num_sms, self)

    @eager_under_compile
    def all_reduce(self, srcs, scale: float = 1.0, group: Optional[dist.ProcessGroup] = None,
                   num_sms: Optional[int] = None, *, dsts=None) -> BucketEvent:
        """`BucketBuffer.all_reduce` accepting tensors outside the storage; fp32 `dsts` of `src.nbytes`."""
        return reduce_call(self.buffer, "all_reduce", srcs, dsts, "fp32", scale, group, num_sms, self)
