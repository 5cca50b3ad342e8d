"""`EPHandle`: what a dispatch leaves behind for cached dispatch and combine (DeepEP V2.5 EPBuffer behaviour, §10)."""

from __future__ import annotations

import copy
from dataclasses import FrozenInstanceError, dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor


def _version_of(t: Tensor) -> Optional[int]:
    """The tensor's version counter, or None for inference-mode tensors (which have none)."""
    try:
        return t._version
    except RuntimeError:
        return None


@dataclass(kw_only=True, eq=False)
class EPHandle:
    """Routing of one dispatch, replayed by cached dispatch and used by combine. Built only by `dispatch`.

    Read-only (assigning or deleting a field raises `dataclasses.FrozenInstanceError`), except that
    `recv_src_metadata` may be narrowed to its first rows, as DeepEP's tests do after a dispatch without CPU sync
    (`handle.recv_src_metadata = handle.recv_src_metadata[:num_recv_tokens]`): a non-expand combine then takes
    `x` with that many rows (reference §11.1: its rows are `recv_src_metadata.shape[0]`), and a cached dispatch
    returns that many rows.

    Fields (M = allocated received rows, S = allocated expanded rows, R ranks, L local experts):
        do_expand: bool -- layout of the producing dispatch.
        num_experts, expert_alignment, num_max_tokens_per_rank: int -- routing context; a cached dispatch that
            passes them must pass the same values.
        num_sms: int -- SM count of the dispatch; combine's default.
        topk_idx: [T, K] -- the caller's tensor, by reference; reading it raises `ValueError` if the tensor was
            modified in place since the dispatch (for an inference-mode tensor, which has no version counter,
            a copy the dispatch made).
        num_recv_tokens: int -- received tokens (exact with CPU sync, else `R * N`).
        num_expanded_tokens: int -- expanded rows `S` (exact with CPU sync, worst case otherwise; 0 non-expand).
        num_recv_tokens_per_expert_list: list[int] -- aligned per-expert counts; empty without CPU sync.
        psum_num_recv_tokens_per_scaleup_rank: [R] int32 -- inclusive prefix sum of tokens received from each
            rank; the last element is the number of valid received rows.
        psum_num_recv_tokens_per_expert: [L] int32 -- non-expand: inclusive prefix sum of aligned counts;
            expand: aligned start of expert i plus its real count.
        num_unaligned_recv_tokens_per_expert: [L] int32 -- real (unaligned) counts `n_i`.
        recv_src_metadata: [M, K + 2] int32 -- col 0 the token key `g = src_rank * N + src_token`; col 1
            `src_rank * K + j*` (j* the largest top-k position of the token on this rank); cols 2.. the
            expanded row of (row, position j) or -1 (expand only; -1 in non-expand). Rows past the valid
            extent are -1.
        dst_buffer_slot_idx: [T, K] int32 -- sender side: `dest_rank * N + slot` at the largest top-k position
            per destination rank, else -1.
        recv_expert_ids: [S] int32 or None -- local expert id of each expanded row, -1 for padding
            (`emit_expert_ids=True`).
        token_metadata_at_forward, channel_linked_list, cached_recv_src_metadata_before_sort: None (the
            reference's hybrid-mode internals; epcomm has one logical domain).

    Properties (epcomm additions): `recv_topk_idx` [M, K] (topk_idx's dtype) -- the local expert id of each
    column of each received row, -1 where not local (what a non-expand dispatch returns as `recv_topk_idx`);
    `num_topk` (K) and `num_local_experts` (L): int.
    """

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: list
    psum_num_recv_tokens_per_scaleup_rank: Tensor
    psum_num_recv_tokens_per_expert: Tensor
    num_unaligned_recv_tokens_per_expert: Tensor
    recv_src_metadata: Tensor
    dst_buffer_slot_idx: Tensor
    recv_expert_ids: Optional[Tensor] = None
    token_metadata_at_forward: Optional[Tensor] = None
    channel_linked_list: Optional[Tensor] = None
    cached_recv_src_metadata_before_sort: Optional[Tensor] = None
    # epcomm internals: the routing plan replayed by cached dispatch and combine (see buffer.py).
    _topk_idx: Tensor = field(repr=False)
    _topk_idx_version: Optional[int] = field(repr=False)
    _plan: Any = field(repr=False)
    _buffer_uid: int = field(repr=False)
    _dispatch_id: int = field(default=0, repr=False)  # the call id of the dispatch that made it (same on every rank)

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_recv_src_metadata", self.recv_src_metadata)  # [M, K + 2], as dispatched
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_sealed", False):  # (getattr with a default raises and catches inside: host time)
            if name != "recv_src_metadata":
                raise FrozenInstanceError(f"cannot assign to field {name!r}: an EPHandle is read-only (only "
                                          "recv_src_metadata may be narrowed to its first rows)")
            self._check_narrowed(value)
        object.__setattr__(self, name, value)

    def __deepcopy__(self, memo) -> "EPHandle":
        """A copy that shares the tensors (`copy.copy`): a handle is read-only, and its plan holds views of the
        buffer's memory and the dispatch's own `topk_idx` (the in-place guard watches that tensor), so copies of
        them would detach the handle from its buffer and routing (a model deep-copied with a handle in it keeps a
        working handle)."""
        return copy.copy(self)

    def __copy__(self) -> "EPHandle":
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)  # the same (sealed) fields and tensors
        return new

    def __reduce_ex__(self, protocol):
        """Refused: a handle's plan holds views of its buffer's memory and watches the dispatch's own `topk_idx`, so
        an unpickled copy (fresh tensors) would be detached from both."""
        raise TypeError("an EPHandle cannot be pickled: its plan holds views of its buffer's memory and it watches "
                        "the dispatch's own topk_idx; keep it in the process that made it (copy.deepcopy shares "
                        "its tensors and works)")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}: an EPHandle is read-only")

    def _check_narrowed(self, value) -> None:
        """`value` is the first rows of the dispatch's `recv_src_metadata`, at least the valid ones.

        Raises:
            ValueError: anything else (another tensor, other columns, fewer rows than were received).
        """
        full = self.full_recv_src_metadata
        prefix = (isinstance(value, Tensor) and value.dim() == 2 and value.dtype == full.dtype
                  and value.shape[1] == full.shape[1] and value.shape[0] <= full.shape[0]
                  and (value.shape[0] == 0 or (value.data_ptr() == full.data_ptr()
                                               and value.stride() == full.stride())))
        if not prefix:
            raise ValueError(f"EPHandle.recv_src_metadata may only be narrowed to its first rows "
                             f"(handle.recv_src_metadata[:n], n <= {full.shape[0]}), got "
                             f"{getattr(value, 'shape', type(value).__name__)}")
        psum = self.psum_num_recv_tokens_per_scaleup_rank
        if not (psum.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            if psum.device.type == "cuda":  # an asynchronous dispatch may still be writing it on the comm stream
                torch.cuda.synchronize(psum.device)
            valid = int(psum[-1]) if psum.numel() else 0  # a host read (what DeepEP's tests read n from)
            if value.shape[0] < valid:
                raise ValueError(f"EPHandle.recv_src_metadata: {valid} rows were received; narrowing to "
                                 f"{value.shape[0]} would drop received rows (narrow to n >= "
                                 "psum_num_recv_tokens_per_scaleup_rank[-1])")

    @property
    def topk_idx(self) -> Tensor:
        """[T, K] -- the dispatch's `topk_idx` (the same object; a copy for an inference-mode tensor outside a CUDA
        graph capture).

        Raises:
            ValueError: the tensor was modified in place after the dispatch.
        """
        if self._topk_idx_version is not None and _version_of(self._topk_idx) != self._topk_idx_version:
            raise ValueError(
                "EPHandle.topk_idx: the topk_idx tensor passed to dispatch was modified in place after the "
                f"dispatch (version {self._topk_idx_version} -> {_version_of(self._topk_idx)}); the handle's "
                "routing no longer matches it. Run a new (non-cached) dispatch, or clone topk_idx before editing"
            )
        return self._topk_idx

    @property
    def recv_topk_idx(self) -> Tensor:
        """[M, K] -- local expert id of each column of each received row, -1 where not local (epcomm addition:
        what non-expand dispatch returns as `recv_topk_idx`, kept for callers such as `TokenDispatcher`)."""
        return self._plan.recv.local_idx_MK.to(self._topk_idx.dtype)

    @property
    def num_topk(self) -> int:
        return self._topk_idx.shape[1]

    @property
    def num_local_experts(self) -> int:
        return self.psum_num_recv_tokens_per_expert.shape[0]

    @staticmethod
    def capture_version(topk_idx: Tensor) -> Optional[int]:
        """`topk_idx`'s version counter, what the in-place guard compares; None for inference-mode tensors."""
        return None if topk_idx.is_inference() else _version_of(topk_idx)

    def __getitem__(self, index):
        # DeepEP V1's handle is a tuple; code that unpacks or indexes it gets a pointer to the fields instead of
        # Python's bare "not subscriptable" / "not iterable".
        raise TypeError(f"EPHandle is not DeepEP V1's tuple handle (asked for item {index!r}): pass it to combine or "
                        "a cached dispatch as it is, or read its fields (recv_src_metadata, "
                        "num_recv_tokens_per_expert_list, ...; docs/porting.md)")

    def __iter__(self):
        return self[0]  # raises: unpacking gets the same pointer

    def __repr__(self) -> str:
        return (
            f"EPHandle(do_expand={self.do_expand}, num_experts={self.num_experts}, "
            f"expert_alignment={self.expert_alignment}, num_max_tokens_per_rank={self.num_max_tokens_per_rank}, "
            f"num_recv_tokens={self.num_recv_tokens}, num_expanded_tokens={self.num_expanded_tokens}, "
            f"topk_idx={tuple(self._topk_idx.shape)})"
        )

