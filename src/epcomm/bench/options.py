"""Command-line values shared by the benchmarks (`epcomm-bench`, `--eplb`, `--suite collectives`): comma lists and
output files, checked before a run starts, so that a bad value costs no measurement."""

from __future__ import annotations

import os
from typing import Optional


def split_list(value: str, option: str) -> list:
    """The items of a comma-separated option value, stripped.

    Raises:
        ValueError: no item, an empty item (`a,,b`), or an item given twice (each would be measured and compared
            against the other's rows).
    """
    items = [v.strip() for v in value.split(",")]
    if not any(items):
        raise ValueError(f"{option} needs at least one value, got {value!r}")
    if not all(items):
        raise ValueError(f"{option} has an empty item in {value!r}; separate values with single commas")
    repeated = sorted({v for v in items if items.count(v) > 1})
    if repeated:
        raise ValueError(f"{option} lists {', '.join(repeated)} more than once in {value!r}; list each value once")
    return items


def check_output_path(option: str, path: Optional[str], plot: bool = False) -> None:
    """Check, before the run, that `path` can be written (and, for a plot, that matplotlib writes its format);
    nothing is left behind.

    Raises:
        ValueError: a folder that does not exist, a path that is a folder or cannot be opened for writing, a plot
            format matplotlib does not write (or no matplotlib).
    """
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{option} {path!r}: the folder {folder!r} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{option} {path!r} is a folder; name a file in it")
    if plot:
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise ValueError(f"{option} needs matplotlib (pip install matplotlib)") from None
        formats = Figure().canvas.get_supported_filetypes()
        suffix = os.path.splitext(path)[1].lstrip(".").lower()
        if suffix not in formats:
            raise ValueError(f"{option} {path!r}: matplotlib writes {', '.join(sorted(formats))}, not {suffix!r}; "
                             "name a file with one of those endings")
    if os.path.exists(path):
        if not os.path.isfile(path):  # a pipe or a device would block or swallow the results
            raise ValueError(f"{option} {path!r} is not a regular file")
        if not os.access(path, os.W_OK):
            raise ValueError(f"{option} {path!r} cannot be written (no permission)")
        return
    if os.path.islink(path):  # a link to a file that does not exist yet: writing would create its target
        raise ValueError(f"{option} {path!r} is a link to a missing file; name the target itself")
    try:  # a new file: create it, then remove it, so that nothing is left behind
        with open(path, "x"):
            pass
    except OSError as e:
        raise ValueError(f"{option} {path!r} cannot be written ({e.strerror or e})") from None
    os.remove(path)
