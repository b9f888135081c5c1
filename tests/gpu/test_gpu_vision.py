"""The vision tower on a CUDA GPU at Qwen3.5's width (4 of its 27 blocks; skipped without CUDA).

fp32: ours against HF transformers' ``Qwen3_5VisionModel`` on the same GPU (both SDPA), relative error 1e-4.
bf16: ours against our fp64 tower (ground truth), budget 3e-2, with HF's bf16 error printed beside it.
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err

from qwen35.vision import VisionConfig, VisionTower
from qwen35.vision_checkpoint import load_vision_weights, random_vision_tensors

pytestmark = pytest.mark.gpu

DEV = "cuda"
WIDTH = dict(depth=4, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048, patch_size=16,
             temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304, in_channels=3,
             hidden_act="gelu_pytorch_tanh")
GRID = [[1, 28, 28], [1, 28, 28], [1, 64, 64], [1, 20, 90]]  # 448^2 twice, 1024^2, 320x1440


def _ours(dtype: torch.dtype) -> VisionTower:
    cfg = VisionConfig.from_dict({"vision_config": WIDTH})
    tower = VisionTower(cfg, dtype=dtype, device=DEV).eval()
    load_vision_weights(tower, random_vision_tensors(cfg, seed=0).items())
    return tower


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(GRID, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(1)
    return torch.randn(int(grid.prod(-1).sum()), 1536, generator=g, device=DEV), grid


def test_fp32_matches_hf_on_gpu(monkeypatch):
    # HF's patch embedding is a Conv3d, which cuDNN runs in TF32 by default (about 2.7e-4 off here); ours is a
    # linear map in full fp32. Compare fp32 with fp32.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    assert transformers
    hc = Qwen3_5VisionConfig(**WIDTH)
    hc._attn_implementation = "sdpa"
    hf = Qwen3_5VisionModel(hc).eval()
    hf.load_state_dict(random_vision_tensors(VisionConfig.from_dict({"vision_config": WIDTH}), seed=0, prefix=""),
                       strict=False)
    hf = hf.to(DEV, torch.float32)
    pixels, grid = _inputs()
    with torch.no_grad():
        ref = hf(pixels, grid_thw=grid).pooler_output
        got = _ours(torch.float32)(pixels, grid)
    err = rel_err(got, ref)
    assert err <= 1e-4, f"fp32 rel err {err:.3e}"


def test_bf16_within_budget_of_fp64():
    pixels, grid = _inputs()
    with torch.no_grad():
        ref = _ours(torch.float64)(pixels.double(), grid)
        got = _ours(torch.bfloat16)(pixels, grid)
    err = rel_err(got, ref)
    print(f"bf16 tower vs fp64: rel err {err:.3e}")
    assert err <= 3e-2, f"bf16 rel err {err:.3e}"
