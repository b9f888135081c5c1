"""The torchvision-free image processor (qwen35.image_processor) against HF transformers' Qwen2VLImageProcessorPil
(the processor Qwen3-VL / Qwen3.5 checkpoints name; its fast variant needs torchvision), and the bad-image
errors a server answers 400 with."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from qwen35.image_processor import (
    ImageInputError,
    ImageLimits,
    ImageProcessorConfig,
    decode_image,
    load_image,
    num_image_tokens,
    preprocess,
    to_rgb,
)

transformers = pytest.importorskip("transformers")

# Qwen3-VL / Qwen3.5's preprocessor_config.json fields
QWEN35_PREPROCESSOR = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
                       "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast"}
SMALL_BOUNDS = {**QWEN35_PREPROCESSOR, "size": {"shortest_edge": 64 * 64, "longest_edge": 512 * 512}}
CLIP_NORM = {**SMALL_BOUNDS, "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711]}


def _hf(raw: dict):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    keys = ("size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    return Qwen2VLImageProcessorPil(**{k: raw[k] for k in keys})


def _noise(h: int, w: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


SIZES = {
    "1x1": (1, 1), "3x5": (3, 5), "32x32": (32, 32), "100x150": (100, 150), "47x333": (47, 333),
    "17x3000 (aspect 176)": (17, 3000), "3000x17": (3000, 17), "1600x1200 (downscaled)": (1600, 1200),
}


@pytest.mark.parametrize("raw", [QWEN35_PREPROCESSOR, SMALL_BOUNDS, CLIP_NORM],
                         ids=["qwen3.5 bounds", "small bounds", "clip mean/std"])
@pytest.mark.parametrize("hw", list(SIZES.values()), ids=list(SIZES))
def test_matches_hf_processor(raw, hw):
    image = _noise(*hw, seed=hw[0] * 7 + hw[1])
    ref = _hf(raw)(image, return_tensors="pt")
    got = preprocess([image], ImageProcessorConfig.from_dict(raw))
    assert got.grid_thw.tolist() == ref["image_grid_thw"].tolist()
    assert got.pixel_values.dtype == torch.float32
    assert torch.equal(got.pixel_values, ref["pixel_values"])  # bit for bit: same PIL resize, same fp ops
    t, h, w = got.grid_thw[0].tolist()
    assert got.num_tokens == [h * w // 4] == [num_image_tokens(*hw, ImageProcessorConfig.from_dict(raw))]
    hf_patches = _hf(raw).get_number_of_image_patches(*hw, {})
    assert got.num_tokens[0] == hf_patches // 4


@pytest.mark.slow
def test_matches_hf_on_an_image_above_max_pixels():
    """4800x3600 = 17.3 MP is over Qwen3.5's 16.7 MP bound: scaled down by both (seconds of CPU on each side)."""
    image = _noise(3600, 4800, seed=9)
    ref = _hf(QWEN35_PREPROCESSOR)(image, return_tensors="pt")
    got = preprocess([image], ImageProcessorConfig.from_dict(QWEN35_PREPROCESSOR))
    assert got.grid_thw.tolist() == ref["image_grid_thw"].tolist() == [[1, 220, 294]]
    assert torch.equal(got.pixel_values, ref["pixel_values"])


def test_several_images_concatenate():
    images = [_noise(40, 90, 1), _noise(200, 64, 2), _noise(64, 64, 3)]
    raw = SMALL_BOUNDS
    ref = _hf(raw)(images, return_tensors="pt")
    got = preprocess(images, ImageProcessorConfig.from_dict(raw))
    assert got.grid_thw.tolist() == ref["image_grid_thw"].tolist()
    assert torch.equal(got.pixel_values, ref["pixel_values"])
    assert sum(got.num_tokens) * 4 == got.pixel_values.shape[0]


@pytest.mark.parametrize("mode", ["L", "P"])
def test_grayscale_and_palette_images_match_hf(mode):
    image = _noise(60, 80, 4, "L") if mode == "L" else _noise(60, 80, 4).convert("P")
    ref = _hf(SMALL_BOUNDS)(image, return_tensors="pt")
    got = preprocess([image], ImageProcessorConfig.from_dict(SMALL_BOUNDS))
    assert torch.equal(got.pixel_values, ref["pixel_values"])


def test_transparency_is_composited_on_white():
    """As vLLM's media loader does (HF's processor, called on RGBA directly, drops alpha instead): transparent
    pixels become white, opaque ones keep their colour."""
    arr = np.zeros((4, 4, 4), np.uint8)
    arr[..., 0] = 200
    arr[:2, :, 3] = 255  # top half opaque red, bottom half fully transparent
    rgb = np.asarray(to_rgb(Image.fromarray(arr, "RGBA")))
    assert (rgb[:2] == [200, 0, 0]).all() and (rgb[2:] == 255).all()
    image = Image.fromarray(arr, "RGBA").resize((64, 64))
    ref = _hf(SMALL_BOUNDS)(to_rgb(image), return_tensors="pt")
    assert torch.equal(preprocess([image], ImageProcessorConfig.from_dict(SMALL_BOUNDS)).pixel_values,
                       ref["pixel_values"])


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_encoded_formats_decode_to_the_pixels_pil_reads(fmt):
    image = _noise(48, 72, 5)
    data = _encode(image, fmt)
    decoded = Image.open(io.BytesIO(data)).convert("RGB")
    ref = _hf(SMALL_BOUNDS)(decoded, return_tensors="pt")
    for source in (data, f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()):
        got = preprocess([source], ImageProcessorConfig.from_dict(SMALL_BOUNDS))
        assert torch.equal(got.pixel_values, ref["pixel_values"])


def test_exif_orientation_is_applied():
    image = _noise(30, 50, 6)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    decoded = decode_image(_encode(image, "JPEG", exif=exif.tobytes()))
    assert decoded.size == (30, 50)


def test_config_from_preprocessor_config_fields():
    cfg = ImageProcessorConfig.from_dict({"min_pixels": 3136, "max_pixels": 1003520, "patch_size": 14})
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size, cfg.factor) == (3136, 1003520, 14, 28)
    cfg = ImageProcessorConfig.from_dict(QWEN35_PREPROCESSOR)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.factor, cfg.patch_dim) == (65536, 16777216, 32, 1536)


@pytest.mark.parametrize("change, match", [
    ({"do_normalize": False}, r"do_normalize=False is not supported"),
    ({"rescale_factor": 1.0}, r"rescale_factor=1.0 is not supported"),
    ({"size": {"shortest_edge": 0, "longest_edge": 100}}, r"min_pixels=0 must be positive"),
    ({"size": {"shortest_edge": 4096, "longest_edge": 1000}}, r"max_pixels=1000 must be >= min_pixels=4096"),
    ({"image_std": [0.5, 0.0, 0.5]}, r"std positive"),
])
def test_bad_processor_configs_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        ImageProcessorConfig.from_dict({**QWEN35_PREPROCESSOR, **change})


# ----------------------------------------------------------------------------- bad images


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (no pixel data): what a decompression bomb looks like."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


PNG = _encode(_noise(40, 30, 7), "PNG")
JPEG = _encode(_noise(40, 30, 7), "JPEG")
BAD = {
    "truncated PNG": (PNG[: len(PNG) // 2], None, r"corrupt PNG image: image file is truncated"),
    "truncated JPEG": (JPEG[: len(JPEG) * 2 // 3], None, r"corrupt JPEG image"),
    "text bytes": (b"just some text, no picture", None,
                   r"not an image, or its header is corrupt \(no image format recognises it\)"),
    "empty": (b"", None, r"empty image data"),
    "PPM (unsupported)": (_encode(_noise(8, 8), "PPM"), None,
                          r"unsupported image format PPM; accepted: PNG, JPEG, WEBP, GIF, BMP, TIFF"),
    "TGA (unsupported)": (_encode(_noise(8, 8), "TGA"), None, r"unsupported image format TGA"),
    "over the pixel limit": (PNG, ImageLimits(max_pixels=1000), r"30x40 = 1200 pixels exceeds the limit of 1000"),
    "over the byte limit": (PNG, ImageLimits(max_bytes=100), rf"image of {len(PNG)} bytes exceeds the limit of 100"),
    "decompression bomb header": (_png_header_only(60000, 60000), None, r"60000x60000 = 3600000000 pixels exceeds|"
                                                                        r"too large"),
    "data: URL of text": ("data:text/plain;base64,aGVsbG8=", None, r"media type 'text/plain'; an image/\* type"),
    "data: URL without base64": ("data:image/png,abc", None, r"not base64-encoded"),
    "data: URL with bad base64": ("data:image/png;base64,@@@@", None, r"invalid base64"),
    "data: URL of non-image bytes": ("data:image/png;base64," + base64.b64encode(b"nope").decode(), None,
                                     r"not an image"),
    "data: URL over the byte limit": ("data:image/png;base64," + "A" * 400, ImageLimits(max_bytes=100),
                                      r"about 300 bytes exceeds the limit of 100 bytes"),
    "malformed data: URL": ("data:image/png;base64", None, r"malformed data: URL"),
    "http URL": ("https://example.com/cat.png", None, r"only data: URLs are decoded here"),
    "aspect ratio 250": (_encode(_noise(2, 500), "PNG"), None, r"500x2 has an aspect ratio of 250\.0; at most 200"),
    "float array": (np.zeros((8, 8, 3), np.float32), None, r"\[H, W, 3\] uint8, got shape \[8, 8, 3\] dtype float32"),
    "a list": ([1, 2, 3], None, r"cannot read an image from list"),
}


@pytest.mark.parametrize("source, limits, match", list(BAD.values()), ids=list(BAD))
def test_bad_images_raise_one_error_type_naming_the_problem(source, limits, match):
    cfg = ImageProcessorConfig(limits=limits or ImageLimits())
    with pytest.raises(ImageInputError, match=match):
        preprocess([source], cfg)


def test_load_image_limits_apply_to_pil_input():
    with pytest.raises(ImageInputError, match=r"40x30 = 1200 pixels exceeds the limit of 100 pixels"):
        load_image(_noise(30, 40), ImageLimits(max_pixels=100))


def test_no_images_is_an_error():
    with pytest.raises(ImageInputError, match="no images"):
        preprocess([])
