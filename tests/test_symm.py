"""`transport.symm.SymmetricRegion` on CPU: what the host does with a device barrier's timeout record. The
barrier kernel itself runs under the Triton interpreter (tests/kernels/test_barrier_kernel.py) and on 2 GPUs
(tests/test_gpu.py)."""

import numpy as np
import pytest

from epcomm.transport.symm import SymmetricRegion


def _region_with_record(value: int) -> SymmetricRegion:
    region = SymmetricRegion.__new__(SymmetricRegion)  # no symmetric memory on CPU: only the host-side fields
    region.rank, region.timeout_ns, region._status_np = 0, 2_000_000_000, np.array([value], dtype=np.int64)
    return region


def test_check_status_names_the_rank_a_barrier_timed_out_on():
    with pytest.raises(TimeoutError, match=r"rank 0: a device barrier timed out after 2 s .* waiting for rank 2"):
        _region_with_record(3).check_status()  # the kernel records 1 + the missing rank


def test_check_status_is_quiet_without_a_record():
    _region_with_record(0).check_status()
