"""`python -m epcomm.bench`: the same as `epcomm-bench`."""

from .cli import main

if __name__ == "__main__":  # the spawned ranks import this module too; only the parent runs
    raise SystemExit(main())
