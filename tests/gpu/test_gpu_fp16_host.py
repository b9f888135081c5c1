"""The standalone host in float16 on the forced ``cuda_sm70`` backend (``QWEN35_BACKEND=cuda_sm70``; on an H200 the
policy would pick Triton): greedy tokens against the Triton backend's, logits against an fp32 reference, a captured
decode step against eager steps. Tiny 4-layer models (qwen35.tiny), dense and MoE. Skipped without CUDA.

Budgets:

- 32 greedy tokens per prompt equal to the Triton backend's (both fp16). Where two candidates' logits lie within
  the two backends' fp16 difference of each other, they may break the tie differently; then at the first
  difference, on the shared prefix, the two backends' logits are within 1e-2 of the largest logit (max abs) and
  Triton's gap between the two tokens is within NEAR_TIE or twice that position's largest logit difference (the
  flip is the backends' rounding, not a wrong token). Teacher-forced logits of the two backends on the same
  tokens: rel err <= 1e-2.
- Logits (a batched prefill's every row, then decode steps) vs the fp32 reference backend: rel err <= 1e-2, the CPU
  budget of tests/test_fp16_host.py (fp16 vs fp32 there: 2.2e-3 dense, 2.9e-3 MoE).
- A captured decode step replays the eager step's logits within 1e-3.
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err
from test_fp16_host import _prompts, _run

from qwen35 import optable, probe
from qwen35.standalone import Qwen35Standalone
from qwen35.tiny import TinySpec, write_checkpoint

pytestmark = pytest.mark.gpu

DEV = "cuda"
TOKENS = 32
NEAR_TIE = 0.05
LOGIT_TOL = 1e-2
GRAPH_TOL = 1e-3
SM70_OPS = ("gdn_chunk_prefill", "gdn_recurrent_step", "causal_conv1d_prefill", "causal_conv1d_update",
            "rms_norm_gated", "rms_norm_zero_centered", "moe_route", "moe_experts", "moe_block")


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def ckpt(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), TinySpec(moe=request.param))


def _backend(monkeypatch, name: str) -> None:
    """Every op on ``name`` from now on (where it defines the op; the policy for the rest). The ops dispatch
    through the probe at each call, so a model runs on whichever backend is set when it is called."""
    monkeypatch.setenv("QWEN35_BACKEND", name)
    probe.reset()


def _model(ckpt, dtype="float16", max_seqs: int = 3) -> Qwen35Standalone:
    return Qwen35Standalone.from_pretrained(ckpt, device=DEV, dtype=dtype, max_seqs=max_seqs, max_len=256)


def _logits(m: Qwen35Standalone, tokens: list[int]) -> torch.Tensor:
    """Every row's logits of one fresh sequence."""
    slot = m.allocate(1)
    try:
        return m.step(slot, [tokens], all_logits=True)
    finally:
        m.release(slot)


def test_forced_cuda_sm70_serves_its_ops_in_fp16(fresh_probe, monkeypatch, ckpt):
    """The host's backend report (no dtype: the H200's default is bf16) self-tests cuda_sm70 in fp16; the model's
    fp16 calls get cuda_sm70 for every op it defines and the policy's Triton for the rest."""
    _backend(monkeypatch, "cuda_sm70")
    m = _model(ckpt)
    _run(m, _prompts((5, 70)), decode=1)
    bf16_default = probe.device_caps(DEV).compute_dtype == torch.bfloat16
    for op in optable.NAMES:
        c = probe.choose(op, DEV, torch.float16)
        if op in SM70_OPS:
            assert c.backend == "cuda_sm70" and "(float16)" in c.reason, (op, c)
            assert not bf16_default or "tested in fp16" in probe.choose(op, DEV).reason, probe.choose(op, DEV)
        else:
            assert c.backend == "triton", (op, c)


def test_greedy_tokens_equal_the_triton_backends(fresh_probe, monkeypatch, ckpt):
    prompts = _prompts((5, 70, 130))
    m = _model(ckpt)  # one model: the backend is the probe's choice at each call
    _backend(monkeypatch, "triton")
    want = m.generate(prompts, TOKENS)
    forced_triton = [_logits(m, p + toks[:-1])[len(p) - 1:] for p, toks in zip(prompts, want, strict=True)]
    _backend(monkeypatch, "cuda_sm70")
    got = m.generate(prompts, TOKENS)
    forced_sm70 = [_logits(m, p + toks[:-1])[len(p) - 1:] for p, toks in zip(prompts, want, strict=True)]
    assert probe.choose("gdn_chunk_prefill", DEV, torch.float16).backend == "cuda_sm70"
    err = rel_err(torch.cat(forced_sm70), torch.cat(forced_triton))
    print(f"\n[fp16 host] cuda_sm70 vs triton, logits on Triton's tokens: rel err {err:.3e}")
    assert err <= LOGIT_TOL, f"rel err {err:.3e} > {LOGIT_TOL}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a == b:
            continue
        first = next(j for j in range(TOKENS) if a[j] != b[j])
        prefix = prompts[i] + b[:first]  # = prompts[i] + a[:first]
        ours = _logits(m, prefix)[-1].float()  # cuda_sm70
        _backend(monkeypatch, "triton")
        theirs = _logits(m, prefix)[-1].float()
        _backend(monkeypatch, "cuda_sm70")
        gap = float(theirs[b[first]] - theirs[a[first]])
        diff = float((ours - theirs).abs().max())
        pos_err = diff / float(theirs.abs().max())
        print(f"[fp16 host] prompt {i}: tokens differ from step {first} on; Triton's gap between the two {gap:.4f}, "
              f"largest logit difference there {diff:.4f} ({pos_err:.2e} of the largest logit)")
        assert pos_err <= LOGIT_TOL, f"prompt {i} step {first}: logits differ by {pos_err:.2e} > {LOGIT_TOL}"
        assert gap <= max(NEAR_TIE, 2 * diff), (
            f"prompt {i}: cuda_sm70 token {a[first]} != Triton's {b[first]} at step {first}, which Triton's logits "
            f"separate by {gap:.4f} > max({NEAR_TIE}, 2 x {diff:.4f})")
    same = sum(a == b for a, b in zip(got, want, strict=True))
    print(f"[fp16 host] {same}/{len(prompts)} prompts: {TOKENS} greedy tokens identical to Triton's")


def test_logits_within_fp16_tolerance_of_an_fp32_reference(fresh_probe, monkeypatch, ckpt):
    prompts = _prompts()
    _backend(monkeypatch, "reference")
    want = _run(_model(ckpt, dtype="float32"), prompts)
    _backend(monkeypatch, "cuda_sm70")
    got = _run(_model(ckpt), prompts)
    assert probe.choose("moe_block", DEV, torch.float16).backend == "cuda_sm70"
    err = rel_err(got, want)
    print(f"\n[fp16 host] cuda_sm70 fp16 vs reference fp32 logits: rel err {err:.3e}")
    assert err <= LOGIT_TOL, f"rel err {err:.3e} > {LOGIT_TOL}"


def test_decode_graph_on_cuda_sm70(fresh_probe, monkeypatch, ckpt):
    _backend(monkeypatch, "cuda_sm70")
    m = _model(ckpt, max_seqs=4)
    prompts, cont = _prompts((5, 40, 17)), _prompts((4, 4, 4), seed=2)
    slots = m.allocate(3)
    m.step(slots, prompts)
    expected = [m.step(slots, [[c[i]] for c in cont]) for i in range(4)]
    m.release(slots)
    slots = m.allocate(3)
    m.step(slots, prompts)
    graph = m.capture_decode(slots)
    for i in range(4):
        got = graph.step([c[i] for c in cont])
        err = rel_err(got, expected[i])
        assert err <= GRAPH_TOL, f"graph step {i}: rel err {err:.3e}"
