"""Triton backend (``triton``): the ops of :mod:`qwen35.ops` as Triton kernels.

Imports only torch and triton. Ops not defined here fall back to the next backend in the
probe's policy. Signatures and semantics are those of :mod:`qwen35.ops` (validation happens
there, before dispatch).
"""

from __future__ import annotations

# --- GDN, causal conv1d, norms, decode attention and its q/k norm + rope and output gate: ops exported here ---
from kernels_triton.attention import attention_decode  # noqa: E402, F401
from kernels_triton.attn_glue import qk_norm_rope, sigmoid_gate_mul  # noqa: E402, F401
from kernels_triton.conv1d import causal_conv1d_prefill, causal_conv1d_update  # noqa: E402, F401
from kernels_triton.gdn import chunk_table as gdn_chunk_table  # noqa: E402, F401
from kernels_triton.gdn import gdn_chunk_prefill, gdn_recurrent_step, prepare_gdn_metadata  # noqa: E402, F401
from kernels_triton.norms import rms_norm_gated, rms_norm_zero_centered  # noqa: E402, F401

# isort: split
# --- MoE: ops exported here ---
from kernels_triton.moe import moe_block, moe_experts, moe_route  # noqa: E402,F401


def availability(caps) -> str | None:  # noqa: ANN001 - qwen35.probe.DeviceCaps
    """None when Triton kernels can run on the probed device, else why not."""
    if not caps.triton_runs:
        return caps.triton_note or "triton cannot run on this device"
    if caps.vendor == "nvidia" and caps.capability is not None and caps.capability < (7, 0):
        return f"compute capability {caps.capability} < 7.0"
    return None
