"""The standalone host's logits against HF transformers' own Qwen3.5 classes, fp32, same checkpoint.

Prefill over a whole prompt (every position) and 16 greedy decode steps, dense and MoE, with the
MoE experts in the hub's per-expert layout (which HF converts on load) and in the fused layout.
HF runs its PyTorch GDN path (FLA cannot run on CPU), so both sides are plain fp32 math.
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err

from qwen35.standalone import Qwen35Standalone
from qwen35.tiny import TinySpec, write_checkpoint

transformers = pytest.importorskip("transformers")

TOL = 1e-4
DECODE_STEPS = 16


@pytest.fixture
def hf_torch_gdn(monkeypatch):
    """Make HF's Qwen3.5 modules use their PyTorch GDN / conv functions instead of FLA kernels."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as dense
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as moe

    for mod in (dense, moe):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update"):
            fn = getattr(mod, name)
            monkeypatch.setattr(mod, name, getattr(fn, "__wrapped__", fn))


def _hf_reference(path: str, prompt: torch.Tensor) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """HF prefill logits [T, vocab], then greedy decode: the tokens fed and the logits after each."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    with torch.no_grad():
        out = model(prompt[None], use_cache=True)
        prefill, cache = out.logits[0], out.past_key_values
        fed, steps, nxt = [], [], int(prefill[-1].argmax())
        for _ in range(DECODE_STEPS):
            o = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
            fed.append(nxt)
            steps.append(o.logits[0, -1])
            nxt = int(o.logits[0, -1].argmax())
    return prefill, fed, steps


@pytest.mark.parametrize("spec", [TinySpec(moe=False), TinySpec(moe=True, per_expert=True),
                                  TinySpec(moe=True, per_expert=False, seed=3)],
                         ids=["dense", "moe-per-expert", "moe-fused"])
def test_logits_match_hf(tmp_path, hf_torch_gdn, spec):
    path = write_checkpoint(tmp_path / "ckpt", spec)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1000, (67,), generator=gen)  # > one 64-token GDN chunk
    ref_prefill, fed, ref_steps = _hf_reference(path, prompt)

    ours = Qwen35Standalone.from_pretrained(path, max_seqs=1, max_len=128)
    slot = ours.allocate(1)
    prefill = ours.step(slot, [prompt.tolist()], all_logits=True)
    err = rel_err(prefill, ref_prefill)
    assert err <= TOL, f"prefill logits: rel err {err:.3e} > {TOL:g}"
    for i, (tok, ref) in enumerate(zip(fed, ref_steps, strict=True)):
        err = rel_err(ours.step(slot, [[tok]])[0], ref)
        assert err <= TOL, f"decode step {i}: rel err {err:.3e} > {TOL:g}"
