"""The op table: every numerical op of the façade, declared once.

One row per op: its name, the function that validates its inputs (whose signature is the op's signature),
its plain-PyTorch reference, its self-test case with the tolerance per compute dtype, and its doc. Everything
that lists the ops derives from this table: the façade functions (:mod:`qwen35.ops`), the registry's op list
(:data:`qwen35.backends.OPS`), the probe's choices and report (:mod:`qwen35.probe`) and the self-test
(:mod:`qwen35.selftest`). A backend implements an op by defining a function with the op's name (and
signature) in its module; the registry looks it up by name.

Adding an op:

1. a row below;
2. its validator, a function with the op's name and signature in :mod:`qwen35.validate`;
3. its self-test case, a function with the op's name in :mod:`qwen35.cases`;
4. its reference in ``qwen35/reference/``, exported from ``qwen35/reference/__init__.py``;
5. then any backend functions of that name (``kernels_triton/__init__.py``, ...).

``tests/test_optable.py`` checks every row: reference and validator signatures agree, the case validates and
runs, a doc and a tolerance per dtype exist, the façade, the registry and ``qwen35-probe --json`` list exactly
these ops.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from qwen35 import cases, reference, validate

# Self-test budget (relative error against the fp64 reference) per compute dtype: loose enough for tf32/bf16
# dots, tight enough that a wrong kernel (sign, index, missing term) cannot pass.
SELFTEST_TOLERANCE: Mapping[torch.dtype, float] = {
    torch.float16: 1e-2, torch.bfloat16: 2.5e-2, torch.float32: 5e-3, torch.float64: 1e-9}


@dataclass(frozen=True)
class Op:
    """One op of the façade.

    ``validate``: raises ValueError for bad inputs; its signature is the op's. ``reference``: the ground truth,
    same signature (less any façade-only parameters that ``call`` consumes). ``case``: ``(device, dtype,
    generator) -> cases.Case``, the self-test input. ``tolerance``: the self-test's rel-err budget per compute
    dtype. ``call``: how the façade runs the chosen implementation when not as ``impl(*args, **kwargs)``,
    as ``call(impl, *args, **kwargs)``.
    """

    name: str
    validate: Callable[..., None]
    reference: Callable
    case: Callable[[torch.device, torch.dtype, torch.Generator], cases.Case]
    doc: str
    tolerance: Mapping[torch.dtype, float] = field(default_factory=lambda: dict(SELFTEST_TOLERANCE))
    call: Callable | None = None


# ----------------------------------------------------------------------------- façade-side calls

_TAKES_PLANES: dict[object, bool] = {}


def conv_by_planes(fn: Callable, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   planes: tuple[int, ...] | None = None, conv_pool: torch.Tensor | None = None,
                   **kw) -> torch.Tensor:
    """A conv op over a plane-layout x: in one call where the backend takes ``planes``, else plane by plane
    (each plane a ``[rows, width]`` block of x's memory, convolved with its channels' weights and history)."""
    if planes is None:
        return fn(x, weight, bias, conv_pool=conv_pool, **kw)
    planes = tuple(planes)
    takes = _TAKES_PLANES.get(fn)
    if takes is None:
        takes = _TAKES_PLANES[fn] = "planes" in inspect.signature(fn).parameters
    if takes:
        return fn(x, weight, bias, conv_pool=conv_pool, planes=planes, **kw)
    rows = x.shape[0]
    flat, y = x.view(-1), torch.empty_like(x)
    at = ch = 0
    for n in planes:
        if n:
            part = slice(ch, ch + n)
            y.view(-1)[at:at + rows * n].view(rows, n).copy_(fn(
                flat[at:at + rows * n].view(rows, n), weight[part], None if bias is None else bias[part],
                conv_pool=None if conv_pool is None else conv_pool[:, part], **kw))
        at, ch = at + rows * n, ch + n
    return y


# ----------------------------------------------------------------------------- the table
# Layouts, dtypes and the gating / state / pool conventions the docs refer to are stated once, in qwen35.ops.

OPS: tuple[Op, ...] = (
    # -- Gated DeltaNet
    Op("gdn_chunk_prefill", validate.gdn_chunk_prefill, reference.gdn_chunk_prefill, cases.gdn_chunk_prefill,
       doc="""Gated delta rule over whole prompts (chunked form), varlen.

       q, k ``[T, H, K]``; v ``[T, HV, V]``; gating as in :mod:`qwen35.ops`.
       Initial states: ``initial_state`` ``[N, HV, K, V]`` fp32, **or** ``state_pool`` with
       ``state_slots`` ``[N]`` (and optionally ``has_initial_state`` ``[N]`` bool: where False the
       sequence starts from zeros whatever the slot holds). With a pool, every sequence's final
       state is written back to its slot in place and the second result is ``None``; otherwise the
       final states ``[N, HV, K, V]`` fp32 are returned when ``output_final_state``.
       ``metadata``: optional per-batch data from the chosen backend's ``prepare_gdn_metadata``
       (computed once per batch, shared by all layers); ``None`` is always accepted.
       ``out``: optional ``[T, HV, V]`` contiguous tensor of q's dtype, not overlapping any input, that receives
       ``o`` (a caller's buffer: no copy of the result); it is then the first result.
       Returns ``(o [T, HV, V] in q's dtype, final_state or None)``.
       """),
    Op("gdn_recurrent_step", validate.gdn_recurrent_step, reference.gdn_recurrent_step, cases.gdn_recurrent_step,
       doc="""Decode: 1 <= T <= 8 new tokens for each of B sequences, recurrent form, state pool in place.

       q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; gating ``[B, T, HV]``; ``state_slots`` ``[B]``
       (negative = padding row: state untouched, output zero). Returns o ``[B, T, HV, V]``: ``out`` when given
       (contiguous, q's dtype, not overlapping any input).
       """),
    # -- depthwise causal conv1d
    Op("causal_conv1d_prefill", validate.causal_conv1d_prefill, reference.causal_conv1d_prefill,
       cases.causal_conv1d_prefill, call=conv_by_planes,
       doc="""Depthwise causal conv over whole prompts, varlen. x ``[T, D]`` -> ``[T, D]``.

       ``planes`` (1 to 3 widths summing to D): x's memory holds planes ``[T, planes[p]]`` back to back (channels
       in order; GDN's q | k | v) instead of rows of D channels; the output has the same layout.

       With ``conv_pool`` + ``conv_slots`` ``[N]``, each sequence's window starts from its slot's
       history (zeros where ``has_initial_state`` is False or the slot is negative) and the last
       ``W - 1`` inputs (history included, for sequences shorter than that) are written back.
       """),
    Op("causal_conv1d_update", validate.causal_conv1d_update, reference.causal_conv1d_update,
       cases.causal_conv1d_update, call=conv_by_planes,
       doc="""Decode: one new token per row. x ``[B, D]``; pool updated in place; negative slots skipped (zero
       output). ``planes`` as in :func:`causal_conv1d_prefill` (planes of B rows).
       """),
    # -- norms
    Op("rms_norm_gated", validate.rms_norm_gated, reference.rms_norm_gated, cases.rms_norm_gated,
       doc="""GDN output norm over the last dim: ``x / rms(x) * weight * silu(z)``; shape and dtype of x."""),
    Op("rms_norm_zero_centered", validate.rms_norm_zero_centered, reference.rms_norm_zero_centered,
       cases.rms_norm_zero_centered,
       doc="""Zero-centred RMSNorm over the last dim: ``x / rms(x) * (1 + weight)``.

       With ``residual``: ``s = x + residual`` (in x's dtype) is normalised and ``(norm(s), s)`` is
       returned, so the caller carries ``s`` as the next residual.
       """),
    # -- mixture of experts
    Op("moe_route", validate.moe_route, reference.moe_route, cases.moe_route,
       doc="""softmax (fp32) -> top-k (ties to the lowest id) -> renormalise.

       router_logits ``[M, E]``. Returns (weights fp32 ``[M, k]``, ids int32 ``[M, k]``).
       """),
    Op("moe_experts", validate.moe_experts, reference.moe_experts, cases.moe_experts,
       doc="""Routed expert MLPs and the weighted top-k sum. x ``[M, H]`` -> ``[M, H]`` in x's dtype.

       ``topk_ids`` hold global expert ids; with ``expert_map`` ids mapping to -1 contribute nothing
       (another rank holds them), so the caller all-reduces across expert-parallel ranks.
       """),
    Op("moe_block", validate.moe_block, reference.moe_block, cases.moe_block,
       doc="""A whole MoE block in one call: router -> routing -> experts -> + sigmoid-gated shared expert.

       x ``[M, H]`` -> ``[M, H]``. Under tensor parallelism pass this rank's expert / shared-expert
       slices (I split); the router and gate are replicated; the caller all-reduces the result.
       """),
    # -- full attention (the standalone host's decode, and the layer's glue)
    Op("attention_decode", validate.attention_decode, reference.attention_decode, cases.attention_decode,
       doc="""One decode query per row over its slot's cached keys; returns ``[B, H, D]`` in q's dtype.

       q ``[B, H, D]``; k_cache, v_cache ``[num_slots, KV, L, D]`` (same dtype as q); slots, lengths
       ``[B]`` int32/int64 with ``0 <= lengths[b] <= L`` (the keys row b sees, its own included).
       Shapes alone fix the work launched, so the op can be captured in a CUDA graph and replayed
       as lengths grow.
       """),
    Op("qk_norm_rope", validate.qk_norm_rope, reference.qk_norm_rope, cases.qk_norm_rope,
       doc="""The attention layer's q/k preparation: every head of q ``[T, Hq, D]`` and k ``[T, Hk, D]``
       normalised (zero-centred RMSNorm, ``q_weight`` / ``k_weight`` ``[D]``), then its first
       ``R = 2 * cos.shape[-1]`` dims rotated NeoX-style (halves ``x1 = y[:R/2]``, ``x2 = y[R/2:R]`` ->
       ``x1 c - x2 s``, ``x2 c + x1 s``; the other dims pass), all in fp32. cos, sin ``[T, R/2]`` fp32. q and k
       may be strided views (last dim contiguous, e.g. column slices of the QKV projection); returns new
       contiguous (q, k) in their dtype.
       """),
    Op("sigmoid_gate_mul", validate.sigmoid_gate_mul, reference.sigmoid_gate_mul, cases.sigmoid_gate_mul,
       doc="""The attention output gate: ``x * sigmoid(gate)`` in fp32, both ``[T, H, D]`` (strided views
       allowed, last dim contiguous), returned contiguous in x's dtype.
       """),
)

NAMES: tuple[str, ...] = tuple(op.name for op in OPS)
_BY_NAME: dict[str, Op] = {op.name: op for op in OPS}


def get(name: str) -> Op:
    """The row of op ``name``; ValueError naming the ops when there is none."""
    op = _BY_NAME.get(name)
    if op is None:
        raise ValueError(f"unknown op {name!r}; ops: {', '.join(NAMES)}")
    return op
