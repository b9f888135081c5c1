"""Entry points of the GDN kernels for benchmarks, the tuner and tests: the ops with forced launch configs, and the
choices the ops make, by name. Not for model code: the ops in :mod:`kernels_triton` choose their own configs.

- :func:`gdn_chunk_prefill`: the prefill with ``prepare`` / ``scan`` configs forced over the plan's (see
  :meth:`Plan.with_configs` for the keys); a forced config also turns off the single-launch path of batches of at
  most ``CHUNK`` tokens, so the two phases can be timed apart (each is its own kernel in a profile:
  :data:`PREFILL_KERNELS`).
- :func:`gdn_recurrent_step`: the decode step with a forced ``config`` (``BV``, ``num_warps``, ``num_stages``,
  ``STREAM``, ``PDL``).
- :func:`plan_for`, :func:`scan_config`, :func:`prepare_config`, :func:`decode_config`: what the ops would choose
  (caches clear with :func:`kernels_triton.bench_api.clear_config_cache`).
- :func:`cut_scan_config`, :func:`suggested_segment_chunks`: a forced scan config that takes the cut-and-correct path
  (:mod:`kernels_triton.gdn.cut`, off in every default plan), and its suggested segment length.
"""

from __future__ import annotations

import torch

from kernels_triton.gdn import launch, recurrent
from kernels_triton.gdn.cut import cut_scan_config, suggested_segment_chunks
from kernels_triton.gdn.metadata import CHUNK, chunk_offsets
from kernels_triton.gdn.plan import (
    ONE_PASS_SEGMENT_RATIO,
    SEGMENT_WEIGHTS,
    Plan,
    plan_for,
    prepare_config,
    scan_config,
    segment_cuts,
    sequence_groups,
    workspace_dtype,
)

__all__ = ["CHUNK", "ONE_PASS_SEGMENT_RATIO", "PREFILL_KERNELS", "SEGMENT_WEIGHTS", "Plan", "chunk_offsets",
           "cut_scan_config", "decode_config", "gdn_chunk_prefill", "gdn_recurrent_step", "plan_for", "prepare_config",
           "scan_config", "segment_cuts", "sequence_groups", "suggested_segment_chunks", "workspace_dtype"]

# The prefill's kernels by role, as they are named in a profile.
PREFILL_KERNELS = {"prepare": "_chunk_prepare_kernel", "scan": "_chunk_scan_kernel",
                   "output": "_chunk_output_kernel", "single": "_chunk_single_kernel",
                   "cut_local": "_cut_local_kernel", "cut_correct": "_cut_correct_kernel"}


def gdn_chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, prepare: dict | None = None,
                      scan: dict | None = None, g: torch.Tensor | None = None, beta: torch.Tensor | None = None,
                      a: torch.Tensor | None = None, b: torch.Tensor | None = None, A_log: torch.Tensor | None = None,
                      dt_bias: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                      initial_state: torch.Tensor | None = None, state_pool: torch.Tensor | None = None,
                      state_slots: torch.Tensor | None = None, has_initial_state: torch.Tensor | None = None,
                      output_final_state: bool = False, scale: float | None = None, use_qk_l2norm: bool = False,
                      metadata: object | None = None,
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kernels_triton.gdn_chunk_prefill` with the ``prepare`` and ``scan`` configs forced (either may be None:
    the plan's). Bad keys or values raise ValueError naming them."""
    return launch.prefill(q, k, v, g, beta, a, b, A_log, dt_bias, cu_seqlens, initial_state, state_pool, state_slots,
                          has_initial_state, output_final_state, scale, use_qk_l2norm, metadata, out,
                          (prepare, scan))


def gdn_recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, state_pool: torch.Tensor,
                       state_slots: torch.Tensor, config: dict | None = None, g: torch.Tensor | None = None,
                       beta: torch.Tensor | None = None, a: torch.Tensor | None = None, b: torch.Tensor | None = None,
                       A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                       scale: float | None = None, use_qk_l2norm: bool = False,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`kernels_triton.gdn_recurrent_step` with ``config`` forced: with ``BV`` it replaces the heuristic's
    config, without (e.g. ``{"PDL": False}``) it overrides those keys only."""
    return recurrent.step(q, k, v, state_pool, state_slots, g, beta, a, b, A_log, dt_bias, scale, use_qk_l2norm, out,
                          config or None)


def decode_config(device: torch.device, B: int, HV: int, V: int) -> dict:
    """The decode step's config for B rows of HV value heads of width V (tuned entry or heuristic)."""
    return dict(recurrent.step_config(device, B, HV, V))
