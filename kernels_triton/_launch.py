"""Launch compiled Triton kernels without the JIT's per-call binder (short prefills are host-bound).

``JITFunction.run`` binds arguments, derives the specialisation key, looks the kernel up, builds
launch metadata and only then launches; a prefill makes two launches and an MoE block five or six, so at
short prompts and decode the host, not the GPU, sets the pace (measured: 46-52 µs per JIT launch against
27 µs through this launcher on the H200 machine's host, tuning/notes_gdn.md).
:class:`DirectLauncher` keys its own cache on what Triton specialises on -- constexpr values,
pointer dtypes (None included) and 16-byte alignment, integers equal to 1 or divisible by 16
unless the kernel opts out; it compiles and launches the first time
through the JIT and afterwards hands the arguments straight to the compiled kernel's C launch
function, tensors as device addresses (no ``data_ptr()`` call and driver pointer query per tensor).

Everything else goes through the JIT as usual: a tensor not on a CUDA device, an integer beyond
32 bits, ``TRITON_INTERPRET`` (CPU), launch hooks installed (profilers), ``QWEN35_DIRECT_LAUNCH=0``
in the environment, or :func:`set_enabled` ``(False)``.
Convention: pointer parameters are named ``*_ptr`` (a tensor anywhere else sends the call to the JIT).

Two call forms: ``launcher(grid, args, options)`` with every parameter in order (a named tuple from
:func:`launch_args`), or ``launcher[grid](*args, **kwargs)`` like ``kernel[grid](...)`` (trailing parameters by
name, the rest of the keywords are launch options such as ``num_warps``).
"""

from __future__ import annotations

import operator
from collections import namedtuple

import torch
import triton
from triton import knobs

from qwen35 import knobs as qwen35_knobs

_I32 = 2**31
ENABLED = qwen35_knobs.on("QWEN35_DIRECT_LAUNCH")  # read at each launch (a module global: no per-launch cost)


def set_enabled(on: bool) -> bool:
    """Send every launch through the direct path (True, the default) or through Triton's JIT (False); returns the
    previous setting. For benchmarks that time both paths."""
    global ENABLED
    before, ENABLED = ENABLED, bool(on)
    return before


def launch_args(name: str, kernel: triton.JITFunction, tail_from: str) -> tuple[type, type]:
    """(``<name>Args``, ``<name>Consts``): named tuples of ``kernel``'s parameters in its order, the whole launch and
    its tail from parameter ``tail_from`` on (what a launch plan fixes, built once per plan by name). A launch's
    ``<name>Args`` goes to :class:`DirectLauncher` as it is: a tuple whose fields say what each position holds."""
    names = list(kernel.arg_names)
    return namedtuple(f"{name}Args", names), namedtuple(f"{name}Consts", names[names.index(tail_from):])


_FIELD_INDEX: dict[type, dict[str, int]] = {}


def replaced(args: tuple, **changes: object) -> tuple:
    """``args._replace(**changes)`` for a launch's named tuple in about half the host time (``_replace`` pops every
    field name from the keywords; a call in parts makes a few of these per part)."""
    cls = type(args)
    index = _FIELD_INDEX.get(cls)
    if index is None:
        index = _FIELD_INDEX[cls] = {name: i for i, name in enumerate(cls._fields)}
    values = list(args)
    for name, value in changes.items():
        values[index[name]] = value
    return tuple.__new__(cls, values)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Give Triton a global-memory allocator (torch's caching allocator) unless one is set in this thread: kernels
    that build tensor descriptors on the device (``tl.make_tensor_descriptor``) need a scratch buffer per launch.
    Triton keeps the allocator in a context variable, so each launching thread sets it (a lookup when set)."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_scratch)


# the current CUDA device without torch.cuda.current_device()'s initialisation check (a tensor argument on a CUDA
# device has initialised CUDA already; measured: 0.6-0.8 µs less per launch on the H200's host)
_get_device = getattr(torch._C, "_cuda_getDevice", None)  # absent from CPU-only builds of torch


def _getter(idx: list[int]):
    """``args -> tuple(args[i] for i in idx)`` at C speed (itemgetter returns a bare item for one index)."""
    if len(idx) > 1:
        return operator.itemgetter(*idx)
    return (lambda args: (args[idx[0]],)) if idx else (lambda args: ())


class DirectLauncher:
    """``launcher(grid, args, options)``: launch ``kernel`` with every parameter given positionally."""

    def __init__(self, kernel: triton.JITFunction) -> None:
        self.kernel = kernel
        # Under the interpreter ``kernel`` is Triton's interpreter wrapper; an autotuned or heuristics
        # wrapper has no single compiled kernel per key: both always take the ordinary path.
        self.interpret = bool(knobs.runtime.interpret) or not isinstance(kernel, triton.JITFunction)
        self.cache: dict[tuple, object] = {}
        self.by_name: dict[tuple, tuple[list, list]] = {}  # call form -> how to fill the parameters (_call_by_name)
        self.hits = 0  # launches that took the direct path
        if self.interpret:
            return
        params = kernel.params
        self.names = [p.name for p in params]
        self.defaults = {p.name: p.default for p in params if p.default is not p._param.empty}
        ptrs = [i for i, p in enumerate(params) if p.name.endswith("_ptr")]
        consts = [i for i, p in enumerate(params) if p.is_constexpr]
        scalars = [i for i, p in enumerate(params) if i not in ptrs and i not in consts]
        self.ptr_index = ptrs
        self.consts = _getter(consts)
        self.specialised = [i for i in scalars if not params[i].do_not_specialize]
        self.plain = [i for i in scalars if params[i].do_not_specialize]

    def key(self, args: tuple) -> tuple[tuple, list] | None:
        """(what Triton would specialise on, the arguments with every tensor replaced by its device address),
        or None where this launcher leaves the call to the JIT. Addresses spare the C launcher a
        ``data_ptr()`` call and a driver pointer query per tensor on every launch; the JIT's first launch
        of a specialisation checked them, and tensors not on a CUDA device go to the JIT (which rejects them).

        The key is one flat tuple (no tuple per argument: nested tuples cost ~1 µs more per GDN prefill launch on the
        H200's host, tuning/notes_gdn.md): per pointer ``None`` or its dtype and 16-byte alignment, per specialised
        int whether it is 1 and whether 16 divides it (else its type), the constexpr values and then their types
        (True, 1 and 1.0 are equal in Python but compile differently). Each part has a fixed place or a fixed shape
        per kernel, so two calls get equal keys only where Triton would specialise them alike."""
        key = []
        add = key.append
        raw = list(args)
        for i in self.ptr_index:
            a = args[i]
            if a is None:
                add(None)
            elif not a.is_cuda:
                return None
            else:
                raw[i] = address = a.data_ptr()
                add(a.dtype)
                add(address & 15 == 0)  # Triton specialises on 16-byte alignment
        for i in self.specialised:
            a = args[i]
            if type(a) is int:
                if not -_I32 <= a < _I32:
                    return None
                add(a == 1)
                add(a % 16 == 0)
            elif isinstance(a, torch.Tensor):
                return None
            else:
                add(type(a))
        for i in self.plain:  # not specialised on value, but an int and a float compile differently
            a = args[i]
            if type(a) is int and not -_I32 <= a < _I32:
                return None
            add(type(a))
        consts = self.consts(args)
        return (*key, *consts, *map(type, consts)), raw

    def __getitem__(self, grid: tuple[int, ...]):
        """``launcher[grid](*args, **kwargs)``: the call form of ``kernel[grid](...)``."""
        return lambda *args, **kwargs: self._call_by_name(grid, args, kwargs)

    def _call_by_name(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        if self.interpret:
            self.kernel[grid](*args, **kwargs)
            return
        plan = self.by_name.get((len(args), *kwargs))
        if plan is None:
            plan = self._by_name_plan(len(args), tuple(kwargs))
        fill, option_names = plan
        self(grid, (*args, *[kwargs[name] if given else default for name, given, default in fill]),
             {name: kwargs[name] for name in option_names})

    def _by_name_plan(self, n_args: int, names: tuple[str, ...]) -> tuple[list, list]:
        """For calls with ``n_args`` positional arguments and keywords ``names`` (in this order): how each trailing
        parameter is filled -- (name, given by keyword, default) -- and which keywords are launch options. Made once
        per call form (a call site passes the same keywords every time), so a launch does no name matching."""
        fill = []
        for name in self.names[n_args:]:
            if name in names:
                fill.append((name, True, None))
            elif name in self.defaults:
                fill.append((name, False, self.defaults[name]))
            else:
                raise TypeError(f"{self.names[0]}...: missing kernel argument {name!r}")
        plan = fill, [name for name in names if name not in self.names[n_args:]]
        self.by_name[(n_args, *names)] = plan
        return plan

    def __call__(self, grid: tuple[int, ...], args: tuple, options: dict,
                 stream: torch.cuda.Stream | None = None) -> None:
        """``stream``: launch there instead of on the current stream (without the cost of switching streams)."""
        if (self.interpret or not ENABLED or knobs.runtime.launch_enter_hook.calls
                or knobs.runtime.launch_exit_hook.calls):
            self._jit(grid, args, options, stream)
            return
        planned = self.key(args)
        if planned is None:
            self._jit(grid, args, options, stream)
            return
        device = _get_device() if _get_device is not None else torch.cuda.current_device()
        key = (device, *options.items(), *planned[0])
        launch = self.cache.get(key)
        if launch is None:  # first call of this specialisation: the JIT compiles and launches it
            compiled = self._jit(grid, args, options, stream)
            self.cache[key] = _launch_function(compiled.result() if hasattr(compiled, "result") else compiled)
            return
        self.hits += 1
        launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
               torch._C._cuda_getCurrentRawStream(device) if stream is None else stream.cuda_stream, *planned[1])

    def _jit(self, grid: tuple[int, ...], args: tuple, options: dict, stream: torch.cuda.Stream | None):  # noqa: ANN202
        if stream is None:
            return self.kernel[grid](*args, **options)
        with torch.cuda.stream(stream):
            return self.kernel[grid](*args, **options)


def _launch_function(compiled):
    """``(gx, gy, gz, stream, *args) -> None`` for a compiled kernel: its C launch function when the kernel
    needs no scratch memory (CudaLauncher.__call__'s work is then all constant), else the launcher object."""
    runner = compiled.run
    fixed = (compiled.function, compiled.packed_metadata, None, None, None)  # no launch metadata, no hooks
    if getattr(runner, "global_scratch_size", 1) == 0 and getattr(runner, "profile_scratch_size", 1) == 0:
        c_launch = runner.launch
        head = (compiled.function, runner.launch_cooperative_grid, runner.launch_pdl, None, None, *fixed[1:])
        return lambda gx, gy, gz, stream, *args: c_launch(gx, gy, gz, stream, *head, *args)
    return lambda gx, gy, gz, stream, *args: runner(gx, gy, gz, stream, *fixed, *args)
