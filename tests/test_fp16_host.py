"""float16 end to end in the standalone host (CPU): what lives in fp16 and what stays fp32, logits against the fp32
model, greedy decisions against fp32's, dtype names, and the report of checkpoint values that do not fit fp16
(standalone load and the load_weights path vLLM's host takes). The vLLM host with ``dtype="float16"`` on vLLM's CPU
build: a real engine (this file run as a script in a subprocess, as vLLM's spawned workers need) generates greedy
tokens that follow the fp32 model up to near-ties, and a second engine on a checkpoint with values beyond fp16's
range logs the report naming them.

Budgets. Logits of the fp16 model vs the fp32 model of the same checkpoint (4-layer tiny models, dense and MoE):
relative error <= 1e-2 over all rows of a prefill and of decode steps; measured 2.2e-3 (dense) and 2.9e-3 (MoE) on
this CPU: every weight, matmul output and residual rounds to 11 bits (unit roundoff 4.9e-4), a few dozen times.
Greedy tokens may differ where two logits are within fp16's rounding of each other (the MoE model meets such a
near-tie within 16 tokens), so each fp16 greedy token must be a near-argmax of the fp32 model on the same prefix:
its fp32 logit within GREEDY_GAP of the best one (logits are O(10) here; their fp16 error per value ~0.02).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from helpers import rel_err

from qwen35.checkpoint import FP16_MAX, CheckpointError, iter_safetensors, load_weights
from qwen35.standalone import Qwen35Standalone
from qwen35.tiny import TinySpec, checkpoint_tensors, write_checkpoint

LOGIT_TOL = 1e-2
GREEDY_GAP = 0.1
LENGTHS = (5, 70, 130)  # a short prompt, one over a 64-token GDN chunk, one over two chunks


def _prompts(lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lengths]


def _run(model: Qwen35Standalone, prompts: list[list[int]], decode: int = 4) -> torch.Tensor:
    """Logits of a batched prefill (every row) and of ``decode`` batched decode steps, stacked."""
    slots = model.allocate(len(prompts))
    out = [model.step(slots, prompts, all_logits=True)]
    for i in range(decode):
        out.append(model.step(slots, [[(7 * i + j) % 1000] for j in range(len(prompts))]))
    model.release(slots)
    return torch.cat(out)


def greedy_gaps(model: Qwen35Standalone, prompts: list[list[int]], generated: list[list[int]]) -> list[float]:
    """For each generated token: how far below ``model``'s best logit its logit lies on the same prefix
    (teacher-forced, one prefill per sequence); 0 where ``model`` would have picked it too."""
    gaps = []
    for prompt, toks in zip(prompts, generated, strict=True):
        slot = model.allocate(1)
        logits = model.step(slot, [prompt + toks[:-1]], all_logits=True)[len(prompt) - 1:]
        model.release(slot)
        picked = logits.gather(1, torch.tensor(toks)[:, None])[:, 0]
        gaps += (logits.max(-1).values - picked).tolist()
    return gaps


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def ckpt(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), TinySpec(moe=request.param))


def test_fp16_model_keeps_states_in_fp32(ckpt):
    m = Qwen35Standalone.from_pretrained(ckpt, dtype="float16", max_seqs=2, max_len=64)
    assert m.dtype == torch.float16
    fp32 = {n for n, p in m.model.named_parameters() if p.dtype == torch.float32}
    assert fp32 and all(n.endswith((".A_log", ".dt_bias")) for n in fp32), sorted(fp32)
    assert all(p.dtype == torch.float16 for n, p in m.model.named_parameters() if n not in fp32)
    gdn = [layer.mixer for layer in m.model.layers if hasattr(layer.mixer, "state")]
    attn = [layer.mixer for layer in m.model.layers if hasattr(layer.mixer, "attn")]
    assert gdn and attn
    for mixer in gdn:
        assert mixer.state.conv_pool.dtype == torch.float16 and mixer.state.state_pool.dtype == torch.float32
    for mixer in attn:
        assert mixer.attn.k_cache.dtype == mixer.attn.v_cache.dtype == torch.float16


def test_fp16_logits_within_fp16_tolerance_of_fp32(ckpt):
    prompts = _prompts()
    want = _run(Qwen35Standalone.from_pretrained(ckpt, max_seqs=3, max_len=256), prompts)
    got = _run(Qwen35Standalone.from_pretrained(ckpt, dtype=torch.float16, max_seqs=3, max_len=256), prompts)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    err = rel_err(got, want)
    print(f"fp16 vs fp32 logits: rel err {err:.3e}")
    assert err <= LOGIT_TOL, f"rel err {err:.3e} > {LOGIT_TOL}"


def test_fp16_greedy_generation_follows_fp32_up_to_near_ties(ckpt):
    prompts = _prompts((5, 70))
    m16 = Qwen35Standalone.from_pretrained(ckpt, dtype="float16", max_seqs=2, max_len=256)
    out = m16.generate(prompts, max_new_tokens=16)
    assert [len(t) for t in out] == [16, 16] and all(0 <= t < 1024 for seq in out for t in seq)
    assert max(greedy_gaps(m16, prompts, out)) == 0.0  # its own greedy choices, step by step
    gaps = greedy_gaps(Qwen35Standalone.from_pretrained(ckpt, max_seqs=1, max_len=256), prompts, out)
    print(f"fp16 greedy tokens below fp32's best logit by at most {max(gaps):.4f}")
    assert max(gaps) <= GREEDY_GAP, gaps


def test_dtype_names_and_bad_dtypes(ckpt):
    from qwen35.config import Qwen35Config

    cfg = Qwen35Config.from_dir(ckpt)
    assert Qwen35Standalone(cfg, dtype="float16", max_seqs=1, max_len=8).dtype == torch.float16
    assert Qwen35Standalone(cfg, dtype="auto", max_seqs=1, max_len=8).dtype == torch.float32  # the CPU's default
    with pytest.raises(ValueError, match=r"dtype='fp8'; accepted: float16, bfloat16, float32, float64, auto"):
        Qwen35Standalone(cfg, dtype="fp8")
    with pytest.raises(ValueError, match=r"dtype=torch.int8; accepted: torch.float16"):
        Qwen35Standalone(cfg, dtype=torch.int8)


# ----------------------------------------------------------------------------- values beyond fp16's range

QKV = "model.layers.0.linear_attn.in_proj_qkv.weight"
HEAD = "lm_head.weight"
A_LOG = "model.layers.0.linear_attn.A_log"


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """A bf16 checkpoint with values beyond fp16's range in two fp16 parameters and one fp32 parameter."""
    spec = TinySpec(dtype=torch.bfloat16)
    tensors = checkpoint_tensors(spec)
    tensors[QKV][0, 0], tensors[QKV][3, 5] = 1e5, -7e4
    tensors[HEAD][2, 1] = 3e38
    tensors[A_LOG][0] = 1e5  # A_log stays fp32 in the model: it fits
    return write_checkpoint(tmp_path_factory.mktemp("wide"), spec, tensors), tensors


def _overflow_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "float16" in r.getMessage()]


def test_overflowing_values_are_named_and_saturate(wide_ckpt, monkeypatch, caplog):
    path, tensors = wide_ckpt
    monkeypatch.delenv("QWEN35_FP16_OVERFLOW", raising=False)
    with caplog.at_level(logging.WARNING, logger="qwen35"):
        m = Qwen35Standalone.from_pretrained(path, dtype="float16", max_seqs=1, max_len=64)
    warned = _overflow_warnings(caplog)
    assert len(warned) == 1, warned
    big_qkv = float(tensors[QKV].float().abs().max())
    big_head = float(tensors[HEAD].float().abs().max())
    assert (f"2 checkpoint tensors hold values beyond float16's range (|x| > 65504) for this float16 model: "
            f"{HEAD} (1 value, max |x| {big_head:.6g}), {QKV} (2 values, max |x| {big_qkv:.6g})") in warned[0]
    assert "saturate to +-65504" in warned[0] and "QWEN35_FP16_OVERFLOW=error" in warned[0]
    assert A_LOG not in warned[0]
    qkv = m.model.layers[0].mixer.in_proj.weight
    assert qkv[0, 0] == FP16_MAX and qkv[3, 5] == -FP16_MAX
    assert m.model.lm_head_weight[2, 1] == FP16_MAX
    assert torch.isfinite(qkv).all() and torch.isfinite(m.model.lm_head_weight).all()
    assert torch.equal(m.model.layers[0].mixer.A_log.float()[0], torch.tensor(1e5).bfloat16().float())
    rest = tensors[QKV].clone()
    rest[0, 0] = rest[3, 5] = 0
    got = qkv[: rest.shape[0]].clone()
    got[0, 0] = got[3, 5] = 0
    assert torch.equal(got, rest.to(torch.float16))  # the other values: a plain cast


def test_overflow_is_an_error_when_asked(wide_ckpt, monkeypatch):
    path, _ = wide_ckpt
    monkeypatch.setenv("QWEN35_FP16_OVERFLOW", "error")
    with pytest.raises(CheckpointError, match=rf"{HEAD} \(1 value.*{QKV} \(2 values.*QWEN35_FP16_OVERFLOW=error"):
        Qwen35Standalone.from_pretrained(path, dtype="float16", max_seqs=1, max_len=64)
    monkeypatch.setenv("QWEN35_FP16_OVERFLOW", "maybe")
    with pytest.raises(ValueError, match=r"QWEN35_FP16_OVERFLOW='maybe' is not accepted; use one of warn, error"):
        Qwen35Standalone.from_pretrained(path, dtype="float16", max_seqs=1, max_len=64)


def test_load_weights_reports_for_any_host(wide_ckpt, monkeypatch, caplog):
    """The (name, tensor) stream vLLM's host hands to load_weights: the same report, to the host's logger; the
    ``overflow`` argument wins over the switch; an fp32 model has nothing to report."""
    path, _ = wide_ckpt
    monkeypatch.delenv("QWEN35_FP16_OVERFLOW", raising=False)
    m16 = Qwen35Standalone.from_pretrained(path, dtype="float16", max_seqs=1, max_len=64)
    host_log = logging.getLogger("qwen35.test_host")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_weights(m16.model, iter_safetensors(path), logger=host_log)
    assert [r.name for r in caplog.records if "float16" in r.getMessage()] == ["qwen35.test_host"]
    with pytest.raises(CheckpointError, match=QKV):
        load_weights(m16.model, iter_safetensors(path), overflow="error")
    with pytest.raises(ValueError, match=r"overflow='loud'; accepted: warn, error"):
        load_weights(m16.model, iter_safetensors(path), overflow="loud")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qwen35"):
        Qwen35Standalone.from_pretrained(path, dtype="float32", max_seqs=1, max_len=64)
    assert not _overflow_warnings(caplog)


# ----------------------------------------------------------------------------- the vLLM host in float16

VLLM_TOKENS = 16


def _vllm_prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j + 1) % 1000 for j in range(n)] for i, n in enumerate([5, 70])]


def _engine_main(workdir: str) -> None:
    """Two engines in turn: greedy tokens of the clean checkpoint in fp16, then the load of the wide one."""
    from vllm import LLM, SamplingParams

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = {}
    for name in ("clean", "wide"):
        llm = LLM(model=os.path.join(workdir, name), skip_tokenizer_init=True, dtype="float16", enforce_eager=True,
                  max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.3, seed=0)
        result[name + "_dtype"] = str(llm.llm_engine.vllm_config.model_config.dtype)
        if name == "clean":
            greedy = SamplingParams(temperature=0, max_tokens=VLLM_TOKENS, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in _vllm_prompts()], greedy)
            result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        llm.llm_engine.engine_core.shutdown()
        del llm
        with open(os.path.join(workdir, "results.json"), "w") as f:
            json.dump(result, f)


@pytest.fixture(scope="module")
def vllm_fp16_run(tmp_path_factory, wide_ckpt):
    pytest.importorskip("vllm")
    workdir = tmp_path_factory.mktemp("vllm16")
    write_checkpoint(workdir / "clean", TinySpec(moe=False))
    spec = TinySpec(dtype=torch.bfloat16)
    tensors = {n: t.clone() for n, t in wide_ckpt[1].items()}
    write_checkpoint(workdir / "wide", spec, tensors)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("TRITON_INTERPRET", None)
    env.pop("QWEN35_FP16_OVERFLOW", None)
    proc = subprocess.run([sys.executable, __file__, str(workdir)], capture_output=True, text=True, timeout=480,
                          env=env, cwd=os.path.dirname(__file__))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine script failed (rc {proc.returncode}):\n{log[-6000:]}"
    return workdir, json.loads((workdir / "results.json").read_text()), log


@pytest.mark.slow
def test_vllm_host_in_fp16_follows_fp32_up_to_near_ties(vllm_fp16_run):
    workdir, result, _ = vllm_fp16_run
    assert result["clean_dtype"] == "torch.float16"
    prompts = _vllm_prompts()
    assert [len(t) for t in result["tokens"]] == [VLLM_TOKENS] * len(prompts)
    m32 = Qwen35Standalone.from_pretrained(workdir / "clean", max_seqs=1, max_len=256)
    gaps = greedy_gaps(m32, prompts, result["tokens"])
    print(f"vLLM fp16 greedy tokens below the fp32 model's best logit by at most {max(gaps):.4f}")
    assert max(gaps) <= GREEDY_GAP, gaps


@pytest.mark.slow
def test_vllm_host_reports_values_beyond_fp16(vllm_fp16_run):
    _, result, log = vllm_fp16_run
    assert result["wide_dtype"] == "torch.float16"
    lines = [ln for ln in log.splitlines() if "beyond float16's range" in ln]
    assert len(lines) == 1, log[-6000:]
    assert f"{HEAD} (1 value" in lines[0] and f"{QKV} (2 values" in lines[0] and "saturate to +-65504" in lines[0]


if __name__ == "__main__":
    _engine_main(sys.argv[1])
