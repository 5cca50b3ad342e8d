"""Eager launches of Triton kernels at a fraction of the host cost of `kernel[grid](...)`.

An eager CPU-synced dispatch on nvlink launches three Triton kernels (four with expand) and is bound by host time. `kernel[grid](...)`
costs the host 40-100 us per launch for kernels of 15-60 arguments (2x H200 hosts, Triton 3.6, measured by wrapping
`JITFunction.run`); Triton's binder alone specialises each tensor argument in ~3 us (Triton 3.9 on CPU). `launch`
keys its own cache with a cheaper description of the arguments that is at least as fine as Triton's
specialisation, and hands the arguments straight to the compiled kernel's launcher (`Compiled`: Triton's runner
would add a closure, a launch-metadata dict and calls of empty hook chains per launch), as `transport/symm.py` does
for the barrier kernel. Tensors reach the launcher as their addresses, which it takes as they are; given a tensor
it would ask the driver whether the address is device memory (a CPU tensor's is not), one query per tensor per
launch, so every caller passes tensors on the launch's device only (their inputs' devices are checked first,
`validate.py`). The key:

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

# Kernels are keyed by id(): hashing a JITFunction hashes its source key under a lock (~1 us per dict access).
# They are module-level functions, never freed, so an id names one kernel for the life of the process.
_compiled: dict = {}  # (id(kernel), device, options, argument key) -> Triton's compiled kernel (`Compiled`)
_params: dict = {}  # id(kernel) -> (parameter names, their set, runtime parameters' indices, constexprs' indices)
_usual_way: set = set()  # ids of kernels whose direct launch failed to prepare
_Tensor = torch.Tensor


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
    compiled, values, raw, device = _prepare(kernel, grid, args, kwargs)
    if compiled is None:
        kernel[grid](*args, **kwargs)
        return
    compiled((grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1), values, raw,
             _raw_stream(device))  # the stream given: Triton's runner would look it up


class Compiled:
    """A compiled variant, launched through what Triton's runner passes its launcher (`CompiledKernel.run`, the
    same call in Triton 3.6 to 3.9): no runner closure, no launch-metadata dict, no calls of empty hook chains
    (Triton 3.6 keeps them even when no profiler has set a hook). While a hook is set (a profiler such as Proton),
    or for a compiled kernel without these fields (another Triton), its runner is called instead."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.direct = None
        try:
            from triton import knobs

            kernel._init_handles()
            if callable(kernel.run) and kernel.function is not None:
                self.direct = (kernel.run, kernel.function, kernel.packed_metadata)
                self.hooks = knobs.runtime
        except Exception:
            self.direct = None

    def __call__(self, grid3: tuple, values, raw, stream: int) -> None:
        """Launch on `stream` (a raw stream handle) with `values`, the arguments in signature order; the launcher
        itself gets `raw`, the same with each tensor's address in its place (`None`: `values`)."""
        if self.direct is not None and _quiet(self.hooks.launch_enter_hook) and _quiet(self.hooks.launch_exit_hook):
            run, function, metadata = self.direct
            run(grid3[0], grid3[1], grid3[2], stream, function, metadata, None, None, None,
                *(values if raw is None else raw))
        else:
            self.kernel[grid3](*values, stream=stream)


def _quiet(hook) -> bool:
    return hook is None or getattr(hook, "calls", None) == []


def _device_index() -> int:
    """`torch.cuda.current_device()` without its initialisation check: a launch always follows CUDA work."""
    return torch._C._cuda_getDevice()


def _raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


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
    """(compiled kernel, every argument in signature order, the same with tensors as their addresses, current device
    index), or (None, None, None, None) to launch the usual way."""
    kid = id(kernel)
    if kid in _usual_way:
        return None, None, None, None
    try:
        params = _params.get(kid)
        if params is None:
            if torch.version.hip is not None:
                raise RuntimeError("ROCm: Triton specialises tensors on their size too")
            names = [p.name for p in kernel.params]
            runtime = [i for i, p in enumerate(kernel.params) if not p.is_constexpr]
            constexpr = [i for i, p in enumerate(kernel.params) if p.is_constexpr]
            params = _params[kid] = (names, frozenset(names), runtime, constexpr)
        names, name_set, runtime, constexpr = params
        values = list(args)
        values += [kwargs[name] for name in names[len(args):]]
        options = tuple([(k, v) for k, v in kwargs.items() if k not in name_set])  # num_warps, ...
        consts = tuple([values[i] for i in constexpr])
        const_types = tuple(map(type, consts))  # True, 1 and 1.0 are one dict key but three variants
        device = _device_index()
        runtime_key = []
        raw = list(values)  # tensors as addresses: the launcher then skips a driver query per pointer
        for i in runtime:  # `_arg_key`, with its two common cases inline (a function call per argument adds up)
            value = values[i]
            kind = type(value)
            if kind is _Tensor:
                raw[i] = address = value.data_ptr()
                runtime_key.append((value.dtype, address % 16 == 0))
            elif kind is int:
                runtime_key.append((value == 1, value % 16 == 0, -2 ** 31 <= value < 2 ** 31, value < 2 ** 63))
            else:
                runtime_key.append(_arg_key(value))
        key = (kid, device, options, tuple(runtime_key), const_types,
               tuple(map(repr, consts)) if float in const_types else consts)
        compiled = _compiled.get(key)
        if compiled is None:
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
            if compiled is None:
                raise TypeError("warmup returned no compiled kernel")
            if getattr(type(compiled), "__getitem__", None) is None:  # still compiling: the usual way this time
                return None, None, None, None
            compiled = _compiled[key] = Compiled(compiled)
        return compiled, values, raw, device
    except Exception:  # no CUDA, the interpreter, another Triton's internals: the usual path from now on
        _usual_way.add(kid)
        return None, None, None, None
