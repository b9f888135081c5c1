"""Every bad input raises ValueError naming the value, before any buffer is touched."""

from __future__ import annotations

import pytest
import torch
from helpers import cu_from_lens, gdn_inputs

from qwen35 import ops

T, H, HV, K, V = 10, 2, 4, 8, 8


def _gdn(**over):
    d = gdn_inputs(T, H, HV, K, V, seed=0)
    d.update(cu_seqlens=cu_from_lens([4, 6]))
    d.update(over)
    return d


def _call_prefill(d):
    d = dict(d)
    q, k, v = d.pop("q"), d.pop("k"), d.pop("v")
    return ops.gdn_chunk_prefill(q, k, v, **d)


PREFILL_CASES = {
    "q not a tensor": (dict(q=[1, 2]), "q must be a torch.Tensor"),
    "q wrong rank": (dict(q=torch.randn(T, H * K)), "q must have 3 dims"),
    "q int dtype": (dict(q=torch.zeros(T, H, K, dtype=torch.int32)), "q has dtype int32; accepted"),
    "k shape differs": (dict(k=torch.randn(T, H, K + 1)), "k has shape"),
    "v on another device": (dict(v=torch.randn(T, HV, V, device="meta")), "v is on meta"),
    "v leading dims": (dict(v=torch.randn(T + 1, HV, V)), "v has shape"),
    "q non-contiguous": (dict(q=torch.randn(H, T, K).transpose(0, 1)), "q must be contiguous"),
    "mixed dtypes": (dict(k=torch.randn(T, H, K, dtype=torch.float16)), "k has dtype torch.float16 but q"),
    "heads not divisible": (dict(v=torch.randn(T, 3, V), g=torch.zeros(T, 3), beta=torch.rand(T, 3)),
                            "HV \\(v heads\\)=3 must be a positive multiple of H"),
    "g wrong shape": (dict(g=torch.zeros(T, HV + 1)), "g has shape"),
    "g fp16": (dict(g=torch.zeros(T, HV, dtype=torch.float16)), "g has dtype float16"),
    "beta without g": (dict(g=None), "g and beta must be given together"),
    "both gatings": (dict(a=torch.zeros(T, HV)), "exactly one of the two"),
    "no gating": (dict(g=None, beta=None), "exactly one of the two"),
    "cu_seqlens float": (dict(cu_seqlens=torch.tensor([0.0, 10.0])), "cu_seqlens has dtype float32"),
    "cu_seqlens decreasing": (dict(cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=torch.int32)), "non-decreasing"),
    "cu_seqlens not ending at T": (dict(cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32)), "must equal"),
    "cu_seqlens not starting at 0": (dict(cu_seqlens=torch.tensor([1, 4, 10], dtype=torch.int32)), "start at 0"),
    "cu_seqlens empty": (dict(cu_seqlens=torch.zeros(0, dtype=torch.int32)), "N\\+1 >= 1"),
    "initial_state wrong N": (dict(initial_state=torch.zeros(3, HV, K, V)), "initial_state has shape"),
    "initial_state fp16": (dict(initial_state=torch.zeros(2, HV, K, V, dtype=torch.float16)), "dtype float16"),
    "state and pool": (dict(initial_state=torch.zeros(2, HV, K, V), state_pool=torch.zeros(4, HV, K, V),
                            state_slots=torch.tensor([0, 1])), "not both"),
    "pool without slots": (dict(state_pool=torch.zeros(4, HV, K, V)), "needs state_slots"),
    "slot out of range": (dict(state_pool=torch.zeros(4, HV, K, V), state_slots=torch.tensor([0, 4])),
                          "slot 4, but state_pool has 4 slots"),
    "slot repeated": (dict(state_pool=torch.zeros(4, HV, K, V), state_slots=torch.tensor([1, 1])),
                      "names a slot twice"),
    "slots wrong count": (dict(state_pool=torch.zeros(4, HV, K, V), state_slots=torch.tensor([1])),
                          "state_slots has shape"),
    "pool wrong head dims": (dict(state_pool=torch.zeros(4, HV, V, K + 1), state_slots=torch.tensor([0, 1])),
                             "state_pool has shape"),
    "slots without pool": (dict(state_slots=torch.tensor([0, 1])), "only meaningful with state_pool"),
    "has_initial_state int": (dict(state_pool=torch.zeros(4, HV, K, V), state_slots=torch.tensor([0, 1]),
                                   has_initial_state=torch.tensor([1, 0])), "has_initial_state has dtype"),
    "chunk_size zero": (dict(chunk_size=0), "chunk_size=0"),
    "negative scale": (dict(scale=-1.0), "scale=-1.0"),
    "out wrong shape": (dict(out=torch.empty(T, HV, V + 1)), "out has shape"),
    "out wrong dtype": (dict(out=torch.empty(T, HV, V, dtype=torch.float16)), "out has dtype float16"),
    "out non-contiguous": (dict(out=torch.empty(HV, T, V).transpose(0, 1)), "out must be contiguous"),
}


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_rejects(case):
    over, msg = PREFILL_CASES[case]
    with pytest.raises(ValueError, match=msg):
        _call_prefill(_gdn(**over))


def test_rejected_call_leaves_pool_untouched():
    pool = torch.randn(4, HV, K, V)
    before = pool.clone()
    with pytest.raises(ValueError):
        _call_prefill(_gdn(state_pool=pool, state_slots=torch.tensor([0, 9])))
    with pytest.raises(ValueError):
        ops.gdn_recurrent_step(torch.randn(2, 9, H, K), torch.randn(2, 9, H, K), torch.randn(2, 9, HV, V),
                               g=torch.zeros(2, 9, HV), beta=torch.rand(2, 9, HV), state_pool=pool,
                               state_slots=torch.tensor([0, 1]))
    assert torch.equal(pool, before)


def _step(B=2, Tn=1, **over):
    d = dict(q=torch.randn(B, Tn, H, K), k=torch.randn(B, Tn, H, K), v=torch.randn(B, Tn, HV, V),
             g=-torch.rand(B, Tn, HV), beta=torch.rand(B, Tn, HV), state_pool=torch.zeros(4, HV, K, V),
             state_slots=torch.tensor([0, -1]))
    d.update(over)
    q, k, v = d.pop("q"), d.pop("k"), d.pop("v")
    return ops.gdn_recurrent_step(q, k, v, **d)


@pytest.mark.parametrize("over,msg", [
    (dict(Tn=9), "1..8 tokens per sequence, got T=9"),
    (dict(state_slots=torch.tensor([0, 5])), "slot 5"),
    (dict(state_slots=torch.tensor([0.0, 1.0])), "state_slots has dtype float32"),
    (dict(state_pool=torch.zeros(4, HV, K, V, dtype=torch.bfloat16)), "state_pool has dtype bfloat16"),
    (dict(g=None, beta=None, a=torch.zeros(2, 1, HV)), "b is missing"),
    (dict(out=torch.empty(2, 1, HV, V + 1)), "out has shape"),
    (dict(out=torch.empty(2, 1, HV, V, dtype=torch.float64)), "out has dtype float64"),
])
def test_decode_rejects(over, msg):
    Tn = over.pop("Tn", 1)
    if Tn != 1:
        over.update(g=-torch.rand(2, Tn, HV), beta=torch.rand(2, Tn, HV))
    with pytest.raises(ValueError, match=msg):
        _step(Tn=Tn, **over)


def test_decode_accepts_spec_tokens_and_padding():
    o = _step(Tn=8)
    assert o.shape == (2, 8, HV, V) and torch.isfinite(o).all()
    assert torch.equal(o[1], torch.zeros_like(o[1])), "the padding row's output is zero"
    assert o[0].abs().sum() > 0


CONV_D, CONV_W = 6, 4


@pytest.mark.parametrize("over,msg", [
    (dict(weight=torch.randn(CONV_D + 1, CONV_W)), "x has 6 channels but weight has 7"),
    (dict(weight=torch.randn(CONV_D, 9)), "conv width W=9"),
    (dict(bias=torch.randn(CONV_D + 1)), "bias has shape"),
    (dict(activation="relu"), "activation='relu'; accepted"),
    (dict(conv_pool=torch.zeros(3, CONV_D, CONV_W)), "conv_pool has shape"),
    (dict(conv_pool=torch.zeros(3, CONV_D, CONV_W - 1, dtype=torch.float16)), "conv_pool has dtype"),
    (dict(conv_slots=torch.tensor([3])), "slot 3, but conv_pool has 3 slots"),
    (dict(cu_seqlens=torch.tensor([0, 2], dtype=torch.int32)), "must equal the number of tokens T=5"),
])
def test_conv_prefill_rejects(over, msg):
    args = dict(x=torch.randn(5, CONV_D), weight=torch.randn(CONV_D, CONV_W), bias=None,
                conv_pool=torch.zeros(3, CONV_D, CONV_W - 1), conv_slots=torch.tensor([0]))
    args.update(over)
    with pytest.raises(ValueError, match=msg):
        ops.causal_conv1d_prefill(args.pop("x"), args.pop("weight"), args.pop("bias"), **args)


def test_conv_update_rejects_bad_slots():
    with pytest.raises(ValueError, match="conv_slots has shape"):
        ops.causal_conv1d_update(torch.randn(2, CONV_D), torch.randn(CONV_D, CONV_W), None,
                                 conv_pool=torch.zeros(3, CONV_D, CONV_W - 1), conv_slots=torch.tensor([0]))


@pytest.mark.parametrize("call,msg", [
    (lambda: ops.rms_norm_gated(torch.randn(3, 8), torch.randn(3, 7), torch.randn(8)), "z has shape"),
    (lambda: ops.rms_norm_gated(torch.randn(3, 8), torch.randn(3, 8), torch.randn(7)), "weight has shape"),
    (lambda: ops.rms_norm_gated(torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), eps=0), "eps=0"),
    (lambda: ops.rms_norm_zero_centered(torch.randn(3, 8), torch.randn(8), residual=torch.randn(3, 8).half()),
     "residual is"),
])
def test_norms_reject(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


def _moe_args(M=4, E=4, Hd=8, I=4, **over):
    d = dict(x=torch.randn(M, Hd), router_weight=torch.randn(E, Hd), w13=torch.randn(E, 2 * I, Hd),
             w2=torch.randn(E, Hd, I), top_k=2)
    d.update(over)
    return d


@pytest.mark.parametrize("over,msg", [
    (dict(top_k=5), "top_k=5 is not accepted; expected an int in 1..4"),
    (dict(top_k=0), "top_k=0"),
    (dict(w13=torch.randn(4, 7, 8)), "dim 1 must be 2\\*I"),
    (dict(w2=torch.randn(4, 8, 5)), "w2 has shape"),
    (dict(w13=torch.randn(4, 8, 8).half()), "must have x's dtype"),
    (dict(router_weight=torch.randn(4, 9)), "router_weight has shape"),
    (dict(w13=torch.randn(2, 8, 8), w2=torch.randn(2, 8, 4)), "pass expert_map"),
    (dict(w13=torch.randn(2, 8, 8), w2=torch.randn(2, 8, 4), expert_map=torch.tensor([0, 1, 2, -1])),
     "expert_map values must be in -1..1"),
    (dict(shared_w13=torch.randn(8, 8)), "given together"),
    (dict(shared_w13=torch.randn(7, 8), shared_w2=torch.randn(8, 4)), "2\\*Is"),
    (dict(shared_gate_weight=torch.randn(1, 8)), "without a shared expert"),
])
def test_moe_block_rejects(over, msg):
    d = _moe_args(**over)
    with pytest.raises(ValueError, match=msg):
        ops.moe_block(d.pop("x"), d.pop("router_weight"), d.pop("w13"), d.pop("w2"), d.pop("top_k"), **d)


def test_moe_experts_and_route_reject():
    d = _moe_args()
    w = torch.full((4, 2), 0.5)
    with pytest.raises(ValueError, match="topk_ids must be in 0..3, got 0..4"):
        ops.moe_experts(d["x"], d["w13"], d["w2"], w, torch.tensor([[0, 4]] * 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="must both be"):
        ops.moe_experts(d["x"], d["w13"], d["w2"], w[:3], torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk_weights has dtype float16"):
        ops.moe_experts(d["x"], d["w13"], d["w2"], w.half(), torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="top_k=17"):
        ops.moe_route(torch.randn(3, 64), 17)
    with pytest.raises(ValueError, match="router_logits must have 2 dims"):
        ops.moe_route(torch.randn(64), 2)


def test_value_checks_can_be_disabled(monkeypatch):
    """QWEN35_CHECK_VALUES=0 skips the checks that read values (what graph capture needs); shape checks stay."""
    from qwen35 import optable

    check = optable.get("gdn_chunk_prefill").validate
    unordered = _gdn(cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        check(**unordered)
    monkeypatch.setenv("QWEN35_CHECK_VALUES", "0")
    assert check(**unordered) is None  # the values are not read
    with pytest.raises(ValueError, match="q must have 3 dims"):
        _call_prefill(_gdn(q=torch.randn(T, H * K)))
    o, _ = _call_prefill(_gdn())  # valid input still runs
    assert o.shape == (T, HV, V) and torch.isfinite(o).all()


def test_value_check_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv("QWEN35_CHECK_VALUES", "no")
    with pytest.raises(ValueError, match=r"QWEN35_CHECK_VALUES='no' is not accepted; use one of 0, 1"):
        ops.causal_conv1d_update(torch.randn(2, 8), torch.randn(8, 4), conv_pool=torch.zeros(4, 8, 3),
                                 conv_slots=torch.tensor([1, 0], dtype=torch.int32))


def test_host_built_inputs_keeps_cpu_value_checks(monkeypatch):
    """Inside ``host_built_inputs`` value checks are skipped only for accelerator tensors (there they cost a
    device synchronisation per layer); CPU tensors are still checked."""
    from qwen35 import _checks

    monkeypatch.delenv("QWEN35_CHECK_VALUES", raising=False)
    cpu = torch.zeros(3)
    with ops.host_built_inputs():
        assert _checks.value_checks_enabled(cpu)
        with pytest.raises(ValueError, match="slot 9"):
            ops.causal_conv1d_update(torch.randn(2, 8), torch.randn(8, 4), conv_pool=torch.zeros(4, 8, 3),
                                     conv_slots=torch.tensor([9, 0], dtype=torch.int32))
        meta = torch.zeros(3, device="meta")
        assert not _checks.value_checks_enabled(meta)
    assert _checks.value_checks_enabled(torch.zeros(3, device="meta"))
