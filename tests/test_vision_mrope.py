"""mrope positions (qwen35.mrope) against HF transformers' Qwen3_5Model.get_rope_index on mixed text + image
prompts, and the interleaved angles against HF's Qwen3_5TextRotaryEmbedding."""

from __future__ import annotations

import random

import pytest
import torch

from qwen35.mrope import decode_positions, find_image_offsets, mrope_angles, mrope_positions
from qwen35.tiny import TinySpec, config_json

transformers = pytest.importorskip("transformers")

RAW = config_json(TinySpec(conditional=True))
IMG, VS, VE = RAW["image_token_id"], RAW["vision_start_token_id"], RAW["vision_end_token_id"]
MERGE = RAW["vision_config"]["spatial_merge_size"]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    return Qwen3_5Model(Qwen3_5Config(**{k: v for k, v in RAW.items() if k != "architectures"})).eval()


def _prompt(grids: list[tuple[int, int, int]], seed: int, text_before: bool = True) -> list[int]:
    """Random text, then each image as <vision_start> image tokens <vision_end> with random text between."""
    rng = random.Random(seed)
    ids = [rng.randrange(0, 900) for _ in range(rng.randrange(1, 6))] if text_before else []
    for t, h, w in grids:
        ids += [VS] + [IMG] * (t * h * w // MERGE**2) + [VE]
        ids += [rng.randrange(0, 900) for _ in range(rng.randrange(0, 4))]
    return ids


def _hf(model, ids: list[int], grids) -> tuple[torch.Tensor, int]:
    x = torch.tensor([ids])
    pos, delta = model.get_rope_index(x, (x == IMG).int(), image_grid_thw=torch.tensor(grids) if grids else None)
    return pos[:, 0], int(delta)


PROMPTS = {
    "one image": [(1, 4, 6)],
    "several images, text between": [(1, 4, 6), (1, 2, 2), (1, 8, 2), (1, 6, 6)],
    "wide and tall": [(1, 2, 14), (1, 12, 2)],
    "two-frame grid": [(2, 4, 4), (1, 2, 2)],
    "text only": [],
}


@pytest.mark.parametrize("grids", list(PROMPTS.values()), ids=list(PROMPTS))
@pytest.mark.parametrize("seed", [0, 1])
def test_positions_match_hf_get_rope_index(hf_model, grids, seed):
    ids = _prompt(grids, seed)
    ref, ref_delta = _hf(hf_model, ids, grids)
    got, delta = mrope_positions(ids, grids, MERGE, IMG)
    assert got.dtype == torch.int64 and got.shape == (3, len(ids))
    assert torch.equal(got, ref)
    assert delta == ref_delta
    if grids:
        assert delta <= 0  # an image advances the position by its longer side, at most its token count


def test_prompt_starting_with_an_image(hf_model):
    grids = [(1, 4, 4), (1, 2, 6)]
    ids = _prompt(grids, 3, text_before=False)[1:]  # the first image token is token 0
    ref, ref_delta = _hf(hf_model, ids, grids)
    got, delta = mrope_positions(ids, grids, MERGE, IMG)
    assert torch.equal(got, ref) and delta == ref_delta


def test_given_offsets_give_the_same_positions():
    grids = PROMPTS["several images, text between"]
    ids = _prompt(grids, 4)
    offsets = find_image_offsets(ids, grids, MERGE, IMG)
    assert [ids[o - 1] for o in offsets] == [VS] * len(grids)
    assert torch.equal(mrope_positions(ids, grids, MERGE, IMG, image_offsets=offsets)[0],
                       mrope_positions(ids, grids, MERGE, IMG)[0])


def test_adjacent_images_split_by_their_grids():
    """Two images with nothing between them share one run of image tokens; the grids cut it."""
    ids = [3, 4] + [IMG] * 3 + [IMG] * 2 + [5]  # a 1x3 then a 2x1 merged grid
    pos, delta = mrope_positions(ids, [(1, 2, 6), (1, 4, 2)], MERGE, IMG)
    first = [[2, 2, 2], [2, 2, 2], [2, 3, 4]]  # (t, row, col) + 2
    second = [[5, 5], [5, 6], [5, 5]]  # from 2 + max(1, 3) = 5
    assert pos[:, 2:5].tolist() == first and pos[:, 5:7].tolist() == second
    assert pos[:, 7].tolist() == [7, 7, 7] and delta == 8 - len(ids)


def test_decode_positions_continue_the_prompt():
    """A token generated after the prompt sits where the same token as prompt text would."""
    grids = PROMPTS["several images, text between"]
    ids = _prompt(grids, 5)
    _, delta = mrope_positions(ids, grids, MERGE, IMG)
    longer, _ = mrope_positions(ids + [7, 8, 9], grids, MERGE, IMG)
    assert torch.equal(decode_positions(len(ids), 3, delta), longer[:, len(ids):])


@pytest.mark.parametrize("ids, grids, offsets, match", [
    ([1, IMG, IMG, 2], [(1, 4, 4)], None, r"holds 2 image tokens \(id 1000\); the 1 image grid\(s\) need 4"),
    ([1, IMG, IMG, 2, IMG, IMG], [(1, 4, 4)], None, r"image 0 needs 4 consecutive image tokens from index 1"),
    ([1, IMG, IMG, IMG, IMG], [(1, 4, 4)], [0], r"image 0: tokens 0\.\.3 are not all the image token 1000"),
    ([IMG] * 8, [(1, 4, 4), (1, 4, 4)], [0, 2], r"image 1 at token 2 with 4 tokens overlaps"),
    ([IMG] * 4, [(1, 3, 4)], None, r"image_grid_thw\[0\]=\(1, 3, 4\): .* multiples of spatial_merge_size=2"),
    ([IMG] * 4, [(1, 4, 4)], [0, 4], r"2 image offsets for 1 image grids"),
])
def test_bad_prompts_are_named(ids, grids, offsets, match):
    with pytest.raises(ValueError, match=match):
        mrope_positions(ids, grids, MERGE, IMG, image_offsets=offsets)


# ----------------------------------------------------------------------------- angles


@pytest.mark.parametrize("head_dim, theta", [(256, 1e7), (64, 1e4)], ids=["Qwen3.5 size", "tiny"])
def test_angles_match_hf_text_rotary(head_dim, theta):
    """cos/sin of our angles equal HF's interleaved mrope (the tiny rotary dim of 16 cuts the sections short,
    as HF does)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    section = [11, 11, 10]
    tc = Qwen3_5TextConfig(head_dim=head_dim, rope_parameters={
        "rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25, "mrope_section": section,
        "mrope_interleaved": True})
    hf = Qwen3_5TextRotaryEmbedding(tc)
    grids = PROMPTS["several images, text between"]
    ids = _prompt(grids, 6)
    pos, _ = mrope_positions(ids, grids, MERGE, IMG)
    ref_cos, ref_sin = hf(torch.zeros(1), pos[:, None, :])
    angles = mrope_angles(pos, hf.inv_freq, section)
    assert angles.shape == (len(ids), head_dim // 8)
    torch.testing.assert_close(torch.cat([angles.cos()] * 2, -1), ref_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([angles.sin()] * 2, -1), ref_sin[0], rtol=0, atol=0)
    text = torch.arange(10)
    assert torch.equal(mrope_angles(text.expand(3, -1), hf.inv_freq, section), mrope_angles(text, hf.inv_freq))
