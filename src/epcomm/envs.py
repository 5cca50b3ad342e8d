"""Environment variables read by epcomm (all in one place; listed in README.md).

| variable | default | effect |
| --- | --- | --- |
| `EPCOMM_DEBUG` | unset | `1`: log sizes, transport choices and per-call counts to stderr (logger `epcomm`) |
| `EPCOMM_PHASE_TIMES` | unset | `1`: synchronise the device around each phase and sum its wall time (`epcomm.debug.phase_times()`); diagnostics only |
"""

from __future__ import annotations

import os


def debug_enabled() -> bool:
    return os.environ.get("EPCOMM_DEBUG", "0") not in ("", "0", "false", "False")


def phase_times_enabled() -> bool:
    return os.environ.get("EPCOMM_PHASE_TIMES", "0") not in ("", "0", "false", "False")
