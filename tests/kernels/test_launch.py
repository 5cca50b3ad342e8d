"""kernels/launch.py: direct launches of compiled Triton kernels.

On CPU: a fake kernel checks that the cache key separates everything Triton specialises on (dtype, 16-byte
alignment, integers 1 / multiples of 16 / 64-bit, constexpr values, launch options) and nothing finer for runtime
integers, that the compiled kernel gets every argument in signature order with a 3-d grid, and that without CUDA
every launch goes the usual way. On a GPU: the direct path is taken for the reduction kernel and matches torch."""

from types import SimpleNamespace

import pytest
import torch

from epcomm.kernels import launch as launch_mod


class FakeKernel:
    """Parameters (a, n, B: constexpr); `warmup` compiles a recorder of launches."""

    def __init__(self):
        self.params = [SimpleNamespace(name="a", is_constexpr=False), SimpleNamespace(name="n", is_constexpr=False),
                       SimpleNamespace(name="B", is_constexpr=True)]
        self.compiles, self.launches, self.usual = [], [], []

    def warmup(self, *args, grid, **kwargs):
        self.compiles.append((args, kwargs))
        variant = len(self.compiles)
        kernel = self

        class Compiled:
            def __getitem__(self, grid3):
                return lambda *values, stream: kernel.launches.append((variant, grid3, values))
        return Compiled()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.usual.append((grid, args, kwargs))


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(launch_mod, "_compiled", {})
    monkeypatch.setattr(launch_mod, "_params", {})
    monkeypatch.setattr(launch_mod, "_usual_way", set())


def test_key_separates_what_triton_specialises(fresh, monkeypatch):
    monkeypatch.setattr(launch_mod, "_device_index", lambda: 0)
    monkeypatch.setattr(launch_mod, "_raw_stream", lambda device: 0)
    k = FakeKernel()
    buf = torch.zeros(64)
    aligned, misaligned = buf[:8], buf[1:9]  # 0 and 4 bytes past a 16-byte boundary (a fresh tensor is aligned)
    calls = [  # (args, kwargs, expected variant)
        ((aligned, 5), dict(B=3, num_warps=4), 1),
        ((aligned, 7), dict(B=3, num_warps=4), 1),  # another runtime int of the same class: no new variant
        ((buf[4:12], 5), dict(B=3, num_warps=4), 1),  # 16 bytes in: aligned as well
        ((misaligned, 5), dict(B=3, num_warps=4), 2),
        ((aligned, 1), dict(B=3, num_warps=4), 3),
        ((aligned, 32), dict(B=3, num_warps=4), 4),
        ((aligned, 48), dict(B=3, num_warps=4), 4),
        ((aligned, 2 ** 40), dict(B=3, num_warps=4), 5),  # a 64-bit int
        ((aligned, 5), dict(B=4, num_warps=4), 6),  # constexpr value
        ((aligned, 5), dict(B=3, num_warps=8), 7),  # launch option
        ((aligned.double(), 5), dict(B=3, num_warps=4), 8),  # dtype
        ((aligned,), dict(n=5, B=3, num_warps=4), 1),  # by keyword: same key
    ]
    for args, kwargs, variant in calls:
        launch_mod.launch(k, (9, 2), *args, **kwargs)
        got_variant, grid3, values = k.launches[-1]
        assert got_variant == variant, (args, kwargs)
        assert grid3 == (9, 2, 1) and values[1:] == (args[1] if len(args) > 1 else kwargs["n"], kwargs["B"])
        assert values[0] is args[0]
    assert len(k.compiles) == 8 and not k.usual


def test_key_separates_constexpr_types_and_float_signs_and_tuples(fresh, monkeypatch):
    """True, 1 and 1.0 (one dict key) and 0.0 / -0.0 are different constexprs to Triton; tuples are keyed element
    by element (not by the identity of the tensors they hold)."""
    monkeypatch.setattr(launch_mod, "_device_index", lambda: 0)
    monkeypatch.setattr(launch_mod, "_raw_stream", lambda device: 0)
    k = FakeKernel()
    a = torch.zeros(8)
    for b, variant in ((1, 1), (True, 2), (1.0, 3), (0.0, 4), (-0.0, 5), (1, 1), (-0.0, 5)):
        launch_mod.launch(k, (1,), a, 5, B=b)
        assert k.launches[-1][0] == variant, b
    for n, variant in (((torch.zeros(4), 3), 6), ((torch.zeros(4), 7), 6), ((torch.zeros(4), 16), 7)):
        launch_mod.launch(k, (1,), a, n, B=1)
        assert k.launches[-1][0] == variant, n
    assert len(k.compiles) == 7 and not k.usual


def test_a_variant_still_compiling_launches_the_usual_way(fresh, monkeypatch):
    """Triton's asynchronous compile mode: warmup returns a future whose type has no `__getitem__` (though
    `hasattr` through its `__getattr__` says it has): launch the usual way, cache nothing, mark nothing."""
    monkeypatch.setattr(launch_mod, "_device_index", lambda: 0)
    monkeypatch.setattr(launch_mod, "_raw_stream", lambda device: 0)

    class Future:
        def __getattr__(self, name):
            return getattr(object(), "__getitem__", None) or (lambda *a: None)

    k = FakeKernel()
    monkeypatch.setattr(k, "warmup", lambda *args, grid, **kwargs: Future())
    launch_mod.launch(k, (2,), torch.zeros(4), 3, B=1)
    assert len(k.usual) == 1 and not launch_mod._compiled and id(k) not in launch_mod._usual_way


def test_cpu_launches_go_the_usual_way(fresh):
    """Without CUDA the preparation fails and the kernel is launched as `kernel[grid](...)` from then on."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine prepares direct launches")
    k = FakeKernel()
    launch_mod.launch(k, (3,), torch.zeros(2), 4, B=1)
    launch_mod.launch(k, (3,), torch.zeros(2), 5, B=1)
    got = [(grid, args[1:], kwargs) for grid, args, kwargs in k.usual]
    assert got == [((3,), (4,), {"B": 1}), ((3,), (5,), {"B": 1})]
    assert id(k) in launch_mod._usual_way and not k.compiles


def test_compiled_variants_skip_the_runner_unless_a_hook_is_set(fresh, monkeypatch):
    """A compiled variant goes straight to its launcher with what Triton's runner would pass (grid, stream, function,
    packed metadata, no metadata, no hooks, the arguments, tensors as their addresses, which the launcher takes
    without a driver query); while a launch hook is set (a profiler), through the runner with the tensors, which
    calls the hook."""
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.setattr(launch_mod, "_device_index", lambda: 0)
    monkeypatch.setattr(launch_mod, "_raw_stream", lambda device: 99)

    class FakeCompiled:
        function, packed_metadata = 7, "meta"

        def __init__(self):
            self.runs, self.runner = [], []

        def _init_handles(self):
            pass

        def run(self, *args):
            self.runs.append(args)

        def __getitem__(self, grid3):
            return lambda *values, stream: self.runner.append((grid3, values, stream))

    compiled, k, a = FakeCompiled(), FakeKernel(), torch.zeros(4)
    monkeypatch.setattr(k, "warmup", lambda *args, grid, **kwargs: compiled)
    launch_mod.launch(k, (3,), a, 5, B=2)
    assert compiled.runs == [(3, 1, 1, 99, 7, "meta", None, None, None, a.data_ptr(), 5, 2)] and not compiled.runner
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    launch_mod.launch(k, (3, 2), a, 6, B=2)
    assert len(compiled.runs) == 1 and compiled.runner == [((3, 2, 1), (a, 6, 2), 99)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_direct_launch_on_gpu_matches_torch():
    pytest.importorskip("triton")
    from epcomm.kernels import _reduce_triton
    from epcomm.kernels.reduce import canonical_reduce, canonical_reduce_torch

    gen = torch.Generator().manual_seed(3)
    kernel = _reduce_triton._canonical_reduce_kernel
    for offset in (0, 1, 0):  # aligned, 4 bytes off, aligned again (a cache hit)
        rows = (torch.randn(64 * 300 + 8, generator=gen) * 10).cuda()[offset: offset + 64 * 300].view(64, 300)
        item = torch.randint(-1, 64, (24, 5), generator=gen).cuda()
        bias = torch.randn(24, 300, generator=gen).cuda()
        assert torch.equal(canonical_reduce(rows, item, bias), canonical_reduce_torch(rows, item, bias))
    assert id(kernel) not in launch_mod._usual_way
    rows_keys = {key[3][0] for key in launch_mod._compiled if key[0] == id(kernel)}  # (dtype, aligned) of `rows`
    assert rows_keys == {(torch.float32, True), (torch.float32, False)}, rows_keys
