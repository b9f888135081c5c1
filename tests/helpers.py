"""Small helpers shared by the op tests: relative error with a readable failure, random GDN inputs, CUDA-graph
capture."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; inf if out has any non-finite value."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output") -> None:
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.1e} (ratio {err / tol:.2f}x)"


def capture_graph(fn, warm):  # noqa: ANN001, ANN201
    """(CUDA graph of ``fn()``, what the captured call returned), after ``warm()`` on a side stream so that every
    kernel is compiled outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warm()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    return graph, captured


def cu_from_lens(lens: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def gdn_inputs(T: int, H: int, HV: int, K: int, V: int, *, dtype=torch.float32, device="cpu", seed=0,
               decay: str = "normal", raw: bool = False, batch: tuple[int, ...] = ()) -> dict:
    """Random q/k/v plus gating; ``decay`` 'weak' | 'normal' | 'strong'; ``raw`` gives a/b/A_log/dt_bias."""
    gen = torch.Generator().manual_seed(seed)
    lead = (*batch, T)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    d = dict(q=rnd(*lead, H, K), k=rnd(*lead, H, K), v=rnd(*lead, HV, V))
    if raw:
        d.update(a=rnd(*lead, HV), b=rnd(*lead, HV),
                 A_log=(torch.randn(HV, generator=gen) * 0.5).to(device),
                 dt_bias=(torch.randn(HV, generator=gen) * 0.5).to(device))
    else:
        lo, hi = {"weak": (0.0, 0.05), "normal": (0.0, 1.0), "strong": (3.0, 10.0)}[decay]
        g = -(lo + (hi - lo) * torch.rand(*lead, HV, generator=gen))
        d.update(g=g.to(device=device, dtype=torch.float32),
                 beta=torch.rand(*lead, HV, generator=gen).to(device=device, dtype=dtype))
    return d


def build_sm90(fn, types: dict, consts: dict, num_warps: int = 4, num_stages: int = 3,
               divisible: tuple[str, ...] = ("H", "I")):  # noqa: ANN201
    """Compile a ``@triton.jit`` function to sm_90 code with Triton's bundled ptxas (no GPU needed) and return it:
    every ``*_ptr`` argument and the ints named in ``divisible`` are 16-divisible (as Triton specialises them at run
    time); ``types`` gives argument types, else pointers are ``*i32``, ``scale`` / ``eps`` ``fp32``, other ints
    ``i32``; constexprs not in ``consts`` take their defaults (left out, they would build as runtime integers).
    Call it in a process without TRITON_INTERPRET (see :func:`run_without_interpreter`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    consts = dict(consts)
    for prm in fn.params:
        if prm.is_constexpr and prm.name not in consts and prm.default is not prm._param.empty:
            consts[prm.name] = prm.default
    plain = {n: "*i32" if n.endswith("_ptr") else "fp32" if n in ("scale", "eps") else "i32" for n in names}
    sig = {n: "constexpr" if n in consts else types.get(n, plain[n]) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr") or n in divisible}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def run_without_interpreter(code: str, timeout: int = 600):
    """Run ``code`` in a fresh Python without TRITON_INTERPRET, from the repo root, with tests/ importable."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "tests"), root, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                          timeout=timeout)


def assert_builds(code: str) -> None:
    """``code`` (kernel builds, ending in ``print("built")``) runs to completion without the interpreter."""
    proc = run_without_interpreter(code)
    assert proc.returncode == 0 and "built" in proc.stdout, proc.stderr[-3000:]
