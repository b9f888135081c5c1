"""The Qwen3.5 vision tower (the Qwen3-VL ViT without deepstack), one definition for every host.

Reads top to bottom in the order data flows: flattened pixel patches -> patch embedding (a linear map of each
``C x temporal x patch x patch`` patch) + learned position embedding resampled to the image's patch grid ->
``depth`` pre-norm ViT blocks (LayerNorm, bidirectional attention within each frame with 2D rotary positions,
LayerNorm, GELU MLP) -> patch merger (LayerNorm, then each ``merge x merge`` block of patches concatenated and
projected by a two-layer MLP to the language model's hidden size). Compared with HF transformers 5.19's
``Qwen3_5VisionModel`` / ``Qwen3_5MoeVisionModel`` (the two are the same module).

Input layout (what :mod:`qwen35.image_processor` produces): ``pixel_values [N, C * Tp * P * P]``, one row per
patch, images back to back; within an image the patches are ordered frame by frame, then merge block by merge
block (row-major over the ``(h / m) x (w / m)`` blocks), then row-major inside a block; a row holds the patch's
values in ``(channel, time, y, x)`` order. ``grid_thw [n, 3]``: frames, patch rows and patch columns of each
image. Output: ``[N / m^2, out_hidden_size]``, one row per merged token, in the same order; these rows replace
the image's placeholder tokens in the prompt (:func:`split_by_image` cuts them per image).

Numerics: plain torch (no façade op fits: LayerNorm with bias, GELU, non-causal attention per frame). The rotary
rotation runs in fp32, the position-embedding resampling in fp32 from the table's values (as HF does); every
other op runs in the weights' dtype. Attention is SDPA, one call per run of consecutive frames of equal size
(a batch of same-sized images is one call). The tower is replicated on every tensor-parallel rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# hidden_act values of the ViT MLP -> function (the merger's activation is always exact GELU, as in HF)
ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}
LAYER_NORM_EPS = 1e-6


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's fields of an HF ``config.json`` (``vision_config``) plus the image token ids."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0
    # top-level token ids of the multimodal checkpoints
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch row of ``pixel_values``: ``C * Tp * P * P``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per merged token: ``m * m``."""
        return self.spatial_merge_size**2

    @property
    def grid_side(self) -> int:
        """Side of the square learned position-embedding grid."""
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_dict(cls, raw: dict) -> VisionConfig | None:
        """From a whole HF ``config.json`` dict; None when it has no ``vision_config`` (text-only checkpoints).

        Raises ValueError naming the field for values the tower cannot run.
        """
        v = raw.get("vision_config")
        if v is None:
            return None
        if not isinstance(v, dict):
            raise ValueError(f"vision_config must be an object, got {type(v).__name__}")

        def need(key: str):
            if v.get(key) is None:
                raise ValueError(f"vision_config lacks {key!r}")
            return v[key]

        def square(key: str, default: int) -> int:
            value = v.get(key, default)
            if isinstance(value, (list, tuple)):
                if len(set(value)) != 1:
                    raise ValueError(f"vision_config.{key}={list(value)}: only equal sizes are supported")
                value = value[0]
            return int(value)

        if v.get("deepstack_visual_indexes"):
            raise ValueError(f"vision_config.deepstack_visual_indexes={v['deepstack_visual_indexes']}: deepstack "
                             "features are not part of Qwen3.5's tower (only an empty list is accepted)")
        rope = v.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", "axial")
        if rope_type not in ("axial", "default"):
            raise ValueError(f"vision_config rope_type={rope_type!r}: only the axial 2D rope is supported")
        ids = {k: int(raw[k]) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                         "vision_end_token_id") if raw.get(k) is not None}
        cfg = cls(
            depth=int(need("depth")), hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")), num_heads=int(need("num_heads")),
            out_hidden_size=int(need("out_hidden_size")), hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
            in_channels=int(v.get("in_channels", 3)), patch_size=square("patch_size", 16),
            temporal_patch_size=square("temporal_patch_size", 2),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            num_position_embeddings=int(v.get("num_position_embeddings", 2304)),
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))), **ids)
        text = raw.get("text_config")
        if isinstance(text, dict) and text.get("hidden_size") not in (None, cfg.out_hidden_size):
            raise ValueError(f"vision_config.out_hidden_size={cfg.out_hidden_size} must equal the language model's "
                             f"hidden_size={text['hidden_size']}")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Shape facts the tower relies on; ValueError naming the offending fields."""
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "in_channels",
                     "patch_size", "temporal_patch_size", "spatial_merge_size", "num_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"vision_config.{name}={getattr(self, name)} must be positive")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision_config.hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"vision head_dim={self.head_dim} (hidden_size / num_heads) must be a multiple of 4: "
                             "the 2D rotary embedding gives a quarter of it to each of rows and columns")
        if self.grid_side**2 != self.num_position_embeddings:
            raise ValueError(f"vision_config.num_position_embeddings={self.num_position_embeddings} must be a "
                             "perfect square (the learned positions form a square grid)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act={self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")


# ----------------------------------------------------------------------------- per-forward layout


def check_grid(grid_thw: torch.Tensor | Sequence[Sequence[int]], merge: int) -> list[tuple[int, int, int]]:
    """``grid_thw`` as a list of ``(t, h, w)`` ints; ValueError unless each is positive with h, w multiples of
    ``merge``."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(g) for g in grid_thw]
    out = []
    for i, g in enumerate(rows):
        if len(g) != 3:
            raise ValueError(f"grid_thw[{i}]={g}: expected (t, h, w)")
        t, h, w = (int(x) for x in g)
        if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
            raise ValueError(f"grid_thw[{i}]=({t}, {h}, {w}): t, h, w must be positive and h, w multiples of the "
                             f"spatial merge size {merge}")
        out.append((t, h, w))
    return out


def block_order(h: int, w: int, merge: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Patch row and column of each patch of an ``h x w`` grid, in merge-block order (``[h * w]`` each)."""
    bh, bw = h // merge, w // merge
    inner = torch.arange(merge, device=device)
    rows = (torch.arange(bh, device=device)[:, None, None, None] * merge + inner[None, None, :, None])
    cols = (torch.arange(bw, device=device)[None, :, None, None] * merge + inner[None, None, None, :])
    shape = (bh, bw, merge, merge)
    return rows.expand(shape).reshape(-1), cols.expand(shape).reshape(-1)


@dataclass
class _Layout:
    """What every block of one forward shares: rotary cos/sin and the attention runs."""

    cos: torch.Tensor  # [N, head_dim / 2] fp32
    sin: torch.Tensor
    runs: list[tuple[int, int, int]]  # (first row, frames, rows per frame): consecutive frames of equal size


# ----------------------------------------------------------------------------- modules


class PatchEmbed(nn.Module):
    """HF's Conv3d whose kernel equals its stride: one linear map of each flattened patch row.

    ``weight [hidden, C * Tp * P * P]`` is the checkpoint's ``patch_embed.proj.weight [hidden, C, Tp, P, P]``
    flattened (same value order as a ``pixel_values`` row).
    """

    def __init__(self, cfg: VisionConfig, *, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.hidden_size, cfg.patch_dim, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return F.linear(pixel_values.to(self.weight.dtype), self.weight, self.bias)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of every head of ``x [N, heads, D]`` over all D dims, in fp32 (cos, sin ``[N, D / 2]``)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention within each frame, 2D rotary positions on q and k."""

    def __init__(self, cfg: VisionConfig, *, dtype=None, device=None):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, dtype=dtype, device=device)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, layout: _Layout) -> torch.Tensor:
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.heads, self.head_dim).unbind(1)
        q, k = rotate(q, layout.cos, layout.sin), rotate(k, layout.cos, layout.sin)
        outs = []
        for start, frames, length in layout.runs:  # frames of one run: a batch of equal-length sequences
            rows = slice(start, start + frames * length)

            def heads_first(t: torch.Tensor, rows=rows, frames=frames, length=length) -> torch.Tensor:
                return t[rows].view(frames, length, self.heads, self.head_dim).transpose(1, 2)

            o = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v))
            outs.append(o.transpose(1, 2).reshape(frames * length, -1))
        return self.proj(outs[0] if len(outs) == 1 else torch.cat(outs))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, *, dtype=None, device=None):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype, device=device)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm ViT block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, cfg: VisionConfig, *, dtype=None, device=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS, dtype=dtype, device=device)
        self.attn = VisionAttention(cfg, dtype=dtype, device=device)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS, dtype=dtype, device=device)
        self.mlp = VisionMLP(cfg, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, layout: _Layout) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), layout)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each merge block's ``m * m`` patches (consecutive rows) concatenated and mapped
    to the language model's hidden size by ``fc2(gelu(fc1(.)))``."""

    def __init__(self, cfg: VisionConfig, *, dtype=None, device=None):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.merge_unit
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS, dtype=dtype, device=device)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """The whole tower: ``forward(pixel_values, grid_thw)`` -> merged image embeddings ``[N / m^2, out_hidden]``.

    Parameter names are HF's under ``model.visual.`` except ``patch_embed.weight`` (HF:
    ``patch_embed.proj.weight``, flattened) and ``patch_embed.bias`` (HF: ``patch_embed.proj.bias``);
    :mod:`qwen35.vision_checkpoint` holds the mapping.
    """

    def __init__(self, cfg: VisionConfig, *, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, dtype=dtype, device=device)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype=dtype, device=device) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, dtype=dtype, device=device)
        quarter = cfg.head_dim // 2  # rows and columns each rotate head_dim / 2 dims: head_dim / 4 frequencies
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (
            torch.arange(0, quarter, 2, dtype=torch.float32, device=device) / quarter), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        grids = self.check_inputs(pixel_values, grid_thw)
        layout, pos = self._layout(grids, pixel_values.device)
        x = self.patch_embed(pixel_values) + pos.to(self.dtype)
        for block in self.blocks:
            x = block(x, layout)
        return self.merger(x)

    def check_inputs(self, pixel_values: torch.Tensor,
                     grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
        """The grids as ints; ValueError naming the value when pixel_values and grid_thw disagree."""
        cfg = self.cfg
        grids = check_grid(grid_thw, cfg.spatial_merge_size)
        if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_dim:
            raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}; expected [patches, {cfg.patch_dim}] "
                             f"(C * temporal_patch * patch * patch = {cfg.in_channels} * {cfg.temporal_patch_size} * "
                             f"{cfg.patch_size}^2)")
        if not pixel_values.is_floating_point():
            raise ValueError(f"pixel_values has dtype {pixel_values.dtype}; expected a floating dtype")
        total = sum(t * h * w for t, h, w in grids)
        if total != pixel_values.shape[0]:
            raise ValueError(f"grid_thw {grids} describes {total} patches, pixel_values has {pixel_values.shape[0]}")
        return grids

    def _layout(self, grids: list[tuple[int, int, int]], device) -> tuple[_Layout, torch.Tensor]:
        """Rotary cos/sin, attention runs and the resampled position embeddings (fp32) of one forward."""
        m = self.cfg.spatial_merge_size
        angles, pos, runs, start = [], [], [], 0
        per_size: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # a batch often repeats a size
        for t, h, w in grids:
            if (h, w) not in per_size:
                rows, cols = block_order(h, w, m, device)
                freqs = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1)
                per_size[h, w] = freqs, self._position_embedding(h, w, rows, cols)
            freqs, embedding = per_size[h, w]
            angles.append(freqs.repeat(t, 1))
            pos.append(embedding.repeat(t, 1))
            if runs and runs[-1][2] == h * w:  # same frame size as the run before: join it
                first, frames, length = runs[-1]
                runs[-1] = (first, frames + t, length)
            else:
                runs.append((start, t, h * w))
            start += t * h * w
        angles = torch.cat(angles)
        return _Layout(angles.cos(), angles.sin(), runs), torch.cat(pos)

    def _position_embedding(self, h: int, w: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The learned ``side x side`` position grid resampled bilinearly (corners aligned) to ``h x w``, fp32,
        picked at the patches' ``rows`` / ``cols``: ``[h * w, hidden]``."""
        side = self.cfg.grid_side
        table = self.pos_embed.weight.float().view(side, side, -1)
        lo_r, hi_r, fr = _taps(h, side, table.device)
        lo_c, hi_c, fc = _taps(w, side, table.device)
        by_row = table[lo_r] * (1 - fr)[:, None, None] + table[hi_r] * fr[:, None, None]  # [h, side, D]
        grid = by_row[:, lo_c] * (1 - fc)[None, :, None] + by_row[:, hi_c] * fc[None, :, None]  # [h, w, D]
        return grid[rows, cols]


def _taps(n: int, side: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear taps from ``n`` target positions onto ``side`` source positions, ends aligned: lower index,
    upper index and the upper one's weight."""
    src = torch.arange(n, dtype=torch.float32, device=device) * (side - 1) / max(n - 1, 1)
    lo = src.floor().long().clamp(max=side - 1)
    return lo, (lo + 1).clamp(max=side - 1), src - lo


def split_by_image(embeddings: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]],
                   merge: int) -> list[torch.Tensor]:
    """The tower's output cut into one ``[t * h * w / m^2, hidden]`` piece per image."""
    sizes = [t * h * w // merge**2 for t, h, w in check_grid(grid_thw, merge)]
    if sum(sizes) != embeddings.shape[0]:
        raise ValueError(f"grid_thw describes {sum(sizes)} merged tokens, embeddings has {embeddings.shape[0]}")
    return list(embeddings.split(sizes))
