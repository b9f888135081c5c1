"""HF checkpoint ``model.visual.*`` -> :class:`qwen35.vision.VisionTower` parameters: one explicit mapping.

Same rules as :mod:`qwen35.checkpoint`: every tensor is checked against the shape the config implies and
copied into its parameter (cast to the parameter's dtype); unknown names, missing tensors and wrong shapes
raise :class:`qwen35.checkpoint.CheckpointError` naming them. The tower is replicated on every tensor-parallel
rank, so nothing is sliced.

:class:`VisionLoader` takes tensors one at a time (``add``) and checks completeness at ``finish``, so that the
text loader's single pass over the safetensors shards can hand it every ``model.visual.*`` tensor it meets;
:func:`load_vision_weights` is the one-call form.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

import torch

from qwen35.checkpoint import VISUAL_PREFIX, CheckpointError, _names
from qwen35.vision import VisionConfig, VisionTower


def _flatten_patch(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


class VisionPlan:
    """Checkpoint name (without ``model.visual.``) -> (parameter name, checkpoint shape, transform)."""

    _block_re = re.compile(r"blocks\.(\d+)\.(.+)")

    def __init__(self, cfg: VisionConfig):
        self.cfg = cfg
        D, I, M = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.merge_unit
        C, Tp, P = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
        self._top: dict[str, tuple[str, tuple[int, ...], Callable]] = {
            "patch_embed.proj.weight": ("patch_embed.weight", (D, C, Tp, P, P), _flatten_patch),
            "patch_embed.proj.bias": ("patch_embed.bias", (D,), _whole),
            "pos_embed.weight": ("pos_embed.weight", (cfg.num_position_embeddings, D), _whole),
            "merger.norm.weight": ("merger.norm.weight", (D,), _whole),
            "merger.norm.bias": ("merger.norm.bias", (D,), _whole),
            "merger.linear_fc1.weight": ("merger.linear_fc1.weight", (M, M), _whole),
            "merger.linear_fc1.bias": ("merger.linear_fc1.bias", (M,), _whole),
            "merger.linear_fc2.weight": ("merger.linear_fc2.weight", (cfg.out_hidden_size, M), _whole),
            "merger.linear_fc2.bias": ("merger.linear_fc2.bias", (cfg.out_hidden_size,), _whole),
        }
        self._block: dict[str, tuple[int, ...]] = {
            "norm1.weight": (D,), "norm1.bias": (D,), "norm2.weight": (D,), "norm2.bias": (D,),
            "attn.qkv.weight": (3 * D, D), "attn.qkv.bias": (3 * D,),
            "attn.proj.weight": (D, D), "attn.proj.bias": (D,),
            "mlp.linear_fc1.weight": (I, D), "mlp.linear_fc1.bias": (I,),
            "mlp.linear_fc2.weight": (D, I), "mlp.linear_fc2.bias": (D,),
        }

    def rule(self, name: str) -> tuple[str, tuple[int, ...], Callable] | None:
        """The rule for a name relative to ``model.visual.``, or None if the tower has no such tensor."""
        if name in self._top:
            return self._top[name]
        m = self._block_re.fullmatch(name)
        if m is None or int(m.group(1)) >= self.cfg.depth or m.group(2) not in self._block:
            return None
        return name, self._block[m.group(2)], _whole  # block parameters keep HF's names

    def expected(self) -> list[str]:
        """Every checkpoint name (relative) the tower needs."""
        return list(self._top) + [f"blocks.{i}.{n}" for i in range(self.cfg.depth) for n in self._block]


class VisionLoader:
    """Copies ``model.visual.*`` tensors into a tower as they come; :meth:`finish` raises for missing ones."""

    def __init__(self, tower: VisionTower, prefix: str = VISUAL_PREFIX):
        self.tower, self.prefix = tower, prefix
        self.plan = VisionPlan(tower.cfg)
        self.params = dict(tower.named_parameters())
        self.seen: set[str] = set()
        self.unknown: list[str] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (full name, prefix included); CheckpointError on a wrong shape."""
        rel = name[len(self.prefix):] if name.startswith(self.prefix) else None
        rule = None if rel is None else self.plan.rule(rel)
        if rule is None:
            self.unknown.append(name)
            return
        param, shape, take = rule
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {list(tensor.shape)}; the vision config implies "
                                  f"{list(shape)} (parameter visual.{param})")
        with torch.no_grad():
            self.params[param].copy_(take(tensor))
        self.seen.add(rel)

    def finish(self) -> set[str]:
        """The parameter names filled; CheckpointError naming unknown and missing tensors."""
        problems = []
        if self.unknown:
            problems.append(f"unknown vision tensors (not part of a Qwen3.5 vision tower of depth "
                            f"{self.tower.cfg.depth}): {_names(self.unknown)}")
        missing = [self.prefix + n for n in self.plan.expected() if n not in self.seen]
        if missing:
            problems.append(f"missing vision tensors: {_names(missing)}")
        if problems:
            raise CheckpointError("; ".join(problems))
        return set(self.params)


def random_vision_tensors(cfg: VisionConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                          prefix: str = VISUAL_PREFIX) -> dict[str, torch.Tensor]:
    """A seeded random tower under the checkpoint's names and shapes (tiny checkpoints, tests, benchmarks).

    Scales keep activations of order one through any depth: LayerNorm weights near 1, biases and projections
    small.
    """
    plan, g = VisionPlan(cfg), torch.Generator().manual_seed(seed)
    out = {}
    for name in plan.expected():
        _, shape, _ = plan.rule(name)
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "merger.norm.weight":
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif len(shape) == 1:
            t = 0.05 * torch.randn(shape, generator=g)
        elif name == "pos_embed.weight":
            t = 0.5 * torch.randn(shape, generator=g)
        else:
            fan_in = math.prod(shape[1:])
            t = torch.randn(shape, generator=g) / math.sqrt(fan_in)
        out[prefix + name] = t.to(dtype)
    return out


def load_vision_weights(tower: VisionTower, weights: Iterable[tuple[str, torch.Tensor]],
                        prefix: str = VISUAL_PREFIX) -> set[str]:
    """Load ``prefix``-named tensors (HF's ``model.visual.*``) into ``tower``; returns the parameters filled.

    Raises :class:`CheckpointError` for unknown names (including names without ``prefix``), missing tensors and
    wrong shapes.
    """
    loader = VisionLoader(tower, prefix)
    for name, tensor in weights:
        loader.add(name, tensor)
    return loader.finish()
