"""Eager launches of Triton kernels at a fraction of the host cost of `kernel[grid](...)`.

An eager CPU-synced dispatch on nvlink launches five Triton kernels and is bound by host time. Triton 3.6's
`kernel[grid](...)` costs the host 40-100 us per launch for kernels of 20-60 arguments (2x H200 hosts; measured
by wrapping `JITFunction.run`), much of it turning the argument specialisation into a string key on every call.
`launch` binds the arguments with the kernel's own binder (the specialisation Triton computes, so the compiled
variant Triton would pick), keys its own cache by that specialisation as a tuple, and launches the compiled
kernel directly, as `transport/symm.py` does for the barrier kernel.

Triton's internals move between releases: if binding or compiling through them fails, the kernel is launched the
usual way from then on (and under the interpreter, `TRITON_INTERPRET=1`, always). Triton's runtime settings
(`TRITON_DEBUG` and the like) are read when a variant is first compiled, not on every launch.
"""

from __future__ import annotations

import torch

_compiled: dict = {}  # (kernel, device, specialisation, options) -> Triton's compiled kernel
_usual_way: set = set()  # kernels whose direct launch failed to prepare


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)` (grid of up to 3 ints), launched directly once compiled."""
    compiled, bound = _prepare(kernel, grid, args, kwargs)
    if compiled is None:
        kernel[grid](*args, **kwargs)
        return
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    compiled[grid3](*bound.values())


def _prepare(kernel, grid: tuple, args: tuple, kwargs: dict) -> tuple:
    """(compiled kernel, bound arguments in signature order), or (None, None) to launch the usual way."""
    if kernel in _usual_way:
        return None, None
    try:
        device = torch.cuda.current_device()
        bound, specialisation, options = kernel.device_caches[device][-1](*args, **kwargs)  # Triton's binder
        key = (kernel, device, tuple(specialisation), tuple(options.items()))
        compiled = _compiled.get(key)
        if compiled is None:
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
            if compiled is None or not hasattr(compiled, "__getitem__"):
                raise TypeError("warmup returned no compiled kernel")
            _compiled[key] = compiled
        return compiled, bound
    except Exception:  # the interpreter, another Triton's internals: the usual path from now on
        _usual_way.add(kernel)
        return None, None
