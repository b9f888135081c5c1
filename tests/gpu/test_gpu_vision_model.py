"""Prompts with images through the standalone host on a CUDA GPU (skipped without CUDA): the tiny
vision-language checkpoint's logits against the same prompt on the CPU (fp32 reference ops), and a captured
decode step continuing an image prompt at ``index + delta``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import rel_err
from PIL import Image

from qwen35.standalone import Qwen35Standalone
from qwen35.tiny import TinySpec, config_json, write_checkpoint

pytestmark = pytest.mark.gpu

RAW = config_json(TinySpec(conditional=True))
IMG, VS, VE = RAW["image_token_id"], RAW["vision_start_token_id"], RAW["vision_end_token_id"]
FP32_TOL = 2e-3  # GPU kernels may run fp32 matmuls in tf32
BF16_TOL = 3e-2
GRAPH_TOL = 1e-5  # same device, same kernels: graph replay against eager steps


def _noise(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


IMAGES = [_noise(70, 100, 0), _noise(150, 60, 1)]


def _prompt(n_images: int, tail: int) -> list[int]:
    ids = [5, 6, 7]
    for i in range(n_images):
        ids += [VS, IMG, VE, 20 + i]
    return ids + [(37 * j + 11) % 900 for j in range(tail)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("vl"), TinySpec(conditional=True))


def _prefill_and_decode(m: Qwen35Standalone) -> list[torch.Tensor]:
    """All prefill logits of a two-image prompt, then the logits of 4 decode steps."""
    slot = m.allocate(1)
    ids = m.attach_images(slot[0], _prompt(2, 70), IMAGES)
    out = [m.step(slot, [ids], all_logits=True).cpu()]
    out += [m.step(slot, [[t]]).cpu() for t in (4, 5, 6, 7)]
    m.release(slot)
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)], ids=["fp32", "bf16"])
def test_image_prompt_on_gpu_matches_cpu(ckpt, dtype, tol):
    ref = _prefill_and_decode(Qwen35Standalone.from_pretrained(ckpt, max_seqs=1, max_len=256))
    got = _prefill_and_decode(Qwen35Standalone.from_pretrained(ckpt, device="cuda", dtype=dtype, max_seqs=1,
                                                               max_len=256))
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        err = rel_err(a, b)
        assert err <= tol, f"{'prefill' if i == 0 else f'decode {i}'}: rel err {err:.3e} > {tol:g}"


def test_decode_graph_continues_an_image_prompt(ckpt):
    from qwen35 import probe

    m = Qwen35Standalone.from_pretrained(ckpt, device="cuda", max_seqs=2, max_len=128)
    on_reference = [r["op"] for r in probe.report("cuda")["ops"] if r["backend"] == "reference"]
    if on_reference:
        pytest.skip(f"the reference backend (host syncs, not capturable) serves {on_reference}")
    prompts, images = [_prompt(1, 4), _prompt(0, 9)], [IMAGES[:1], None]

    def prefill(slots: list[int]) -> None:
        ids = [m.attach_images(s, p, im) if im else p for s, p, im in zip(slots, prompts, images, strict=True)]
        m.step(slots, ids)

    slots = m.allocate(2)
    prefill(slots)
    expected = [m.step(slots, [[t], [t]]) for t in (4, 5, 6)]
    m.release(slots)
    slots = m.allocate(2)
    prefill(slots)
    assert m._images[slots[0]].delta < 0  # the image prompt's decode positions are shifted
    graph = m.capture_decode(slots)
    for t, want in zip((4, 5, 6), expected, strict=True):
        err = rel_err(graph.step([t, t]), want)
        assert err <= GRAPH_TOL, f"graph step: rel err {err:.3e}"
