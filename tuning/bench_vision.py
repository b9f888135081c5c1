"""Vision benchmark: our Qwen3.5 vision tower (qwen35.vision) against HF transformers' ``Qwen3_5VisionModel``.

    python -m tuning.bench_vision --out DIR [--quick]       # H200, bf16, the real tower's size
    python -m tuning.bench_vision --out DIR --tiny          # CPU smoke run: tiny tower, small images, fp32

Tower: Qwen3.5's (depth 27, hidden 1152, MLP 4304, 16 heads, patch 16, temporal patch 2, merge 2, 48x48 learned
positions) projecting to a 2048-wide language model (Qwen3.5-35B-A3B's), random weights made by
:func:`qwen35.vision_checkpoint.random_vision_tensors` and loaded into both towers (same tensors on each side).

Rows:
- ``agreement``: our merged embeddings vs HF's on one batch of mixed sizes, relative error (fp32 reference too);
- ``encode``: images/s for B square images of S x S pixels (S = 448: 784 patches / 196 tokens per image;
  S = 1024: 4096 patches / 1024 tokens), one forward from pixel rows to merged embeddings; anchor = HF's tower
  (SDPA attention) on the same input; ``tflops`` = the forward's matmul + attention FLOPs over our time;
- ``preprocess``: images/s of our CPU image processor on one S x S RGB image, anchor = HF's PIL processor.
Benchmarks report; they never assert times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from tuning import _bench

TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048, patch_size=16,
             temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304, in_channels=3,
             hidden_act="gelu_pytorch_tanh")
TINY_TOWER = dict(TOWER, depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=96,
                  num_position_embeddings=64)
FULL = dict(sizes={448: [1, 8, 32], 1024: [1, 4, 8]}, rep=20)
QUICK = dict(sizes={448: [1, 8], 1024: [1, 4]}, rep=10)
TINY = dict(sizes={64: [1, 2], 128: [1]}, rep=2)


def build(tower: dict, device: str, dtype: torch.dtype, with_hf: bool):
    """(our tower, HF's tower or None) holding the same random weights."""
    from qwen35.vision import VisionConfig, VisionTower
    from qwen35.vision_checkpoint import load_vision_weights, random_vision_tensors

    cfg = VisionConfig.from_dict({"vision_config": tower})
    weights = random_vision_tensors(cfg, seed=0, prefix="")
    ours = VisionTower(cfg, dtype=dtype, device=device).eval()
    load_vision_weights(ours, weights.items(), prefix="")
    hf = None
    if with_hf:
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        hc = Qwen3_5VisionConfig(**tower)
        hc._attn_implementation = "sdpa"
        hf = Qwen3_5VisionModel(hc).eval()
        hf.load_state_dict(weights, strict=False)
        hf = hf.to(device=device, dtype=dtype)
    return ours, hf


def square_batch(cfg, size: int, batch: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel rows and grid_thw of ``batch`` images of ``size`` x ``size`` (size a multiple of patch * merge)."""
    side = size // cfg.patch_size
    grid = torch.tensor([[1, side, side]] * batch, device=device)
    g = torch.Generator().manual_seed(size * 100 + batch)
    return torch.randn(batch * side * side, cfg.patch_dim, generator=g).to(device), grid


def forward_flops(cfg, size: int, batch: int) -> float:
    """Matmul and attention FLOPs of one forward (multiply-adds x 2)."""
    n = (size // cfg.patch_size) ** 2
    D, I, M = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.merge_unit
    per_block = 2 * n * (3 * D * D + D * D + 2 * D * I) + 4 * n * n * D
    merger = 2 * (n // cfg.merge_unit) * (M * M + M * cfg.out_hidden_size)
    return batch * (2 * n * cfg.patch_dim * D + cfg.depth * per_block + merger)


def time_call_ms(fn, device: str, rep: int) -> float:
    if device == "cuda":
        return _bench.time_ms(fn, warmup=3, rep=rep)
    fn()
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def agreement(ours, hf, tower: dict, device: str, dtype: torch.dtype) -> list[dict]:
    """Our embeddings vs HF's on one mixed batch, in the benchmark dtype and in fp32."""
    cfg = ours.cfg
    f = cfg.patch_size * cfg.spatial_merge_size
    grid = torch.tensor([[1, 448 // cfg.patch_size, 448 // cfg.patch_size], [1, 2 * f // cfg.patch_size,
                         6 * f // cfg.patch_size], [1, 1024 // cfg.patch_size, 512 // cfg.patch_size]], device=device)
    g = torch.Generator().manual_seed(7)
    pixels = torch.randn(int(grid.prod(-1).sum()), cfg.patch_dim, generator=g).to(device)
    rows = []
    for dt in dict.fromkeys([dtype, torch.float32]):
        o, h = ours.to(dt), hf.to(dt)
        with torch.no_grad():
            err = _rel_err(o(pixels, grid), h(pixels, grid_thw=grid).pooler_output)
        rows.append(_bench.row("agreement", f"{grid.tolist()}", str(dt).replace("torch.", ""), 0.0, anchor="hf",
                               rel_err=err))
    ours.to(dtype)
    hf.to(dtype)
    return rows


def encode_rows(ours, hf, sizes: dict, device: str, dtype: torch.dtype, rep: int) -> list[dict]:
    cfg, rows = ours.cfg, []
    for size, batches in sizes.items():
        for batch in batches:
            pixels, grid = square_batch(cfg, size, batch, device)
            with torch.no_grad():
                ms = time_call_ms(lambda p=pixels, g=grid: ours(p, g), device, rep)
                hf_ms = None if hf is None else time_call_ms(
                    lambda p=pixels, g=grid: hf(p, grid_thw=g).pooler_output, device, rep)
            rows.append(_bench.row(
                "encode", f"{batch}x{size}^2", str(dtype).replace("torch.", ""), ms, anchor="hf" if hf else None,
                anchor_ms=hf_ms, images_per_s=round(batch / ms * 1e3, 2),
                hf_images_per_s=None if hf_ms is None else round(batch / hf_ms * 1e3, 2),
                tokens_per_image=(size // cfg.patch_size) ** 2 // cfg.merge_unit,
                tflops=round(forward_flops(cfg, size, batch) / ms / 1e9, 1)))
            print(_bench.format_table(rows[-1:], ["op", "shape", "ours_ms", "anchor_ms", "images_per_s",
                                                  "hf_images_per_s", "speedup"]).splitlines()[-1], flush=True)
    return rows


def preprocess_rows(sizes: list[int], rep: int, with_hf: bool) -> list[dict]:
    from PIL import Image

    from qwen35.image_processor import ImageProcessorConfig, preprocess

    cfg, rows = ImageProcessorConfig(), []
    hf = None
    if with_hf:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        hf = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                      image_std=[0.5] * 3, size={"shortest_edge": cfg.min_pixels,
                                                                 "longest_edge": cfg.max_pixels})
    for size in sizes:
        image = Image.fromarray(np.random.default_rng(size).integers(0, 256, (size, size, 3), dtype=np.uint8))
        ms = time_call_ms(lambda im=image: preprocess([im], cfg), "cpu", rep)
        hf_ms = None if hf is None else time_call_ms(lambda im=image: hf(im, return_tensors="pt"), "cpu", rep)
        rows.append(_bench.row("preprocess", f"1x{size}^2", "fp32", ms, anchor="hf-pil" if hf else None,
                               anchor_ms=hf_ms, images_per_s=round(1e3 / ms, 2),
                               hf_images_per_s=None if hf_ms is None else round(1e3 / hf_ms, 2)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_vision", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for vision.json (none: print only)")
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes and repetitions")
    ap.add_argument("--tiny", action="store_true", help="tiny tower, small images, fp32: a CPU smoke run")
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers' tower (no anchor)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device == "cpu" and not args.tiny:
        ap.error("the full-size benchmark needs a CUDA device; use --tiny on CPU")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    plan, tower = (TINY, TINY_TOWER) if args.tiny else (QUICK if args.quick else FULL, TOWER)
    ours, hf = build(tower, device, dtype, with_hf=not args.no_hf)
    rows = agreement(ours, hf, tower, device, dtype) if hf is not None else []
    rows += encode_rows(ours, hf, plan["sizes"], device, dtype, plan["rep"])
    rows += preprocess_rows(list(plan["sizes"]), 2 if args.tiny else 5, with_hf=not args.no_hf)
    columns = ["op", "shape", "dtype", "ours_ms", "anchor_ms", "speedup", "images_per_s", "hf_images_per_s",
               "tflops", "rel_err"]
    print(_bench.format_table(rows, columns))
    if args.out:
        meta = {"tower": tower, "device": device, "hf_attention": "sdpa", "tiny": args.tiny}
        print(_bench.write_results(args.out, "vision", rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
