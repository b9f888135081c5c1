"""cuda_sm70 (kernels_cuda.sm70) on a CUDA GPU: every op against the fp64 reference, the JIT build (clean cache,
missing compiler, a failing source), the probe's build gate (nvcc missing: a WARNING and Triton; ``qwen35-probe
--build``), CUDA-graph capture. Skipped without CUDA.

On an H200 with CUDA 13 the extension is built as compute_75 PTX (the SM70 feature set; the driver compiles it).
Budgets (relative error over the whole tensor, as the Triton GPU tests): GDN fp32 1e-3, fp16 4e-3; conv and norms
fp32 1e-5, fp16 1e-3; MoE fp32 1e-4, fp16 4e-3. A failure prints the case and its relative error; any non-finite
value fails; pool slots a call does not name must be bit-identical afterwards.

``QWEN35_CUDA_CACHE`` names the build cache; the GPU command points it at a fresh directory, so the first test's
build is a clean one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_close, capture_graph, cu_from_lens, rel_err

from kernels_cuda import build
from qwen35 import reference as ref

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    from kernels_cuda import sm70

DEV = "cuda"
GDN_TOL = {torch.float32: 1e-3, torch.float16: 4e-3}
ELT_TOL = {torch.float32: 1e-5, torch.float16: 1e-3}
MOE_TOL = {torch.float32: 1e-4, torch.float16: 4e-3}
DTYPES = [torch.float16, torch.float32]
IDS = ["fp16", "fp32"]
REPO = Path(__file__).resolve().parents[2]


def _rand(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)


def _f64(d: dict) -> dict:
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}


def _untouched(after: torch.Tensor, before: torch.Tensor, named: torch.Tensor) -> None:
    keep = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    keep[named[named >= 0].long()] = False
    assert torch.equal(after[keep], before[keep]), "pool slots not named by the call changed"


# ----------------------------------------------------------------------------- the build


@pytest.fixture(scope="module")
def built():
    """The extension for this device, built now; (facts of the build, whether the cache had it before)."""
    p = build.plan(build._device_cc(torch.device(DEV)))
    had = any(Path(p.build_dir).glob("*.so"))
    t0 = time.time()
    sm70.extension(torch.device(DEV))
    facts = dict(build.last_build, wall=time.time() - t0, plan=p)
    print(f"\n[cuda_sm70] build {'cached' if had else 'fresh'}: compute_{p.arch} with {p.toolkit.compiler} "
          f"(CUDA {p.toolkit.version}) in {facts['wall']:.1f}s -> {p.build_dir}")
    return facts, had


def test_build_from_a_clean_cache(built, tmp_path):
    """The build into an empty cache directory yields a loadable module with every op; a second load in a fresh
    process finds it (no compile)."""
    facts, had = built
    if had:  # the session's cache was warm: build once more into an empty one, in a fresh process
        env = dict(os.environ, QWEN35_CUDA_CACHE=str(tmp_path / "cache"))
        code = "import torch; from kernels_cuda import build; build.load(torch.device('cuda')); print(build.last_build)"
        proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "'fresh': True" in proc.stdout, proc.stdout
    else:
        assert facts["fresh"], facts
    ext = sm70.extension(torch.device(DEV))
    for fn in ("rms_norm", "conv_prefill", "conv_update", "gdn_step", "gdn_prepare", "gdn_scan", "moe_route",
               "moe_align", "moe_gate_up", "moe_down", "moe_combine"):
        assert hasattr(ext, fn), fn
    env = dict(os.environ, QWEN35_CUDA_CACHE=str(Path(facts["plan"].build_dir).parent))
    code = ("import time, torch; from kernels_cuda import build; t = time.time(); build.load(torch.device('cuda')); "
            "print('reload', time.time() - t, build.last_build['fresh'])")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(proc.stdout.strip())
    assert proc.stdout.strip().endswith("False"), "a second process rebuilt instead of loading the cached build"


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    missing = str(tmp_path / "nowhere" / "nvcc")
    monkeypatch.setenv("QWEN35_CUDA_COMPILER", missing)
    with pytest.raises(build.CudaBuildError, match="does not exist"):
        build.load(torch.device(DEV))
    from qwen35 import probe

    assert sm70.availability(probe.device_caps(DEV)) is None  # the toolchain is the build's business


_FALLBACK = """
import json, logging, torch
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from qwen35 import probe
caps = probe.device_caps("cuda")
# this GPU under a V100's policy: cuda_sm70 first
probe.POLICY[caps.platform] = ("cuda_sm70",) + tuple(b for b in probe.POLICY[caps.platform] if b != "cuda_sm70")
rows = {op: probe.choose(op, "cuda", torch.float16) for op in ("rms_norm_gated", "moe_block", "gdn_chunk_prefill")}
print(json.dumps({op: [c.backend, dict(c.rejected).get("cuda_sm70")] for op, c in rows.items()}))
"""


def test_probe_falls_back_with_a_warning_when_nvcc_is_missing(tmp_path):
    """A fresh process whose build cannot find its compiler, with cuda_sm70 first in the policy: one WARNING that
    quotes the build error, and every op on Triton; with the backend forced, the probe raises instead."""
    missing = str(tmp_path / "no-cuda" / "bin" / "nvcc")
    env = dict(os.environ, QWEN35_CUDA_COMPILER=missing, QWEN35_CUDA_CACHE=str(tmp_path / "cache"))
    env.pop("QWEN35_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", _FALLBACK], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    print(rows)
    for op, (backend, why) in rows.items():
        assert backend == "triton", (op, backend, why)
        assert why.startswith("failed its build (CudaBuildError: ") and missing in why, why
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("WARNING") and "cuda_sm70" in ln]
    assert len(warnings) == 1 and "could not be built" in warnings[0] and missing in warnings[0], proc.stderr
    forced = subprocess.run([sys.executable, "-m", "qwen35.probe"], env=dict(env, QWEN35_BACKEND="cuda_sm70"),
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert forced.returncode != 0 and "QWEN35_BACKEND=cuda_sm70 was requested" in forced.stderr, forced.stderr[-4000:]
    assert "failed its build" in forced.stderr


def test_probe_build_reports_the_build(built):
    """``qwen35-probe --build`` in a fresh process (the session's cache holds the build: a load): the build's facts
    in the JSON report and the text one; the forced backend's choices carry fp16 self-tests."""
    import json

    facts, _ = built
    env = dict(os.environ, QWEN35_CUDA_CACHE=str(Path(facts["plan"].build_dir).parent), QWEN35_BACKEND="cuda_sm70")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "qwen35.probe", "--build", "--json"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    b = doc["build"]
    print(f"\n[cuda_sm70] qwen35-probe --build in {time.time() - t0:.1f}s: {b}")
    assert b["build_dir"] == facts["plan"].build_dir and b["arch"] == facts["plan"].arch and b["fresh"] is False
    assert b["compiler"] == facts["plan"].toolkit.compiler and b["seconds"] >= 0
    picked = {r["op"]: r for r in doc["ops"]}
    assert picked["moe_block"]["backend"] == "cuda_sm70" and picked["moe_block"]["dtype"] == "float16"
    text = subprocess.run([sys.executable, "-m", "qwen35.probe", "--build"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert text.returncode == 0 and "build    cuda_sm70 loaded from the cache" in text.stdout, text.stdout[-2000:]


def test_a_failing_source_is_quoted(tmp_path):
    """A source that does not compile: CudaBuildError with the compiler's first error lines."""
    bad = tmp_path / "bad.cu"
    bad.write_text("__global__ void k(float* x) { x[0] = qwen35_undeclared_name; }\n")
    p = build.plan(build._device_cc(torch.device(DEV)), env=dict(os.environ, QWEN35_CUDA_CACHE=str(tmp_path / "c")))
    broken = build.BuildPlan(name="qwen35_sm70_broken", sources=(str(bad),), arch=p.arch, cuda_flags=p.cuda_flags,
                             cxx_flags=p.cxx_flags, build_dir=str(tmp_path / "c" / "broken"), key="broken",
                             toolkit=p.toolkit)
    with pytest.raises(build.CudaBuildError) as err:
        build._build(broken, verbose=False)
    print(str(err.value))
    assert "qwen35_undeclared_name" in str(err.value) and "error" in str(err.value)


def test_bf16_is_refused_by_name(built):
    x = torch.randn(4, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cuda_sm70 computes in float16 or float32"):
        sm70.rms_norm_zero_centered(x, torch.zeros(64, device=DEV))


# ----------------------------------------------------------------------------- GDN prefill


def _gdn(T, H, HV, K, V, dtype, *, seed=0, raw=True, g_lo=0.0, g_hi=1.0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    d = dict(q=_rand(gen, T, H, K, dtype=dtype), k=_rand(gen, T, H, K, dtype=dtype),
             v=_rand(gen, T, HV, V, dtype=dtype))
    if raw:
        d.update(a=_rand(gen, T, HV, dtype=dtype), b=_rand(gen, T, HV, dtype=dtype),
                 A_log=_rand(gen, HV, scale=0.5), dt_bias=_rand(gen, HV, scale=0.5))
    else:
        g = -(g_lo + (g_hi - g_lo) * torch.rand(T, HV, generator=gen, device=DEV))
        d.update(g=g, beta=torch.rand(T, HV, generator=gen, device=DEV).to(dtype))
    return d


def _prefill_vs_reference(lens, H, HV, K, V, dtype, slots, has, seed, what, **kw):
    d = _gdn(sum(lens), H, HV, K, V, dtype, seed=seed, **kw)
    cu = cu_from_lens(lens, DEV)
    pool = _rand(torch.Generator(device=DEV).manual_seed(seed + 1), max(max(slots), 0) + 3, HV, K, V, scale=0.1)
    slots_t = torch.tensor(slots, dtype=torch.int32, device=DEV)
    has_t = torch.tensor(has, device=DEV)
    ours = pool.clone()
    o, final = sm70.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=ours, state_slots=slots_t,
                                      has_initial_state=has_t, use_qk_l2norm=True)
    assert final is None and o.dtype == dtype and o.shape == (sum(lens), HV, V)
    ref_pool = pool.double()
    ro, _ = ref.gdn_chunk_prefill(**_f64(d), cu_seqlens=cu, state_pool=ref_pool, state_slots=slots_t,
                                  has_initial_state=has_t, use_qk_l2norm=True)
    assert_close(o, ro, GDN_TOL[dtype], f"{what} output {dtype}")
    assert_close(ours, ref_pool, GDN_TOL[dtype], f"{what} pool {dtype}")
    _untouched(ours, pool, slots_t)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_prefill_varlen_with_empty_sequences_pools_and_padding(built, dtype):
    lens = [300, 0, 1, 64, 65, 0, 1000, 129]
    slots = [5, 2, -1, 0, 7, 3, 1, -1]
    has = [True, True, True, False, True, False, True, True]
    _prefill_vs_reference(lens, 4, 12, 128, 128, dtype, slots, has, seed=11, what="varlen")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("K,V,H,HV", [(32, 32, 2, 4), (64, 64, 2, 2), (64, 128, 1, 3), (128, 96, 2, 8)])
def test_prefill_head_dims(built, dtype, K, V, H, HV):
    _prefill_vs_reference([70, 5, 200], H, HV, K, V, dtype, [1, 0, 2], [True, False, True], seed=K + V,
                          what=f"K={K} V={V}")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_prefill_initial_state_tensor_and_final_states(built, dtype):
    lens = [513, 0, 64, 7]
    d = _gdn(sum(lens), 2, 8, 128, 128, dtype, seed=21, raw=False)
    cu = cu_from_lens(lens, DEV)
    h0 = _rand(torch.Generator(device=DEV).manual_seed(22), len(lens), 8, 128, 128, scale=0.1)
    o, ht = sm70.gdn_chunk_prefill(**d, cu_seqlens=cu, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    ro, rht = ref.gdn_chunk_prefill(**_f64(d), cu_seqlens=cu, initial_state=h0.double(), output_final_state=True,
                                    use_qk_l2norm=True)
    assert ht.dtype == torch.float32 and ht.shape == h0.shape
    assert_close(o, ro, GDN_TOL[dtype], f"output {dtype}")
    assert_close(ht, rht, GDN_TOL[dtype], f"final states {dtype}")
    assert torch.equal(ht[1], h0[1]), "an empty sequence's final state is its initial state"
    o2, none = sm70.gdn_chunk_prefill(**d, cu_seqlens=cu, use_qk_l2norm=True)  # no states at all: zeros in
    assert none is None
    ro2, _ = ref.gdn_chunk_prefill(**_f64(d), cu_seqlens=cu, use_qk_l2norm=True)
    assert_close(o2, ro2, GDN_TOL[dtype], f"output from zero states {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("cut", [300, 512])
def test_prefill_chunked_continuation(built, dtype, cut):
    """A sequence prefilled in two calls (the pool slot carries the state) matches one call and the reference."""
    T, H, HV, K, V = 1100, 2, 6, 128, 128
    d = _gdn(T, H, HV, K, V, dtype, seed=cut)
    pool = _rand(torch.Generator(device=DEV).manual_seed(3), 4, HV, K, V, scale=0.1)
    slot = torch.tensor([2], dtype=torch.int32, device=DEV)
    whole = pool.clone()
    o_whole, _ = sm70.gdn_chunk_prefill(**d, state_pool=whole, state_slots=slot, use_qk_l2norm=True)
    parts = pool.clone()
    first = {k: (v[:cut] if v.dim() > 1 else v) for k, v in d.items()}
    rest = {k: (v[cut:] if v.dim() > 1 else v) for k, v in d.items()}
    o1, _ = sm70.gdn_chunk_prefill(**first, state_pool=parts, state_slots=slot, use_qk_l2norm=True)
    o2, _ = sm70.gdn_chunk_prefill(**rest, state_pool=parts, state_slots=slot, use_qk_l2norm=True)
    ref_pool = pool.double()
    ro, _ = ref.gdn_chunk_prefill(**_f64(d), state_pool=ref_pool, state_slots=slot, use_qk_l2norm=True)
    assert_close(torch.cat([o1, o2]), ro, GDN_TOL[dtype], f"two calls, cut {cut}, output")
    assert_close(parts, ref_pool, GDN_TOL[dtype], f"two calls, cut {cut}, state")
    assert_close(o_whole, ro, GDN_TOL[dtype], "one call, output")
    assert rel_err(parts, whole) <= GDN_TOL[dtype], "two calls and one call end in different states"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_prefill_in_windows(built, dtype, monkeypatch):
    """A workspace budget of a few chunks: the batch runs in windows, states carried across them."""
    monkeypatch.setattr(sm70, "GDN_WORKSPACE_BYTES", 3 << 20)
    lens = [700, 0, 90, 1, 1500]
    _prefill_vs_reference(lens, 2, 4, 128, 128, dtype, [4, 1, -1, 0, 2], [True, False, True, True, False], seed=31,
                          what="windows")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_prefill_correlated_keys(built, dtype):
    """Strongly correlated keys (|z| + 1), beta near 1, no decay: the inverse's hard case (fp16 emulation on the CPU
    gives 9e-4, tests/test_cuda_sm70_algorithm.py)."""
    T, H, HV, K, V = 2000, 2, 4, 128, 128
    gen = torch.Generator(device=DEV).manual_seed(81)
    keys = (torch.randn(T, H, K, generator=gen, device=DEV).abs() + 1).to(dtype)
    d = dict(q=_rand(gen, T, H, K, dtype=dtype), k=keys,
             v=_rand(gen, T, HV, V, dtype=dtype), g=torch.zeros(T, HV, device=DEV),
             beta=(0.95 + 0.05 * torch.rand(T, HV, generator=gen, device=DEV)).to(dtype))
    o, ht = sm70.gdn_chunk_prefill(**d, output_final_state=True, use_qk_l2norm=True)
    ro, rht = ref.gdn_chunk_prefill(**_f64(d), output_final_state=True, use_qk_l2norm=True)
    assert_close(o, ro, GDN_TOL[dtype], f"correlated keys output {dtype}")
    assert_close(ht, rht, GDN_TOL[dtype], f"correlated keys state {dtype}")


def test_prefill_strong_decay_16384_is_finite(built):
    """g down to -20 per token over 16384 tokens: no inf or NaN anywhere, and the reference's values."""
    T, H, HV, K, V = 16384, 2, 4, 128, 128
    d = _gdn(T, H, HV, K, V, torch.float16, seed=41, raw=False, g_lo=0.0, g_hi=20.0)
    pool = torch.zeros(2, HV, K, V, device=DEV)
    slot = torch.tensor([1], dtype=torch.int32, device=DEV)
    o, _ = sm70.gdn_chunk_prefill(**d, state_pool=pool, state_slots=slot, use_qk_l2norm=True)
    assert torch.isfinite(o).all() and torch.isfinite(pool).all(), "non-finite values under strong decay"
    print(f"\nstrong decay: |o| mean {o.float().abs().mean().item():.4g}, |S| mean {pool.abs().mean().item():.4g}")
    ref_pool = torch.zeros(2, HV, K, V, device=DEV, dtype=torch.float64)
    ro, _ = ref.gdn_chunk_prefill(**_f64(d), state_pool=ref_pool, state_slots=slot, use_qk_l2norm=True)
    assert_close(o, ro, GDN_TOL[torch.float16], "strong decay output")


def test_prefill_out_buffer_and_graph_capture(built):
    lens = [100, 0, 37]
    d = _gdn(sum(lens), 2, 4, 64, 64, torch.float16, seed=51)
    cu = cu_from_lens(lens, DEV)
    pool = _rand(torch.Generator(device=DEV).manual_seed(52), 4, 4, 64, 64, scale=0.1)
    slots = torch.tensor([0, 3, 1], dtype=torch.int32, device=DEV)
    out = torch.empty(sum(lens), 4, 64, dtype=torch.float16, device=DEV)
    eager_pool = pool.clone()
    o, _ = sm70.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=eager_pool, state_slots=slots, use_qk_l2norm=True,
                                  out=out)
    assert o.data_ptr() == out.data_ptr()
    expect = out.clone()
    graph_pool = pool.clone()

    def call():
        return sm70.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=graph_pool, state_slots=slots,
                                      use_qk_l2norm=True, out=out)[0]

    graph, _ = capture_graph(call, lambda: sm70.gdn_chunk_prefill(**d, cu_seqlens=cu, state_pool=pool.clone(),
                                                                  state_slots=slots, use_qk_l2norm=True))
    graph_pool.copy_(pool)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect), "graph replay differs from the eager call"
    assert torch.equal(graph_pool, eager_pool), "graph replay's states differ from the eager call's"


# ----------------------------------------------------------------------------- GDN decode


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("raw", [True, False], ids=["raw", "g_beta"])
def test_recurrent_step(built, dtype, T, raw):
    B, H, HV, K, V = 6, 2, 8, 128, 128
    gen = torch.Generator(device=DEV).manual_seed(T)
    d = dict(q=_rand(gen, B, T, H, K, dtype=dtype), k=_rand(gen, B, T, H, K, dtype=dtype),
             v=_rand(gen, B, T, HV, V, dtype=dtype))
    if raw:
        d.update(a=_rand(gen, B, T, HV, dtype=dtype), b=_rand(gen, B, T, HV, dtype=dtype),
                 A_log=_rand(gen, HV, scale=0.5), dt_bias=_rand(gen, HV, scale=0.5))
    else:
        d.update(g=-torch.rand(B, T, HV, generator=gen, device=DEV), beta=torch.rand(B, T, HV, generator=gen,
                                                                                        device=DEV).to(dtype))
    pool = _rand(gen, 10, HV, K, V, scale=0.1)
    slots = torch.tensor([3, -1, 0, 9, -1, 5], dtype=torch.int32, device=DEV)
    ours = pool.clone()
    o = sm70.gdn_recurrent_step(**d, state_pool=ours, state_slots=slots, use_qk_l2norm=True)
    ref_pool = pool.double()
    ro = ref.gdn_recurrent_step(**_f64(d), state_pool=ref_pool, state_slots=slots, use_qk_l2norm=True)
    assert_close(o, ro, GDN_TOL[dtype], f"decode output T={T} {dtype}")
    assert_close(ours, ref_pool, GDN_TOL[dtype], f"decode pool T={T} {dtype}")
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.equal(o[4], torch.zeros_like(o[4])), "padding rows"
    _untouched(ours, pool, slots)


@pytest.mark.parametrize("K,V", [(32, 32), (64, 64), (128, 80)])
def test_recurrent_step_head_dims(built, K, V):
    B, T, H, HV = 3, 2, 1, 2
    gen = torch.Generator(device=DEV).manual_seed(K + V)
    d = dict(q=_rand(gen, B, T, H, K), k=_rand(gen, B, T, H, K), v=_rand(gen, B, T, HV, V),
             g=-torch.rand(B, T, HV, generator=gen, device=DEV), beta=torch.rand(B, T, HV, generator=gen, device=DEV))
    pool = _rand(gen, 4, HV, K, V, scale=0.1)
    slots = torch.tensor([2, 0, -1], dtype=torch.int64, device=DEV)
    ours = pool.clone()
    o = sm70.gdn_recurrent_step(**d, state_pool=ours, state_slots=slots, use_qk_l2norm=True)
    ref_pool = pool.double()
    ro = ref.gdn_recurrent_step(**_f64(d), state_pool=ref_pool, state_slots=slots, use_qk_l2norm=True)
    assert_close(o, ro, GDN_TOL[torch.float32], f"decode K={K} V={V}")
    assert_close(ours, ref_pool, GDN_TOL[torch.float32], f"decode pool K={K} V={V}")


def test_recurrent_step_strided_pool(built):
    """A pool that is a strided view into a bigger buffer (vLLM's page packing) is used in place."""
    B, T, H, HV, K, V = 4, 1, 2, 4, 64, 64
    gen = torch.Generator(device=DEV).manual_seed(61)
    d = dict(q=_rand(gen, B, T, H, K, dtype=torch.float16), k=_rand(gen, B, T, H, K, dtype=torch.float16),
             v=_rand(gen, B, T, HV, V, dtype=torch.float16), g=-torch.rand(B, T, HV, generator=gen, device=DEV),
             beta=torch.rand(B, T, HV, generator=gen, device=DEV).half())
    page = _rand(gen, 8, HV * K * V + 1000, scale=0.1)
    pool = page[:, 500:500 + HV * K * V].view(8, HV, K, V)
    before = page.clone()
    slots = torch.tensor([1, 6, -1, 3], dtype=torch.int32, device=DEV)
    ref_pool = pool.double().clone()
    o = sm70.gdn_recurrent_step(**d, state_pool=pool, state_slots=slots, use_qk_l2norm=True)
    ro = ref.gdn_recurrent_step(**_f64(d), state_pool=ref_pool, state_slots=slots, use_qk_l2norm=True)
    assert_close(o, ro, GDN_TOL[torch.float16], "strided pool output")
    assert_close(pool, ref_pool, GDN_TOL[torch.float16], "strided pool states")
    assert torch.equal(page[:, :500], before[:, :500]) and torch.equal(page[:, 500 + HV * K * V:],
                                                                        before[:, 500 + HV * K * V:])


# ----------------------------------------------------------------------------- conv1d


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("W,bias,act", [(4, True, "silu"), (2, False, None), (1, True, "silu")])
def test_conv_prefill(built, dtype, W, bias, act):
    lens = [5, 0, 1, 300, 2, 33]
    D, T = 200, sum(lens)
    gen = torch.Generator(device=DEV).manual_seed(W)
    x = _rand(gen, T, D, dtype=dtype)
    w = _rand(gen, D, W, dtype=dtype, scale=0.5)
    bs = _rand(gen, D, dtype=dtype) if bias else None
    cu = cu_from_lens(lens, DEV)
    pool = _rand(gen, 9, D, W - 1, dtype=dtype)
    slots = torch.tensor([3, 8, -1, 0, 5, 1], dtype=torch.int32, device=DEV)
    has = torch.tensor([True, True, True, False, True, True], device=DEV)
    ours = pool.clone()
    y = sm70.causal_conv1d_prefill(x, w, bs, cu_seqlens=cu, conv_pool=ours, conv_slots=slots, has_initial_state=has,
                                   activation=act)
    ref_pool = pool.double()
    ry = ref.causal_conv1d_prefill(x.double(), w.double(), None if bs is None else bs.double(), cu_seqlens=cu,
                                   conv_pool=ref_pool, conv_slots=slots, has_initial_state=has, activation=act)
    assert_close(y, ry, ELT_TOL[dtype], f"conv prefill W={W} {dtype}")
    if W > 1:
        assert_close(ours, ref_pool, ELT_TOL[dtype], f"conv pool W={W} {dtype}")
    _untouched(ours, pool, slots)
    y2 = sm70.causal_conv1d_prefill(x, w, bs, activation=act)  # one sequence, no pool
    assert_close(y2, ref.causal_conv1d_prefill(x.double(), w.double(), None if bs is None else bs.double(),
                                               activation=act), ELT_TOL[dtype], "conv prefill, one sequence")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_conv_update_strided_pool(built, dtype):
    B, D, W = 5, 96, 4
    gen = torch.Generator(device=DEV).manual_seed(71)
    x = _rand(gen, B, D, dtype=dtype)
    w = _rand(gen, D, W, dtype=dtype, scale=0.5)
    page = _rand(gen, 7, D * (W - 1) + 64, dtype=dtype)
    pool = page[:, :D * (W - 1)].view(7, D, W - 1)
    before = page.clone()
    slots = torch.tensor([6, -1, 0, 2, 4], dtype=torch.int64, device=DEV)
    ref_pool = pool.double().clone()
    y = sm70.causal_conv1d_update(x, w, None, conv_pool=pool, conv_slots=slots, activation="silu")
    ry = ref.causal_conv1d_update(x.double(), w.double(), None, conv_pool=ref_pool, conv_slots=slots)
    assert_close(y, ry, ELT_TOL[dtype], f"conv update {dtype}")
    assert_close(pool, ref_pool, ELT_TOL[dtype], f"conv update pool {dtype}")
    assert torch.equal(y[1], torch.zeros_like(y[1])), "padding row"
    assert torch.equal(page[:, D * (W - 1):], before[:, D * (W - 1):])


# ----------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("n", [64, 128, 1000, 2048, 5120, 16384])
def test_norms(built, dtype, n):
    gen = torch.Generator(device=DEV).manual_seed(n)
    x, z = _rand(gen, 37, n, dtype=dtype), _rand(gen, 37, n, dtype=dtype)
    w = _rand(gen, n, scale=0.1)  # fp32 weights with either activation dtype
    wd = w.to(dtype)
    assert_close(sm70.rms_norm_gated(x, z, wd), ref.rms_norm_gated(x.double(), z.double(), wd.double()),
                 ELT_TOL[dtype], f"gated norm n={n}")
    assert_close(sm70.rms_norm_zero_centered(x, w), ref.rms_norm_zero_centered(x.double(), w.double()),
                 ELT_TOL[dtype], f"zero-centred norm n={n}")
    r = _rand(gen, 37, n, dtype=dtype)
    y, s = sm70.rms_norm_zero_centered(x, w, 1e-6, residual=r)
    ry, rs = ref.rms_norm_zero_centered(x, w, 1e-6, residual=r)
    assert torch.equal(s, rs), "the carried residual is x + residual in x's dtype"
    assert_close(y, ref.rms_norm_zero_centered(rs.double(), w.double()), ELT_TOL[dtype], f"norm with residual n={n}")


def test_gated_norm_per_head_rows(built):
    x = torch.randn(300, 32, 128, device=DEV, dtype=torch.float16)
    z = torch.randn(300, 32, 128, device=DEV, dtype=torch.float16)
    w = torch.randn(128, device=DEV, dtype=torch.float16)
    assert_close(sm70.rms_norm_gated(x, z, w), ref.rms_norm_gated(x.double(), z.double(), w.double()), 1e-3,
                 "gated norm [T, HV, V]")


# ----------------------------------------------------------------------------- MoE


def _moe_weights(E, H, I, dtype, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return dict(w13=_rand(gen, E, 2 * I, H, dtype=dtype, scale=H**-0.5), w2=_rand(gen, E, H, I, dtype=dtype,
                                                                                  scale=I**-0.5))


@pytest.mark.parametrize("E,k", [(8, 2), (256, 8), (512, 10), (1024, 16)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route(built, E, k, renormalize):
    logits = torch.randn(77, E, device=DEV) * 3
    w, ids = sm70.moe_route(logits, k, renormalize)
    rw, rids = ref.moe_route(logits.double(), k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids, rids), "picked experts differ"
    assert_close(w, rw, 1e-6, f"route weights E={E} k={k}")
    w16, ids16 = sm70.moe_route(logits.half(), k, renormalize)
    assert torch.equal(ids16, ref.moe_route(logits.half().double(), k, renormalize)[1])


def test_route_ties_go_to_the_lowest_id(built):
    logits = torch.zeros(5, 16, device=DEV)
    logits[:, 3] = logits[:, 9] = 1.0
    _, ids = sm70.moe_route(logits, 4)
    assert ids.tolist() == [[3, 9, 0, 1]] * 5


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("M", [1, 3, 16, 32, 33, 300, 2048])
def test_experts(built, dtype, M):
    E, k, H, I = 64, 8, 1024, 256
    w = _moe_weights(E, H, I, dtype, seed=M)
    gen = torch.Generator(device=DEV).manual_seed(M)
    x = _rand(gen, M, H, dtype=dtype)
    weights, ids = ref.moe_route(torch.randn(M, E, generator=gen, device=DEV), k)
    out = sm70.moe_experts(x, w["w13"], w["w2"], weights, ids)
    expect = ref.moe_experts(x.double(), w["w13"].double(), w["w2"].double(), weights.double(), ids)
    assert_close(out, expect, MOE_TOL[dtype], f"moe_experts M={M} {dtype}")


@pytest.mark.parametrize("M", [5, 1000])
def test_experts_skewed_and_expert_map(built, M):
    E, k, H, I = 32, 4, 512, 128
    dtype = torch.float16
    w = _moe_weights(E, H, I, dtype, seed=7)
    gen = torch.Generator(device=DEV).manual_seed(M + 1)
    x = _rand(gen, M, H, dtype=dtype)
    weights = torch.softmax(torch.randn(M, k, generator=gen, device=DEV), -1)
    same = (torch.arange(k, device=DEV, dtype=torch.int32) * 7).repeat(M, 1)  # every token on the same experts
    assert_close(sm70.moe_experts(x, w["w13"], w["w2"], weights, same),
                 ref.moe_experts(x.double(), w["w13"].double(), w["w2"].double(), weights.double(), same),
                 MOE_TOL[dtype], "all tokens on the same experts")
    emap = torch.full((2 * E,), -1, dtype=torch.int32, device=DEV)  # 64 global experts, every other one here
    emap[1::2] = torch.arange(E, dtype=torch.int32, device=DEV)
    gids = torch.stack([torch.randperm(2 * E, generator=gen, device=DEV)[:k] for _ in range(M)]).int()
    out = sm70.moe_experts(x, w["w13"], w["w2"], weights, gids, emap)
    expect = ref.moe_experts(x.double(), w["w13"].double(), w["w2"].double(), weights.double(), gids, emap)
    assert_close(out, expect, MOE_TOL[dtype], "expert_map")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("M", [1, 9, 700])
def test_block_with_shared_expert(built, dtype, M):
    E, k, H, I = 64, 4, 512, 128
    gen = torch.Generator(device=DEV).manual_seed(M + 3)
    w = _moe_weights(E, H, I, dtype, seed=M)
    kw = dict(router_weight=_rand(gen, E, H, dtype=dtype, scale=H**-0.5 * 4), **w,
              shared_w13=_rand(gen, 2 * I, H, dtype=dtype, scale=H**-0.5),
              shared_w2=_rand(gen, H, I, dtype=dtype, scale=I**-0.5),
              shared_gate_weight=_rand(gen, 1, H, dtype=dtype, scale=H**-0.5))
    x = _rand(gen, M, H, dtype=dtype)
    out = sm70.moe_block(x, top_k=k, **kw)
    expect = ref.moe_block(x.double(), top_k=k, **_f64(kw))
    assert_close(out, expect, MOE_TOL[dtype], f"moe_block M={M} {dtype}")


def test_experts_graph_capture(built):
    E, k, H, I, M = 16, 2, 256, 64, 8
    w = _moe_weights(E, H, I, torch.float16)
    x = torch.randn(M, H, device=DEV, dtype=torch.float16)
    weights, ids = ref.moe_route(torch.randn(M, E, device=DEV), k)
    eager = sm70.moe_experts(x, w["w13"], w["w2"], weights, ids)
    graph, captured = capture_graph(lambda: sm70.moe_experts(x, w["w13"], w["w2"], weights, ids),
                                    lambda: sm70.moe_experts(x, w["w13"], w["w2"], weights, ids))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_module_docstring_states_the_bf16_decision():
    assert "bf16 activations are **refused**" in sm70.__doc__
