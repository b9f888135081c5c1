"""Launch configs for the MoE grouped GEMMs: tuned JSON first, else a documented heuristic.

Two files per device, written by ``qwen35-tune`` (:mod:`tuning.tune`): ``moe_gate_up.json`` (the
``[slots, H] x [H, 2I]`` GEMM, shape key ``E=<local experts>,N=<2I>,K=<H>,dtype=<dtype>``) and
``moe_down.json`` (``[slots, I] x [I, H]``, key ``E=..,N=<H>,K=<I>,dtype=..``), token buckets =
tokens M. Each entry holds ``BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages``.

Alignment pads every expert's group of token-slots to a multiple of ``BLOCK_M``, so both GEMMs
must use one ``BLOCK_M``: the gate_up entry's value wins and the down entry's is overridden.

Heuristic (no file or no entry; :mod:`kernels_triton._config` logs one INFO line per shape),
read off the H200 sweeps (``tuning/notes_moe.md``):

- ``BLOCK_M`` follows the mean number of token-slots per expert, ``M*k/E``: 16 up to 12 (and
  always for ``M <= 16``, the decode path: each active expert is one block, its weights read
  once), 64 up to 32, else 128 (its short last blocks run shorter tiles, ``experts.sub_levels``;
  with them 128-row blocks beat 64-row ones from ~40 slots per expert; measured: gate_up + down at 35B M=2048
  504 against 523 µs).
- ``BLOCK_M = 16`` streams weights: gate_up ``BLOCK_N`` 64 x ``BLOCK_K`` 128, 4 stages, except at ``M <= 16``
  when that gives fewer than 64 programs (~``M * k * I / 64``): then 32 x 256 (more programs); down 128 x 256,
  2 stages, at ``M <= 16`` (where the down launch waits block by block, ``experts.block_wait_default``), else
  128 x 64, 5 stages; 4 warps (measured on the H200 by graph replay, whole block: 397B-TP8 M=16 119.5 µs, 35B-A3B
  M=16 159.0; the H200's tuned files carry these shapes as entries).
- ``BLOCK_M = 64``: 128 x 64 tiles, 4 warps, 4 stages, both GEMMs.
- ``BLOCK_M = 128``: gate_up 128 x 64 (two accumulators), down 256 x 64, both 8 warps and 4
  stages (measured at 35B, 16384 tokens: 1.11 + 0.72 ms against 1.23 + 0.76 with 3 stages; 64-row tiles re-read A
  and B from L2 twice as often).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from kernels_triton import _config

GATE_UP_OP, DOWN_OP = "moe_gate_up", "moe_down"
BUCKET_REACH = 4  # see _near
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
    if M <= 16 or per_expert <= 12:
        return 16
    return 64 if per_expert <= 32 else 128


SMALL_M = 16  # token counts whose BLOCK_M = 16 configs differ (see the module docstring)
MIN_GATE_UP_PROGRAMS = 64  # below this many 64-wide gate_up programs at SMALL_M tokens, 32-wide ones


def heuristic(which: str, M: int, top_k: int, E: int, N: int, K: int) -> GemmConfig:
    """The documented fallback config for ``which`` in ('gate_up', 'down')."""
    bm = block_m_for(M, top_k, E)
    n_cols = N // 2 if which == "gate_up" else N
    if bm == 16:
        if which == "gate_up":
            few = M <= SMALL_M and min(M * top_k, E) * -(-n_cols // 64) < MIN_GATE_UP_PROGRAMS
            bn, bk, warps, stages = (32, 256, 4, 4) if few else (64, 128, 4, 4)
        else:
            bn, bk, warps, stages = (128, 256, 4, 2) if M <= SMALL_M else (128, 64, 4, 5)
    elif bm == 64:
        bn, bk, warps, stages = 128, 64, 4, 4
    else:
        bn, bk, warps, stages = (128, 64, 8, 4) if which == "gate_up" else (256, 64, 8, 4)
    return GemmConfig(bm, _pow2_at_most(n_cols, bn), _pow2_at_most(K, bk), warps, stages)


def _near(entry: dict | None, M: int) -> dict | None:
    """A tuned entry only counts within BUCKET_REACH x of the token count it was tuned at.

    Far from any tuned bucket the tile shape that won there says little (a 1024-token winner ran
    TP8 at 16384 tokens with half the heuristic's rows per tile); the heuristic is the better guess.
    The lookup returns the nearest bucket's entry, which carries its bucket as ``"M"`` when the
    tuner wrote it; older files without it are trusted as before.
    """
    if entry is None or "M" not in entry:
        return entry
    tuned = max(int(entry["M"]), 1)
    return entry if tuned / BUCKET_REACH <= M <= tuned * BUCKET_REACH else None


def _from_entry(entry: dict | None) -> GemmConfig | None:
    if not entry or any(k not in entry for k in KEYS):
        return None
    return GemmConfig(*(int(entry[k]) for k in KEYS))


def shared_bytes(which: str, cfg: GemmConfig, elem_bytes: int) -> int:
    """Shared memory the pipelined loads of one program need (Triton buffers num_stages - 1 tiles)."""
    weight_tiles = 2 if which == "gate_up" else 1  # gate_up streams the gate and the up rows
    per_stage = (cfg.BLOCK_M * cfg.BLOCK_K + weight_tiles * cfg.BLOCK_K * cfg.BLOCK_N) * elem_bytes
    return max(cfg.num_stages - 1, 1) * per_stage


def fit_shared_memory(which: str, cfg: GemmConfig, elem_bytes: int, limit: int | None) -> GemmConfig:
    """Fewer stages, then a narrower BLOCK_K, until the config fits ``limit`` bytes (fp32 doubles bf16's need)."""
    if limit is None:
        return cfg
    while shared_bytes(which, cfg, elem_bytes) > limit:
        if cfg.num_stages > 2:
            cfg = GemmConfig(cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.num_warps, cfg.num_stages - 1)
        elif cfg.BLOCK_K > 16:
            cfg = GemmConfig(cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K // 2, cfg.num_warps, cfg.num_stages)
        elif cfg.BLOCK_N > 16:
            cfg = GemmConfig(cfg.BLOCK_M, cfg.BLOCK_N // 2, cfg.BLOCK_K, cfg.num_warps, cfg.num_stages)
        else:
            break
    return cfg


def _shared_limit(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", None) or getattr(props, "shared_memory_per_block", None)


@_config.derived
@functools.lru_cache(maxsize=4096)
def configs(M: int, top_k: int, E: int, H: int, I: int, dtype: torch.dtype,
            device: torch.device) -> tuple[GemmConfig, GemmConfig]:
    """(gate_up, down) configs for M tokens routed to top_k of E local experts; one BLOCK_M for both."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    up = _from_entry(_near(_config.lookup(GATE_UP_OP, name, shape_key(E, 2 * I, H, dtype), M), M))
    down = _from_entry(_near(_config.lookup(DOWN_OP, name, shape_key(E, H, I, dtype), M), M))
    up = up or heuristic("gate_up", M, top_k, E, 2 * I, H)
    down = down or heuristic("down", M, top_k, E, H, I)
    if down.BLOCK_M != up.BLOCK_M:
        down = GemmConfig(up.BLOCK_M, down.BLOCK_N, down.BLOCK_K, down.num_warps, down.num_stages)
    elem, limit = torch.empty((), dtype=dtype).element_size(), _shared_limit(device)
    return fit_shared_memory("gate_up", up, elem, limit), fit_shared_memory("down", down, elem, limit)


# ----------------------------------------------------------------------------- the tuner's search space

# Every value of each launch parameter the tuner may try (both GEMMs; one BLOCK_M for the pair). Pruned per shape and
# device by :func:`excluded`.
SEARCH_SPACE: dict[str, tuple[int, ...]] = {
    "BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (16, 32, 64, 128, 256), "BLOCK_K": (32, 64, 128, 256),
    "num_warps": (2, 4, 8), "num_stages": (2, 3, 4, 5, 6)}
SPACE_HASH = _config.declare_search_space((GATE_UP_OP, DOWN_OP), {"space": SEARCH_SPACE, "rules": 1})
MAX_ACC_PER_THREAD = 128  # fp32 accumulator registers per thread (gate_up holds two accumulators): beyond, spills


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def block_m_cap(M: int, top_k: int, E: int) -> int:
    """The widest BLOCK_M worth trying: twice the mean token-slots per expert (as a power of two), at most 128, at
    least the heuristic's (:func:`block_m_for`). Wider blocks are mostly padding rows."""
    return max(block_m_for(M, top_k, E), min(128, 2 * _pow2_at_least(-(-M * top_k // max(E, 1)))))


def excluded(which: str, cfg: GemmConfig, M: int, top_k: int, E: int, N: int, K: int, dtype: torch.dtype,
             limits: _config.DeviceLimits) -> str | None:
    """Why ``cfg`` is outside the search space of ``which`` ('gate_up': ``[slots, K] x [K, N]`` with N = 2I; 'down':
    ``[slots, K] x [K, N]`` with K = I) at M tokens on a device with ``limits``, or None: a value not in
    :data:`SEARCH_SPACE`, a tile wider than the matrix, a BLOCK_M past :func:`block_m_cap`, more threads than a
    block may have, more accumulator registers per thread than :data:`MAX_ACC_PER_THREAD`, more shared memory than
    the device has (:func:`shared_bytes`)."""
    for key in KEYS:
        if getattr(cfg, key) not in SEARCH_SPACE[key]:
            return f"{key}={getattr(cfg, key)} is not in {SEARCH_SPACE[key]}"
    n_cols = N // 2 if which == "gate_up" else N
    if cfg.BLOCK_N > max(16, _pow2_at_least(n_cols)):
        return f"BLOCK_N={cfg.BLOCK_N} is wider than the {n_cols} output columns"
    if cfg.BLOCK_K > max(32, _pow2_at_least(K)):
        return f"BLOCK_K={cfg.BLOCK_K} is wider than K={K}"
    if cfg.BLOCK_M > block_m_cap(M, top_k, E):
        return f"BLOCK_M={cfg.BLOCK_M} is over twice the mean rows per expert at M={M}"
    threads = cfg.num_warps * 32
    if limits.max_threads is not None and threads > limits.max_threads:
        return f"{threads} threads > {limits.max_threads} per block"
    acc = cfg.BLOCK_M * cfg.BLOCK_N * (2 if which == "gate_up" else 1) // threads
    if acc > MAX_ACC_PER_THREAD:
        return f"{acc} accumulator registers per thread > {MAX_ACC_PER_THREAD}"
    need = shared_bytes(which, cfg, torch.empty((), dtype=dtype).element_size())
    if limits.shared_memory is not None and need > limits.shared_memory:
        return f"{need} bytes of shared memory > {limits.shared_memory}"
    return None


def search_space(which: str, M: int, top_k: int, E: int, N: int, K: int, dtype: torch.dtype,
                 limits: _config.DeviceLimits, block_m: int | None = None) -> list[GemmConfig]:
    """Every config of :data:`SEARCH_SPACE` that :func:`excluded` keeps (only BLOCK_M = ``block_m`` when given)."""
    out = []
    for values in itertools.product(*(SEARCH_SPACE[k] for k in KEYS)):
        cfg = GemmConfig(*values)
        if (block_m is None or cfg.BLOCK_M == block_m) and excluded(which, cfg, M, top_k, E, N, K, dtype,
                                                                     limits) is None:
            out.append(cfg)
    return out
