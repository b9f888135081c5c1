"""Images -> the vision tower's input, with PIL and numpy only (no torchvision).

Two stages:

1. **Decoding** untrusted input (:func:`load_image`: raw bytes, a ``data:`` URL, a PIL image or an ``HxWx3``
   uint8 array) into an RGB PIL image. Encoded bytes are checked against :class:`ImageLimits` (size in bytes,
   pixel count read from the header before any pixel is decoded, an allowlist of formats), decoded, turned
   upright by their EXIF orientation and, when they carry transparency, composited onto white: the same pixels
   vLLM's media loader hands a model, so both hosts see one image. Every failure raises
   :class:`ImageInputError` with a message naming the problem (what a server answers 400 with).
2. **Preprocessing** (:func:`preprocess`), as HF transformers 5.19's ``Qwen2VLImageProcessorPil`` (the processor
   Qwen3-VL and Qwen3.5 checkpoints name) does it: resize with PIL's bicubic filter to the nearest size whose
   sides are multiples of ``patch_size * merge_size`` and whose area lies within ``[min_pixels, max_pixels]``
   (:func:`smart_resize`), scale to [0, 1], normalise by mean/std, and cut into patch rows in the layout
   :mod:`qwen35.vision` takes (each patch repeated ``temporal_patch_size`` times: an image is a one-frame clip).
   On RGB input the result equals HF's bit for bit.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, ImageOps

if TYPE_CHECKING:
    from qwen35.vision import VisionConfig

MAX_ASPECT_RATIO = 200  # HF's smart_resize refuses longer / shorter sides beyond this ratio
# Still-image formats a chat client sends (the ones OpenAI's API takes, plus BMP and TIFF).
DEFAULT_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


class ImageInputError(ValueError):
    """An image that cannot be used: corrupt, not an image, unsupported format, too large, bad data URL."""


@dataclass(frozen=True)
class ImageLimits:
    """What :func:`load_image` accepts from untrusted input."""

    max_bytes: int = 20 * 1024 * 1024  # encoded size
    max_pixels: int = 8192 * 8192  # width * height before resizing, read from the header
    formats: tuple[str, ...] = DEFAULT_FORMATS  # PIL format names


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The preprocessing parameters (HF ``preprocessor_config.json``); defaults are Qwen3-VL / Qwen3.5's."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 256 * 256
    max_pixels: int = 4096 * 4096
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resample: int = int(Image.Resampling.BICUBIC)
    limits: ImageLimits = field(default_factory=ImageLimits)

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"image processor {name}={getattr(self, name)} must be positive")
        if self.max_pixels < max(self.min_pixels, self.factor**2):
            raise ValueError(f"image processor max_pixels={self.max_pixels} must be >= min_pixels={self.min_pixels} "
                             f"and >= (patch_size * merge_size)^2 = {self.factor**2}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError(f"image_mean={list(self.image_mean)} / image_std={list(self.image_std)}: expected three "
                             "values each, std positive")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers ``factor x factor`` pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_dict(cls, raw: dict, limits: ImageLimits | None = None) -> ImageProcessorConfig:
        """From a ``preprocessor_config.json`` dict (``size.shortest_edge`` / ``size.longest_edge`` or the older
        ``min_pixels`` / ``max_pixels``); ValueError for settings this processor does not implement."""
        for key, want in (("do_resize", True), ("do_rescale", True), ("do_normalize", True),
                          ("do_convert_rgb", True)):
            if raw.get(key, want) is not want:
                raise ValueError(f"preprocessor_config {key}={raw[key]!r} is not supported (only {want})")
        if not math.isclose(float(raw.get("rescale_factor", 1 / 255)), 1 / 255):
            raise ValueError(f"preprocessor_config rescale_factor={raw['rescale_factor']} is not supported (1/255)")
        size = raw.get("size") or {}
        d = cls()
        kw = dict(
            patch_size=int(raw.get("patch_size", d.patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", d.temporal_patch_size)),
            merge_size=int(raw.get("merge_size", d.merge_size)),
            min_pixels=int(size.get("shortest_edge", raw.get("min_pixels", d.min_pixels))),
            max_pixels=int(size.get("longest_edge", raw.get("max_pixels", d.max_pixels))),
            image_mean=tuple(float(x) for x in raw.get("image_mean", d.image_mean)),
            image_std=tuple(float(x) for x in raw.get("image_std", d.image_std)),
            resample=int(raw.get("resample", d.resample)),
        )
        return cls(**kw, limits=limits or ImageLimits())

    @classmethod
    def for_tower(cls, tower: VisionConfig, given: ImageProcessorConfig | None = None) -> ImageProcessorConfig:
        """``given`` (else the defaults at the tower's patch sizes), checked against the tower: ValueError unless
        its patch, temporal-patch and merge sizes are the tower's (``preprocessor_config.json`` against
        ``config.json``'s ``vision_config``)."""
        sizes = (tower.patch_size, tower.temporal_patch_size, tower.spatial_merge_size)
        if given is None:
            return cls(patch_size=sizes[0], temporal_patch_size=sizes[1], merge_size=sizes[2])
        mine = (given.patch_size, given.temporal_patch_size, given.merge_size)
        if mine != sizes:
            raise ValueError(f"image processor (patch_size, temporal_patch_size, merge_size)={mine} differs from the "
                             f"vision tower's {sizes} (preprocessor_config.json vs config.json's vision_config)")
        return given

    @classmethod
    def from_dir(cls, path: str | os.PathLike, limits: ImageLimits | None = None) -> ImageProcessorConfig:
        """From ``preprocessor_config.json`` in a checkpoint directory; the defaults when it has none."""
        file = os.path.join(path, "preprocessor_config.json")
        if not os.path.isfile(file):
            return cls(limits=limits or ImageLimits())
        with open(file) as f:
            return cls.from_dict(json.load(f), limits)


@dataclass
class ProcessedImages:
    """The tower's input for a list of images."""

    pixel_values: torch.Tensor  # [patches, 3 * temporal_patch_size * patch_size^2] fp32
    grid_thw: torch.Tensor  # [images, 3] int64: frames (1), patch rows, patch columns
    num_tokens: list[int]  # placeholder tokens per image: h * w / merge^2


# ----------------------------------------------------------------------------- decoding


_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)", re.DOTALL)


def decode_data_url(url: str, limits: ImageLimits | None = None) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL; ImageInputError for anything else."""
    limits = limits or ImageLimits()
    m = _DATA_URL.fullmatch(url.strip())
    if m is None:
        raise ImageInputError("malformed data: URL (expected data:image/<type>;base64,<data>)")
    mime = m.group("mime").strip().lower()
    if not mime.startswith("image/"):
        raise ImageInputError(f"data: URL has media type {mime or 'text/plain'!r}; an image/* type is required")
    if "base64" not in [p.strip().lower() for p in m.group("params").split(";")]:
        raise ImageInputError("data: URL is not base64-encoded (expected ';base64,')")
    payload = re.sub(r"\s+", "", m.group("data"))
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise ImageInputError(f"image of about {len(payload) * 3 // 4} bytes exceeds the limit of "
                              f"{limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageInputError(f"data: URL holds invalid base64 ({e})") from None


def decode_image(data: bytes, limits: ImageLimits | None = None) -> Image.Image:
    """Encoded image bytes -> an upright RGB PIL image (see the module docstring); ImageInputError naming the
    problem: too many bytes, not an image, a format outside ``limits.formats``, too many pixels, corrupt data."""
    limits = limits or ImageLimits()
    if len(data) > limits.max_bytes:
        raise ImageInputError(f"image of {len(data)} bytes exceeds the limit of {limits.max_bytes} bytes")
    if not data:
        raise ImageInputError("empty image data")
    try:
        image = Image.open(io.BytesIO(data), formats=list(limits.formats))
    except Image.DecompressionBombError as e:
        raise ImageInputError(f"image is too large ({e})") from None
    except (Image.UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ImageInputError(_not_accepted(data, limits)) from None
    w, h = image.size
    if w * h > limits.max_pixels:
        raise ImageInputError(f"image of {w}x{h} = {w * h} pixels exceeds the limit of {limits.max_pixels} pixels")
    if w <= 0 or h <= 0:
        raise ImageInputError(f"image has no pixels ({w}x{h})")
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
    except Image.DecompressionBombError as e:
        raise ImageInputError(f"image is too large ({e})") from None
    except Exception as e:  # noqa: BLE001 - PIL's decoders raise OSError, ValueError, SyntaxError, struct.error...
        raise ImageInputError(f"corrupt {image.format} image: {e}") from None
    return to_rgb(image)


def _not_accepted(data: bytes, limits: ImageLimits) -> str:
    """Why PIL refused the bytes: a format outside the allowlist, or no image at all."""
    try:
        fmt = Image.open(io.BytesIO(data)).format  # identifies the header only; nothing is decoded
    except Exception:  # noqa: BLE001 - any failure here means PIL knows no such image
        return "the data is not an image, or its header is corrupt (no image format recognises it)"
    return f"unsupported image format {fmt}; accepted: {', '.join(limits.formats)}"


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with transparent pixels composited onto white (what vLLM's media loader does)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return image.convert("RGB")


def load_image(source: bytes | str | Image.Image | np.ndarray, limits: ImageLimits | None = None) -> Image.Image:
    """An RGB PIL image from bytes, a ``data:`` URL, a PIL image or an ``[H, W, 3]`` uint8 array."""
    limits = limits or ImageLimits()
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source), limits)
    if isinstance(source, str):
        if not source.lstrip().lower().startswith("data:"):
            raise ImageInputError("only data: URLs are decoded here; fetch http(s) images before passing them")
        return decode_image(decode_data_url(source, limits), limits)
    if isinstance(source, Image.Image):
        w, h = source.size
        if w * h > limits.max_pixels:
            raise ImageInputError(f"image of {w}x{h} = {w * h} pixels exceeds the limit of {limits.max_pixels} pixels")
        return to_rgb(source)
    if isinstance(source, np.ndarray):
        if source.ndim != 3 or source.shape[2] != 3 or source.dtype != np.uint8:
            raise ImageInputError(f"an image array must be [H, W, 3] uint8, got shape {list(source.shape)} "
                                  f"dtype {source.dtype}")
        return load_image(Image.fromarray(source, "RGB"), limits)
    raise ImageInputError(f"cannot read an image from {type(source).__name__}; pass bytes, a data: URL, a PIL image "
                          "or an [H, W, 3] uint8 array")


# ----------------------------------------------------------------------------- preprocessing


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The resized ``(height, width)``: multiples of ``factor`` near the original size (Python's round, half to
    even), scaled down by a common factor to fit ``max_pixels`` or up to reach ``min_pixels``, aspect ratio kept
    as closely as the grid allows. ImageInputError beyond a 200:1 aspect ratio."""
    if height <= 0 or width <= 0:
        raise ImageInputError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageInputError(f"image of {width}x{height} has an aspect ratio of "
                              f"{max(height, width) / min(height, width):.1f}; at most {MAX_ASPECT_RATIO} is accepted")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def num_image_tokens(height: int, width: int, cfg: ImageProcessorConfig | None = None) -> int:
    """Placeholder tokens an image of this size takes (no pixels needed)."""
    cfg = cfg or ImageProcessorConfig()
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return (h // cfg.patch_size) * (w // cfg.patch_size) // cfg.merge_size**2


def max_image_tokens(cfg: ImageProcessorConfig | None = None) -> int:
    """An upper bound on :func:`num_image_tokens` over every image size :func:`smart_resize` accepts.

    Three cases: a resized area within ``max_pixels`` (at most ``max_pixels / factor^2`` tokens); a scale-down
    that clamps the short side to one ``factor`` (the long side is then at most ``sqrt(200 * max_pixels)``); a
    scale-up to ``min_pixels``, each side rounded up by less than one ``factor``. What a host sizes its
    encoder cache by.
    """
    cfg = cfg or ImageProcessorConfig()
    f, r = cfg.factor, MAX_ASPECT_RATIO
    within = cfg.max_pixels // f**2
    clamped = math.isqrt(r * cfg.max_pixels) // f
    root = math.sqrt(cfg.min_pixels)
    scaled_up = math.floor(cfg.min_pixels / f**2 + root / f * (math.sqrt(r) + 1 / math.sqrt(r)) + 1)
    return max(within, clamped, scaled_up)


def patchify(pixels: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """``[H, W, 3]`` normalised fp32 -> ``[H/P * W/P, 3 * Tp * P * P]`` patch rows: merge blocks row-major, patches
    row-major inside a block, each row in (channel, time, y, x) order with the frame repeated ``Tp`` times."""
    H, W, C = pixels.shape
    P, m, Tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    bh, bw = H // (P * m), W // (P * m)
    # axes: block row, row in block, y in patch, block column, column in block, x in patch, channel
    x = pixels.reshape(bh, m, P, bw, m, P, C).transpose(0, 3, 1, 4, 6, 2, 5)  # -> bh, bw, m, m, C, P(y), P(x)
    x = np.broadcast_to(x[:, :, :, :, :, None], (bh, bw, m, m, C, Tp, P, P))
    return np.ascontiguousarray(x).reshape(bh * bw * m * m, C * Tp * P * P)


def preprocess_one(image: Image.Image, cfg: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One RGB image -> (patch rows, its grid ``(1, h, w)`` in patches)."""
    h, w = smart_resize(image.height, image.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    resized = np.asarray(image.resize((w, h), resample=cfg.resample))
    normalised = _normalisation_table(cfg.image_mean, cfg.image_std)[np.arange(3), resized]  # [h, w, 3]
    return patchify(normalised, cfg), (1, h // cfg.patch_size, w // cfg.patch_size)


def _normalisation_table(mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """``[3, 256]`` fp32: each channel's normalised value of every uint8 level, computed as HF computes a pixel
    (``x * (1 / 255)`` in fp64, cast to fp32, then ``(x - mean) / std`` in fp32), so a lookup gives its bits."""
    levels = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    mean32, std32 = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    return (levels[None, :] - mean32[:, None]) / std32[:, None]


def preprocess(images: Sequence[bytes | str | Image.Image | np.ndarray],
               cfg: ImageProcessorConfig | None = None) -> ProcessedImages:
    """Images (anything :func:`load_image` takes) -> the tower's ``pixel_values`` and ``grid_thw``."""
    cfg = cfg or ImageProcessorConfig()
    if isinstance(images, (bytes, str, Image.Image, np.ndarray)):
        images = [images]
    if not images:
        raise ImageInputError("no images to preprocess")
    rows, grids = [], []
    for source in images:
        patches, grid = preprocess_one(load_image(source, cfg.limits), cfg)
        rows.append(patches)
        grids.append(grid)
    m2 = cfg.merge_size**2
    return ProcessedImages(pixel_values=torch.from_numpy(np.concatenate(rows)),
                           grid_thw=torch.tensor(grids, dtype=torch.int64),
                           num_tokens=[t * h * w // m2 for t, h, w in grids])
