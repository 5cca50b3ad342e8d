"""Environment variables read by epcomm (all in one place; listed in README.md).

| variable | default | effect |
| --- | --- | --- |
| `EPCOMM_DEBUG` | unset | `1`: log sizes, transport choices and per-call counts to stderr (logger `epcomm`) |
"""

from __future__ import annotations

import os


def debug_enabled() -> bool:
    return os.environ.get("EPCOMM_DEBUG", "0") not in ("", "0", "false", "False")
