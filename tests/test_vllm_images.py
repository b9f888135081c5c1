"""Images through the vLLM host on vLLM's CPU build: our multimodal processor, the tower in the engine, fp32.

Fast tests: the adapter resolves vLLM's multimodal internals and dispatches the processor's main step by
version; the plugin maps each architecture to its class; the encoder-cache bound covers every image size.

Slow tests: vLLM's own registry builds our processor for a tiny ``Qwen3_5ForConditionalGeneration``
checkpoint, whose prompt expansion, placeholder offsets and tensors must equal what
:mod:`qwen35.mrope` and :mod:`qwen35.image_processor` compute; then one subprocess (this file run as a
script, as vLLM's spawned workers need) starts two engines on that checkpoint (found through the
``vllm.general_plugins`` entry point alone) and the tests compare what they saw with the standalone host:

- ``vl``: tensor parallel 2 when the box has two cores (the tower replicated on both ranks), prefix
  caching on, chunked prefill forced below the image sizes (an image's tokens cross a chunk boundary);
  prompts with one image, two images, an image in a cached prefix, the same prompt with another image
  (which must not reuse the cache past the image), and text only. Greedy tokens equal the standalone
  host's, and two different images right before the reply give different tokens;
- ``no-images``: the same checkpoint with an image limit of 0 (vLLM's text-only mode): no tower is
  built, its tensors are skipped at load, text still equals the standalone host and an image request
  is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from qwen35 import vllm_adapter
from qwen35.image_processor import ImageInputError, ImageProcessorConfig, max_image_tokens, num_image_tokens
from qwen35.tiny import TinySpec, write_checkpoint

vllm = pytest.importorskip("vllm")

SPEC = TinySpec(conditional=True, seed=3)
IMG, VS, VE = 1000, 1002, 1003  # qwen35.tiny's image, vision-start and vision-end token ids
MAX_BATCHED_TOKENS = 32
BLOCK = 128  # vLLM CPU's attention block size
NEW_TOKENS = 16
SIZES = [(100, 70), (64, 200), (300, 90), (40, 40), (128, 96)]  # (width, height): 6, 12, 14, 4 and 12 tokens


def picture(index: int) -> np.ndarray:
    width, height = SIZES[index]
    return np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _requests() -> tuple[list[tuple[list[int], list[int]]], list[tuple[list[int], list[int]]]]:
    """(prompt, image indices) pairs. Round 1: mixed prompts, one long enough to fill a cache block before
    its tail. Round 2: that prompt again (a prefix-cache hit through its image), and with another image."""
    text = [(11 * j + 5) % 900 + 20 for j in range(BLOCK + 40)]
    first = [
        ([5, VS, IMG, VE, 7, 8, 9], [0]),
        ([VS, IMG, VE, 3, *range(100, 130), VS, IMG, VE, 4], [1, 2]),
        ([*range(200, 230), VS, IMG, VE, 31], [3]),
        (text[:20] + [VS, IMG, VE] + text[20:], [4]),
        ([1, 2, 3, 4, 5], []),
    ]
    second = [first[3], (first[3][0], [0]), ([5, VS, IMG, VE, 7, 8, 9], [4])]
    return first, second


# ----------------------------------------------------------------------------- fast: adapter, plugin, bounds


def test_multimodal_api_resolves_to_vllms_own_objects():
    from vllm.model_executor.models.interfaces import SupportsMultiModal
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.inputs import MultiModalFieldConfig
    from vllm.multimodal.parse import ImageProcessorItems
    from vllm.multimodal.processing import (
        BaseDummyInputsBuilder,
        BaseMultiModalProcessor,
        BaseProcessingInfo,
        ProcessorInputs,
        PromptReplacement,
    )

    api = vllm_adapter.multimodal_api()
    expected = dict(registry=MULTIMODAL_REGISTRY, SupportsMultiModal=SupportsMultiModal,
                    BaseProcessingInfo=BaseProcessingInfo, BaseDummyInputsBuilder=BaseDummyInputsBuilder,
                    BaseMultiModalProcessor=BaseMultiModalProcessor, ProcessorInputs=ProcessorInputs,
                    MultiModalFieldConfig=MultiModalFieldConfig, PromptReplacement=PromptReplacement,
                    ImageProcessorItems=ImageProcessorItems)  # fmt: skip
    for name, obj in expected.items():
        assert getattr(api, name) is obj, name
    # 0.32's processor gets the media only (the renderer tokenized the prompt); 0.26's got the prompt too
    assert api.processor_takes_prompt is (api.version[:2] < (0, 32))
    assert vllm_adapter.multimodal_api() is api


class _Steps:
    """What the main step calls on a processor: records the calls, answers fixed values."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def _prompt_ids(self, prompt, tokenization_kwargs):  # noqa: ANN001, ANN202
        self.calls.append(("ids", prompt, dict(tokenization_kwargs)))
        return [1, 2]

    def _process_media(self, mm_items):  # noqa: ANN001, ANN202
        self.calls.append(("media", mm_items))
        return {"pixel_values": mm_items}


def test_main_step_takes_each_versions_arguments():
    api = vllm_adapter.multimodal_api()
    media_only = vllm_adapter.image_processor_main_step(dataclasses.replace(api, processor_takes_prompt=False))
    steps = _Steps()
    assert media_only(steps, "ITEMS", {"k": 1}) == {"pixel_values": "ITEMS"}
    assert steps.calls == [("media", "ITEMS")]
    with_prompt = vllm_adapter.image_processor_main_step(dataclasses.replace(api, processor_takes_prompt=True))
    steps = _Steps()
    out = with_prompt(steps, "a prompt", "ITEMS", {}, {"add_special_tokens": False}, enable_hf_prompt_update=True)
    assert out == ([1, 2], {"pixel_values": "ITEMS"}, False), "vLLM applies the prompt updates itself"
    assert steps.calls == [("ids", "a prompt", {"add_special_tokens": False}), ("media", "ITEMS")]


def test_plugin_maps_vision_checkpoints_to_the_vision_class():
    from qwen35.config import ARCHITECTURES
    from qwen35.vllm_plugin import MODEL_CLASS, VISION_MODEL_CLASS, model_class

    assert {a: model_class(a) for a in ARCHITECTURES} == {
        "Qwen3_5ForCausalLM": MODEL_CLASS, "Qwen3_5MoeForCausalLM": MODEL_CLASS,
        "Qwen3_5ForConditionalGeneration": VISION_MODEL_CLASS,
        "Qwen3_5MoeForConditionalGeneration": VISION_MODEL_CLASS}  # fmt: skip


@pytest.mark.parametrize("bounds", [(64 * 64, 128 * 128), (64 * 64, 256 * 256), (256 * 256, 4096 * 4096),
                                    (200 * 200, 210 * 210)])  # fmt: skip
def test_max_image_tokens_bounds_every_size(bounds):
    cfg = ImageProcessorConfig(min_pixels=bounds[0], max_pixels=bounds[1])
    bound, rng, worst = max_image_tokens(cfg), np.random.default_rng(0), 0
    sides = [int(s) for s in rng.integers(1, 20000, 4000)]
    for h in sides:
        for w in (max(1, -(-h // 200)), min(20000, h * 200), int(rng.integers(max(1, -(-h // 200)), h * 200 + 1))):
            try:
                worst = max(worst, num_image_tokens(h, w, cfg))
            except ImageInputError:
                continue
    assert worst <= bound, f"an image needs {worst} tokens, above the bound {bound}"
    assert bound >= cfg.max_pixels // cfg.factor**2


# ----------------------------------------------------------------------------- slow: vLLM's registry, our processor


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("vl") / "ckpt", SPEC)


@pytest.mark.slow
def test_processor_from_vllms_registry_matches_our_processor(checkpoint):
    from PIL import Image
    from vllm.config import ModelConfig
    from vllm.multimodal.processing import ProcessorInputs, TimingContext

    from qwen35.image_processor import preprocess
    from qwen35.mrope import expand_image_placeholders, find_image_offsets
    from qwen35.vllm_multimodal import Qwen35ImageProcessor
    from qwen35.vllm_plugin import register

    register()
    config = ModelConfig(model=checkpoint, dtype="float32", skip_tokenizer_init=True, max_model_len=512)
    assert config.is_multimodal_model
    processor = vllm_adapter.multimodal_api().registry.create_processor(config)
    assert isinstance(processor, Qwen35ImageProcessor)
    images = [Image.fromarray(picture(i)) for i in (1, 2)]
    prompt, _ = _requests()[0][1]
    out = processor.apply(ProcessorInputs(prompt=prompt, mm_data_items=processor.info.parse_mm_data({"image": images})),
                          TimingContext(enabled=False))  # fmt: skip
    ours = preprocess(images, ImageProcessorConfig.from_dir(checkpoint))
    assert out["prompt_token_ids"] == expand_image_placeholders(prompt, ours.num_tokens, IMG).tolist()
    placeholders = out["mm_placeholders"]["image"]
    assert [p.offset for p in placeholders] == find_image_offsets(out["prompt_token_ids"], ours.grid_thw, 2, IMG)
    assert [p.length for p in placeholders] == ours.num_tokens == [12, 14]
    data = out["mm_kwargs"].get_data()
    assert torch.equal(data["pixel_values"], ours.pixel_values) and torch.equal(data["image_grid_thw"], ours.grid_thw)
    assert processor.info.get_mm_max_tokens_per_item(512, {"image": 1}) == {"image": 56}  # 64..128 px: at most 56
    dummy = processor.get_dummy_mm_inputs({"image": 2})  # built from token ids: no tokenizer needed
    assert [p.length for p in dummy["mm_placeholders"]["image"]] == [16, 16]
    with pytest.raises((RuntimeError, ValueError)):  # two images, one placeholder: vLLM refuses the request
        processor.apply(
            ProcessorInputs(prompt=[5, VS, IMG, VE], mm_data_items=processor.info.parse_mm_data({"image": images})),
            TimingContext(enabled=False),
        )


# ----------------------------------------------------------------------------- slow: engines


def _cpu_bind(tp: int) -> str | None:
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(c) for c in cores[:tp]) if len(cores) >= tp else None


def _engine(path: str, tp: int, **kw):
    from vllm import LLM

    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_bind(tp)
    return LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, enable_prefix_caching=True,
               max_num_batched_tokens=MAX_BATCHED_TOKENS, max_model_len=512, max_num_seqs=8,
               gpu_memory_utilization=0.3, tensor_parallel_size=tp, seed=0, **kw)  # fmt: skip


def _stop(llm) -> None:  # noqa: ANN001
    llm.llm_engine.engine_core.shutdown()


def _inputs(requests: list[tuple[list[int], list[int]]]) -> list[dict]:
    from PIL import Image

    out = []
    for prompt, images in requests:
        item: dict = {"prompt_token_ids": prompt}
        if images:
            item["multi_modal_data"] = {"image": [Image.fromarray(picture(i)) for i in images]}
        out.append(item)
    return out


def _engine_main(path: str, out: str) -> None:
    from vllm import SamplingParams

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first, second = _requests()
    tp = 2 if _cpu_bind(2) else 1
    results: dict = {"tp": tp}
    llm = _engine(path, tp)
    cfg = llm.llm_engine.vllm_config
    results["max_num_batched_tokens"] = cfg.scheduler_config.max_num_batched_tokens
    outs = llm.generate(_inputs(first), greedy)
    results["first"] = [list(o.outputs[0].token_ids) for o in outs]
    results["first_prompt_lengths"] = [len(o.prompt_token_ids) for o in outs]
    outs = llm.generate(_inputs(second), greedy)
    results["second"] = [list(o.outputs[0].token_ids) for o in outs]
    results["second_cached_tokens"] = [o.num_cached_tokens for o in outs]
    _stop(llm)
    del llm
    llm = _engine(path, 1, limit_mm_per_prompt={"image": 0})
    outs = llm.generate(_inputs([first[4]]), greedy)
    results["no_images_text"] = list(outs[0].outputs[0].token_ids)
    try:
        llm.generate(_inputs([first[0]]), greedy)
        results["no_images_error"] = None
    except Exception as e:  # noqa: BLE001 - the test asserts on the message
        results["no_images_error"] = [type(e).__name__, str(e)]
    _stop(llm)
    with open(out, "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def engine_run(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("vl-run") / "results.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, __file__, checkpoint, str(out)], capture_output=True, text=True,
                          timeout=480, env=env, cwd=os.path.dirname(__file__))  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine script failed (rc {proc.returncode}):\n{log[-6000:]}"
    return json.loads(out.read_text()), log


def _standalone(path: str, requests: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    from qwen35.standalone import Qwen35Standalone

    model = Qwen35Standalone.from_pretrained(path, max_seqs=len(requests), max_len=512)
    return model.generate([p for p, _ in requests], NEW_TOKENS,
                          images=[[picture(i) for i in imgs] or None for _, imgs in requests])  # fmt: skip


@pytest.mark.slow
def test_greedy_tokens_with_images_equal_standalone(engine_run, checkpoint):
    got, log = engine_run
    first, second = _requests()
    tokens = [6, 12 + 14, 4, 12, 0]
    assert got["first_prompt_lengths"] == [len(p) + n - len(imgs) for (p, imgs), n in zip(first, tokens, strict=True)]
    assert got["max_num_batched_tokens"] < max(got["first_prompt_lengths"]), "chunked prefill was not forced"
    assert got["first"] == _standalone(checkpoint, first), "round-1 tokens differ from the standalone host's"
    assert got["second"] == _standalone(checkpoint, second), "round-2 tokens differ from the standalone host's"
    assert got["second_cached_tokens"][0] >= BLOCK, "the prompt with its image was not served from the prefix cache"
    assert got["second_cached_tokens"][1] < len(first[3][0]) - 1, "another image must not reuse the cached image"
    assert got["first"][0] != got["second"][2], "two different images right before the reply gave the same tokens"
    if got["tp"] == 2:
        assert "world_size=2" in log or "tensor_parallel_size=2" in log


@pytest.mark.slow
def test_image_limit_zero_builds_no_tower(engine_run, checkpoint):
    got, log = engine_run
    first, _ = _requests()
    assert got["no_images_text"] == _standalone(checkpoint, [first[4]])[0]
    assert "skipped 22 vision / MTP tensors" in log, "with no images the tower's tensors are skipped"
    kind, message = got["no_images_error"]
    assert kind == "ValueError" and "text-only" in message, (kind, message)


if __name__ == "__main__":
    _engine_main(sys.argv[1], sys.argv[2])
