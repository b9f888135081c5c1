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
- The tuner's search spaces: :data:`SCAN_SEARCH_SPACE` / :func:`scan_search_space` / :func:`scan_excluded` (the
  ``gdn_chunk_scan`` file), :data:`STEP_SEARCH_SPACE` / :func:`step_search_space` / :func:`step_excluded` (the
  ``gdn_recurrent_step`` file); :func:`scan_forced`: the forced scan config that runs what the plan makes of a
  scan config.
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
    SCAN_SEARCH_SPACE,
    SEGMENT_WEIGHTS,
    Plan,
    default_scan_t,
    plan_for,
    prepare_config,
    scan_config,
    scan_excluded,
    scan_search_space,
    scan_t_fits,
    segment_cuts,
    sequence_groups,
    workspace_dtype,
)
from kernels_triton.gdn.recurrent import STEP_SEARCH_SPACE, step_excluded, step_search_space

__all__ = ["CHUNK", "ONE_PASS_SEGMENT_RATIO", "PREFILL_KERNELS", "SCAN_OP", "SCAN_SEARCH_SPACE", "SEGMENT_WEIGHTS",
           "STEP_OP", "STEP_SEARCH_SPACE", "Plan", "chunk_offsets", "cut_scan_config", "decode_config",
           "gdn_chunk_prefill", "gdn_recurrent_step", "plan_for", "prepare_config", "scan_config", "scan_excluded",
           "scan_forced", "scan_search_space", "scan_shape_key", "segment_cuts", "sequence_groups", "step_excluded",
           "step_search_space", "step_shape_key", "suggested_segment_chunks", "workspace_dtype"]

SCAN_OP, STEP_OP = "gdn_chunk_scan", "gdn_recurrent_step"  # their tuned-config files

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


def scan_shape_key(HV: int, V: int, dtype: torch.dtype) -> str:
    """The ``gdn_chunk_scan`` file's shape key (token buckets: tokens per sequence)."""
    return f"HV={HV},V={V},dtype={str(dtype).replace('torch.', '')}"


def step_shape_key(HV: int, V: int) -> str:
    """The ``gdn_recurrent_step`` file's shape key (token buckets: batch rows)."""
    return f"HV={HV},V={V}"


def scan_forced(cfg: dict, K: int, V: int) -> dict:
    """The forced ``scan`` config (:func:`gdn_chunk_prefill`) that runs what the plan makes of a scan config (a
    :func:`scan_config` result: the heuristic's, or a tuned entry's): ``SCAN_T`` as the plan sets it where the config
    does not (a forced config leaves it off). Idempotent."""
    split = bool(cfg.get("SPLIT", False))
    return {**cfg, "SCAN_T": bool(cfg.get("SCAN_T", default_scan_t(split))) and scan_t_fits(K, V, split)}
