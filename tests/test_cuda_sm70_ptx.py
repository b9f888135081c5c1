"""The SM70 feature audit of kernels_cuda/csrc: every .cu compiled to PTX for the lowest arch this nvcc offers, no
post-Volta instruction in it; shared memory and spills from ptxas; and a 32-lane note wherever a warp shuffle is.

Forbidden: cp.async (any form, TMA's bulk copies included), ldmatrix / stmatrix / movmatrix, any bf16 type, tf32 and
fp8 types, wgmma, redux, mbarrier, griddepcontrol (PDL), setmaxnreg, elect, cluster barriers and addresses,
multimem, tcgen05; mma.sync only as m8n8k4 and wmma only as m16n16k16.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path

import pytest

from kernels_cuda import build

NVCC = next((p for p in build._nvcc_candidates() if os.path.isfile(p)), None)
pytestmark = pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")

# Flags torch adds to every nvcc command of an extension (torch.utils.cpp_extension.COMMON_NVCC_FLAGS).
TORCH_NVCC_FLAGS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr"]

FORBIDDEN = [
    (re.compile(r"\bcp\.async"), "cp.async"),
    (re.compile(r"\bcp\.reduce\.async"), "cp.reduce.async (TMA)"),
    (re.compile(r"\btensormap\b|\bprefetch\.tensormap|\.tensor\."), "TMA tensor maps"),
    (re.compile(r"\b(ldmatrix|stmatrix|movmatrix)\b"), "ldmatrix / stmatrix / movmatrix"),
    (re.compile(r"\.bf16(x2)?\b|\bbf16\b"), "bf16"),
    (re.compile(r"\.tf32\b|\.e4m3|\.e5m2|\.e2m1|\.e3m2|\.e2m3"), "tf32 / fp8 / fp6 / fp4 types"),
    (re.compile(r"\bwgmma\b"), "wgmma"),
    (re.compile(r"\bredux\b"), "redux"),
    (re.compile(r"\bmbarrier\b"), "mbarrier"),
    (re.compile(r"\bgriddepcontrol\b"), "griddepcontrol (PDL)"),
    (re.compile(r"\bsetmaxnreg\b"), "setmaxnreg"),
    (re.compile(r"\belect\.sync\b"), "elect.sync"),
    (re.compile(r"\bbarrier\.cluster\b|\bmapa\b|%cluster"), "thread-block clusters"),
    (re.compile(r"\bmultimem\b"), "multimem"),
    (re.compile(r"\btcgen05\b"), "tcgen05"),
    (re.compile(r"\bst\.async\b|\bred\.async\b"), "async stores"),
]
MMA = re.compile(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)")
WMMA = re.compile(r"\bwmma\.\w+\.sync\.aligned\.[\w.]*?(m\d+n\d+k\d+)")


def sources() -> list[Path]:
    return sorted(build.CSRC.glob("*.cu"))


@functools.lru_cache(maxsize=1)
def lowest_arch() -> int:
    out = subprocess.run([NVCC, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
    return min(int(a) for a in re.findall(r"compute_(\d+)", out))


def compile_ptx(src: Path, out: Path, arch: int) -> str:
    cmd = [NVCC, "-std=c++17", "-O3", *TORCH_NVCC_FLAGS, f"-arch=compute_{arch}", "-ptx", str(src), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{src.name}: nvcc failed\n{proc.stderr[-3000:]}"
    assert "warning" not in proc.stderr.lower(), f"{src.name}: nvcc warned\n{proc.stderr[-3000:]}"
    return out.read_text()


def audit(ptx: str) -> list[str]:
    """Every post-Volta instruction or type in a PTX text, as 'line N: what: text'."""
    bad = []
    for n, line in enumerate(ptx.splitlines(), 1):
        code = line.split("//")[0]
        for pat, what in FORBIDDEN:
            if pat.search(code):
                bad.append(f"line {n}: {what}: {code.strip()[:120]}")
        for m in MMA.finditer(code):
            if m.group(1) != "m8n8k4":
                bad.append(f"line {n}: mma.sync shape {m.group(1)}: {code.strip()[:120]}")
        for m in WMMA.finditer(code):
            if m.group(1) != "m16n16k16":
                bad.append(f"line {n}: wmma shape {m.group(1)}: {code.strip()[:120]}")
    return bad


@pytest.fixture(scope="module")
def ptx_dir(tmp_path_factory) -> dict[str, str]:
    arch = lowest_arch()
    d = tmp_path_factory.mktemp("ptx")
    return {src.name: compile_ptx(src, d / (src.stem + ".ptx"), arch) for src in sources()}


def test_every_source_is_audited(ptx_dir):
    assert set(ptx_dir) == {"conv1d.cu", "gdn_chunk.cu", "gdn_step.cu", "moe.cu", "norms.cu"}


@pytest.mark.parametrize("name", [s.name for s in sources()])
def test_no_post_volta_instruction(ptx_dir, name):
    ptx = ptx_dir[name]
    assert re.search(rf"^\.target\s+sm_{lowest_arch()}\b", ptx, re.M), f"{name}: PTX not for sm_{lowest_arch()}"
    bad = audit(ptx)
    assert not bad, f"{name}: post-Volta features in the PTX:\n" + "\n".join(bad[:40])


def test_gdn_and_moe_use_wmma(ptx_dir):
    """The tensor-core paths are really there (the audit would pass an all-scalar build too)."""
    for name in ("gdn_chunk.cu", "moe.cu"):
        assert "wmma.mma.sync.aligned" in ptx_dir[name] and "m16n16k16" in ptx_dir[name], name


def test_the_audit_catches_post_volta_code(tmp_path):
    """A kernel with cp.async, ldmatrix, an m16n8k16 mma and bf16 arithmetic (as inline PTX, which nvcc passes
    through unchecked) is flagged on each."""
    src = tmp_path / "newer.cu"
    src.write_text(r"""
__global__ void k(float* out, const float* in) {
  __shared__ float s[32];
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(s));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(a), "l"(in));
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(a) : "r"(a));
  asm volatile("{ .reg .b32 r<4>; mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{r0,r1,r2,r3}, {r0,r1,r2,r3}, {r0,r1}, {r0,r1,r2,r3}; }");
  asm volatile("{ .reg .b32 x; fma.rn.bf16x2 x, x, x, x; }");
  out[threadIdx.x] = s[threadIdx.x] + a;
}
""")
    found = " ".join(audit(compile_ptx(src, tmp_path / "newer.ptx", lowest_arch())))
    for what in ("cp.async", "ldmatrix", "mma.sync shape m16n8k16", "bf16"):
        assert what in found, f"the audit missed {what}: {found}"


def ptxas_report(ptx: str, tmp_path: Path, arch: int) -> dict[str, dict]:
    src = tmp_path / "x.ptx"
    src.write_text(ptx)
    ptxas = os.path.join(os.path.dirname(NVCC), "ptxas")
    proc = subprocess.run([ptxas, "-v", f"-arch=sm_{arch}", str(src), "-o", str(tmp_path / "x.cubin")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report, fn = {}, None
    for line in proc.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            fn = m.group(1)
            report[fn] = {"smem": 0, "spill": 0, "regs": 0}
        elif fn:
            if m := re.search(r"(\d+) bytes spill stores", line):
                report[fn]["spill"] = int(m.group(1))
            if m := re.search(r"Used (\d+) registers", line):
                report[fn]["regs"] = int(m.group(1))
            if m := re.search(r"(\d+) bytes smem", line):
                report[fn]["smem"] = int(m.group(1))
    return report


@pytest.mark.parametrize("name", [s.name for s in sources()])
def test_static_shared_memory_and_spills(ptx_dir, name, tmp_path):
    """Static shared memory <= 48 KB (dynamic buffers are held to 96 KB by static_asserts in the sources); spills
    of at most 64 bytes per kernel."""
    report = ptxas_report(ptx_dir[name], tmp_path, lowest_arch())
    assert report, f"{name}: ptxas reported no kernels"
    for fn, r in report.items():
        assert r["smem"] <= 48 * 1024, f"{name} {fn}: {r['smem']} bytes of static shared memory"
        assert r["spill"] <= 64, f"{name} {fn}: {r['spill']} bytes of spill stores"


def test_dynamic_shared_memory_is_budgeted():
    """Every kernel that takes dynamic shared memory is sized against the 96 KB budget in its source."""
    for src in sources():
        text = src.read_text()
        if "extern __shared__" in text:
            assert "kMaxSmem" in text, f"{src.name}: dynamic shared memory without a check against kMaxSmem"
    assert "constexpr int kMaxSmem = 96 * 1024" in (build.CSRC / "common.cuh").read_text()


def test_warp_width_assumptions_are_commented():
    """Each warp shuffle and full-warp mask sits within 8 lines after a comment that says '32 lanes'."""
    for src in [*sources(), *build.CSRC.glob("*.cuh")]:
        lines = src.read_text().splitlines()
        for i, line in enumerate(lines):
            if "__shfl" in line or "0xffffffff" in line:
                window = "\n".join(lines[max(0, i - 8):i + 1])
                assert "32 lanes" in window, f"{src.name}:{i + 1}: warp-width assumption without a '32 lanes' note"
