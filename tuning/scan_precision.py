"""Precision of two algebraic forms of the GDN scan's chunk step, with the GPU's bf16 roundings emulated on a CPU.

Current form (``kernels_triton.gdn.scan._scan_chunk``): ``V' = U - W bf16(S)``, ``S <- e^{g_C} S + K~^T bf16(V')``,
``O = Q~ bf16(S) + Aqk bf16(V')`` (two dependent dots per chunk on the state's path). "M-form": per chunk
``M = K~^T W`` and ``KU = K~^T U`` (K x K and K x V, bf16), ``S <- e^{g_C} S + KU - M bf16(S)`` (one dependent
dot), ``O = (Q~ - Aqk W) bf16(S) + Aqk U``. Math in fp64 on bf16-rounded operands, fp32 state and accumulators;
relative error of the output and final state against plain fp64. Usage: ``python -m tuning.scan_precision``.

The M-form measured slower as a scan on the H200 on every shape (397B-TP8 1x32768 1.49 against 0.96 ms, all
kernels; tuning/notes_gdn.md), so the kernels do not have it; this emulation keeps the record of its (better)
precision.
"""

from __future__ import annotations

import torch

F64 = torch.float64


def _bf(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(F64)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).to(F64)


def _inputs(T: int, case: str, K: int, V: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q, k, v = (torch.randn(T, d, dtype=F64, generator=gen) for d in (K, K, V))
    beta = torch.rand(T, dtype=F64, generator=gen)
    if case == "hard":  # strongly correlated keys, beta near 1, no decay (the prepare kernel's hard case)
        k, beta, g = k.abs() + 1.0, 0.95 + 0.05 * beta, torch.zeros(T, dtype=F64)
    elif case == "weak":  # correlated keys, weak decay
        k, g = k.abs() + 0.5, -0.02 * torch.rand(T, dtype=F64, generator=gen)
    else:
        g = -torch.rand(T, dtype=F64, generator=gen)
    q, k, v = _bf(q), _bf(k), _bf(v)
    return q / q.norm(dim=1, keepdim=True) * K**-0.5, k / k.norm(dim=1, keepdim=True), v, beta, g


def compare(T: int, case: str, K: int = 128, V: int = 128, C: int = 64, seed: int = 0) -> dict:
    """Relative errors {output, state} x {current, mform} for one head of T tokens."""
    q, k, v, beta, g = _inputs(T, case, K, V, torch.Generator().manual_seed(seed))
    S = {name: torch.zeros(K, V, dtype=F64) for name in ("ref", "current", "mform")}
    out: dict[str, list[torch.Tensor]] = {name: [] for name in S}
    for c0 in range(0, T, C):
        sl = slice(c0, c0 + C)
        Q, Kc, b, gc = q[sl], k[sl], beta[sl], g[sl].cumsum(0)
        n = Q.shape[0]
        gam = torch.exp(gc[:, None] - gc[None, :]).tril()
        Tm = torch.linalg.inv(torch.eye(n, dtype=F64) + ((b[:, None] * (Kc @ Kc.T)) * gam).tril(-1))
        W, U = Tm @ ((b * gc.exp())[:, None] * Kc), Tm @ (b[:, None] * v[sl])
        Aqk = (Q @ Kc.T) * gam
        Qt, Kt, e = gc.exp()[:, None] * Q, (gc[-1] - gc).exp()[:, None] * Kc, gc[-1].exp()

        vn = U - W @ S["ref"]
        out["ref"].append(Qt @ S["ref"] + Aqk @ vn)
        S["ref"] = e * S["ref"] + Kt.T @ vn

        Sd = _bf(S["current"])
        vn = _f32(_bf(U) - _bf(W) @ Sd)
        out["current"].append(_f32(_f32(Q @ Sd) * _f32(gc.exp())[:, None] + _bf(Aqk) @ _bf(vn)))
        S["current"] = _f32(S["current"] * _f32(e) + Kc.T @ _bf(vn * _f32((gc[-1] - gc).exp())[:, None]))

        M, KU, Qp, AU = (_bf(_f32(x)) for x in (Kt.T @ W, Kt.T @ U, Qt - Aqk @ W, Aqk @ U))
        Sd = _bf(S["mform"])
        out["mform"].append(_f32(Qp @ Sd + AU))
        S["mform"] = _f32(S["mform"] * _f32(e) + _f32(KU - M @ Sd))

    ref_o = torch.cat(out["ref"])
    rel = {}
    for name in ("current", "mform"):
        rel[f"output_{name}"] = float((torch.cat(out[name]) - ref_o).norm() / ref_o.norm())
        rel[f"state_{name}"] = float((S[name] - S["ref"]).norm() / S["ref"].norm())
    return rel


def main() -> None:
    for case in ("normal", "weak", "hard"):
        for T in (1024, 8192):
            r = compare(T, case)
            print(f"{case:7s} T={T:5d}  output: current {r['output_current']:.2e}  M-form {r['output_mform']:.2e}"
                  f"   state: current {r['state_current']:.2e}  M-form {r['state_mform']:.2e}", flush=True)


if __name__ == "__main__":
    main()
