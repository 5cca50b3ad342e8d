"""The transport interface, the registry, and bounded host waits.

A transport moves rows of bytes between the ranks of one group and nothing else: the buffer computes the
layout, packs records, and places/reduces what arrives. Its data methods:

| method | moves | host waits? |
| --- | --- | --- |
| `exchange_counts(send_RC)` | an int64 row per peer: counts + call header (or a failed call's messages) | if `wait` |
| `move_fields(moves, route, beside)` | each field of a CPU-synced dispatch straight into its output (and the caller's local copies `beside`) | on CPU only |
| `return_fields(srcs, route)` | the same, combine direction (nvlink: views, reduced in place) | on CPU only |
| `push_rows(spec, tensors, src_X, cap)` | sync-free records into every peer's block of `cap` rows | on CPU only |
| `dispatch_rows(buf, splits)` | packed records to their destination ranks | on CPU only |
| `combine_rows(buf, splits)` | the same primitive in the return direction | on CPU only |

`splits=None` means equal splits (every peer gets `rows / R` rows): the sync-free mode, where sizes are the
worst case and no host read of counts is needed.

Every host wait is bounded by the buffer's `num_cpu_timeout_secs`: a peer that does not arrive gives a
`TransportTimeout` naming the missing group ranks (docs/decisions.md "Errors and timeouts").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..moves import as_words
from ..waits import TransportTimeout, bounded_wait  # noqa: F401 (TransportTimeout is re-exported)


class Transport(ABC):
    """Moves rows between the ranks of `group`.

    Args:
        group: the EP process group (group ranks are used in every message).
        device: the buffer's device.
        timeout_s: bound on every host wait (`num_cpu_timeout_secs`).
        uid: an id shared by all ranks of this buffer (names the progress keys used to find missing ranks).
    """

    name = "base"
    # True when dispatch_rows/combine_rows return views of a reused receive area (see EPBuffer._finish).
    borrows_rows = False
    # True when the transport writes rows straight into per-sender blocks of peers' receive areas, so the
    # pipeline uses the blocked layout even with CPU sync (see `push_rows`).
    writes_blocks = False
    # Called with the call id of an exchange that found the ranks in different calls (CPU): the owner takes the id
    # back, so that its next call is in step with the peers, which never made this one.
    on_calls_differ = None

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float, uid: int):
        self.group = group
        self.device = device
        self.rank = group.rank()
        self.num_ranks = group.size()
        self.timeout_s = float(timeout_s)
        self.uid = uid

    @abstractmethod
    def exchange_counts(self, send_RC: Tensor, *, wait: bool, call_id: int, what: str = "count exchange",
                        kind: Optional[str] = None, label: Optional[str] = None) -> Tensor:
        """Send row r of `send_RC` ([R, C] int64) to rank r; return [R, C] with row s from rank s. `what` names the
        exchange in a timeout's message; on CPU, `kind` (default `what`) and `label` (the call) frame the rows
        (`agreement.framed_exchange`: ranks in different calls raise instead of aborting gloo)."""

    @abstractmethod
    def dispatch_rows(
        self, send_XB: Tensor, send_splits: Optional[list], recv_splits: Optional[list], *, call_id: int
    ) -> Tensor:
        """All-to-all of packed rows ([X, B] uint8) grouped by destination; returns rows grouped by source."""

    def combine_rows(
        self, send_XB: Tensor, send_splits: Optional[list], recv_splits: Optional[list], *, call_id: int
    ) -> Tensor:
        """The return direction of `dispatch_rows` (same primitive unless a transport specialises it)."""
        return self.dispatch_rows(send_XB, send_splits, recv_splits, call_id=call_id)

    def push_rows(self, spec, tensors: dict, src_X: Tensor, cap: int, *, call_id: int) -> Tensor:
        """Move records in the blocked layout: send row x (token `src_X[x]`, -1 for a hole) lands in rank
        `x // cap`'s receive buffer at row `my_rank * cap + x % cap`. Returns [R * cap, B] uint8 grouped by source.

        The default packs the records and sends equal splits; a transport may write them straight into peers.
        """
        return self.dispatch_rows(spec.pack(tensors, src_X, holes=True), None, None, call_id=call_id)

    def move_fields(self, moves: list, route, *, call_id: int, beside: tuple = ()) -> None:
        """Packed move of several fields (moves.py): for each `(src, out)`, send row x is `src[route.src_X[x]]`
        (or `src[x]`) and `out` ([route.num_recv, ...], same dtype and row shape) receives the rows grouped by
        source rank. Both contiguous. `beside`: local copies `(src, dst)` (`dst.copy_(src)`) the caller needs too; every
        one is done in the current stream's order when the call returns, and a transport may run them while rows
        travel. The default sends each field through `dispatch_rows`.
        """
        for src, dst in beside:
            dst.copy_(src)
        idx = route.send_index(self.device)
        for src, out in moves:
            send = as_words(src).index_select(0, idx)
            as_words(out).copy_(self.dispatch_rows(send, route.send_splits, route.recv_splits, call_id=call_id))

    def return_fields(self, srcs: list, route, *, call_id: int, skip_own: bool = False) -> tuple:
        """`move_fields` in the combine direction, where the caller only reads the result before its next call.

        Returns:
            `(outs, ready, own)`: one [route.num_recv, ...] tensor per source tensor; None (ready in stream order)
            or a list of C CUDA events: chunk c of every source's rows (rows
            `moves.chunk_bounds(n, moves.return_weights(C))[c: c + 2]` of its n rows) may be read once `ready[c]`
            has fired; and None, or (with `skip_own`, where a transport honours it)
            `(row, count, src_row)`: rows `row .. row + count - 1` of every out were not filled and are rows
            `src_row ..` of the sources (this rank's rows for itself). A transport may return views of its own
            memory (`borrows_rows`); the default moves everything into fresh tensors.
        """
        outs = [torch.empty((route.num_recv,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device) for t in srcs]
        self.move_fields(list(zip(srcs, outs)), route, call_id=call_id)
        return outs, None, None

    def destroy(self) -> None:
        """Release transport resources (local; the buffer runs the collective part)."""

    # -- bounded waits -------------------------------------------------------------------------------
    def wait(self, work: "dist.Work", what: str, call_id: int) -> None:
        """Wait for `work` on the host, at most `timeout_s`; name the missing ranks on expiry (waits.py)."""
        bounded_wait(work, what=what, call_id=call_id, rank=self.rank, num_ranks=self.num_ranks, uid=self.uid,
                     device=self.device, timeout_s=self.timeout_s, owner="EPBuffer", group=self.group)


_REGISTRY = {
    # name: (devices it runs on, chosen by "auto"); "auto" tries them in this order.
    "nvlink": (("cuda",), True),
    "collective": (("cpu", "cuda"), True),
}


def available_transports(device: torch.device) -> list:
    """Names of the transports that can run on `device`, in the order "auto" tries them."""
    return [name for name, (devices, _) in _REGISTRY.items() if device.type in devices]


def resolve_transport(name: str, device: torch.device, unavailable: Optional[dict] = None) -> type:
    """The transport class for `name` ("auto" picks the first default that applies).

    Args:
        unavailable: name -> reason for transports that cannot run for this group (e.g. ranks on several hosts).

    Raises:
        ValueError: unknown name, or a transport asked for by name that cannot run here.
    """
    unavailable = unavailable or {}
    if name == "auto":
        name = next(n for n, (devices, auto) in _REGISTRY.items()
                    if auto and device.type in devices and n not in unavailable)
    if name not in _REGISTRY:
        raise ValueError(f"EPBuffer: transport={name!r} is unknown; expected 'auto' or one of {sorted(_REGISTRY)}")
    devices, _ = _REGISTRY[name]
    if device.type not in devices:
        raise ValueError(f"EPBuffer: transport={name!r} cannot run on device {device}; it supports {devices}")
    if name in unavailable:
        raise ValueError(f"EPBuffer: transport={name!r} cannot run for this group: {unavailable[name]}")
    if name == "nvlink":
        from .nvlink import NVLinkTransport

        return NVLinkTransport
    from .collective import CollectiveTransport

    return CollectiveTransport
