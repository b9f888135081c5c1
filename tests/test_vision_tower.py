"""The vision tower (qwen35.vision) against HF transformers' own Qwen3.5 vision classes, fp32, same weights;
its checkpoint mapping (qwen35.vision_checkpoint) and its input / config errors."""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err

from qwen35.checkpoint import CheckpointError
from qwen35.vision import VisionConfig, VisionTower, split_by_image
from qwen35.vision_checkpoint import load_vision_weights, random_vision_tensors

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # fp32 both sides; measured 5-7e-7 (the patch embedding, SDPA and the interpolation sum in another order)

# head_dim 16 (4 rotary frequencies per axis), a 6x6 learned position grid, merge 2
TINY = dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48, patch_size=8,
            temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=36, in_channels=3,
            hidden_act="gelu_pytorch_tanh")
GRIDS = {
    "one image": [[1, 4, 6]],
    "same size twice, then others": [[1, 4, 6], [1, 4, 6], [1, 2, 2], [1, 10, 4]],
    "two frames, a 1-row-of-blocks image": [[2, 4, 4], [1, 2, 12]],
    "larger than the position grid": [[1, 14, 8]],
}


def _hf_tower(moe: bool):
    if moe:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig as Config
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel as Model
    else:
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig as Config
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel as Model
    hc = Config(**TINY)
    hc._attn_implementation = "sdpa"
    return hc, Model(hc).float().eval()


def _pair(moe: bool) -> tuple[object, VisionTower]:
    """HF's tower and ours holding the same random weights (HF's loaded by its own load_state_dict)."""
    hc, hf = _hf_tower(moe)
    cfg = VisionConfig.from_dict({"vision_config": hc.to_dict()})
    weights = random_vision_tensors(cfg, seed=1, prefix="")
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and not [m for m in missing if "inv_freq" not in m], (missing, unexpected)
    ours = VisionTower(cfg, dtype=torch.float32)
    load_vision_weights(ours, weights.items(), prefix="")
    return hf, ours


@pytest.mark.parametrize("moe", [False, True], ids=["Qwen3_5VisionModel", "Qwen3_5MoeVisionModel"])
@pytest.mark.parametrize("grids", list(GRIDS.values()), ids=list(GRIDS))
def test_embeddings_match_hf(moe, grids):
    hf, ours = _pair(moe)
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(-1).sum()), ours.cfg.patch_dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(pixels, grid_thw=grid).pooler_output
        got = ours(pixels, grid)
    assert got.shape == ref.shape == (grid.prod(-1).sum() // 4, TINY["out_hidden_size"])
    assert ref.abs().max() > 0.1  # the reference is not degenerate
    err = rel_err(got, ref)
    assert err <= TOL, f"rel err {err:.3e} > {TOL:.0e}"
    pieces = split_by_image(got, grids, 2)
    assert [p.shape[0] for p in pieces] == [t * h * w // 4 for t, h, w in grids]


def test_images_are_independent():
    """An image's embeddings do not depend on the images batched with it (attention stays within a frame)."""
    _, ours = _pair(False)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(24, ours.cfg.patch_dim, generator=g), torch.randn(16, ours.cfg.patch_dim, generator=g)
    with torch.no_grad():
        alone = ours(a, [[1, 4, 6]])
        together = ours(torch.cat([b, a]), [[1, 4, 4], [1, 4, 6]])
    assert rel_err(together[4:], alone) <= 1e-6


def test_bf16_runs_close_to_fp32():
    hf, ours = _pair(False)
    grid = [[1, 4, 6], [1, 8, 8]]
    pixels = torch.randn(24 + 64, ours.cfg.patch_dim, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = ours(pixels, grid)
        got = ours.to(torch.bfloat16)(pixels, grid)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, ref) <= 3e-2


# ----------------------------------------------------------------------------- checkpoint mapping


def _cfg() -> VisionConfig:
    return VisionConfig(**{k: v for k, v in TINY.items()})


def test_loader_fills_every_parameter_with_the_checkpoint_values():
    cfg = _cfg()
    weights = random_vision_tensors(cfg, seed=5)
    tower = VisionTower(cfg, dtype=torch.float32)
    filled = load_vision_weights(tower, weights.items())
    assert filled == {n for n, _ in tower.named_parameters()}
    assert torch.equal(tower.patch_embed.weight, weights["model.visual.patch_embed.proj.weight"].reshape(64, -1))
    assert torch.equal(tower.blocks[1].attn.qkv.bias, weights["model.visual.blocks.1.attn.qkv.bias"])
    assert torch.equal(tower.merger.linear_fc2.weight, weights["model.visual.merger.linear_fc2.weight"])


def test_loader_names_missing_tensors():
    weights = random_vision_tensors(_cfg())
    del weights["model.visual.blocks.1.mlp.linear_fc2.bias"], weights["model.visual.pos_embed.weight"]
    with pytest.raises(CheckpointError, match=r"missing vision tensors: model\.visual\.blocks\.1\.mlp\.linear_fc2"
                                              r"\.bias, model\.visual\.pos_embed\.weight"):
        load_vision_weights(VisionTower(_cfg()), weights.items())


def test_loader_names_unknown_tensors():
    weights = random_vision_tensors(_cfg())
    weights["model.visual.blocks.2.norm1.weight"] = torch.ones(64)  # depth is 2
    weights["model.visual.deepstack_merger_list.0.norm.weight"] = torch.ones(256)
    with pytest.raises(CheckpointError, match=r"unknown vision tensors .*depth 2\): model\.visual\.blocks\.2\.norm1"
                                              r"\.weight, model\.visual\.deepstack_merger_list"):
        load_vision_weights(VisionTower(_cfg()), weights.items())


def test_loader_names_a_mis_shaped_tensor():
    weights = random_vision_tensors(_cfg())
    weights["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(192, 32)
    with pytest.raises(CheckpointError, match=r"model\.visual\.blocks\.0\.attn\.qkv\.weight has shape \[192, 32\]; "
                                              r"the vision config implies \[192, 64\]"):
        load_vision_weights(VisionTower(_cfg()), weights.items())


# ----------------------------------------------------------------------------- inputs and config


@pytest.mark.parametrize("pixels_shape, grid, match", [
    ((24, 100), [[1, 4, 6]], r"pixel_values has shape \[24, 100\]; expected \[patches, 384\]"),
    ((23, 384), [[1, 4, 6]], r"describes 24 patches, pixel_values has 23"),
    ((15, 384), [[1, 3, 5]], r"grid_thw\[0\]=\(1, 3, 5\): .* multiples of the spatial merge size 2"),
    ((0, 384), [[0, 4, 6]], r"grid_thw\[0\]=\(0, 4, 6\)"),
    ((24, 384), [[4, 6]], r"grid_thw\[0\]=\[4, 6\]: expected \(t, h, w\)"),
])
def test_bad_inputs_are_named(pixels_shape, grid, match):
    with pytest.raises(ValueError, match=match):
        VisionTower(_cfg())(torch.zeros(pixels_shape), grid)


def test_config_from_a_checkpoint_config():
    raw = {"vision_config": {**TINY, "deepstack_visual_indexes": []}, "text_config": {"hidden_size": 48},
           "image_token_id": 7, "vision_start_token_id": 5}
    cfg = VisionConfig.from_dict(raw)
    assert (cfg.head_dim, cfg.patch_dim, cfg.grid_side, cfg.image_token_id, cfg.vision_start_token_id) == \
        (16, 384, 6, 7, 5)
    assert VisionConfig.from_dict({"hidden_size": 8}) is None  # text-only config


@pytest.mark.parametrize("change, match", [
    ({"deepstack_visual_indexes": [1, 2]}, r"deepstack_visual_indexes=\[1, 2\]"),
    ({"num_heads": 5}, r"hidden_size=64 is not divisible by num_heads=5"),
    ({"hidden_size": 24}, r"head_dim=6 .* multiple of 4"),
    ({"num_position_embeddings": 40}, r"num_position_embeddings=40 must be a perfect square"),
    ({"hidden_act": "relu"}, r"hidden_act='relu'; supported"),
    ({"patch_size": [8, 16]}, r"patch_size=\[8, 16\]: only equal sizes"),
    ({"depth": None}, r"vision_config lacks 'depth'"),
])
def test_bad_configs_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        VisionConfig.from_dict({"vision_config": {**TINY, **change}})


def test_out_hidden_size_must_match_the_language_model():
    with pytest.raises(ValueError, match=r"out_hidden_size=48 must equal the language model's hidden_size=128"):
        VisionConfig.from_dict({"vision_config": TINY, "text_config": {"hidden_size": 128}})
