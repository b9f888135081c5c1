"""Entry points of the MoE kernels for benchmarks, the tuner and tests: each launch group of ``moe_block`` on its
own (to time where the GPU time goes), the launch configs the ops choose, and the knobs that A/B comparisons flip.
Not for model code: :func:`kernels_triton.moe_block` runs the whole pipeline and chooses its own configs.

The general pipeline (:mod:`.ops`), stage by stage:

- :func:`router_logits` -> :func:`route_and_align` (routing + alignment; :func:`route` and :func:`align` apart);
- :func:`gate_up` -> :func:`down` -> :func:`combine`, with a :class:`GemmConfig` each (:func:`configs`: the op's
  pair; :func:`heuristic`: the fallback; ``tma=``, ``sub=``, ``tiles_n=``, ``pdl=``, ``done=`` force the choices
  the op makes by itself).

The tuner's search space of the two GEMMs: :data:`SEARCH_SPACE`, :func:`search_space`, :func:`excluded`,
:func:`block_m_cap`.

One token (:mod:`.decode`): :func:`route_one` -> :func:`gate_up_one` -> :func:`down_one`, or
:func:`moe_block_one_token` for all three; :func:`decode_config` is their launch shape.

Environment switches read at each call: ``QWEN35_MOE_PDL`` (:data:`PDL_ENV`) and ``QWEN35_MOE_DECODE``
(:data:`DECODE_ENV`, ``0``: one token through the general pipeline).
"""

from __future__ import annotations

from kernels_triton._arrival import block_counters
from kernels_triton.moe.align import Alignment, align, route_and_align
from kernels_triton.moe.config import (
    DOWN_OP,
    GATE_UP_OP,
    SEARCH_SPACE,
    GemmConfig,
    block_m_cap,
    block_m_for,
    configs,
    excluded,
    heuristic,
    search_space,
    shape_key,
)
from kernels_triton.moe.decode import ENV as DECODE_ENV
from kernels_triton.moe.decode import (
    DecodeConfig,
    decode_config,
    down_one,
    gate_up_one,
    moe_block_one_token,
    route_one,
)
from kernels_triton.moe.decode import enabled as decode_path_enabled
from kernels_triton.moe.experts import combine, down, gate_up, sub_levels
from kernels_triton.moe.pdl import ENV as PDL_ENV
from kernels_triton.moe.pdl import enabled as pdl_enabled
from kernels_triton.moe.routing import route, router_logits

__all__ = ["DECODE_ENV", "DOWN_OP", "GATE_UP_OP", "PDL_ENV", "SEARCH_SPACE", "Alignment", "DecodeConfig", "GemmConfig",
           "align", "block_counters", "block_m_cap", "block_m_for", "combine", "configs", "decode_config",
           "decode_path_enabled", "down", "down_one", "excluded", "gate_up", "gate_up_one", "heuristic",
           "moe_block_one_token", "pdl_enabled", "route", "route_and_align", "route_one", "router_logits",
           "search_space", "shape_key", "sub_levels"]
