"""epcomm's entry points run eagerly inside `torch.compile`.

Dynamo would otherwise trace into epcomm and break the graph at every host read and Triton launch (dozens of
frames and warnings per step); with its entry points disabled for Dynamo, it compiles the caller's code around
each call: one graph break per call, the same results. `torch.compiler.disable` as a decorator imports
`torch._dynamo` (and with it inductor, sympy and Triton: ~1.1 s and ~140 MB per process) when the class is
defined, for every user. So `eager_under_compile` makes the disabled function at the first call that finds
`torch._dynamo` loaded (anything that compiles has loaded it) and calls the function directly until then.
"""

from __future__ import annotations

import functools
import sys


def eager_under_compile(fn):
    """`fn` as `torch.compiler.disable(fn)` would run it, without importing `torch._dynamo` (~0.4 us per call)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        disabled = fn.__dict__.get("_epcomm_eager")
        if disabled is None:
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is None:  # nothing in this process compiles yet
                return fn(*args, **kwargs)
            disabled = fn._epcomm_eager = dynamo.disable(fn, recursive=True)
        return disabled(*args, **kwargs)

    return call
