"""Plain-PyTorch reference ops: the backend named ``reference`` and the ground truth for all others.

Every function here has exactly the signature of the façade op of the same name in
:mod:`qwen35.ops`; the façade validates, this module only computes (fp32, or fp64 for fp64 inputs).
"""

from qwen35.reference.attention import attention_decode, qk_norm_rope, sigmoid_gate_mul
from qwen35.reference.conv import causal_conv1d_prefill, causal_conv1d_update
from qwen35.reference.gdn import gdn_chunk_prefill, gdn_recurrent_step
from qwen35.reference.moe import moe_block, moe_experts, moe_route
from qwen35.reference.norm import rms_norm_gated, rms_norm_zero_centered

__all__ = [
    "attention_decode",
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "gdn_chunk_prefill",
    "gdn_recurrent_step",
    "moe_block",
    "moe_experts",
    "moe_route",
    "qk_norm_rope",
    "rms_norm_gated",
    "rms_norm_zero_centered",
    "sigmoid_gate_mul",
]


def availability(caps) -> str | None:  # noqa: ANN001 - DeviceCaps, kept import-free
    """The reference runs wherever torch runs."""
    return None
