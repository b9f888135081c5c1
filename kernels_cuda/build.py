"""JIT build of the ``cuda_sm70`` extension: compiler, target arch, flags, cache; built at first use.

The sources are ``kernels_cuda/csrc/*.cu`` (kernels and their launchers, no torch headers) and
``csrc/binding.cpp`` (the torch binding). :func:`load` builds them once per process through
``torch.utils.cpp_extension.load`` (ninja) into a cache directory keyed by the sources' hash, the target arch
and the toolkit, and imports the result; a later process finds the build done (ninja has nothing to do).

Target arch (:func:`choose_arch`):

- ``QWEN35_CUDA_ARCH`` (``70``, ``7.5``, ``sm_70``, ``compute_75``) when set;
- else ``70`` when the toolkit still offers it (CUDA <= 12), else the lowest arch the toolkit offers
  (``nvcc --list-gpu-arch``; CUDA 13 gives 75). The kernels use SM70 features only whatever the target.

The build emits PTX for the target (``-gencode=arch=compute_XX,code=compute_XX``, compiled for the device by
the driver at load and kept in its cache) plus SASS (``code=sm_XX``) when the device is of that very arch. A
device older than the target (a V100 with CUDA 13) cannot run the PTX: :func:`load` says so instead of building.

Compiler (:func:`find_toolkit`), first found of:

- ``QWEN35_CUDA_COMPILER``: a path to ``nvcc`` or to CoreX's ``clang++``;
- ``CUDA_HOME`` / ``CUDA_PATH`` ``/bin/nvcc``, then ``nvcc`` on ``PATH``, then ``/usr/local/cuda/bin/nvcc``;
- CoreX's ``/usr/local/corex/bin/clang++`` (Iluvatar).

nvcc flags: ``-O3 -lineinfo`` plus the gencode above (no ``--use_fast_math``: exp and rsqrt keep their IEEE
accuracy), on top of torch's own (``-std=c++17``/``20``, ``--expt-relaxed-constexpr``, no implicit half
conversions). CoreX clang++ (Iluvatar, a CUDA-compatible clang) gets
``-x ivcore --cuda-gpu-arch=<QWEN35_COREX_ARCH, default ivcore10> --cuda-path=/usr/local/corex
--no-cuda-version-check -O3`` and is handed to torch as the CUDA compiler through ``PYTORCH_NVCC``; this relies
on CoreX's torch build accepting a clang driver there (contract-documented, not hardware-verified).

The build runs ninja (torch's JIT build does): the one on ``PATH``, else the ``ninja`` wheel's binary. The
compiler and ninja are looked for before anything else, so a host without them gets a :class:`CudaBuildError`
naming what is missing (the probe turns it into a WARNING and falls back).

Cache directory: ``QWEN35_CUDA_CACHE`` if set, else ``$XDG_CACHE_HOME/qwen35/cuda_sm70`` (``~/.cache/...``),
one subdirectory per :func:`cache_key`. A failed build raises :class:`CudaBuildError` quoting the compiler's
first error lines.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
COREX_ROOT = "/usr/local/corex"
COREX_CLANG = f"{COREX_ROOT}/bin/clang++"
ENV_ARCH = "QWEN35_CUDA_ARCH"
ENV_COMPILER = "QWEN35_CUDA_COMPILER"
ENV_CACHE = "QWEN35_CUDA_CACHE"
ENV_COREX_ARCH = "QWEN35_COREX_ARCH"
VOLTA = 70  # the feature set the kernels are written for
NVCC_FLAGS = ("-O3", "-lineinfo")
COREX_FLAGS = ("-x", "ivcore", "--no-cuda-version-check", "-O3")
CXX_FLAGS = ("-O3",)


class CudaBuildError(RuntimeError):
    """The ``cuda_sm70`` extension could not be built or loaded here; the message says why."""


@dataclass(frozen=True)
class Toolkit:
    """The compiler that builds the extension."""

    compiler: str  # path to nvcc or CoreX clang++
    kind: str  # "nvcc" | "corex-clang"
    home: str  # CUDA_HOME for torch's build (include/, lib64/)
    version: str  # e.g. "13.0.88"; part of the cache key
    archs: tuple[int, ...] = ()  # compute archs nvcc offers (empty for CoreX)

    @property
    def major(self) -> int:
        m = re.match(r"(\d+)", self.version)
        return int(m.group(1)) if m else 0


@dataclass(frozen=True)
class BuildPlan:
    """Everything :func:`load` hands to ``torch.utils.cpp_extension.load``."""

    name: str
    sources: tuple[str, ...]
    arch: int
    cuda_flags: tuple[str, ...]
    cxx_flags: tuple[str, ...]
    build_dir: str
    key: str
    toolkit: Toolkit
    env: dict = field(default_factory=dict)  # environment for the build (PYTORCH_NVCC for CoreX)


def _run(cmd: list[str], timeout: float = 60) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return proc.stdout + proc.stderr


def _nvcc_candidates() -> list[str]:
    out = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            out.append(os.path.join(home, "bin", "nvcc"))
    on_path = shutil.which("nvcc")
    if on_path:
        out.append(on_path)
    out.append("/usr/local/cuda/bin/nvcc")
    return out


@functools.lru_cache(maxsize=8)
def _describe(compiler: str) -> Toolkit:
    """Kind, home, version and offered archs of a compiler path (runs it once per path)."""
    path = os.path.realpath(compiler)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise CudaBuildError(f"CUDA compiler {compiler!r} does not exist or is not executable "
                             f"(set {ENV_COMPILER} or CUDA_HOME to a CUDA toolkit with nvcc)")
    base = os.path.basename(path)
    home = os.path.dirname(os.path.dirname(os.path.abspath(compiler)))
    if "clang" in base:
        text = _run([compiler, "--version"])
        m = re.search(r"version\s+([\w.\-]+)", text)
        return Toolkit(compiler, "corex-clang", home, "corex-clang-" + (m.group(1) if m else "unknown"))
    text = _run([compiler, "--version"])
    m = re.search(r"release\s+[\d.]+,\s+V([\d.]+)", text) or re.search(r"release\s+([\d.]+)", text)
    if not m:
        raise CudaBuildError(f"{compiler} --version did not report a CUDA release: {text.strip()[:200]!r}")
    archs = tuple(sorted({int(a) for a in re.findall(r"compute_(\d+)", _run([compiler, "--list-gpu-arch"]))}))
    return Toolkit(compiler, "nvcc", home, m.group(1), archs)


def find_toolkit(env: dict | None = None) -> Toolkit:
    """The compiler that builds the extension (see the module docstring for the order)."""
    env = os.environ if env is None else env
    forced = env.get(ENV_COMPILER)
    if forced:
        return _describe(forced)
    saved = {k: os.environ.get(k) for k in ("CUDA_HOME", "CUDA_PATH")}
    try:  # _nvcc_candidates reads os.environ; honour a caller's env
        for k in saved:
            if env.get(k) is not None:
                os.environ[k] = env[k]
            else:
                os.environ.pop(k, None)
        candidates = _nvcc_candidates()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    for cand in candidates:
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return _describe(cand)
    if os.path.isfile(COREX_CLANG):
        return _describe(COREX_CLANG)
    raise CudaBuildError("no CUDA compiler found: nvcc is not in CUDA_HOME/bin, on PATH or in /usr/local/cuda, "
                         f"and CoreX's {COREX_CLANG} is absent; install a CUDA toolkit or set {ENV_COMPILER}")


def parse_arch(text: str) -> int:
    """``70``, ``7.0``, ``sm_70``, ``compute_75``, ``sm70`` -> 70 / 75; ValueError naming the value otherwise."""
    t = text.strip().lower()
    m = re.fullmatch(r"(?:sm_?|compute_?)?(\d)\.?(\d)", t)
    if not m:
        raise ValueError(f"{ENV_ARCH}={text!r} is not an arch; accepted e.g. 70, 7.5, sm_70, compute_75")
    return int(m.group(1)) * 10 + int(m.group(2))


def choose_arch(toolkit: Toolkit, env: dict | None = None) -> int:
    """The target arch: ``QWEN35_CUDA_ARCH`` if set, else 70 where the toolkit offers it, else its lowest arch."""
    env = os.environ if env is None else env
    if env.get(ENV_ARCH):
        return parse_arch(env[ENV_ARCH])
    if toolkit.kind != "nvcc":
        return VOLTA  # CoreX reports capability 7.0; its arch flag is separate (QWEN35_COREX_ARCH)
    if toolkit.major <= 12 or not toolkit.archs or VOLTA in toolkit.archs:
        return VOLTA
    return min(toolkit.archs)


def gencode_flags(arch: int, device_cc: int | None) -> list[str]:
    """PTX for ``arch``, plus SASS when the device is of that arch."""
    flags = [f"-gencode=arch=compute_{arch},code=compute_{arch}"]
    if device_cc == arch:
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def source_files() -> list[Path]:
    return sorted(p for p in CSRC.iterdir() if p.suffix in SOURCE_SUFFIXES)


def source_hash(files: list[Path] | None = None) -> str:
    h = hashlib.sha256()
    for p in files if files is not None else source_files():
        h.update(p.name.encode())
        h.update(b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def cache_key(src_hash: str, arch: int, toolkit: Toolkit, torch_version: str, device_cc: int | None) -> str:
    """Key of one build: sources x arch (with or without device SASS) x toolkit x torch."""
    sass = device_cc == arch
    text = (f"{src_hash}|arch={arch}|sass={sass}|{toolkit.kind}|{toolkit.version}|{toolkit.compiler}"
            f"|torch={torch_version}")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_root(env: dict | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get(ENV_CACHE):
        return Path(env[ENV_CACHE])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qwen35" / "cuda_sm70"


def plan(device_cc: int | None, env: dict | None = None, toolkit: Toolkit | None = None) -> BuildPlan:
    """The build for a device of compute capability ``device_cc`` (e.g. 70, 90; None: PTX only)."""
    import torch

    env = os.environ if env is None else env
    tk = toolkit or find_toolkit(env)
    arch = choose_arch(tk, env)
    files = source_files()
    key = cache_key(source_hash(files), arch, tk, torch.__version__, device_cc)
    sources = tuple(str(p) for p in files if p.suffix in (".cu", ".cpp"))
    build_env: dict = {}
    if tk.kind == "nvcc":
        cuda_flags = [*NVCC_FLAGS, *gencode_flags(arch, device_cc)]
        if device_cc is not None and device_cc < arch:
            raise CudaBuildError(f"this device is sm_{device_cc} but the toolkit ({tk.compiler}, CUDA {tk.version}) "
                                 f"targets compute_{arch} at the lowest; sm_{device_cc} needs a toolkit that "
                                 f"offers it (CUDA <= 12 for sm_70) or {ENV_ARCH}")
    else:
        corex_arch = env.get(ENV_COREX_ARCH, "ivcore10")
        cuda_flags = [*COREX_FLAGS, f"--cuda-gpu-arch={corex_arch}", f"--cuda-path={tk.home}"]
        build_env["PYTORCH_NVCC"] = tk.compiler
    return BuildPlan(name=f"qwen35_sm70_{key}", sources=sources, arch=arch, cuda_flags=tuple(cuda_flags),
                     cxx_flags=CXX_FLAGS, build_dir=str(cache_root(env) / key), key=key, toolkit=tk, env=build_env)


def first_errors(text: str, lines: int = 6) -> str:
    """The compiler's first error lines from a build log (or its last lines when none says 'error')."""
    rows = [r for r in text.splitlines() if r.strip()]
    errs = [r for r in rows if re.search(r"\berror\b|fatal", r, re.IGNORECASE)]
    pick = errs[:lines] if errs else rows[-lines:]
    return "\n".join(r.strip()[:400] for r in pick)


_LOADED: dict[str, ModuleType] = {}
_LOCK = threading.Lock()
last_build: dict = {}  # facts of this process's last build or load (the GPU tests read them)


def _device_cc(device) -> int | None:  # noqa: ANN001
    import torch

    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _ninja_dir() -> str:
    """The directory of the ninja binary torch's build runs: PATH's, else the ``ninja`` wheel's."""
    on_path = shutil.which("ninja")
    if on_path:
        return os.path.dirname(on_path)
    try:
        import ninja

        if os.path.isfile(os.path.join(ninja.BIN_DIR, "ninja")):
            return ninja.BIN_DIR
    except Exception:  # noqa: BLE001 - absent or without BIN_DIR: not found
        pass
    raise CudaBuildError("ninja not found (torch.utils.cpp_extension builds with it): pip install ninja, or put a "
                         "ninja binary on PATH")


def load(device=None, *, verbose: bool = False) -> ModuleType:  # noqa: ANN001
    """The built extension for ``device`` (default: the current CUDA device), built now if the cache lacks it."""
    tk = find_toolkit()  # first: no compiler is an error on any device (and needs no CUDA runtime to say so)
    ninja_dir = _ninja_dir()
    cc = _device_cc(device)
    p = plan(cc, toolkit=tk)
    if shutil.which("ninja") is None:  # torch runs `ninja` from PATH: add the wheel's binary for the build
        p = replace(p, env={**p.env, "PATH": ninja_dir + os.pathsep + os.environ.get("PATH", "")})
    with _LOCK:
        if p.key in _LOADED:
            return _LOADED[p.key]
        module = _build(p, verbose)
        _LOADED[p.key] = module
        return module


def _build(p: BuildPlan, verbose: bool) -> ModuleType:
    import torch.utils.cpp_extension as cpp

    os.makedirs(p.build_dir, exist_ok=True)
    fresh = not any(Path(p.build_dir).glob("*.so"))
    saved_env = {k: os.environ.get(k) for k in p.env}
    saved_home = cpp.CUDA_HOME
    os.environ.update(p.env)
    # torch finds nvcc through its module-level CUDA_HOME (read at import); point it at the chosen toolkit.
    cpp.CUDA_HOME = p.toolkit.home
    t0 = time.time()
    try:
        module = cpp.load(name=p.name, sources=list(p.sources), extra_cflags=list(p.cxx_flags),
                          extra_cuda_cflags=list(p.cuda_flags), build_directory=p.build_dir, verbose=verbose)
    except Exception as e:  # noqa: BLE001 - any failure becomes one error with the compiler's words
        raise CudaBuildError(f"building the cuda_sm70 extension with {p.toolkit.compiler} (CUDA {p.toolkit.version}, "
                             f"compute_{p.arch}) failed in {p.build_dir}:\n{first_errors(str(e))}") from e
    finally:
        cpp.CUDA_HOME = saved_home
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    last_build.clear()
    last_build.update(key=p.key, build_dir=p.build_dir, fresh=fresh, seconds=time.time() - t0, arch=p.arch,
                      compiler=p.toolkit.compiler, toolkit=p.toolkit.version)
    return module
