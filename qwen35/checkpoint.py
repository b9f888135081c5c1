"""HF checkpoint -> :class:`qwen35.model.Qwen35Model` parameters: one explicit name mapping, one loop.

Checkpoint names are those of HF's Qwen3.5 classes, under ``model.`` (``*ForCausalLM``) or
``model.language_model.`` (``*ForConditionalGeneration``; either prefix is accepted for either
class). ``model.visual.*`` goes to the vision tower when the host passes one
(:class:`qwen35.vision_checkpoint.VisionLoader`, same error rules); otherwise it is skipped, as
``mtp.*`` always is, with one INFO line. Routed experts come
either fused (``mlp.experts.gate_up_proj [E, 2I, H]`` / ``mlp.experts.down_proj [E, H, I]``,
as transformers 5 stores them) or per expert (``mlp.experts.<e>.{gate,up,down}_proj.weight``,
as the hub checkpoints do).

Every tensor is checked against the shape the config implies, then this rank's slice is copied
into its place (merged projections stack several checkpoint tensors). Unknown names, missing
tensors and wrong shapes raise :class:`CheckpointError` naming them.

Loading into a float16 model (the hosts' ``dtype=float16``; vLLM's ``--dtype float16`` loads through
:func:`load_weights` too) checks every tensor that arrives in a wider dtype (bf16, fp32) for values beyond
fp16's range, ``|x| > 65504``, which a plain cast would turn into inf. They are reported per checkpoint
tensor (name, how many values, the largest magnitude) once the load is done:

- by default (``QWEN35_FP16_OVERFLOW=warn``) as one WARNING, the values saturating to +-65504: a few
  outliers then cost a small error in a few products, where an inf would turn every product it touches
  into inf or NaN, and a refusal would rule out fp16 (the only fast dtype on sm70/sm75) for the checkpoint;
- with ``QWEN35_FP16_OVERFLOW=error`` (or ``overflow="error"``) as a :class:`CheckpointError`, for a user who
  needs the fp16 weights to be the checkpoint's values.

Values below fp16's smallest normal (6.1e-5) lose precision or flush to zero without a report.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qwen35 import knobs
from qwen35.config import Qwen35Config
from qwen35.model import Parallel, Qwen35Model, Shards

if TYPE_CHECKING:
    from qwen35.vision import VisionTower

log = logging.getLogger("qwen35.checkpoint")

FP16_MAX = 65504.0  # the largest finite float16
OVERFLOW_MODES = ("warn", "error")
TEXT_PREFIXES = ("model.language_model.", "model.")
VISUAL_PREFIX = "model.visual."
SKIPPED_PREFIXES = (VISUAL_PREFIX, "mtp.")
MAX_NAMES_IN_ERROR = 20


class CheckpointError(ValueError):
    """A checkpoint that does not fit the config: unknown, missing or mis-shaped tensors."""


@dataclass(frozen=True)
class Rule:
    """Where one checkpoint tensor goes: ``param[offset : offset + rows]`` (dim 0) gets ``take(tensor)``.

    ``expert`` set: the destination is ``param[expert]`` (per-expert checkpoints).
    """

    param: str
    shape: tuple[int, ...]  # the full (unsharded) shape the checkpoint must hold
    take: Callable[[torch.Tensor], torch.Tensor]  # full tensor -> this rank's piece
    offset: int = 0
    expert: int | None = None


def _names(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - MAX_NAMES_IN_ERROR} more" if len(names) > MAX_NAMES_IN_ERROR else ""
    return ", ".join(names[:MAX_NAMES_IN_ERROR]) + more


class Plan:
    """The mapping for one config and one tensor-parallel rank."""

    def __init__(self, cfg: Qwen35Config, par: Parallel):
        self.cfg, self.par = cfg, par
        self.sh = Shards.of(cfg, par)
        self._layer_re = re.compile(r"layers\.(\d+)\.(.+)")
        self._expert_re = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")

    # --- slicing helpers: full tensor -> this rank's piece
    def _rows(self, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
        start, count = self.par.split(n, "rows")
        return lambda t: t.narrow(0, start, count)

    def _cols(self, n: int, dim: int = 1) -> Callable[[torch.Tensor], torch.Tensor]:
        start, count = self.par.split(n, "columns")
        return lambda t: t.narrow(dim, start, count)

    def _segments(self, sizes: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
        """Rows laid out as consecutive segments, each split evenly across ranks (GDN q | k | v)."""
        def take(t: torch.Tensor) -> torch.Tensor:
            parts, at = [], 0
            for n in sizes:
                start, count = self.par.split(n, "segment rows")
                parts.append(t.narrow(0, at + start, count))
                at += n
            return torch.cat(parts)
        return take

    def _vocab(self) -> Callable[[torch.Tensor], torch.Tensor]:
        start, rows, vocab = self.sh.vocab_start, self.sh.vocab, self.cfg.vocab_size

        def take(t: torch.Tensor) -> torch.Tensor:
            piece = t.narrow(0, min(start, vocab), max(0, min(rows, vocab - start)))
            if piece.shape[0] < rows:  # the last shard is padded with zero rows
                piece = torch.cat([piece, piece.new_zeros(rows - piece.shape[0], *t.shape[1:])])
            return piece
        return take

    def _kv_rows(self) -> Callable[[torch.Tensor], torch.Tensor]:
        D = self.cfg.head_dim
        return lambda t: t.narrow(0, self.sh.kv_head_start * D, self.sh.kv_heads * D)

    @staticmethod
    def _whole(t: torch.Tensor) -> torch.Tensor:
        return t

    # --- the mapping
    def rule(self, name: str) -> Rule | None:
        """The rule for a checkpoint name with its text prefix removed, or None if unknown."""
        cfg, H = self.cfg, self.cfg.hidden_size
        V_, whole = cfg.vocab_size, self._whole
        if name == "embed_tokens.weight":
            return Rule("embed_tokens.weight", (V_, H), self._vocab())
        if name == "norm.weight":
            return Rule("norm_weight", (H,), whole)
        m = self._layer_re.fullmatch(name)
        if m is None:
            return None
        i, rest = int(m.group(1)), m.group(2)
        if i >= cfg.num_hidden_layers:
            return None
        p = f"layers.{i}."
        if rest == "input_layernorm.weight":
            return Rule(p + "input_norm_weight", (H,), whole)
        if rest == "post_attention_layernorm.weight":
            return Rule(p + "post_norm_weight", (H,), whole)
        linear = cfg.layer_types[i] == "linear_attention"
        if linear and rest.startswith("linear_attn."):
            return self._gdn_rule(p + "mixer.", rest[len("linear_attn."):])
        if not linear and rest.startswith("self_attn."):
            return self._attention_rule(p + "mixer.", rest[len("self_attn."):])
        if rest.startswith("mlp."):
            return self._moe_rule(p + "mlp.", rest) if cfg.is_moe else self._dense_rule(p + "mlp.", rest)
        return None

    def _gdn_rule(self, p: str, rest: str) -> Rule | None:
        cfg, sh, H = self.cfg, self.sh, self.cfg.hidden_size
        Kd, Vd, HK, HV = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_key_heads, \
            cfg.linear_num_value_heads
        qkv_sizes = [HK * Kd, HK * Kd, HV * Vd]
        conv_local = 2 * sh.gdn_key_heads * Kd + sh.gdn_value_heads * Vd
        z_local, bv_local = sh.gdn_value_heads * Vd, sh.gdn_value_heads
        W = cfg.linear_conv_kernel_dim
        qkv_rows = self._segments(qkv_sizes)
        table = {
            "in_proj_qkv.weight": Rule(p + "in_proj.weight", (sum(qkv_sizes), H), self._segments(qkv_sizes), 0),
            "in_proj_z.weight": Rule(p + "in_proj.weight", (HV * Vd, H), self._rows(HV * Vd), conv_local),
            "in_proj_b.weight": Rule(p + "in_proj.weight", (HV, H), self._rows(HV), conv_local + z_local),
            "in_proj_a.weight": Rule(p + "in_proj.weight", (HV, H), self._rows(HV), conv_local + z_local + bv_local),
            "conv1d.weight": Rule(p + "conv1d_weight", (sum(qkv_sizes), 1, W),
                                  lambda t: qkv_rows(t)[:, 0, :]),
            "A_log": Rule(p + "A_log", (HV,), self._rows(HV)),
            "dt_bias": Rule(p + "dt_bias", (HV,), self._rows(HV)),
            "norm.weight": Rule(p + "norm_weight", (Vd,), self._whole),
            "out_proj.weight": Rule(p + "out_proj.weight", (H, HV * Vd), self._cols(HV * Vd)),
        }
        return table.get(rest)

    def _attention_rule(self, p: str, rest: str) -> Rule | None:
        cfg, sh, H, D = self.cfg, self.sh, self.cfg.hidden_size, self.cfg.head_dim
        NH, KV = cfg.num_attention_heads, cfg.num_key_value_heads
        q_local = sh.heads * 2 * D
        table = {
            "q_proj.weight": Rule(p + "qkv_proj.weight", (NH * 2 * D, H), self._rows(NH * 2 * D), 0),
            "k_proj.weight": Rule(p + "qkv_proj.weight", (KV * D, H), self._kv_rows(), q_local),
            "v_proj.weight": Rule(p + "qkv_proj.weight", (KV * D, H), self._kv_rows(), q_local + sh.kv_heads * D),
            "q_norm.weight": Rule(p + "q_norm_weight", (D,), self._whole),
            "k_norm.weight": Rule(p + "k_norm_weight", (D,), self._whole),
            "o_proj.weight": Rule(p + "o_proj.weight", (H, NH * D), self._cols(NH * D)),
        }
        return table.get(rest)

    def _dense_rule(self, p: str, rest: str) -> Rule | None:
        H, I = self.cfg.hidden_size, self.cfg.intermediate_size
        table = {
            "mlp.gate_proj.weight": Rule(p + "gate_up_proj.weight", (I, H), self._rows(I), 0),
            "mlp.up_proj.weight": Rule(p + "gate_up_proj.weight", (I, H), self._rows(I), self.sh.mlp),
            "mlp.down_proj.weight": Rule(p + "down_proj.weight", (H, I), self._cols(I)),
        }
        return table.get(rest)

    def _moe_rule(self, p: str, rest: str) -> Rule | None:
        cfg, sh, H = self.cfg, self.sh, self.cfg.hidden_size
        E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        m = self._expert_re.fullmatch(rest)
        if m is not None:
            e, which = int(m.group(1)), m.group(2)
            if e >= E:
                return None
            if which == "down_proj":
                return Rule(p + "w2", (H, I), self._cols(I), expert=e)
            return Rule(p + "w13", (I, H), self._rows(I), 0 if which == "gate_proj" else sh.mlp, expert=e)

        def fused_w13(t: torch.Tensor) -> torch.Tensor:  # [E, 2I, H]: this rank's gate rows, then its up rows
            gate, up = t.narrow(1, 0, I), t.narrow(1, I, I)
            start, count = self.par.split(I, "moe_intermediate_size")
            return torch.cat([gate.narrow(1, start, count), up.narrow(1, start, count)], dim=1)

        table = {
            "mlp.gate.weight": Rule(p + "router_weight", (E, H), self._whole),
            "mlp.experts.gate_up_proj": Rule(p + "w13", (E, 2 * I, H), fused_w13),
            "mlp.experts.down_proj": Rule(p + "w2", (E, H, I), self._cols(I, dim=2)),
        }
        if Is:
            table.update({
                "mlp.shared_expert.gate_proj.weight": Rule(p + "shared_w13", (Is, H), self._rows(Is), 0),
                "mlp.shared_expert.up_proj.weight": Rule(p + "shared_w13", (Is, H), self._rows(Is), sh.shared_mlp),
                "mlp.shared_expert.down_proj.weight": Rule(p + "shared_w2", (H, Is), self._cols(Is)),
                "mlp.shared_expert_gate.weight": Rule(p + "shared_gate_weight", (1, H), self._whole),
            })
        return table.get(rest)

    def expected(self) -> dict[str, list[list[str]]]:
        """Per parameter, alternative sets of checkpoint names that fill it (any one set suffices)."""
        cfg = self.cfg
        want: dict[str, list[list[str]]] = {"embed_tokens.weight": [["embed_tokens.weight"]],
                                            "norm_weight": [["norm.weight"]]}
        if not cfg.tie_word_embeddings:
            want["lm_head_weight"] = [["lm_head.weight"]]
        for i, lt in enumerate(cfg.layer_types):
            p, c = f"layers.{i}.", f"layers.{i}."
            want[p + "input_norm_weight"] = [[c + "input_layernorm.weight"]]
            want[p + "post_norm_weight"] = [[c + "post_attention_layernorm.weight"]]
            if lt == "linear_attention":
                la = c + "linear_attn."
                want[p + "mixer.in_proj.weight"] = [[la + f"in_proj_{s}.weight" for s in ("qkv", "z", "b", "a")]]
                for ours, theirs in (("conv1d_weight", "conv1d.weight"), ("A_log", "A_log"),
                                     ("dt_bias", "dt_bias"), ("norm_weight", "norm.weight"),
                                     ("out_proj.weight", "out_proj.weight")):
                    want[p + "mixer." + ours] = [[la + theirs]]
            else:
                sa = c + "self_attn."
                want[p + "mixer.qkv_proj.weight"] = [[sa + f"{s}_proj.weight" for s in "qkv"]]
                for ours, theirs in (("q_norm_weight", "q_norm.weight"), ("k_norm_weight", "k_norm.weight"),
                                     ("o_proj.weight", "o_proj.weight")):
                    want[p + "mixer." + ours] = [[sa + theirs]]
            mp = c + "mlp."
            if cfg.is_moe:
                E = range(cfg.num_experts)
                want[p + "mlp.router_weight"] = [[mp + "gate.weight"]]
                want[p + "mlp.w13"] = [[mp + "experts.gate_up_proj"],
                                       [mp + f"experts.{e}.{w}.weight" for e in E for w in ("gate_proj", "up_proj")]]
                want[p + "mlp.w2"] = [[mp + "experts.down_proj"], [mp + f"experts.{e}.down_proj.weight" for e in E]]
                if cfg.shared_expert_intermediate_size:
                    want[p + "mlp.shared_w13"] = [[mp + "shared_expert.gate_proj.weight",
                                                   mp + "shared_expert.up_proj.weight"]]
                    want[p + "mlp.shared_w2"] = [[mp + "shared_expert.down_proj.weight"]]
                    want[p + "mlp.shared_gate_weight"] = [[mp + "shared_expert_gate.weight"]]
            else:
                want[p + "mlp.gate_up_proj.weight"] = [[mp + "gate_proj.weight", mp + "up_proj.weight"]]
                want[p + "mlp.down_proj.weight"] = [[mp + "down_proj.weight"]]
        return want


def strip_text_prefix(name: str) -> str | None:
    """The decoder-relative name (``layers.0...``, ``lm_head.weight``), or None for a skipped tensor."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name == "lm_head.weight":
        return name
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name  # unprefixed: reported as unknown unless the mapping knows it


def load_weights(model: Qwen35Model, weights: Iterable[tuple[str, torch.Tensor]],
                 logger: logging.Logger | None = None, visual: VisionTower | None = None,
                 overflow: str | None = None) -> set[str]:
    """Copy checkpoint tensors into ``model`` (and ``model.visual.*`` into ``visual`` when given); returns the
    names of the parameters filled (the tower's as ``visual.<name>``).

    Raises :class:`CheckpointError` for unknown tensors, wrong shapes and missing tensors, the tower's
    included. ``logger`` (default ``qwen35.checkpoint``) gets the one INFO line about skipped tensors and the
    fp16 overflow WARNING. ``overflow``: ``"warn"`` or ``"error"`` for values beyond fp16's range loaded into a
    float16 parameter (None: ``QWEN35_FP16_OVERFLOW``; see the module docstring).
    """
    mode = knobs.get("QWEN35_FP16_OVERFLOW") if overflow is None else overflow
    if mode not in OVERFLOW_MODES:
        raise ValueError(f"overflow={mode!r}; accepted: {', '.join(OVERFLOW_MODES)}")
    overflows: list[tuple[str, int, float]] = []  # (checkpoint name, values beyond fp16, largest |x|)
    plan = Plan(model.cfg, model.par)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    unknown: list[str] = []
    skipped = 0
    prefix = "model." if not model.cfg.nested_text else "model.language_model."
    vision = None
    if visual is not None:
        from qwen35.vision_checkpoint import VisionLoader  # it imports this module

        vision = VisionLoader(visual, VISUAL_PREFIX)
    for raw_name, tensor in weights:
        if vision is not None and raw_name.startswith(VISUAL_PREFIX):
            vision.add(raw_name, tensor)
            continue
        name = strip_text_prefix(raw_name)
        if name is None:
            skipped += 1
            continue
        if name != raw_name and name != "lm_head.weight":
            prefix = raw_name[: len(raw_name) - len(name)]  # to name missing tensors as this checkpoint would
        if name == "lm_head.weight":
            if model.cfg.tie_word_embeddings:
                seen.add(name)  # tied: the embedding serves as the head
                continue
            rule = Rule("lm_head_weight", (model.cfg.vocab_size, model.cfg.hidden_size), plan._vocab())
        else:
            rule = plan.rule(name)
        if rule is None:
            unknown.append(raw_name)
            continue
        if tuple(tensor.shape) != rule.shape:
            raise CheckpointError(f"tensor {raw_name} has shape {list(tensor.shape)}; the config implies "
                                  f"{list(rule.shape)} (parameter {rule.param})")
        over = _copy(params[rule.param], rule, tensor)
        if over is not None:
            overflows.append((raw_name, *over))
        seen.add(name)
    if skipped and vision is None:
        (logger or log).info("qwen35: skipped %d vision / MTP tensors (model.visual.*, mtp.*): text-only model",
                             skipped)
    elif skipped:
        (logger or log).info("qwen35: skipped %d MTP tensors (mtp.*)", skipped)
    missing = [n if n == "lm_head.weight" else prefix + n for n in _missing(plan.expected(), seen)]
    problems = []
    if unknown:
        problems.append(f"unknown tensors (not part of a {model.cfg.architecture} text decoder): {_names(unknown)}")
    if missing:
        problems.append(f"missing tensors: {_names(missing)}")
    filled = set(plan.expected())
    if vision is not None:
        try:
            filled |= {"visual." + n for n in vision.finish()}
        except CheckpointError as e:
            problems.append(str(e))
    if overflows:
        text = overflow_report(overflows)
        if mode == "error":
            problems.append(f"{text} (QWEN35_FP16_OVERFLOW=error asks for an error; 'warn' saturates them)")
        else:
            (logger or log).warning("qwen35: %s; they saturate to +-%g (QWEN35_FP16_OVERFLOW=error makes this an "
                                    "error)", text, FP16_MAX)
    if problems:
        raise CheckpointError("; ".join(problems))
    return filled


def overflow_report(overflows: list[tuple[str, int, float]]) -> str:
    """One sentence naming the tensors whose values do not fit float16, by name: name (count, largest |x|)."""
    items = [f"{name} ({count} value{'s' if count != 1 else ''}, max |x| {big:.6g})"
             for name, count, big in sorted(overflows)]
    more = f" ... and {len(items) - MAX_NAMES_IN_ERROR} more" if len(items) > MAX_NAMES_IN_ERROR else ""
    return (f"{len(items)} checkpoint tensor{'s' if len(items) != 1 else ''} hold values beyond float16's range "
            f"(|x| > {FP16_MAX:g}) for this float16 model: " + ", ".join(items[:MAX_NAMES_IN_ERROR]) + more)


def _fp16_overflow(piece: torch.Tensor) -> tuple[int, float] | None:
    """(how many values of ``piece`` lie beyond fp16's range, the largest magnitude), or None when all fit."""
    if piece.numel() == 0:
        return None
    lo, hi = torch.aminmax(piece)  # one pass, no copy: the common case is a tensor that fits
    if not (float(hi) > FP16_MAX or float(lo) < -FP16_MAX):
        return None
    big = piece.abs() > FP16_MAX
    return int(big.sum()), float(piece.abs().max())


def _copy(param: torch.Tensor, rule: Rule, tensor: torch.Tensor) -> tuple[int, float] | None:
    """Copy this rank's piece of ``tensor`` into ``param``; returns (count, largest |x|) of values that do not
    fit a float16 ``param`` (saturated to +-65504 there), else None."""
    piece = rule.take(tensor)
    dest = param.data if rule.expert is None else param.data[rule.expert]
    if rule.offset or piece.shape[0] != dest.shape[0]:
        dest = dest.narrow(0, rule.offset, piece.shape[0])
    if dest.shape != piece.shape:
        raise CheckpointError(f"internal: {rule.param} slice {list(dest.shape)} vs checkpoint piece "
                              f"{list(piece.shape)}")
    over = None
    if dest.dtype == torch.float16 and piece.is_floating_point() and piece.dtype != torch.float16:
        over = _fp16_overflow(piece)
        if over is not None:
            piece = piece.float().clamp(-FP16_MAX, FP16_MAX)  # in fp32: bf16 rounds 65504 up to 65536
    dest.copy_(piece)
    return over


def _missing(expected: dict[str, list[list[str]]], seen: set[str]) -> list[str]:
    missing = []
    for alternatives in expected.values():
        if any(all(n in seen for n in names) for names in alternatives):
            continue
        # name what is missing from the alternative that came closest
        best = max(alternatives, key=lambda names: sum(n in seen for n in names))
        missing += [n for n in best if n not in seen]
    return missing


# ----------------------------------------------------------------------------- files


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The safetensors shards of a checkpoint directory (index order when an index exists)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise CheckpointError(f"checkpoint index names shard files that are absent: {_names(missing)}")
    return [os.path.join(path, f) for f in files]


def iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, one at a time (CPU)."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


def load_checkpoint(model: Qwen35Model, path: str | os.PathLike, visual: VisionTower | None = None,
                    overflow: str | None = None) -> set[str]:
    """Load a checkpoint directory's safetensors into ``model`` and ``visual`` (see :func:`load_weights`)."""
    return load_weights(model, iter_safetensors(path), visual=visual, overflow=overflow)
