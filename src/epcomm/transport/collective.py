"""The `collective` transport: `torch.distributed.all_to_all_single` on any backend (gloo, NCCL), any number of nodes.

Rows travel as packed uint8 records. With CPU sync the splits are exact; without it every peer gets the
worst-case `N` rows (equal splits), so no host read of counts is needed and NCCL calls stay graph-capturable.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import agreement
from ..moves import as_words
from .base import Transport


class CollectiveTransport(Transport):
    name = "collective"

    def _all_to_all(
        self, out: Tensor, inp: Tensor, out_splits: Optional[list], in_splits: Optional[list], wait: bool,
        what: str, call_id: int,
    ) -> Tensor:
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
        if wait or self.device.type == "cpu":
            self.wait(work, what, call_id)
        else:
            work.wait()  # orders the current stream after the collective; no host wait
        return out

    def exchange_counts(self, send_RC: Tensor, *, wait: bool, call_id: int, what: str = "count exchange",
                        kind: Optional[str] = None, label: Optional[str] = None) -> Tensor:
        def exchange(send: Tensor) -> Tensor:
            return self._all_to_all(torch.empty_like(send), send, None, None, wait, what, call_id)

        if self.device.type != "cpu":
            return exchange(send_RC)
        try:
            return agreement.framed_exchange(exchange, send_RC, kind=kind or what, label=label or what,
                                             rank=self.rank)
        except agreement.CallsDiffer:
            if self.on_calls_differ is not None:  # the call never happened on the peers: its id is not spent
                self.on_calls_differ(call_id)
            raise

    def dispatch_rows(
        self, send_XB: Tensor, send_splits: Optional[list], recv_splits: Optional[list], *, call_id: int
    ) -> Tensor:
        rows = sum(recv_splits) if recv_splits is not None else send_XB.shape[0]
        recv_XB = torch.empty(rows, send_XB.shape[1], dtype=send_XB.dtype, device=send_XB.device)
        if self.num_ranks == 1:
            return recv_XB.copy_(send_XB)
        return self._all_to_all(recv_XB, send_XB, recv_splits, send_splits, False, "row exchange", call_id)

    def move_fields(self, moves: list, route, *, call_id: int, beside: tuple = ()) -> None:
        """One `all_to_all_single` per field, straight into its output (no records, no unpacking)."""
        for src, dst in beside:
            dst.copy_(src)
        for src, out in moves:
            words = as_words(src)
            send = words if route.src_X is None else words.index_select(0, route.src_X)
            if self.num_ranks == 1:
                as_words(out).copy_(send)
            else:
                self._all_to_all(as_words(out), send, route.recv_splits, route.send_splits, False, "row exchange",
                                 call_id)
