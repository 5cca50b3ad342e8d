"""Environment variables read by epcomm (all in one place; listed in README.md).

Every rank must set the variables of `AGREED` alike (they choose kernels and barrier counts on nvlink):
`EPBuffer` checks them at construction and raises "ranks disagree on EPCOMM_..." on every rank.

| variable | default | effect |
| --- | --- | --- |
| `EPCOMM_DEBUG` | unset | `1`: log sizes, transport choices and per-call counts to stderr (logger `epcomm`) |
| `EPCOMM_NVLINK_PUSH` | `copy-engine` | how the nvlink transport moves the records of sync-free calls: `copy-engine` (pack, then copy-engine writes) or `kernel` (the Triton push kernel) |
| `EPCOMM_NVLINK_RETURN` | `push` | how the nvlink transport returns combine rows of CPU-synced handles: `push` (copy-engine writes straight into the origins' areas, read in place) or `pull` (staged, then copied out by the origins) |
| `EPCOMM_RETURN_CHUNKS` | unset | nvlink combine of CPU-synced handles (`push`): write in this many chunks, each reduced as soon as it arrives (default 1 eager, up to 3 in a CUDA graph) |
| `EPCOMM_PULL_CHUNKS` | unset | nvlink pulls (CPU-synced and cached dispatch; the combine with `EPCOMM_NVLINK_RETURN=pull`): stage and pull in this many chunks, the first a third of each later one (default 1 eager, up to 2 in a CUDA graph) |
| `EPCOMM_FUSED_SYNC_FREE_ROWS` | `4096` | nvlink: `dispatch(do_cpu_sync=False)`, and combine (not per pair) and cached dispatch on its handle, take the fused kernels (`syncfree_nvlink.py`) when `num_ranks * num_max_tokens_per_rank` is at most this and rows are whole 4-byte words; `0`: never. Must be the same on every rank |
| `EPCOMM_FUSED_EXACT` | `1` | nvlink: `dispatch(do_cpu_sync=True)` takes the fused kernels (`exact_nvlink.py`: layouts and value checks on the device, one host read) when rows are whole 4-byte words and a rank has at most 1024 local experts; `0`: the generic path. Must be the same on every rank (checked at construction on every transport; only nvlink uses it) |
| `EPCOMM_PHASE_TIMES` | unset | `1`: synchronise the device around each phase and sum its wall time (`epcomm.debug.phase_times()`); diagnostics only; read when epcomm is imported |
"""

from __future__ import annotations

import os


_OFF, _ON = ("", "0", "false", "False"), ("1", "true", "True")


def _flag(name: str, strict: bool = True) -> bool:
    """A diagnostics switch: unset, 0 or false is off, 1 or true on; anything else raises (`strict`) or is off."""
    value = os.environ.get(name, "")
    if value not in _OFF + _ON and strict:
        raise ValueError(f"{name} must be 1 (or true) to switch it on, or 0 (or false, or unset), got {value!r}")
    return value in _ON


def debug_enabled() -> bool:
    return _flag("EPCOMM_DEBUG")


def phase_times_enabled(strict: bool = True) -> bool:
    return _flag("EPCOMM_PHASE_TIMES", strict)


def nvlink_push() -> str:
    value = os.environ.get("EPCOMM_NVLINK_PUSH", "copy-engine")
    if value not in ("copy-engine", "kernel"):
        raise ValueError(f"EPCOMM_NVLINK_PUSH must be 'copy-engine' or 'kernel', got {value!r}")
    return value


def nvlink_return() -> str:
    value = os.environ.get("EPCOMM_NVLINK_RETURN", "push")
    if value not in ("push", "pull"):
        raise ValueError(f"EPCOMM_NVLINK_RETURN must be 'push' or 'pull', got {value!r}")
    return value


def pull_chunks() -> int:
    return _chunks("EPCOMM_PULL_CHUNKS")


def return_chunks() -> int:
    return _chunks("EPCOMM_RETURN_CHUNKS")


def _chunks(name: str) -> int:
    """0 when unset (the caller's default), else an integer in [1, 64]."""
    value = os.environ.get(name, "")
    if value == "":
        return 0
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= 64:
        raise ValueError(f"{name} must be an integer in [1, 64], got {value!r}")
    return int(value)


def check_all() -> None:
    """Parse every `EPCOMM_*` value now (EPBuffer construction), so that a bad one raises on every rank at once
    rather than in the first call that reads it.

    Raises:
        ValueError: a variable's value is not one its table row allows.
    """
    agreed_values()
    debug_enabled()
    phase_times_enabled()


_CHOICES = {"EPCOMM_NVLINK_PUSH": ("copy-engine", "kernel"), "EPCOMM_NVLINK_RETURN": ("push", "pull")}
# The variables every rank must set alike, each with its reader as an int (`agreed_values`).
_AGREED = {"EPCOMM_NVLINK_PUSH": lambda: _CHOICES["EPCOMM_NVLINK_PUSH"].index(nvlink_push()),
           "EPCOMM_NVLINK_RETURN": lambda: _CHOICES["EPCOMM_NVLINK_RETURN"].index(nvlink_return()),
           "EPCOMM_PULL_CHUNKS": lambda: pull_chunks(), "EPCOMM_RETURN_CHUNKS": lambda: return_chunks(),
           "EPCOMM_FUSED_SYNC_FREE_ROWS": lambda: fused_sync_free_rows(),
           "EPCOMM_FUSED_EXACT": lambda: int(fused_exact())}
AGREED = tuple(_AGREED)  # their names, in the order of agreed_values


def agreed_values() -> dict:
    """The variables every rank must set alike, as ints for the construction exchange (`EPBuffer`): on nvlink they
    choose the kernels and the number of device barriers of a call, so ranks that differ would pair one call's
    barriers with another's. Diagnostics (`EPCOMM_DEBUG`, `EPCOMM_PHASE_TIMES`) may differ.

    Raises:
        ValueError: a variable's value is not one its table row allows.
    """
    return {name: read() for name, read in _AGREED.items()}


def shown(name: str, code: int) -> str:
    """An `agreed_values` code as the user set it (`unset` for a chunk count left to its default)."""
    if name in _CHOICES:
        return repr(_CHOICES[name][code])
    return "unset" if code == 0 and name.endswith("_CHUNKS") else str(code)


def fused_exact() -> bool:
    value = os.environ.get("EPCOMM_FUSED_EXACT", "1")
    if value not in ("0", "1"):
        raise ValueError(f"EPCOMM_FUSED_EXACT must be 0 or 1, got {value!r}")
    return value == "1"


def fused_sync_free_rows() -> int:
    value = os.environ.get("EPCOMM_FUSED_SYNC_FREE_ROWS", "")
    if value == "":
        return 4096
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"EPCOMM_FUSED_SYNC_FREE_ROWS must be an integer >= 0, got {value!r}")
    return int(value)
