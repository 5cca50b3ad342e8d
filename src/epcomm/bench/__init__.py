"""`epcomm-bench`: the benchmark harness (docs/benchmarks.md). Run it as `epcomm-bench` or `python -m epcomm.bench`."""

from .cli import main

__all__ = ["main"]
