"""Triton MoE: fused routing, on-device token alignment, grouped GEMMs (SiLU-mul and router-weight
epilogues), deterministic top-k combine, shared expert in the same pipeline. See :mod:`.ops`."""

from kernels_triton.moe.ops import moe_block, moe_experts, moe_route

__all__ = ["moe_route", "moe_experts", "moe_block"]
