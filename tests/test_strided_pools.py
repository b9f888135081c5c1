"""Pools that are strided views into one page buffer (as vLLM packs a block's conv + recurrent state).

Every backend must update such views in place exactly as it updates compact pools, and leave the
rest of each page (the other state, padding) untouched. Triton runs in the interpreter on CPU and
natively on a GPU (the ``cuda`` cases, marked ``gpu``).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import assert_close, cu_from_lens, gdn_inputs

from qwen35 import ops

S, HV, H, K, V, D, W = 5, 4, 2, 16, 16, 24, 4
CONV = D * (W - 1)
STATE = HV * K * V
PAGE = CONV + STATE + 7  # odd padding: the slot stride is no multiple of either block


def _pages(seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    buf = torch.randn(S * PAGE, generator=torch.Generator().manual_seed(seed)).to(device)
    conv = torch.as_strided(buf, (S, D, W - 1), (PAGE, W - 1, 1))
    state = torch.as_strided(buf, (S, HV, K, V), (PAGE, K * V, V, 1), CONV)
    return buf, conv, state


def _padding(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(S, PAGE)[:, CONV + STATE:]


@pytest.fixture(params=["reference", "triton"])
def backend(request, fresh_probe, monkeypatch):
    monkeypatch.setenv("QWEN35_BACKEND", request.param)
    fresh_probe.reset()
    return request.param


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, backend):
    if request.param == "cpu" and backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs CPU tensors only in the interpreter")
    return request.param


def test_strided_views_update_like_compact_pools(backend, device):
    def on(x: torch.Tensor) -> torch.Tensor:
        return x.to(device)

    buf, conv_view, state_view = _pages(0, device)
    pad = _padding(buf).clone()
    conv_c, state_c = conv_view.clone(), state_view.clone()
    lens = [3, 9, 1]
    T = sum(lens)
    cu = cu_from_lens(lens, device)
    slots = on(torch.tensor([4, 0, 2], dtype=torch.int32))
    has_init = on(torch.tensor([True, False, True]))
    gen = torch.Generator().manual_seed(1)
    x = on(torch.randn(T, D, generator=gen))
    w = on(torch.randn(D, W, generator=gen))
    d = gdn_inputs(T, H, HV, K, V, seed=2, raw=True, device=device)
    gating = {k: d[k] for k in ("a", "b", "A_log", "dt_bias")}

    outs = []
    for conv_pool, state_pool in ((conv_view, state_view), (conv_c, state_c)):
        y = ops.causal_conv1d_prefill(x, w, None, cu_seqlens=cu, conv_pool=conv_pool, conv_slots=slots,
                                      has_initial_state=has_init)
        o, _ = ops.gdn_chunk_prefill(d["q"], d["k"], d["v"], **gating, cu_seqlens=cu, state_pool=state_pool,
                                     state_slots=slots, has_initial_state=has_init, use_qk_l2norm=True)
        dec = gdn_inputs(2, H, HV, K, V, seed=3, raw=True, batch=(3,), device=device)
        dec_slots = on(torch.tensor([2, -1, 4], dtype=torch.int32))
        y2 = ops.causal_conv1d_update(on(torch.randn(3, D, generator=torch.Generator().manual_seed(4))), w, None,
                                      conv_pool=conv_pool, conv_slots=dec_slots)
        o2 = ops.gdn_recurrent_step(dec["q"], dec["k"], dec["v"], a=dec["a"], b=dec["b"], A_log=dec["A_log"],
                                    dt_bias=dec["dt_bias"], state_pool=state_pool, state_slots=dec_slots,
                                    use_qk_l2norm=True)
        outs.append((y, o, y2, o2))
    for got, want, what in zip(outs[0], outs[1], ("conv prefill", "gdn prefill", "conv update", "gdn decode"),
                               strict=True):
        assert_close(got, want, 1e-6, what)
    assert_close(conv_view, conv_c, 1e-6, "conv pool")
    assert_close(state_view, state_c, 1e-6, "state pool")
    assert torch.equal(_padding(buf), pad), "bytes between slots must be untouched"


def test_pool_with_non_contiguous_slots_is_rejected():
    pool = torch.zeros(S, HV, V, K).transpose(2, 3)  # each slot's block is transposed
    with pytest.raises(ValueError, match="each slot's block contiguously"):
        ops.gdn_recurrent_step(torch.randn(1, 1, H, K), torch.randn(1, 1, H, K), torch.randn(1, 1, HV, V),
                               g=-torch.rand(1, 1, HV), beta=torch.rand(1, 1, HV), state_pool=pool,
                               state_slots=torch.tensor([0]))
    overlapping = torch.as_strided(torch.zeros(STATE * S), (S, HV, K, V), (STATE // 2, K * V, V, 1))
    with pytest.raises(ValueError, match="slot stride"):
        ops.gdn_recurrent_step(torch.randn(1, 1, H, K), torch.randn(1, 1, H, K), torch.randn(1, 1, HV, V),
                               g=-torch.rand(1, 1, HV), beta=torch.rand(1, 1, HV), state_pool=overlapping,
                               state_slots=torch.tensor([0]))
