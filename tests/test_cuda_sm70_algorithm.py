"""The chunked GDN algorithm of kernels_cuda/csrc/gdn_chunk.cu, emulated on the CPU step by step, vs the fp64 reference.

The emulation follows the kernels' blocking and rounding points: 64-token chunks padded with zero rows, the Gram
products of the raw q / k rows, the row scales applied after them, the inverse by 16-row substitution and two
block merges in fp32, and every operand the fp16 kernels hand to WMMA rounded to fp16 where they round it (the
state's copy, V', the workspace tiles Wn, Qs, Ks, Aqk, T diag(.)); accumulations are fp32. It checks the algebra
(signs, scales, masks, the record's contents) and that the fp16 rounding stays inside the GPU tests' budget, which
the CUDA build itself cannot be run for here.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, gdn_inputs

from qwen35 import reference as ref
from qwen35.reference.gdn import gating_from_raw

C = 64


def blocked_unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower A [64, 64] as the prepare kernel forms it: 16-row diagonal blocks by
    substitution, then T_21 = -T_22 A_21 T_11 for 16 -> 32 and 32 -> 64."""
    T = torch.zeros_like(A)
    for b0 in range(0, C, 16):
        for col in range(16):
            x = torch.zeros(16, dtype=A.dtype)
            x[col] = 1.0
            for i in range(col + 1, 16):
                x[i] = -(A[b0 + i, b0:b0 + i] * x[:i]).sum()
            T[b0:b0 + 16, b0 + col] = x
    for o in (0, 32):
        P = A[o + 16:o + 32, o:o + 16] @ T[o:o + 16, o:o + 16]
        T[o + 16:o + 32, o:o + 16] = -(T[o + 16:o + 32, o + 16:o + 32] @ P)
    P = A[32:, :32] @ T[:32, :32]
    T[32:, :32] = -(T[32:, 32:] @ P)
    return T


def emulate_sequence(q, k, v, g, beta, S0, scale, use_l2, fp16):  # noqa: ANN001, ANN201
    """One sequence of one value head: q, k [T, K] (activation values), v [T, V], g, beta [T] fp32, S0 [K, V]."""
    rnd = (lambda x: x.half().float()) if fp16 else (lambda x: x)
    f = torch.float32
    T, K = q.shape
    S = S0.to(f).clone()
    out = torch.zeros(T, v.shape[1], dtype=f)
    i_idx = torch.arange(C)[:, None]
    j_idx = torch.arange(C)[None, :]
    for cs in range(0, T, C):
        L = min(C, T - cs)
        qr, kr, vr = (torch.zeros(C, x.shape[1], dtype=f) for x in (q, k, v))
        qr[:L], kr[:L], vr[:L] = q[cs:cs + L].to(f), k[cs:cs + L].to(f), v[cs:cs + L].to(f)
        gp, bp = torch.zeros(C, dtype=f), torch.zeros(C, dtype=f)
        gp[:L], bp[:L] = g[cs:cs + L], beta[cs:cs + L]
        G = gp.cumsum(0)
        rk = torch.rsqrt((kr * kr).sum(1) + 1e-6) if use_l2 else torch.ones(C)
        rq = (torch.rsqrt((qr * qr).sum(1) + 1e-6) if use_l2 else torch.ones(C)) * scale
        Gkk, Gqk = kr @ kr.T, qr @ kr.T
        lower = (i_idx >= j_idx) & (i_idx < L)
        diff = torch.where(lower, G[:, None] - G[None, :], torch.zeros(()))
        assert (diff <= 0).all(), "exp of a positive difference"
        gamma = torch.where(lower, diff.exp(), torch.zeros(()))
        A = torch.where(lower & (i_idx > j_idx), bp[:, None] * rk[:, None] * rk[None, :] * Gkk * gamma, torch.zeros(()))
        Aqk = rnd(rq[:, None] * rk[None, :] * Gqk * gamma)
        Qs = rnd(qr * (rq * G.exp())[:, None])
        Ks = rnd(kr * (rk * (G[L - 1] - G).exp())[:, None])
        Tinv = blocked_unit_lower_inverse(A)
        Wn = rnd(-(rnd(Tinv * (bp * G.exp() * rk)[None, :]) @ kr))
        U = rnd(Tinv * bp[None, :]) @ vr
        ec = G[L - 1].exp()
        # the scan
        Sop = rnd(S)
        Vp = rnd(U + Wn @ Sop)
        o = Qs @ Sop + Aqk @ Vp
        out[cs:cs + L] = o[:L]
        S = ec * S + Ks.T @ Vp
    return out, S


def emulate(d: dict, K: int, HV: int, H: int, S0: torch.Tensor, use_l2: bool, fp16: bool):  # noqa: ANN201
    """Every value head of one sequence; returns (o [T, HV, V], S [HV, K, V])."""
    g, beta = (d["g"].float(), d["beta"].float()) if "g" in d else gating_from_raw(
        d["a"], d["b"], d["A_log"], d["dt_bias"], torch.float32)
    outs, states = [], []
    for hv in range(HV):
        h = hv // (HV // H)
        o, S = emulate_sequence(d["q"][:, h], d["k"][:, h], d["v"][:, hv], g[:, hv], beta[:, hv], S0[hv], K**-0.5,
                                use_l2, fp16)
        outs.append(o)
        states.append(S)
    return torch.stack(outs, 1), torch.stack(states)


def test_blocked_inverse_is_the_inverse():
    gen = torch.Generator().manual_seed(0)
    A = (torch.randn(C, C, generator=gen, dtype=torch.float64) * 0.3).tril(-1)
    T = blocked_unit_lower_inverse(A)
    err = (T @ (torch.eye(C, dtype=torch.float64) + A) - torch.eye(C, dtype=torch.float64)).abs().max()
    assert err < 1e-12, f"(I + A) T differs from I by {err:.3e}"


@pytest.mark.parametrize("fp16,tol", [(False, 2e-5), (True, 4e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("T", [1, 63, 64, 200])
def test_emulated_chunks_match_reference(fp16, tol, T):
    H, HV, K, V = 1, 2, 32, 16
    dtype = torch.float16 if fp16 else torch.float32
    d = gdn_inputs(T, H, HV, K, V, dtype=dtype, seed=T, raw=True)
    S0 = torch.randn(HV, K, V, generator=torch.Generator().manual_seed(1)) * 0.1
    o, S = emulate(d, K, HV, H, S0, use_l2=True, fp16=fp16)
    d64 = {k_: (x.double() if x.is_floating_point() else x) for k_, x in d.items()}
    pool = S0[None].double().clone()
    ro, _ = ref.gdn_chunk_prefill(**d64, state_pool=pool, state_slots=torch.tensor([0]), use_qk_l2norm=True)
    assert_close(o, ro, tol, f"emulated output T={T}")
    assert_close(S, pool[0], tol, f"emulated state T={T}")


def test_emulated_strong_decay_stays_finite():
    """g down to -20 per token over many chunks: every exp argument is <= 0, nothing overflows."""
    T, H, HV, K, V = 1024, 1, 1, 32, 32
    gen = torch.Generator().manual_seed(3)
    d = dict(q=torch.randn(T, H, K, generator=gen).half(), k=torch.randn(T, H, K, generator=gen).half(),
             v=torch.randn(T, HV, V, generator=gen).half(), g=-20.0 * torch.rand(T, HV, generator=gen),
             beta=torch.rand(T, HV, generator=gen).half())
    o, S = emulate(d, K, HV, H, torch.zeros(HV, K, V), use_l2=True, fp16=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    d64 = {k_: x.double() for k_, x in d.items()}
    ro, rS = ref.gdn_chunk_prefill(**d64, output_final_state=True, use_qk_l2norm=True)
    assert_close(o, ro, 4e-3, "strong decay output")
