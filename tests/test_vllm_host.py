"""vLLM host on vLLM's CPU build: real engines, greedy tokens equal to the standalone host's, fp32.

One subprocess (this file run as a script, as vLLM's spawned workers need) starts an engine per
case in turn and writes what it saw to JSON; the tests below compare that with the standalone
host on the same checkpoints. Every engine runs with prefix caching on and chunked prefill forced
(``max_num_batched_tokens`` below the longest prompt), so GDN states cross chunk boundaries and
are restored from the prefix cache. The model is found through the ``vllm.general_plugins``
entry point alone: the script never registers anything itself.

Cases: dense ``Qwen3_5ForCausalLM`` (an image request refused: a text-only checkpoint); MoE
``Qwen3_5MoeForConditionalGeneration`` (per-expert tensors, the vision tower loaded and an image request
answered as the standalone host answers it, the MTP tensor skipped); MoE at tensor parallel 2 with one kv
head (replicated across ranks) and a vocabulary that does not split evenly. Images in depth:
``tests/test_vllm_images.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qwen35.tiny import TinySpec, write_checkpoint

MAX_BATCHED_TOKENS = 64
BLOCK = 128  # vLLM CPU's attention block size; prefix-cache hits come in multiples of it
NEW_TOKENS = 32
CASES = {
    "dense": (TinySpec(moe=False, seed=0), 1),
    "moe-cg": (TinySpec(moe=True, conditional=True, per_expert=True, seed=1), 1),
    "moe-tp2": (TinySpec(moe=True, seed=2, overrides={"num_key_value_heads": 1, "vocab_size": 1021}), 2),
}


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Round 1: mixed lengths (one longer than the chunk budget and than two cache blocks).
    Round 2: prompts that share cached prefixes with round 1."""
    first = [[(7 * i + 3 * j + 1) % 1000 for j in range(n)] for i, n in enumerate([5, 70, 33, 300])]
    second = [first[3][:2 * BLOCK + 4] + [11, 12, 13, 14, 15], first[1] + [21, 22, 23]]
    return first, second


# ----------------------------------------------------------------------------- the engine script


def _cpu_bind(tp: int) -> str | None:
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(c) for c in cores[:tp]) if len(cores) >= tp else None


IMAGE_PROMPT = [5, 1002, 1000, 1003, 7, 8, 9]  # qwen35.tiny's vision-start, image and vision-end token ids


def _image():
    import numpy as np

    return np.random.default_rng(0).integers(0, 256, (70, 100, 3), dtype=np.uint8)


def _run_case(path: str, tp: int, conditional: bool) -> dict:
    from vllm import LLM, SamplingParams

    if tp > 1:  # vLLM CPU binds one OpenMP thread group per rank; a 1-NUMA-node box needs it spelled out
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_bind(tp)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, enable_prefix_caching=True,
              max_num_batched_tokens=MAX_BATCHED_TOKENS, max_model_len=512, max_num_seqs=8,
              gpu_memory_utilization=0.3, tensor_parallel_size=tp, seed=0)
    cfg = llm.llm_engine.vllm_config
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first, second = _prompts()
    result = {"mamba_cache_mode": cfg.cache_config.mamba_cache_mode,
              "prefix_caching": cfg.cache_config.enable_prefix_caching,
              "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens}
    outs = llm.generate([{"prompt_token_ids": p} for p in first], greedy)
    result["first"] = [list(o.outputs[0].token_ids) for o in outs]
    if tp == 1:  # a ConditionalGeneration checkpoint answers an image; a CausalLM one refuses it
        from PIL import Image

        request = {"prompt_token_ids": IMAGE_PROMPT, "multi_modal_data": {"image": Image.fromarray(_image())}}
        try:
            result["image"] = list(llm.generate([request], greedy)[0].outputs[0].token_ids)
        except Exception as e:  # noqa: BLE001 - the test asserts on the type and message
            result["image"] = [type(e).__name__, str(e)]
    outs = llm.generate([{"prompt_token_ids": p} for p in second], greedy)
    result["second"] = [list(o.outputs[0].token_ids) for o in outs]
    result["second_cached_tokens"] = [o.num_cached_tokens for o in outs]
    llm.llm_engine.engine_core.shutdown()
    del llm
    return result


def _engine_main(workdir: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results = {}
    for name, (spec, tp) in CASES.items():
        if tp > 1 and _cpu_bind(tp) is None:
            results[name] = {"skipped": f"needs {tp} CPU cores, have {len(os.sched_getaffinity(0))}"}
            continue
        results[name] = _run_case(os.path.join(workdir, name), tp, spec.conditional)
        with open(os.path.join(workdir, "results.json"), "w") as f:
            json.dump(results, f)


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    pytest.importorskip("vllm")
    workdir = tmp_path_factory.mktemp("vllm")
    for name, (spec, _) in CASES.items():
        write_checkpoint(workdir / name, spec)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, __file__, str(workdir)], capture_output=True, text=True, timeout=480,
                          env=env, cwd=os.path.dirname(__file__))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine script failed (rc {proc.returncode}):\n{log[-6000:]}"
    results = json.loads((workdir / "results.json").read_text())
    return workdir, results, log


def _standalone(path, prompts: list[list[int]]) -> list[list[int]]:
    from qwen35.standalone import Qwen35Standalone

    m = Qwen35Standalone.from_pretrained(path, max_seqs=len(prompts), max_len=512)
    return m.generate(prompts, NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_standalone(engine_run, case):
    workdir, results, _ = engine_run
    got = results[case]
    if "skipped" in got:
        pytest.skip(got["skipped"])
    assert got["prefix_caching"] and got["mamba_cache_mode"] == "align"
    first, second = _prompts()
    assert got["max_num_batched_tokens"] < max(len(p) for p in first), "chunked prefill was not forced"
    assert got["first"] == _standalone(workdir / case, first), f"{case}: round-1 tokens differ from standalone"
    assert got["second"] == _standalone(workdir / case, second), f"{case}: round-2 tokens differ from standalone"
    # the long prompt resumed from the GDN state and KV cached at a block boundary of round 1
    assert got["second_cached_tokens"][0] >= 2 * BLOCK, got["second_cached_tokens"]


@pytest.mark.slow
def test_images_answered_by_vision_checkpoints_refused_by_text_ones(engine_run):
    workdir, results, _ = engine_run
    from qwen35.standalone import Qwen35Standalone

    model = Qwen35Standalone.from_pretrained(workdir / "moe-cg", max_seqs=1, max_len=512)
    assert results["moe-cg"]["image"] == model.generate([IMAGE_PROMPT], NEW_TOKENS, images=[[_image()]])[0]
    kind, message = results["dense"]["image"]
    assert (kind, message) == ("ValueError", "Multi-modal processor not available for text-only models")
    assert results["dense"]["second"], "the engine must keep serving after refusing the image request"


@pytest.mark.slow
def test_plugin_found_and_backends_logged(engine_run):
    _, _, log = engine_run
    assert "qwen35 backends on cpu" in log, "the host did not log the probe's report"
    assert "qwen35: skipped 1 MTP tensors (mtp.*)" in log  # the vision host loads the tower and skips MTP only
    assert "vision / MTP tensors" not in log, "no host here skips a tower"


if __name__ == "__main__":
    _engine_main(sys.argv[1])
