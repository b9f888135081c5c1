"""The op façade: every numerical op of a Qwen3.5 layer, validated, then run on the probed backend.

The ops are declared once, in the op table (:mod:`qwen35.optable`: name, validator, reference, self-test
case, doc); this module makes one function per row, with the op's signature and doc, plus the per-batch
helpers of the GDN prefill (:func:`prepare_gdn_metadata`, :func:`gdn_chunk_table`).

Conventions (written once here; every backend follows them)
-------------------------------------------------------------
Tokens are flattened: a batch of N sequences is one ``[T, ...]`` tensor plus ``cu_seqlens``
(int32/int64 offsets ``[N+1]``, ``cu_seqlens[0] = 0``, non-decreasing, ``cu_seqlens[N] = T``;
``None`` means one sequence of length T). Sequences of length 0 are allowed.

GDN heads: ``H`` key heads of dim ``K`` (q, k), ``HV`` value heads of dim ``V`` (v, outputs),
``HV`` a multiple of ``H``; value head ``j`` reads key head ``j // (HV // H)``.

Gating, per token and value head: ``g`` is the log-decay (fp32, <= 0) and ``beta`` the write
strength in (0, 1) (post-sigmoid). Either pass ``g`` and ``beta``, or pass the raw projections
``a``, ``b`` ``[T, HV]`` with ``A_log``, ``dt_bias`` ``[HV]`` and the op computes
``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` in fp32. The gating tensors may be
views into a wider buffer (e.g. columns of one projection output) as long as each row's HV values are
adjacent; q, k and v are contiguous.

Recurrent state: ``S`` per sequence is ``[HV, K, V]`` fp32, updated per token as
``S <- exp(g) S;  S <- S + beta k (v - S^T k)^T;  o = S^T q`` (q, k optionally L2-normalised,
q scaled by ``scale``, default ``K**-0.5``). States live either in plain tensors
``[N, HV, K, V]`` or in a **state pool** ``[num_slots, HV, K, V]`` fp32 addressed by slot
indices (int32/int64); a negative slot is padding: that sequence starts from zeros and its state
is not written (prefill), or the row is skipped and its output is zero (decode). Pools (state and
conv) need each slot's block contiguous but may have a larger slot stride: a strided view into a
bigger buffer (vLLM packs a block's conv and recurrent state into one page) is used in place.

Conv state: the depthwise causal conv over ``D`` channels with window ``W`` keeps the last
``W - 1`` inputs per sequence in a **conv pool** ``[num_slots, D, W - 1]`` (oldest column
first), in the activation dtype. Conv weights are ``[D, W]`` (HF's ``conv1d.weight[:, 0, :]``).

MoE weights are stacked as in HF checkpoints: ``w13`` ``[E, 2I, H]`` (gate rows then up rows),
``w2`` ``[E, H, I]``; router weight ``[E, H]``; shared expert ``shared_w13`` ``[2Is, H]``,
``shared_w2`` ``[H, Is]``, its gate ``shared_gate_weight`` ``[1, H]``. Routing is softmax over
experts in fp32 -> top-k (ties to the lowest id) -> renormalise; weights fp32, ids int32.
``expert_map`` ``[E]`` (int32) maps global to local expert ids, -1 for experts not held here.

Decode attention (the standalone host's full-attention layers): KV caches per slot
``[num_slots, KV, L, D]`` (``L`` positions per slot), one query per row ``q [B, H, D]`` with
``H`` a multiple of ``KV`` (query head ``j`` reads kv head ``j // (H // KV)``); row ``b`` attends
to keys ``0 .. lengths[b] - 1`` of slot ``slots[b]``. A negative slot is padding (zero output).

Dtypes: activations fp16, bf16, fp32 (fp64 accepted everywhere and always computed by the
reference: it is how tests get ground truth). Outputs come back in the activation dtype;
accumulation is fp32 or better in every backend.

Every op raises ``ValueError`` before touching any buffer when an input is off, naming the
value and what is accepted. Checks that read tensor values (cu_seqlens, slots) synchronise the
device; they are skipped while a CUDA graph is captured, when ``QWEN35_CHECK_VALUES=0``, and for
accelerator tensors inside :func:`host_built_inputs` (the model hosts run their forward in it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import numpy as np
import torch

from qwen35 import _checks as chk
from qwen35 import backends, optable, probe, validate

host_built_inputs = chk.host_built_inputs
MAX_SPEC_TOKENS = validate.MAX_SPEC_TOKENS


def _facade(op: optable.Op) -> Callable:
    """The façade function of one table row: validate, then run the implementation the probe chose for the
    device and dtype of the op's first argument (the reference for fp64 inputs, which is how tests get ground
    truth)."""
    name, check, ref, call = op.name, op.validate, op.reference, op.call
    params = inspect.signature(check).parameters
    first = next(iter(params))

    def run(*args, **kwargs):
        check(*args, **kwargs)
        x = args[0] if args else kwargs[first]
        fn = ref if x.dtype == torch.float64 else probe.implementation(name, x.device, x.dtype)
        return fn(*args, **kwargs) if call is None else call(fn, *args, **kwargs)

    run.__name__ = run.__qualname__ = name
    run.__module__ = __name__
    run.__doc__ = inspect.cleandoc(op.doc)
    run.__signature__ = inspect.Signature(list(params.values()),
                                          return_annotation=inspect.signature(ref).return_annotation)
    return run


# One function per row of the op table: qwen35.ops.gdn_chunk_prefill(...) and so on.
globals().update({op.name: _facade(op) for op in optable.OPS})

__all__ = [*optable.NAMES, "prepare_gdn_metadata", "gdn_chunk_table", "host_built_inputs", "MAX_SPEC_TOKENS"]


def gdn_chunk_table(offsets: Sequence[int], device: torch.device | str) -> np.ndarray | None:
    """The host half of :func:`prepare_gdn_metadata`, for a host that sends its own per-step data to the device.

    Returns the int32 array that the backend ``gdn_chunk_prefill`` uses on ``device`` wants on the device for a
    batch of sequences at ``offsets`` (the values of ``cu_seqlens``), or ``None`` when that backend takes no
    table. Copy it to the device with the step's other data (one transfer instead of one per table) and pass
    the device copy as ``prepare_gdn_metadata(cu_seqlens, offsets=offsets, table=...)``.
    """
    if isinstance(offsets, torch.Tensor) or not len(offsets):
        raise ValueError(f"offsets must be a non-empty list of host ints (the values of cu_seqlens), got {offsets!r}")
    device = torch.device(device)
    choice = probe.choose("gdn_chunk_prefill", device)
    build = getattr(backends.load(choice.backend), "gdn_chunk_table", None)
    if not callable(build):
        return None
    return build(chk.host_offsets("offsets", offsets, len(offsets)))


def prepare_gdn_metadata(cu_seqlens: torch.Tensor, chunk_size: int = 64, *,
                         offsets: Sequence[int] | None = None, table: torch.Tensor | None = None,
                         chunk_indices: torch.Tensor | None = None) -> object | None:
    """Per-batch data for :func:`gdn_chunk_prefill` (e.g. chunk indices), computed once per batch.

    Asks the backend that ``gdn_chunk_prefill`` uses on ``cu_seqlens``' device; ``None`` when that
    backend needs none. Pass the result as ``metadata=`` to every GDN layer of the batch so the
    op itself does no host synchronisation. ``offsets``: the values of ``cu_seqlens`` when the caller
    has them on the host (a host that built the batch does), so the backend need not read them back
    from the device, which waits for all work queued before. ``table``: the device copy of
    :func:`gdn_chunk_table` of ``offsets`` (needs ``offsets``): the backend then copies nothing.
    ``chunk_indices``: ``[n, 2]`` int (sequence, chunk within it) pairs of ``chunk_size``-token chunks on the
    device, as FLA's ``prepare_chunk_indices`` (and vLLM's GDN metadata) hold them: the backend derives its
    data from them on the device, with no read-back and no host offsets.
    """
    chk.tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=chk.INDEX_DTYPES)
    chk.positive_int("chunk_size", chunk_size, maximum=256)
    if offsets is not None:
        offsets = chk.host_offsets("offsets", offsets, cu_seqlens.shape[0])
    if table is not None:
        if offsets is None:
            raise ValueError("table needs offsets: the values of cu_seqlens it was built from")
        chk.tensor("table", table, device=cu_seqlens.device, dtypes=(torch.int32,))
    if chunk_indices is not None:
        if offsets is not None or table is not None:
            raise ValueError("pass chunk_indices alone, or offsets (with an optional table), not both")
        chk.tensor("chunk_indices", chunk_indices, ndim=2, device=cu_seqlens.device, dtypes=chk.INDEX_DTYPES)
        chk.shape("chunk_indices", chunk_indices, [None, 2])
    choice = probe.choose("gdn_chunk_prefill", cu_seqlens.device)
    prepare = getattr(backends.load(choice.backend), "prepare_gdn_metadata", None)
    if not callable(prepare):
        return None
    if chunk_indices is not None:
        return prepare(cu_seqlens, chunk_size, chunk_indices=chunk_indices)
    if offsets is None:
        return prepare(cu_seqlens, chunk_size)
    return prepare(cu_seqlens, chunk_size, offsets=offsets, table=table)
