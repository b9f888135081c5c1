"""The cuda_sm70 JIT build's logic on the CPU: target arch, compiler choice and override, cache key, the command torch
writes for it, and the compiler's errors quoted; nothing is linked here (that needs a CUDA torch, on the GPU)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels_cuda import build

NVCC = build._nvcc_candidates()
NVCC = next((p for p in NVCC if os.path.isfile(p)), None)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")

TK12 = build.Toolkit("/opt/cuda12/bin/nvcc", "nvcc", "/opt/cuda12", "12.4.131", (50, 52, 60, 70, 75, 80, 90))
TK13 = build.Toolkit("/opt/cuda13/bin/nvcc", "nvcc", "/opt/cuda13", "13.0.88", (75, 80, 86, 90, 100, 120))
COREX = build.Toolkit("/usr/local/corex/bin/clang++", "corex-clang", "/usr/local/corex", "corex-clang-16.0.0")


@pytest.mark.parametrize("text,want", [("70", 70), ("7.5", 75), ("sm_70", 70), ("compute_75", 75), ("sm75", 75),
                                       (" 8.0 ", 80)])
def test_parse_arch(text, want):
    assert build.parse_arch(text) == want


@pytest.mark.parametrize("bad", ["volta", "7", "sm_", "700", ""])
def test_parse_arch_rejects_with_the_variable_named(bad):
    with pytest.raises(ValueError, match="QWEN35_CUDA_ARCH"):
        build.parse_arch(bad)


def test_arch_is_volta_up_to_cuda_12_then_the_lowest_offered():
    assert build.choose_arch(TK12, env={}) == 70
    assert build.choose_arch(TK13, env={}) == 75
    assert build.choose_arch(COREX, env={}) == 70
    assert build.choose_arch(TK13, env={"QWEN35_CUDA_ARCH": "sm_90"}) == 90
    assert build.choose_arch(TK12, env={"QWEN35_CUDA_ARCH": "7.5"}) == 75


def test_gencode_is_ptx_plus_sass_for_a_device_of_that_arch():
    assert build.gencode_flags(75, 90) == ["-gencode=arch=compute_75,code=compute_75"]
    assert build.gencode_flags(75, None) == ["-gencode=arch=compute_75,code=compute_75"]
    assert build.gencode_flags(70, 70) == ["-gencode=arch=compute_70,code=compute_70",
                                           "-gencode=arch=compute_70,code=sm_70"]


def test_cache_key_separates_sources_arch_toolkit_and_sass():
    base = build.cache_key("abc", 75, TK13, "2.11.0", 90)
    assert base == build.cache_key("abc", 75, TK13, "2.11.0", 90)
    others = {build.cache_key("abd", 75, TK13, "2.11.0", 90), build.cache_key("abc", 70, TK13, "2.11.0", 90),
              build.cache_key("abc", 75, TK12, "2.11.0", 90), build.cache_key("abc", 75, TK13, "2.12.0", 90),
              build.cache_key("abc", 75, TK13, "2.11.0", 75)}
    assert base not in others and len(others) == 5
    assert build.cache_key("abc", 75, TK13, "2.11.0", 90) == build.cache_key("abc", 75, TK13, "2.11.0", 80)


def test_source_hash_follows_every_source(tmp_path):
    a, b = tmp_path / "a.cu", tmp_path / "b.cuh"
    a.write_text("x")
    b.write_text("y")
    h1 = build.source_hash([a, b])
    b.write_text("z")
    assert build.source_hash([a, b]) != h1
    assert len(build.source_hash()) == 64 and {p.suffix for p in build.source_files()} >= {".cu", ".cuh", ".cpp"}


def test_cache_root_from_env(tmp_path):
    assert build.cache_root({"QWEN35_CUDA_CACHE": str(tmp_path)}) == tmp_path
    assert build.cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "qwen35" / "cuda_sm70"


def test_missing_compiler_override_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "no" / "nvcc")
    with pytest.raises(build.CudaBuildError, match=re.escape(missing) + ".*does not exist"):
        build.find_toolkit({"QWEN35_CUDA_COMPILER": missing})


@needs_nvcc
def test_compiler_override_and_this_toolkit():
    tk = build.find_toolkit({"QWEN35_CUDA_COMPILER": NVCC})
    assert tk.kind == "nvcc" and tk.compiler == NVCC and tk.archs and tk.major >= 11
    assert build.choose_arch(tk, env={}) == (70 if tk.major <= 12 else min(tk.archs))
    assert build.find_toolkit({"CUDA_HOME": os.path.dirname(os.path.dirname(NVCC))}).kind == "nvcc"


@needs_nvcc
def test_plan_for_a_device_the_toolkit_cannot_target(monkeypatch):
    tk = build.find_toolkit({"QWEN35_CUDA_COMPILER": NVCC})
    if tk.major <= 12:
        pytest.skip("this toolkit still targets sm_70")
    with pytest.raises(build.CudaBuildError, match="sm_70 needs a toolkit"):
        build.plan(70, env={}, toolkit=tk)
    p = build.plan(70, env={"QWEN35_CUDA_ARCH": "70"}, toolkit=tk)  # forced: the user's call
    assert "-gencode=arch=compute_70,code=compute_70" in p.cuda_flags


@needs_nvcc
def test_plan_here(tmp_path):
    tk = build.find_toolkit({"QWEN35_CUDA_COMPILER": NVCC})
    p = build.plan(90, env={"QWEN35_CUDA_CACHE": str(tmp_path)}, toolkit=tk)
    arch = build.choose_arch(tk, env={})
    assert p.arch == arch
    assert f"-gencode=arch=compute_{arch},code=compute_{arch}" in p.cuda_flags
    assert not any("code=sm_" in f for f in p.cuda_flags)  # an H200 gets PTX only
    assert Path(p.build_dir).parent == tmp_path and p.key in p.build_dir and p.name.endswith(p.key)
    assert sorted(Path(s).name for s in p.sources) == sorted(
        f.name for f in build.source_files() if f.suffix in (".cu", ".cpp"))


def test_corex_plan_hands_clang_to_torch(tmp_path):
    p = build.plan(70, env={"QWEN35_CUDA_CACHE": str(tmp_path), "QWEN35_COREX_ARCH": "ivcore11"}, toolkit=COREX)
    assert p.env == {"PYTORCH_NVCC": COREX.compiler}
    assert "--cuda-gpu-arch=ivcore11" in p.cuda_flags and "-x" in p.cuda_flags
    assert not any(f.startswith("-gencode") for f in p.cuda_flags)


@needs_nvcc
def test_torch_writes_the_build_command(tmp_path, monkeypatch):
    """torch.utils.cpp_extension, pointed at this toolkit, writes the ninja file for the plan; its nvcc command
    compiles a source of ours (to PTX: linking needs a CUDA torch)."""
    import torch.utils.cpp_extension as cpp

    writer = getattr(cpp, "_write_ninja_file_to_build_library", None)
    if writer is None:
        pytest.skip("this torch has no _write_ninja_file_to_build_library")
    tk = build.find_toolkit({"QWEN35_CUDA_COMPILER": NVCC})
    p = build.plan(None, env={"QWEN35_CUDA_CACHE": str(tmp_path)}, toolkit=tk)
    monkeypatch.setattr(cpp, "CUDA_HOME", tk.home)
    ninja = tmp_path / "build.ninja"
    writer(str(ninja), p.name, list(p.sources), list(p.cxx_flags), list(p.cuda_flags), [], [], [], True, False,
           False)
    text = ninja.read_text()
    assert f"nvcc = {tk.home}/bin/nvcc" in text.replace("'", "")
    flags = next(ln for ln in text.splitlines() if ln.startswith("cuda_cflags = "))
    assert f"-gencode=arch=compute_{p.arch},code=compute_{p.arch}" in flags
    assert f"-DTORCH_EXTENSION_NAME={p.name}" in flags and "-O3" in flags
    assert not re.search(r"-gencode=arch=compute_\d+,code=sm_\d+", flags)
    src = next(s for s in p.sources if s.endswith("gdn_step.cu"))
    args = flags[len("cuda_cflags = "):].replace("--compiler-options '-fPIC'", "").split()
    args = [a for a in args if not a.startswith("-gencode")]
    proc = subprocess.run([tk.compiler, *args, f"-arch=compute_{p.arch}", "-ptx", src, "-o", str(tmp_path / "x.ptx")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]


@needs_nvcc
def test_a_failed_compile_is_quoted_by_its_first_error_lines(tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text("__global__ void k(float* x) { x[0] = undeclared_name; }\n")
    proc = subprocess.run([NVCC, "-ptx", str(bad), "-o", str(tmp_path / "bad.ptx")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    quoted = build.first_errors("ninja: build stopped\n" + proc.stdout + proc.stderr)
    assert "undeclared_name" in quoted and "error" in quoted


def test_binding_compiles_against_torch_headers(tmp_path):
    """binding.cpp against this torch's headers (syntax only; the CPU build of torch lacks one generated CUDA
    header, which a stub stands in for)."""
    import sysconfig

    import torch.utils.cpp_extension as cpp

    gxx = shutil.which("g++") or shutil.which("c++")
    cuda_inc = next((os.path.join(os.path.dirname(os.path.dirname(p)), "include") for p in build._nvcc_candidates()
                     if os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(p)), "include",
                                                    "cuda_runtime_api.h"))), None)
    if gxx is None or cuda_inc is None:
        pytest.skip("needs a C++ compiler and the CUDA runtime headers")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    incs = [*cpp.include_paths(), cuda_inc, sysconfig.get_path("include"), str(tmp_path)]
    cmd = [gxx, "-std=c++17", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=qwen35_sm70_check",
           "-DTORCH_API_INCLUDE_EXTENSION_H", *[f"-isystem{i}" for i in incs], str(build.CSRC / "binding.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
