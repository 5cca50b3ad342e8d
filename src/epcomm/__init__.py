"""epcomm: expert-parallel dispatch/combine for Mixture-of-Experts models (DeepEP's EPBuffer API, in Python)."""

import torch

from . import comm, eplb
from ._version import __version__
from .allocator import BufferAllocator
from .autograd import TokenDispatcher
from .bucket import BucketBuffer, BucketSession
from .buffer import EPBuffer
from .engram import EngramBuffer
from .events import EventHandle, EventOverlap
from .handle import EPHandle
from .lowlatency import LowLatencyHandle
from .comm import destroy_all_managed_nccl_comm, get_logical_domain_size, get_physical_domain_size
from .pp import PPBuffer
from .sizing import get_num_allocation_alignment, get_num_rdma_alignment, get_num_tma_alignment
from .waits import PeerFailed, TransportTimeout

topk_idx_t = torch.int64


def __getattr__(name: str):
    from . import deepep_v1

    err = deepep_v1.missing("module 'epcomm'", name, deepep_v1.MODULE)
    if name in deepep_v1.MODULE:  # `from epcomm import Buffer` replaces an AttributeError by a bare ImportError
        raise ImportError(str(err), name=name)
    raise err

__all__ = ["BucketBuffer", "BucketSession", "BufferAllocator", "EPBuffer", "EPHandle", "EngramBuffer",
           "EventHandle", "EventOverlap", "LowLatencyHandle", "PPBuffer", "PeerFailed", "TokenDispatcher",
           "TransportTimeout", "__version__", "comm", "destroy_all_managed_nccl_comm", "eplb",
           "get_logical_domain_size", "get_num_allocation_alignment", "get_num_rdma_alignment",
           "get_num_tma_alignment", "get_physical_domain_size", "topk_idx_t"]
