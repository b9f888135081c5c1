"""Launch configs for the MoE grouped GEMMs: tuned JSON first, else a documented heuristic.

Two files per device, written by ``tuning/bench_moe.py --tune``: ``moe_gate_up.json`` (the
``[slots, H] x [H, 2I]`` GEMM, shape key ``E=<local experts>,N=<2I>,K=<H>,dtype=<dtype>``) and
``moe_down.json`` (``[slots, I] x [I, H]``, key ``E=..,N=<H>,K=<I>,dtype=..``), token buckets =
tokens M. Each entry holds ``BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages``.

Alignment pads every expert's group of token-slots to a multiple of ``BLOCK_M``, so both GEMMs
must use one ``BLOCK_M``: the gate_up entry's value wins and the down entry's is overridden.

Heuristic (no file or no entry; :mod:`kernels_triton._config` logs one INFO line per shape):

- ``BLOCK_M`` follows the mean number of token-slots per expert, ``M*k/E``: 16 up to 16 (the
  decode path: with ``M <= 16`` each active expert is one block, so its weights are read once),
  then 32, 64, and 128 from 96 up.
- Up to ``BLOCK_M = 32`` the GEMMs are weight-streaming: narrow ``BLOCK_N`` (32 for gate_up,
  which reads gate and up rows, 64 for down) to spread the weights over many programs, deep
  ``BLOCK_K`` (256 / 128) and 4 stages to keep bytes in flight.
- From ``BLOCK_M = 64``: tensor-core tiles, ``BLOCK_N = 128``, ``BLOCK_K = 64``, 8 warps at
  ``BLOCK_M = 128``, 3 stages (gate_up holds two accumulators) or 4 (down).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels_triton import _config

GATE_UP_OP, DOWN_OP = "moe_gate_up", "moe_down"
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


@dataclass(frozen=True)
class GemmConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in KEYS}


def shape_key(E: int, N: int, K: int, dtype: torch.dtype) -> str:
    return f"E={E},N={N},K={K},dtype={str(dtype).replace('torch.', '')}"


def _pow2_at_most(n: int, cap: int) -> int:
    p = 16
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def block_m_for(M: int, top_k: int, E: int) -> int:
    """BLOCK_M from the mean token-slots per expert (see module docstring)."""
    per_expert = M * top_k / max(E, 1)
    if M <= 16 or per_expert <= 16:
        return 16
    if per_expert <= 32:
        return 32
    if per_expert <= 96:
        return 64
    return 128


def heuristic(which: str, M: int, top_k: int, E: int, N: int, K: int) -> GemmConfig:
    """The documented fallback config for ``which`` in ('gate_up', 'down')."""
    bm = block_m_for(M, top_k, E)
    gate_up = which == "gate_up"
    if bm <= 32:
        bn = _pow2_at_most(N // 2 if gate_up else N, 32 if gate_up else 64)
        return GemmConfig(bm, bn, _pow2_at_most(K, 256 if gate_up else 128), 4, 4)
    bn = _pow2_at_most(N // 2 if gate_up else N, 128)
    return GemmConfig(bm, bn, _pow2_at_most(K, 64), 8 if bm == 128 else 4, 3 if gate_up else 4)


def _from_entry(entry: dict | None) -> GemmConfig | None:
    if not entry or any(k not in entry for k in KEYS):
        return None
    return GemmConfig(*(int(entry[k]) for k in KEYS))


@functools.lru_cache(maxsize=4096)
def configs(M: int, top_k: int, E: int, H: int, I: int, dtype: torch.dtype,
            device: torch.device) -> tuple[GemmConfig, GemmConfig]:
    """(gate_up, down) configs for M tokens routed to top_k of E local experts; one BLOCK_M for both."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    up = _from_entry(_config.lookup(GATE_UP_OP, name, shape_key(E, 2 * I, H, dtype), M))
    down = _from_entry(_config.lookup(DOWN_OP, name, shape_key(E, H, I, dtype), M))
    up = up or heuristic("gate_up", M, top_k, E, 2 * I, H)
    down = down or heuristic("down", M, top_k, E, H, I)
    if down.BLOCK_M != up.BLOCK_M:
        down = GemmConfig(up.BLOCK_M, down.BLOCK_N, down.BLOCK_K, down.num_warps, down.num_stages)
    return up, down
