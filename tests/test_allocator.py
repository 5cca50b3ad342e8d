"""`BufferAllocator`: allocation plans inside one 2 MiB-aligned region (DeepEP V2.5 behaviour, §6)."""

import pytest
import torch

from epcomm.allocator import BufferAllocator

MiB = 1 << 20


def test_layout_worked_example():
    plan = BufferAllocator()
    a = plan.allocate((3, 5), torch.float32)  # 60 bytes at 0
    b = plan.allocate(2 * MiB, torch.uint8)  # 2 MiB at 2 MiB
    c = plan.allocate((0, 7), torch.bfloat16)  # empty, at 4 MiB
    d = plan.allocate(1, torch.float64)  # 8 bytes at 4 MiB
    assert [(p.offset, p.num_bytes) for p in plan.allocations] == [(0, 60), (2 * MiB, 2 * MiB), (4 * MiB, 0),
                                                                   (4 * MiB, 8)]
    assert plan.num_bytes == 6 * MiB and plan.alignment == 2 * MiB and not plan.materialized
    assert all(t.device.type == "meta" for t in (a, b, c, d))
    assert plan.allocations[0].tensor is a


def test_materialize_swaps_placeholders_in_place():
    plan = BufferAllocator()
    w = plan.allocate((4, 2, 8), torch.bfloat16)
    sf = plan.allocate((4, 3), torch.float32)
    flag = plan.allocate((5,), torch.bool)
    keep = {"w": w}  # any reference the user holds sees the real tensor
    storage = torch.zeros(plan.num_bytes, dtype=torch.uint8)
    plan.materialize(storage)
    assert plan.materialized and keep["w"] is w
    assert w.device.type == "cpu" and w.shape == (4, 2, 8) and w.dtype == torch.bfloat16 and w.is_contiguous()
    assert w.data_ptr() == storage.data_ptr()
    assert sf.data_ptr() == storage.data_ptr() + 2 * MiB and flag.data_ptr() == storage.data_ptr() + 4 * MiB
    w.fill_(1.5)  # fills round-trip through the storage
    sf.copy_(torch.arange(12.0).view(4, 3))
    flag[2] = True
    assert torch.equal(storage[:64].view(torch.bfloat16), torch.full((32,), 1.5, dtype=torch.bfloat16))
    assert torch.equal(storage[2 * MiB:2 * MiB + 48].view(torch.float32), torch.arange(12.0))
    assert storage[4 * MiB + 2] == 1 and storage[4 * MiB:4 * MiB + 5].sum() == 1


def test_empty_plan():
    plan = BufferAllocator()
    plan.materialize(torch.empty(0, dtype=torch.uint8))
    assert plan.num_bytes == 0 and plan.materialized


def test_allocate_checks():
    plan = BufferAllocator()
    with pytest.raises(TypeError, match=r"BufferAllocator\.allocate: shape must be an int or a sequence of ints, "
                                        r"got '3'"):
        plan.allocate("3", torch.float32)
    with pytest.raises(TypeError, match=r"shape must be an int or a sequence of ints, got \(2, 1\.5\)"):
        plan.allocate((2, 1.5), torch.float32)
    with pytest.raises(ValueError, match=r"shape must have dimensions >= 0, got \(2, -1\)"):
        plan.allocate((2, -1), torch.float32)
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype, got str"):
        plan.allocate(4, "float32")
    assert plan.allocations == [] and plan.num_bytes == 0
    plan.allocate(torch.Size([2, 2]), torch.float32)
    plan.materialize(torch.empty(plan.num_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"BufferAllocator\.allocate: the plan is already materialized"):
        plan.allocate(4, torch.float32)


def test_materialize_checks():
    plan = BufferAllocator()
    plan.allocate(10, torch.float32)
    with pytest.raises(TypeError, match=r"BufferAllocator\.materialize: storage must be a torch\.Tensor, got list"):
        plan.materialize([0] * plan.num_bytes)
    with pytest.raises(TypeError, match=r"storage must have dtype torch\.uint8, got torch\.int8"):
        plan.materialize(torch.empty(plan.num_bytes, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"storage must be a 1-D contiguous tensor, got shape \(2, 1048576\)"):
        plan.materialize(torch.empty(2, MiB, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"storage must be a 1-D contiguous tensor, got shape \(2097152,\) and "
                                         r"strides \(2,\)"):
        plan.materialize(torch.empty(2 * plan.num_bytes, dtype=torch.uint8)[::2])
    with pytest.raises(ValueError, match=r"storage must be on a real device \(cpu or cuda\), got meta"):
        plan.materialize(torch.empty(plan.num_bytes, dtype=torch.uint8, device="meta"))
    with pytest.raises(ValueError, match=r"storage holds 4194304 bytes but the plan needs num_bytes=2097152; "
                                         r"allocate exactly plan\.num_bytes bytes"):
        plan.materialize(torch.empty(2 * plan.num_bytes, dtype=torch.uint8))
    assert not plan.materialized and plan.allocations[0].tensor.device.type == "meta"
    plan.materialize(torch.empty(plan.num_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"BufferAllocator\.materialize: the plan is already materialized \(a plan "
                                         r"is used once\)"):
        plan.materialize(torch.empty(plan.num_bytes, dtype=torch.uint8))


def test_views_of_placeholders_block_the_swap_and_leave_the_plan_whole():
    plan = BufferAllocator()
    first = plan.allocate(4, torch.float32)
    second = plan.allocate(4, torch.float32)
    view = second.view(2, 2)  # noqa: F841 -- a view keeps the placeholder's implementation shared
    with pytest.raises(ValueError, match=r"planned tensor #1 \(shape \(4,\), torch\.float32\) cannot be swapped in "
                                         r"place: another tensor shares it; do not take views of placeholders "
                                         r"before materialize"):
        plan.materialize(torch.empty(plan.num_bytes, dtype=torch.uint8))
    assert not plan.materialized and first.device.type == "meta" and second.device.type == "meta"


def test_rebind_moves_the_same_objects_onto_new_storage():
    plan = BufferAllocator()
    w = plan.allocate((2, 3), torch.float32)
    sf = plan.allocate(4, torch.int16)
    with pytest.raises(ValueError, match=r"BufferAllocator\.rebind: the plan is not materialized yet"):
        plan.rebind(torch.zeros(plan.num_bytes, dtype=torch.uint8))
    old = torch.zeros(plan.num_bytes, dtype=torch.uint8)
    plan.materialize(old)
    w.fill_(1.0)
    new = torch.zeros(plan.num_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"BufferAllocator\.rebind: storage holds 2 bytes but the plan needs"):
        plan.rebind(torch.zeros(2, dtype=torch.uint8))
    plan.rebind(new)  # values are not copied: the new storage is zero
    assert w.data_ptr() == new.data_ptr() and sf.data_ptr() == new.data_ptr() + 2 * MiB
    assert w.shape == (2, 3) and w.dtype == torch.float32 and bool((w == 0).all())
    w.fill_(3.0)
    assert torch.equal(new[:24].view(torch.float32), torch.full((6,), 3.0))
    assert torch.equal(old[:24].view(torch.float32), torch.full((6,), 1.0))
    assert torch.equal(sf, torch.zeros(4, dtype=torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_materialize_on_cuda():
    plan = BufferAllocator()
    w = plan.allocate((3, 4), torch.float16)
    storage = torch.zeros(plan.num_bytes, dtype=torch.uint8, device="cuda")
    plan.materialize(storage)
    assert w.is_cuda and w.data_ptr() == storage.data_ptr()
    w.fill_(2.0)
    assert torch.equal(storage[:24].view(torch.float16).cpu(), torch.full((12,), 2.0, dtype=torch.float16))


def test_release_turns_a_materialized_plan_back_into_placeholders():
    plan = BufferAllocator()
    a, b = plan.allocate((3, 4), torch.float32), plan.allocate(5, torch.bfloat16)
    plan.materialize(torch.zeros(plan.num_bytes, dtype=torch.uint8))
    plan.release()
    assert not plan.materialized and a.device.type == b.device.type == "meta" and a.shape == (3, 4)
    storage = torch.zeros(plan.num_bytes, dtype=torch.uint8)
    plan.materialize(storage)  # the same objects, usable again
    assert a.data_ptr() == storage.data_ptr() and b.dtype == torch.bfloat16
    plan2 = BufferAllocator()
    with pytest.raises(ValueError, match="the plan is not materialized"):
        plan2.release()
