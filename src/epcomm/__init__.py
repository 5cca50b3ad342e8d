"""epcomm: expert-parallel dispatch/combine for Mixture-of-Experts models (DeepEP's EPBuffer API, in Python)."""

import torch

from . import eplb
from ._version import __version__
from .allocator import BufferAllocator
from .autograd import TokenDispatcher
from .buffer import EPBuffer
from .events import EventHandle, EventOverlap
from .handle import EPHandle

topk_idx_t = torch.int64

__all__ = ["BufferAllocator", "EPBuffer", "EPHandle", "EventHandle", "EventOverlap", "TokenDispatcher", "__version__",
           "eplb", "topk_idx_t"]
