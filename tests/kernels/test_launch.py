"""``qerl_kernels.launch``: the direct launch of a remembered compiled kernel (logic, with stand-in kernels: the GPU
check is ``qerl bench host`` and ``python -m qerl.bench.kernels_check``, which run both paths)."""
import types

import pytest

pytest.importorskip("triton")

from qerl_kernels import launch  # noqa: E402


class _Param:
    def __init__(self, name, constexpr, default=None):
        self.name, self.is_constexpr, self.default, self.has_default = name, constexpr, default, default is not None


class _Compiled:
    packed_metadata, function = object(), object()

    def __init__(self):
        self.runs = []
        self.run = lambda *a: self.runs.append(a)

    def launch_metadata(self, grid, stream, *args):
        return None


class _Kernel:
    """A JIT function with parameters (x, n, BLOCK: constexpr, FLAG: constexpr = True)."""

    def __init__(self, compiled):
        self.params = [_Param("x", False), _Param("n", False), _Param("BLOCK", True), _Param("FLAG", True, True)]
        self.compiled, self.triton_calls = compiled, []

    def __getitem__(self, grid):
        def go(*args, **kw):
            self.triton_calls.append((grid, args, kw))
            return self.compiled
        return go


@pytest.fixture
def fake(monkeypatch):
    launch.clear()
    drv = types.SimpleNamespace(active=types.SimpleNamespace(get_current_device=lambda: 0,
                                                             get_current_stream=lambda dev: 1234))
    import sys

    import triton.runtime.driver  # noqa: F401 (the module; ``triton.runtime.driver`` the attribute is its object)
    monkeypatch.setattr(sys.modules["triton.runtime.driver"], "driver", drv)
    c = _Compiled()
    return _Kernel(c), c


def test_second_launch_in_a_scope_calls_the_compiled_launcher_with_runtime_args_then_constexprs(fake):
    k, c = fake
    for x in ("a", "b"):
        prev = launch.scope(("call", 1))
        launch.run(k, (3, 2), (x, 7), dict(BLOCK=64, num_warps=4))
        launch.restore(prev)
    assert len(k.triton_calls) == 1 and len(c.runs) == 1
    grid0, grid1, grid2, stream, *_, enter, leave = c.runs[0][:9]
    assert (grid0, grid1, grid2, stream) == (3, 2, 1, 1234) and enter is None and leave is None
    assert c.runs[0][9:] == ("b", 7, 64, True)  # the default of FLAG filled in; num_warps is no parameter


def test_no_scope_different_scope_or_direct_off_take_tritons_path(fake):
    k, c = fake
    launch.run(k, (1,), ("a", 1), dict(BLOCK=8))
    launch.run(k, (1,), ("a", 1), dict(BLOCK=8))
    for key in ("s1", "s2"):
        prev = launch.scope(key)
        launch.run(k, (1,), ("a", 1), dict(BLOCK=8))
        launch.restore(prev)
    launch.DIRECT[0] = False
    try:
        prev = launch.scope("s1")
        launch.run(k, (1,), ("a", 1), dict(BLOCK=8))
        launch.restore(prev)
    finally:
        launch.DIRECT[0] = True
    assert len(k.triton_calls) == 5 and c.runs == []


def test_keywords_are_remembered_as_scope_constants_and_a_missing_parameter_is_never_remembered(fake):
    k, c = fake
    for x in ("a", "b"):
        prev = launch.scope("s")
        launch.run(k, (1,), (x,), dict(n=5, BLOCK=8))  # n: a runtime count the scope implies
        launch.restore(prev)
    assert len(k.triton_calls) == 1 and c.runs[0][9:] == ("b", 5, 8, True)
    for _ in range(2):
        prev = launch.scope("t")
        launch.run(k, (1,), ("a",), dict(BLOCK=8))  # n given nowhere: Triton's path (and its error) every time
        launch.restore(prev)
    assert len(k.triton_calls) == 3


def test_launches_of_one_scope_are_told_apart_by_order_and_kernel(fake):
    k, c = fake
    other = _Kernel(_Compiled())
    for _ in range(2):
        prev = launch.scope("s")
        launch.run(k, (1,), ("a", 1), dict(BLOCK=8))  # ordinal 0
        launch.run(other, (1,), ("b", 2), dict(BLOCK=16))  # ordinal 1
        launch.restore(prev)
    assert len(k.triton_calls) == 1 and len(other.triton_calls) == 1
    assert c.runs[0][9:] == ("a", 1, 8, True) and other.compiled.runs[0][9:] == ("b", 2, 16, True)
    prev = launch.scope("s")  # a different kernel at a remembered ordinal: Triton's path, not a wrong launch
    launch.run(other, (1,), ("c", 3), dict(BLOCK=16))
    launch.restore(prev)
    assert len(other.triton_calls) == 2


def test_an_installed_launch_hook_gets_tritons_path(fake):
    from triton import knobs

    k, c = fake
    seen = []
    hook = seen.append
    for _ in range(2):
        prev = launch.scope("s")
        launch.run(k, (1,), ("a", 1), dict(BLOCK=8))
        launch.restore(prev)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        prev = launch.scope("s")
        launch.run(k, (1,), ("a", 1), dict(BLOCK=8))
        launch.restore(prev)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(k.triton_calls) == 2 and len(c.runs) == 1


def test_scopes_are_per_thread(fake):
    """A scope opened on one thread (the trainer's) is not the scope of another (autograd's CUDA backward thread)."""
    import threading

    k, c = fake
    seen = []
    prev = launch.scope("main")
    t = threading.Thread(target=lambda: seen.append(launch._TLS.__dict__.get("key")))
    t.start()
    t.join()
    launch.restore(prev)
    assert seen == [None] and getattr(launch._TLS, "key", None) is None


def test_memo_computes_a_launchers_static_part_once_per_scope(fake):
    """``launch.memo``: once per (scope, builder) inside a scope; on every call outside one or with the direct
    launches off; ``clear`` forgets it."""
    calls = []

    def build(n):
        calls.append(n)
        return ("static", n)

    for _ in range(3):
        prev = launch.scope(("call", 1))
        assert launch.memo(build, 5) == ("static", 5)
        launch.restore(prev)
    assert calls == [5]
    prev = launch.scope(("call", 2))  # another scope: built again
    launch.memo(build, 6)
    launch.restore(prev)
    assert calls == [5, 6]
    launch.memo(build, 7), launch.memo(build, 7)  # outside any scope: every call
    assert calls == [5, 6, 7, 7] and not launch.in_scope()
    launch.DIRECT[0] = False
    try:
        prev = launch.scope(("call", 1))
        launch.memo(build, 8)
        launch.restore(prev)
    finally:
        launch.DIRECT[0] = True
    assert calls[-1] == 8
    launch.clear()
    prev = launch.scope(("call", 1))
    launch.memo(build, 9)
    launch.restore(prev)
    assert calls[-1] == 9


def test_cdiv_is_plain_integer_ceil_division():
    assert [launch.cdiv(a, 8) for a in (0, 1, 8, 9, 4096, 4097)] == [0, 1, 1, 2, 512, 513]


class _CudaLauncherLike:
    """What Triton's ``CudaLauncher`` holds: the C ``launch`` (recorded here), its flags and scratch sizes."""

    def __init__(self, scratch: int = 0):
        self.launches, self.calls = [], []
        self.global_scratch_size, self.global_scratch_align = scratch, 8
        self.profile_scratch_size, self.profile_scratch_align = 0, 1
        self.launch_cooperative_grid, self.launch_pdl, self.num_ctas = False, True, 1
        self.launch = lambda *a: self.launches.append(a)

    def __call__(self, *a):  # Triton's own path: CudaLauncher.__call__ (see the test below)
        self.calls.append(a)


def test_direct_launch_calls_the_c_launcher_with_what_cudalaunchers_call_would_pass(fake):
    """The direct path skips ``CudaLauncher.__call__`` for kernels without scratch; Triton's own ``__call__`` (run on
    the same stand-in) is the judge of the arguments the C launcher gets."""
    nvidia = pytest.importorskip("triton.backends.nvidia.driver")
    k, c = fake
    c.run = _CudaLauncherLike()
    for x in ("a", "b"):
        prev = launch.scope(("raw", 1))
        launch.run(k, (3, 2), (x, 7), dict(BLOCK=64))
        launch.restore(prev)
    assert len(k.triton_calls) == 1 and len(c.run.launches) == 1 and not c.run.calls
    direct = c.run.launches[0]
    nvidia.CudaLauncher.__call__(c.run, 3, 2, 1, 1234, c.function, c.packed_metadata, None, None, None, "b", 7, 64, True)
    assert c.run.launches[1] == direct
    assert direct[:7] == (3, 2, 1, 1234, c.function, False, True) and direct[-4:] == ("b", 7, 64, True)


def test_direct_launch_of_a_kernel_with_scratch_goes_through_the_launcher_call(fake):
    k, c = fake
    c.run = _CudaLauncherLike(scratch=64)  # needs a global scratch allocation: CudaLauncher.__call__ makes it
    for x in ("a", "b"):
        prev = launch.scope(("scratch", 1))
        launch.run(k, (5,), (x, 1), dict(BLOCK=8))
        launch.restore(prev)
    assert not c.run.launches and c.run.calls == [(5, 1, 1, 1234, c.function, c.packed_metadata, None, None, None,
                                                    "b", 1, 8, True)]
