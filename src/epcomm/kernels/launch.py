"""Eager launches of Triton kernels at a fraction of the host cost of `kernel[grid](...)`.

An eager CPU-synced dispatch on nvlink launches five Triton kernels and is bound by host time. `kernel[grid](...)`
costs the host 40-100 us per launch for kernels of 15-60 arguments (2x H200 hosts, Triton 3.6, measured by wrapping
`JITFunction.run`); Triton's binder alone specialises each tensor argument in ~3 us (Triton 3.9 on CPU). `launch`
keys its own cache with a cheaper description of the arguments that is at least as fine as Triton's
specialisation, and launches the compiled kernel directly, as `transport/symm.py` does for the barrier kernel. It
takes 3-4% off an eager full dispatch on those hosts (benchmarks/direct_launch_ab.py): the compiled kernel's own
launcher still costs 8-9 us there. The key:

* tensors: dtype and whether the address is a multiple of 16 bytes (Triton's alignment specialisation);
* integers of runtime parameters: 1 or not, a multiple of 16 or not, 32- or 64-bit (all Triton looks at);
* constexpr parameters: their type and value (floats by their text, so -0.0 is not 0.0); booleans, None and
  strings: their values; other floats: one class; tuples: element by element;
* the launch options (`num_warps`, ...) and the device.

Two calls with one key get one specialisation, so the variant Triton compiled (`kernel.warmup`) for the first is the
one it would pick for the second. If anything fails before the launch (another Triton's internals), the kernel is
launched the usual way from then on, and always under the interpreter (`TRITON_INTERPRET=1`), without CUDA and on
ROCm (whose Triton also specialises tensors on their size). A variant still compiling (Triton's asynchronous
compile mode) is launched the usual way until it is ready.
Triton's runtime settings (`TRITON_DEBUG` and the like) count when a variant is first compiled, not per launch.
"""

from __future__ import annotations

import torch

_compiled: dict = {}  # (kernel, device, options, argument key) -> Triton's compiled kernel
_params: dict = {}  # kernel -> (parameter names, their set, runtime parameters' indices, constexprs' indices)
_usual_way: set = set()  # kernels whose direct launch failed to prepare


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`, launched directly once compiled.

    Args:
        kernel: a `@triton.jit` function.
        grid: 1 to 3 ints, programs per grid axis.
        args, kwargs: the kernel's arguments (tensors, ints, constexprs) and launch options (`num_warps`, ...), as
            for `kernel[grid](...)`.

    Raises:
        whatever `kernel[grid](...)` raises (compile errors, bad arguments, launch failures); a launch never runs
        twice.
    """
    compiled, values = _prepare(kernel, grid, args, kwargs)
    if compiled is None:
        kernel[grid](*args, **kwargs)
        return
    compiled[(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)](*values)


def _arg_key(value, _tensor=torch.Tensor):
    kind = type(value)
    if kind is int:
        return value == 1, value % 16 == 0, -2 ** 31 <= value < 2 ** 31, value < 2 ** 63
    if kind is bool or value is None or kind is str:
        return value
    if isinstance(value, _tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, int):  # an int subclass
        return _arg_key(int(value))
    if isinstance(value, float):
        return float
    if isinstance(value, tuple):
        return tuple(map(_arg_key, value))
    return value  # anything else (a Triton dtype, ...) by value: must be hashable


def _prepare(kernel, grid: tuple, args: tuple, kwargs: dict) -> tuple:
    """(compiled kernel, every argument in signature order), or (None, None) to launch the usual way."""
    if kernel in _usual_way:
        return None, None
    try:
        if torch.version.hip is not None:
            raise RuntimeError("ROCm: Triton specialises tensors on their size too")
        params = _params.get(kernel)
        if params is None:
            names = [p.name for p in kernel.params]
            runtime = [i for i, p in enumerate(kernel.params) if not p.is_constexpr]
            constexpr = [i for i, p in enumerate(kernel.params) if p.is_constexpr]
            params = _params[kernel] = (names, frozenset(names), runtime, constexpr)
        names, name_set, runtime, constexpr = params
        values = list(args)
        values += [kwargs[name] for name in names[len(args):]]
        options = tuple((k, v) for k, v in kwargs.items() if k not in name_set)  # num_warps, ...
        consts = [values[i] for i in constexpr]
        const_types = tuple(map(type, consts))  # True, 1 and 1.0 are one dict key but three variants
        const_key = tuple(map(repr, consts)) if float in const_types else tuple(consts)
        key = (kernel, torch.cuda.current_device(), options, tuple([_arg_key(values[i]) for i in runtime]),
               const_types, const_key)
        compiled = _compiled.get(key)
        if compiled is None:
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
            if compiled is None:
                raise TypeError("warmup returned no compiled kernel")
            if getattr(type(compiled), "__getitem__", None) is None:  # still compiling: the usual way this time
                return None, None
            _compiled[key] = compiled
        return compiled, values
    except Exception:  # no CUDA, the interpreter, another Triton's internals: the usual path from now on
        _usual_way.add(kernel)
        return None, None
