"""Reference ops vs naive loops, chunked vs recurrent GDN, varlen, continuation, edge lengths, fp16 stability."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, cu_from_lens, gdn_inputs, rel_err

from qwen35 import ops
from qwen35.reference import gdn as ref_gdn
from qwen35.reference import moe as ref_moe

# ----------------------------------------------------------------------------- naive loops


def naive_gdn(q, k, v, g, beta, S0):
    """Per head, per token, per element: the recurrence as qwen35/ops.py's docstring states it (fp64)."""
    T, HV, K = q.shape
    V = v.shape[-1]
    S = S0.clone()
    out = torch.zeros(T, HV, V, dtype=torch.float64)
    for h in range(HV):
        for t in range(T):
            decay = float(torch.exp(g[t, h]))
            for i in range(K):
                for j in range(V):
                    S[h, i, j] *= decay
            pred = [sum(float(S[h, i, j]) * float(k[t, h, i]) for i in range(K)) for j in range(V)]
            for i in range(K):
                for j in range(V):
                    S[h, i, j] += float(beta[t, h]) * float(k[t, h, i]) * (float(v[t, h, j]) - pred[j])
            for j in range(V):
                out[t, h, j] = sum(float(S[h, i, j]) * float(q[t, h, i]) for i in range(K))
    return out, S


def test_recurrent_matches_naive_loops():
    T, HV, K, V = 9, 2, 3, 4
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(T, HV, K, generator=gen, dtype=torch.float64), torch.randn(T, HV, K, generator=gen,
                                                                                    dtype=torch.float64)
    v = torch.randn(T, HV, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(T, HV, generator=gen, dtype=torch.float64)
    beta = torch.rand(T, HV, generator=gen, dtype=torch.float64)
    S0 = torch.randn(HV, K, V, generator=gen, dtype=torch.float64)
    o_ref, S_ref = naive_gdn(q, k, v, g, beta, S0)
    o, S = ref_gdn.recurrent_delta_rule(q, k, v, g, beta, S0)
    assert_close(o, o_ref, 1e-12)
    assert_close(S, S_ref, 1e-12)


@pytest.mark.parametrize("T,chunk", [(1, 64), (63, 64), (64, 64), (65, 64), (200, 64), (130, 16), (37, 32)])
@pytest.mark.parametrize("decay", ["weak", "normal", "strong"])
def test_chunked_equals_recurrent_fp64(T, chunk, decay):
    d = gdn_inputs(T, 3, 3, 16, 8, dtype=torch.float64, seed=T + chunk, decay=decay)
    q = ref_gdn.l2_normalize(d["q"]) * 16**-0.5
    k = ref_gdn.l2_normalize(d["k"])
    S0 = torch.randn(3, 16, 8, dtype=torch.float64)
    o1, s1 = ref_gdn.chunked_delta_rule(q, k, d["v"], d["g"].double(), d["beta"], S0, chunk)
    o2, s2 = ref_gdn.recurrent_delta_rule(q, k, d["v"], d["g"].double(), d["beta"], S0)
    assert_close(o1, o2, 1e-6, "output")
    assert_close(s1, s2, 1e-6, "final state")


def test_conv1d_matches_naive_loops():
    T, D, W = 7, 5, 4
    gen = torch.Generator().manual_seed(2)
    x, w, bias = torch.randn(T, D, generator=gen), torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    hist = torch.randn(1, D, W - 1, generator=gen)
    pool = hist.clone()
    y = ops.causal_conv1d_prefill(x, w, bias, conv_pool=pool, conv_slots=torch.tensor([0]),
                                  activation="silu")
    full = torch.cat([hist[0].t(), x], 0)  # [W-1+T, D]
    naive = torch.zeros(T, D)
    for t in range(T):
        for c in range(D):
            acc = float(bias[c])
            for j in range(W):
                acc += float(w[c, j]) * float(full[t + j, c])
            naive[t, c] = acc / (1 + float(torch.exp(torch.tensor(-acc))))
    assert_close(y, naive, 1e-6)
    assert_close(pool[0], x[-(W - 1):].t(), 0)


def test_norms_match_naive_loops():
    gen = torch.Generator().manual_seed(3)
    x, z, w = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen), torch.randn(6, generator=gen)
    res = torch.randn(4, 6, generator=gen)
    eps = 1e-6
    gated = torch.zeros(4, 6)
    zc = torch.zeros(4, 6)  # zero-centred norm of x alone
    zc_sum = torch.zeros(4, 6)  # ... of x + residual
    for r in range(4):
        ms = sum(float(x[r, c]) ** 2 for c in range(6)) / 6
        s = x[r] + res[r]
        ms2 = sum(float(s[c]) ** 2 for c in range(6)) / 6
        for c in range(6):
            gated[r, c] = float(x[r, c]) / (ms + eps) ** 0.5 * float(w[c]) * float(F.silu(z[r, c]))
            zc[r, c] = float(x[r, c]) / (ms + eps) ** 0.5 * (1 + float(w[c]))
            zc_sum[r, c] = float(s[c]) / (ms2 + eps) ** 0.5 * (1 + float(w[c]))
    assert_close(ops.rms_norm_gated(x, z, w, eps), gated, 1e-6)
    y, new_res = ops.rms_norm_zero_centered(x, w, eps, residual=res)
    assert_close(y, zc_sum, 1e-6)
    assert torch.equal(new_res, x + res)
    alone = ops.rms_norm_zero_centered(x, w, eps)  # no residual: one tensor, the norm of x itself
    assert isinstance(alone, torch.Tensor)
    assert_close(alone, zc, 1e-6)


def test_moe_matches_naive_loops():
    gen = torch.Generator().manual_seed(4)
    M, E, H, I, k = 6, 5, 8, 4, 2
    x = torch.randn(M, H, generator=gen, dtype=torch.float64)
    router = torch.randn(E, H, generator=gen, dtype=torch.float64)
    w13 = torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64)
    w2 = torch.randn(E, H, I, generator=gen, dtype=torch.float64)
    sw13, sw2 = torch.randn(2 * I, H, generator=gen, dtype=torch.float64), torch.randn(H, I, generator=gen,
                                                                                         dtype=torch.float64)
    sg = torch.randn(1, H, generator=gen, dtype=torch.float64)
    out = ops.moe_block(x, router, w13, w2, k, shared_w13=sw13, shared_w2=sw2, shared_gate_weight=sg)

    def mlp(xr, a13, a2):
        gate, up = a13[: a13.shape[0] // 2] @ xr, a13[a13.shape[0] // 2:] @ xr
        return a2 @ (gate * torch.sigmoid(gate) * up)

    for m in range(M):
        logits = [float(router[e] @ x[m]) for e in range(E)]
        mx = max(logits)
        probs = [pow(2.718281828459045, lg - mx) for lg in logits]
        total = sum(probs)
        probs = [p / total for p in probs]
        top = sorted(range(E), key=lambda e: (-probs[e], e))[:k]
        wsum = sum(probs[e] for e in top)
        expect = sum(probs[e] / wsum * mlp(x[m], w13[e], w2[e]) for e in top)
        expect = expect + torch.sigmoid(sg[0] @ x[m]) * mlp(x[m], sw13, sw2)
        assert_close(out[m], expect, 1e-10, f"token {m}")


def test_moe_route_ties_go_to_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    w, ids = ops.moe_route(logits, 2)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert torch.allclose(w, torch.full_like(w, 0.5))


def test_moe_expert_map_drops_remote_experts():
    gen = torch.Generator().manual_seed(5)
    M, E, H, I = 5, 4, 8, 4
    x = torch.randn(M, H, generator=gen)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    weights, ids = ref_moe.moe_route(torch.randn(M, E, generator=gen), 2)
    full = ops.moe_experts(x, w13, w2, weights, ids)
    # Split the experts across two "ranks": the sum of the two partial results is the full result.
    map0 = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    map1 = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    part0 = ops.moe_experts(x, w13[:2].contiguous(), w2[:2].contiguous(), weights, ids, map0)
    part1 = ops.moe_experts(x, w13[2:].contiguous(), w2[2:].contiguous(), weights, ids, map1)
    assert_close(part0 + part1, full, 1e-6)


# ----------------------------------------------------------------------------- GDN op semantics


def _prefill(d, **kw):
    gating = {k: d[k] for k in ("g", "beta", "a", "b", "A_log", "dt_bias") if k in d}
    return ops.gdn_chunk_prefill(d["q"], d["k"], d["v"], **gating, **kw)


def _slice(d, s, e):
    return {k: (v[s:e] if v.dim() and k not in ("A_log", "dt_bias") else v) for k, v in d.items()}


@pytest.mark.parametrize("lens", [[5, 70, 1], [0, 3, 0], [130], [1, 1, 1, 64, 0, 65]])
def test_varlen_equals_each_sequence_alone(lens):
    T = sum(lens)
    d = gdn_inputs(T, 2, 4, 16, 8, seed=len(lens) + T, raw=True)
    init = torch.randn(len(lens), 4, 16, 8)
    o, final = _prefill(d, cu_seqlens=cu_from_lens(lens), initial_state=init, output_final_state=True,
                        use_qk_l2norm=True)
    start = 0
    for n, L in enumerate(lens):
        o1, f1 = _prefill(_slice(d, start, start + L), initial_state=init[n:n + 1], output_final_state=True,
                          use_qk_l2norm=True)
        assert_close(o[start:start + L], o1, 1e-5, f"seq {n} output") if L else None
        assert_close(final[n], f1[0], 1e-5, f"seq {n} state")
        start += L
    empty = [n for n, L in enumerate(lens) if L == 0]
    for n in empty:  # an empty sequence hands its initial state through unchanged
        assert torch.equal(final[n], init[n])


def test_grouped_heads_equal_explicit_repeat():
    d = gdn_inputs(40, 2, 6, 16, 8, seed=7)
    o, f = _prefill(d, output_final_state=True, use_qk_l2norm=True)
    rep = dict(d, q=d["q"].repeat_interleave(3, dim=1), k=d["k"].repeat_interleave(3, dim=1))
    o2, f2 = _prefill(rep, output_final_state=True, use_qk_l2norm=True)
    assert_close(o, o2, 1e-5)
    assert_close(f, f2, 1e-5)


def test_raw_gating_equals_precomputed():
    d = gdn_inputs(30, 2, 4, 16, 8, seed=8, raw=True)
    g = -d["A_log"].exp() * F.softplus(d["a"] + d["dt_bias"])
    pre = dict(q=d["q"], k=d["k"], v=d["v"], g=g, beta=torch.sigmoid(d["b"]))
    assert_close(_prefill(d, use_qk_l2norm=True)[0], _prefill(pre, use_qk_l2norm=True)[0], 1e-5)


@pytest.mark.parametrize("split", [1, 30, 64, 99])
def test_continuation_two_calls_equal_one(split):
    T = 100
    d = gdn_inputs(T, 2, 4, 16, 8, seed=split, raw=True)
    o_full, f_full = _prefill(d, output_final_state=True, use_qk_l2norm=True)
    # tensor states
    o1, f1 = _prefill(_slice(d, 0, split), output_final_state=True, use_qk_l2norm=True)
    o2, f2 = _prefill(_slice(d, split, T), initial_state=f1, output_final_state=True, use_qk_l2norm=True)
    assert_close(torch.cat([o1, o2]), o_full, 1e-5)
    assert_close(f2, f_full, 1e-5)
    # pool states: the second call reads what the first wrote back
    pool = torch.full((3, 4, 16, 8), float("nan"))
    slot = torch.tensor([2], dtype=torch.int32)
    _prefill(_slice(d, 0, split), state_pool=pool, state_slots=slot, has_initial_state=torch.tensor([False]),
             use_qk_l2norm=True)
    o2p, none = _prefill(_slice(d, split, T), state_pool=pool, state_slots=slot, use_qk_l2norm=True)
    assert none is None
    assert_close(o2p, o2, 1e-5)
    assert_close(pool[2], f_full[0], 1e-5)
    assert torch.isnan(pool[:2]).all(), "slots not named must be untouched"


def test_decode_steps_continue_prefill_and_respect_padding():
    T0, steps = 20, 6
    d = gdn_inputs(T0 + steps, 2, 4, 16, 8, seed=11, raw=True)
    o_full, f_full = _prefill(d, output_final_state=True, use_qk_l2norm=True)
    pool = torch.randn(4, 4, 16, 8)
    untouched = pool[[0, 2]].clone()
    slot = torch.tensor([1], dtype=torch.int32)
    _prefill(_slice(d, 0, T0), state_pool=pool, state_slots=slot, has_initial_state=torch.tensor([False]),
             use_qk_l2norm=True)
    # one real row (slot 1) and one padding row (-1) per step; tokens 1, then 2, then 3 at a time (speculative)
    t = T0
    for n_tok in (1, 2, 3):
        rows = {}
        for key, val in d.items():
            if key in ("A_log", "dt_bias"):
                rows[key] = val
            else:
                real = val[t:t + n_tok]
                rows[key] = torch.stack([real, torch.randn_like(real)])  # [B=2, T, ...]
        o = ops.gdn_recurrent_step(rows["q"], rows["k"], rows["v"], a=rows["a"], b=rows["b"], A_log=rows["A_log"],
                                   dt_bias=rows["dt_bias"], state_pool=pool,
                                   state_slots=torch.tensor([1, -1], dtype=torch.int32), use_qk_l2norm=True)
        assert_close(o[0], o_full[t:t + n_tok], 1e-5, f"decode tokens {t}..{t + n_tok}")
        assert torch.equal(o[1], torch.zeros_like(o[1])), "padding rows give zero output"
        t += n_tok
    assert_close(pool[1], f_full[0], 1e-5)
    assert torch.equal(pool[[0, 2]], untouched), "slots not named must be bit-identical"


def test_length_zero_and_one_batches():
    d = gdn_inputs(1, 1, 1, 8, 8, seed=12)
    o, f = _prefill(d, cu_seqlens=cu_from_lens([0, 1, 0]), output_final_state=True)
    assert o.shape == (1, 1, 8) and f.shape == (3, 1, 8, 8)
    assert torch.equal(f[0], torch.zeros_like(f[0])) and torch.equal(f[2], torch.zeros_like(f[2]))
    e = gdn_inputs(0, 1, 1, 8, 8, seed=13)
    o, f = _prefill(e, cu_seqlens=cu_from_lens([0, 0]), output_final_state=True)
    assert o.shape == (0, 1, 8) and torch.equal(f, torch.zeros(2, 1, 8, 8))


def test_fp16_strong_decay_long_sequence_is_finite_and_accurate():
    T = 4096
    d16 = gdn_inputs(T, 1, 2, 32, 32, dtype=torch.float16, seed=14, decay="strong")
    d16["g"][T // 2:] = -0.001  # then almost no decay: state grows for 2k tokens without overflow
    o16, f16 = _prefill(d16, output_final_state=True, use_qk_l2norm=True)
    d64 = {k: v.double() for k, v in d16.items()}
    o64, f64 = _prefill(d64, output_final_state=True, use_qk_l2norm=True)
    assert torch.isfinite(o16).all() and torch.isfinite(f16).all()
    assert o16.dtype == torch.float16 and f16.dtype == torch.float32
    assert rel_err(o16, o64) <= 2e-3
    assert rel_err(f16, f64) <= 1e-5


def test_conv_update_continues_prefill():
    T, D, W = 9, 6, 4
    gen = torch.Generator().manual_seed(15)
    x, w = torch.randn(T + 3, D, generator=gen), torch.randn(D, W, generator=gen)
    y_full = ops.causal_conv1d_prefill(x, w, None)
    pool = torch.randn(3, D, W - 1)
    keep = pool[0].clone()
    ops.causal_conv1d_prefill(x[:T], w, None, conv_pool=pool, conv_slots=torch.tensor([2]),
                              has_initial_state=torch.tensor([False]))
    for t in range(T, T + 3):
        y = ops.causal_conv1d_update(torch.stack([x[t], x[t]]), w, None, conv_pool=pool,
                                     conv_slots=torch.tensor([2, -1]))
        assert_close(y[0], y_full[t], 1e-6)
        assert torch.equal(y[1], torch.zeros(D))
    assert torch.equal(pool[0], keep)


def test_conv_prefill_short_sequence_keeps_history():
    D, W = 3, 4
    pool = torch.arange(2 * D * (W - 1), dtype=torch.float32).reshape(2, D, W - 1)
    x = torch.randn(1, D)
    ops.causal_conv1d_prefill(x, torch.randn(D, W), None, conv_pool=pool, conv_slots=torch.tensor([1]),
                              activation=None)
    expect = torch.cat([torch.arange(9, 18, dtype=torch.float32).reshape(D, W - 1), x.t()], 1)[:, 1:]
    assert torch.equal(pool[1], expect)
