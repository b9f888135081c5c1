"""The direct launcher (kernels_triton/_launch.py), on a CPU: Triton's JIT and the compiled kernel are faked,
so what is tested is the specialisation key, the argument order handed to the launch function, and when
the launcher leaves a call to the JIT."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from kernels_triton import _launch
from kernels_triton._launch import DirectLauncher

STREAM = 1234


def _toy_kernel(x_ptr, y_ptr, n, stride, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pass  # never compiled


def _named_kernel(x_ptr, n, BLOCK: tl.constexpr, FLAG: tl.constexpr = True):
    pass  # never compiled


@pytest.fixture
def faked(monkeypatch):
    """``make(fn, **jit_options) -> (launcher, jit_calls, direct_calls, Compiled)`` on a faked GPU: every tensor
    reports itself as CUDA, the JIT records its calls and returns a compiled kernel whose ``run`` records its."""
    monkeypatch.setattr(knobs.runtime, "interpret", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: STREAM, raising=False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))

    def make(fn, **jit_options):
        launcher = DirectLauncher(JITFunction(fn, **jit_options))
        jit_calls, direct_calls = [], []

        class Compiled:
            function, packed_metadata = "fn", "meta"

            def run(self, *a):
                direct_calls.append(a)

        class FakeJit:
            def __getitem__(self, grid):
                return lambda *args, **options: jit_calls.append((grid, args, options)) or Compiled()

        launcher.kernel = FakeJit()
        return launcher, jit_calls, direct_calls, Compiled

    return make


def test_direct_launcher_keys_and_launches(faked, monkeypatch):
    """The first call of a specialisation goes through the JIT, later ones straight to the compiled kernel's
    launcher with every argument in order; a new dtype, a None pointer, a specialised integer becoming 1 or
    a multiple of 16, a pointer's 16-byte alignment or a constexpr change is a new specialisation; an
    opted-out integer is not; tensors off the GPU and integers beyond 32 bits always take the JIT."""
    launcher, jit_calls, direct_calls, Compiled = faked(_toy_kernel, do_not_specialize=["n"])
    x = torch.zeros(64, dtype=torch.float32)
    p = x.data_ptr()  # the direct path hands addresses to the launcher
    opts = {"num_warps": 4}

    def launch(*args, grid=(3,)):
        launcher(grid, args, opts)
        return len(jit_calls), len(direct_calls)

    assert launch(x, x, 5, 7, 0.5, 32, True) == (1, 0)
    assert launch(x, x, 9, 7, 0.25, 32, True) == (1, 1)  # n opts out, scale is a plain float
    assert direct_calls[-1] == (3, 1, 1, STREAM, "fn", "meta", None, None, None, p, p, 9, 7, 0.25, 32, True)
    assert launch(x, x, 5, 7, 0.5, 32, True, grid=(2, 5)) == (1, 2) and direct_calls[-1][:3] == (2, 5, 1)
    assert launch(x, x, 5, 16, 0.5, 32, True) == (2, 2)  # stride divisible by 16
    assert launch(x, x, 5, 1, 0.5, 32, True) == (3, 2)  # stride == 1
    assert launch(x, None, 5, 7, 0.5, 32, True) == (4, 2)
    assert launch(x, x.half(), 5, 7, 0.5, 32, True) == (5, 2)
    assert launch(x, x, 5, 7, 0.5, 64, True) == (6, 2)
    assert launch(x, x, 5, 7, 0.5, 32, True) == (6, 3)
    assert launch(x[1:], x, 5, 7, 0.5, 32, True) == (7, 3)  # 4-byte aligned view: its own specialisation
    assert launch(x[1:], x, 5, 7, 0.5, 32, True) == (7, 4)
    assert direct_calls[-1][9] == p + 4
    assert launch(x, x, 2**33, 7, 0.5, 32, True) == (8, 4)
    assert jit_calls[-1] == ((3,), (x, x, 2**33, 7, 0.5, 32, True), opts)

    class Runner:  # Triton's CudaLauncher: without scratch memory its C launch function is called directly
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

        def launch(self, *a):
            direct_calls.append(("c", *a))

    Compiled.run = Runner()
    launcher.cache.clear()
    assert launch(x, x, 5, 7, 0.5, 32, True) == (9, 4)
    assert launch(x, x, 6, 7, 0.5, 32, True, grid=(4, 2, 2)) == (9, 5)
    assert direct_calls[-1] == ("c", 4, 2, 2, STREAM, "fn", False, True, None, None, "meta", None, None, None,
                                p, p, 6, 7, 0.5, 32, True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: False))
    assert launch(x, x, 6, 7, 0.5, 32, True) == (10, 5)  # a tensor off the GPU: the JIT rejects it


def test_direct_launcher_keys_types_not_just_values(faked):
    """Triton compiles ``FLAG=True`` and ``FLAG=1``, or an opted-out ``n`` of 5 and of 5.0, separately: so do we."""
    launcher, *_ = faked(_toy_kernel, do_not_specialize=["n"])
    x = torch.zeros(64)
    base = launcher.key((x, x, 5, 7, 0.5, 32, True))[0]
    assert launcher.key((x, x, 5, 7, 0.5, 32, 1))[0] != base
    assert launcher.key((x, x, 5.0, 7, 0.5, 32, True))[0] != base
    assert launcher.key((x, x, 6, 7, 0.5, 32, True))[0] == base  # n is not specialised on its value


def test_direct_launcher_by_name_call_form(faked, monkeypatch):
    """``launcher[grid](*args, **kw)`` (the MoE call sites' form) completes trailing parameters from keywords
    and defaults, passes the rest as launch options, and switches off with ``ENABLED``."""
    launcher, jit_calls, direct_calls, _ = faked(_named_kernel)
    buf = torch.zeros(64)
    launcher[(3,)](buf, 5, BLOCK=16, num_warps=4)  # first call: the JIT, with every parameter in order
    assert jit_calls == [((3,), (buf, 5, 16, True), {"num_warps": 4})]
    launcher[(4, 2)](buf, 5, BLOCK=16, num_warps=4)  # hit
    assert launcher.hits == 1
    assert direct_calls[-1] == (4, 2, 1, STREAM, "fn", "meta", None, None, None, buf.data_ptr(), 5, 16, True)
    launcher[(1,)](buf, 5, BLOCK=16, FLAG=False, num_warps=4)  # another constexpr: compiled anew
    assert len(jit_calls) == 2 and jit_calls[-1][1] == (buf, 5, 16, False)
    launcher[(2,)](buf, 5, num_warps=4, FLAG=False, BLOCK=16)  # the same call with its keywords in another order
    assert launcher.hits == 2 and direct_calls[-1][-3:] == (5, 16, False)
    with pytest.raises(TypeError, match="BLOCK"):
        launcher[(1,)](buf, 5, num_warps=4)
    with pytest.raises(TypeError, match="BLOCK"):  # a failed call form is not remembered
        launcher[(1,)](buf, 5, num_warps=4)
    monkeypatch.setattr(_launch, "ENABLED", False)
    launcher[(4, 2)](buf, 5, BLOCK=16, num_warps=4)
    assert len(jit_calls) == 3 and launcher.hits == 2


def test_launch_args_name_every_parameter_and_patch_by_name():
    """A launch's named tuple has the kernel's parameters in order (the tail from a parameter on: what one plan
    fixes); ``replaced`` patches fields by name as ``_replace`` does, and a name the kernel lacks is an error."""
    Args, Consts = _launch.launch_args("Toy", JITFunction(_toy_kernel), "BLOCK")
    assert Args._fields == ("x_ptr", "y_ptr", "n", "stride", "scale", "BLOCK", "FLAG")
    assert Consts._fields == ("BLOCK", "FLAG")
    args = tuple.__new__(Args, (1, 2, 3, 4, 0.5, *Consts(BLOCK=32, FLAG=True)))
    got = _launch.replaced(args, n=7, FLAG=False)
    assert type(got) is Args and got == args._replace(n=7, FLAG=False) == (1, 2, 7, 4, 0.5, 32, False)
    with pytest.raises(KeyError, match="nope"):
        _launch.replaced(args, nope=1)


def test_direct_launch_switch_and_the_bench_api(faked, monkeypatch):
    """``set_enabled`` turns the direct path off and on (returning what was set); the bench API's ``jit_launches``
    restores the setting after its block, and ``launches_stubbed`` reports every launch instead of running it."""
    from kernels_triton import bench_api

    launcher, jit_calls, _, _ = faked(_named_kernel)
    buf = torch.zeros(64)
    assert _launch.set_enabled(False) is True and _launch.ENABLED is False
    assert _launch.set_enabled(True) is False
    with bench_api.jit_launches():
        assert _launch.ENABLED is False
    assert _launch.ENABLED is True
    seen = []
    with bench_api.launches_stubbed(seen.append):
        launcher[(1,)](buf, 5, BLOCK=16, num_warps=4)
        launcher((2,), (buf, 5, 16, True), {"num_warps": 4})
    assert seen == ["direct", "direct"] and jit_calls == []
    launcher[(1,)](buf, 5, BLOCK=16, num_warps=4)  # stubs gone: the first call of the specialisation compiles
    assert len(jit_calls) == 1
