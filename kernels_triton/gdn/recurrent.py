"""Gated DeltaNet decode step: 1..8 tokens per sequence, recurrent form, state pool updated in place.

One program per (sequence, value head, V block) loads its slice ``S[:, v-block]`` of the pool
slot once, runs the tokens through it and stores it back: the state is read and written exactly
once, which is all the HBM traffic that matters here (the op is memory-bound). Per token,
``S^T k`` and ``S^T q`` come from one pass over the old state::

    S' = e^g S + k d^T,   d = beta (v - e^g S^T k),   o = S'^T q = e^g S^T q + d (k . q)

Padding rows (slot < 0) write zero output and leave the pool alone. No host synchronisation and
no value-dependent allocation: the launch is CUDA-graph capturable.

On sm_90+ the step launches with programmatic dependent launch (:mod:`kernels_triton._pdl`): its programs are
scheduled while the launch before is finishing and wait for it before touching anything (``QWEN35_GDN_PDL=0``
turns it off; measured: 0.3-0.4 µs less of 2.5-3.2 µs at one token on the H200, tuning/notes_gdn.md).
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl

from kernels_triton import _config, _pdl
from kernels_triton._config import device_facts
from kernels_triton._launch import DirectLauncher, launch_args
from kernels_triton._util import cdiv, pow2
from kernels_triton.gdn.common import check_head_dims, gate_rows, gating, grid_rows
from qwen35 import knobs as qwen35_knobs


@triton.jit(do_not_specialize=["H", "HV", "NH", "gate_stride"])
def _recurrent_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
    pool_ptr, slots_ptr, o_ptr, scale, pool_slot_stride,
    T: tl.constexpr, H, HV, gate_stride, NH, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, RAW_GATING: tl.constexpr, USE_L2: tl.constexpr,
    STREAM: tl.constexpr = False, PDL: tl.constexpr = False,
):
    _pdl.enter(PDL)  # launched with PDL: wait for the launch before (its q/k/v, slots, pool writes) first
    vb = tl.program_id(0)
    nh = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)  # (row, head) pairs: see common.grid_rows
    if nh >= NH:
        return
    n = nh // HV
    hv = nh % HV
    h = hv // (HV // H)
    kcols = tl.arange(0, BK)
    vcols = vb * BV + tl.arange(0, BV)
    kmask = kcols < K
    vmask = vcols < V
    slot = tl.load(slots_ptr + n).to(tl.int64)
    live = slot >= 0
    row0 = n.to(tl.int64) * T  # first token row of this sequence in the flattened [B*T, ...] inputs
    # No branch on the slot: the token loads below do not wait for it, only the state load does (one
    # dependent round trip instead of two at B = 1). Padding rows (slot < 0) load nothing from the pool,
    # store zeros as output and leave the pool alone.
    s_ptrs = pool_ptr + tl.maximum(slot, 0) * pool_slot_stride + (hv * K + kcols[:, None]) * V + vcols[None, :]
    smask = kmask[:, None] & vmask[None, :] & live
    if STREAM:  # each state slice is read once and written once: keep it from displacing the token rows in L2
        S = tl.load(s_ptrs, mask=smask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        S = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)
    for t in tl.static_range(T):
        row = row0 + t
        g, beta = gating(row, row >= 0, hv, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, gate_stride,
                          RAW_GATING)
        q = tl.load(q_ptr + (row * H + h) * K + kcols, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + (row * H + h) * K + kcols, mask=kmask, other=0.0).to(tl.float32)
        if USE_L2:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale
        v = tl.load(v_ptr + (row * HV + hv) * V + vcols, mask=vmask, other=0.0).to(tl.float32)
        decay = tl.exp(g)
        Sk = tl.sum(S * k[:, None], axis=0)
        Sq = tl.sum(S * q[:, None], axis=0)
        d = beta * (v - decay * Sk)
        o = tl.where(live, decay * Sq + d * tl.sum(k * q, axis=0), 0.0)
        tl.store(o_ptr + (row * HV + hv) * V + vcols, o.to(o_ptr.dtype.element_ty), mask=vmask)
        S = S * decay + k[:, None] * d[None, :]
    if STREAM:
        tl.store(s_ptrs, S.to(pool_ptr.dtype.element_ty), mask=smask, cache_modifier=".cs")
    else:
        tl.store(s_ptrs, S.to(pool_ptr.dtype.element_ty), mask=smask)


_launch_step = DirectLauncher(_recurrent_step_kernel)
StepArgs, _ = launch_args("Step", _recurrent_step_kernel, "K")  # the launch's arguments by name


@_config.derived
@functools.lru_cache(maxsize=1024)
def step_config(device: torch.device, B: int, HV: int, V: int) -> dict:
    """V block and warps: a tuned file entry if present, else the heuristic below (cached per batch size).

    By (row, head) pairs: >= 1024 pairs, 64-wide blocks and 4 warps with streaming cache hints on the state
    (``STREAM``; they cost 0.05-0.2 µs at B=1, so only here); a few hundred, 32-wide and 1 warp; tens, 16-wide and
    1 warp. Measured on the H200: 4.0-4.1 TB/s of state traffic at B >= 128, ``STREAM`` 36.9 against 38.6 µs at 397B-TP8
    B=128, 32-wide 8.3 µs against 9.2 for 64-wide at TP8 B=32 (tuning/notes_gdn.md).
    """
    if device.type != "cuda":  # the interpreter: fewest programs is fastest
        return {"BV": pow2(V, 8), "num_warps": 4}
    tuned = _config.lookup("gdn_recurrent_step", device_facts(device)[0], f"HV={HV},V={V}", tokens=B,
                           fields=("BV", "num_warps", "num_stages", "STREAM"))
    if tuned:
        return tuned
    pairs = B * HV
    if pairs >= 1024:
        return {"BV": min(64, pow2(V, 8)), "num_warps": 4, "STREAM": True}
    BV, warps = (32, 1) if pairs > 64 else (16, 1)
    return {"BV": min(BV, pow2(V, 8)), "num_warps": warps}


# What a tuned ``gdn_recurrent_step`` entry may set, every value the tuner may try; pruned per shape and device by
# :func:`step_excluded`.
STEP_SEARCH_SPACE: dict[str, tuple] = {"BV": (8, 16, 32, 64, 128), "num_warps": (1, 2, 4, 8), "STREAM": (False, True)}
STEP_SPACE_HASH = _config.declare_search_space(("gdn_recurrent_step",), {"space": STEP_SEARCH_SPACE, "rules": 1})
MAX_STATE_REGS = 128  # fp32 registers per thread for the program's [BK, BV] state slice


def step_excluded(cfg: dict, K: int, V: int, limits: _config.DeviceLimits) -> str | None:
    """Why a step config is outside the search space for these head dims on a device with ``limits``, or None: a
    value not in :data:`STEP_SEARCH_SPACE`, V blocks wider than V, a state slice over :data:`MAX_STATE_REGS`
    registers per thread, more threads than a block may have."""
    for key, values in STEP_SEARCH_SPACE.items():
        if cfg.get(key) not in values:
            return f"{key}={cfg.get(key)} is not in {values}"
    if cfg["BV"] > pow2(V, 8):
        return f"BV={cfg['BV']} is wider than V={V}"
    regs = pow2(K, 16) * cfg["BV"] // (32 * cfg["num_warps"])
    if regs > MAX_STATE_REGS:
        return f"{regs} state registers per thread > {MAX_STATE_REGS}"
    if limits.max_threads is not None and 32 * cfg["num_warps"] > limits.max_threads:
        return f"{32 * cfg['num_warps']} threads > {limits.max_threads} per block"
    return None


def step_search_space(K: int, V: int, limits: _config.DeviceLimits) -> list[dict]:
    """Every step config of :data:`STEP_SEARCH_SPACE` that :func:`step_excluded` keeps."""
    keys = tuple(STEP_SEARCH_SPACE)
    cands = (dict(zip(keys, values, strict=True)) for values in itertools.product(*STEP_SEARCH_SPACE.values()))
    return [c for c in cands if step_excluded(c, K, V, limits) is None]


PDL_ENV = "QWEN35_GDN_PDL"


def _use_pdl(device: torch.device, cfg: dict) -> bool:
    """Whether the step launches with programmatic dependent launch (:mod:`kernels_triton._pdl`): a config's
    ``PDL`` key, else ``QWEN35_GDN_PDL`` (``1`` / ``0``), else on. Only CUDA devices of sm_90+ can (elsewhere it is
    off, whatever was asked). Measured on the H200 through CUDA graphs: 0.3-0.4 µs less at B=1, 0.2-0.6 at B=8, the
    same or slightly less from B=32 on (tuning/notes_gdn.md)."""
    if not _pdl.supported(device):
        return False
    if "PDL" in cfg:
        return bool(cfg["PDL"])
    forced = qwen35_knobs.on(PDL_ENV)
    return True if forced is None else forced


def gdn_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`qwen35.ops.gdn_recurrent_step` (see the module docstring)."""
    return step(q, k, v, state_pool, state_slots, g, beta, a, b, A_log, dt_bias, scale, use_qk_l2norm, out, None)


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state_pool: torch.Tensor, state_slots: torch.Tensor,
         g: torch.Tensor | None, beta: torch.Tensor | None, a: torch.Tensor | None, b: torch.Tensor | None,
         A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, scale: float | None, use_qk_l2norm: bool,
         out: torch.Tensor | None, config: dict | None) -> torch.Tensor:
    """:func:`gdn_recurrent_step` with every argument in order; ``config``: keys forced over the heuristic's
    (``BV``, ``num_warps``, ``num_stages``, ``STREAM``, ``PDL``; with ``BV`` it replaces the heuristic's config,
    without, e.g. ``{"PDL": False}``, it keeps its blocks), for :mod:`kernels_triton.gdn.bench_api`; None for the
    op's own."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    check_head_dims(K, V)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"triton GDN kernels take fp16, bf16 or fp32 activations, got {q.dtype}")
    if state_pool.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"state_pool has dtype {state_pool.dtype}; states are fp32 (fp64 accepted)")
    o = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device) if out is None else out
    if B == 0:
        return o
    g, beta, a, b, gate_stride = gate_rows(g, beta, a, b)
    cfg = step_config(q.device, B, HV, V)
    if config:
        unknown = sorted(set(config) - set(STEP_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"step config keys {unknown}: accepted {', '.join(STEP_CONFIG_KEYS)}")
        cfg = {**cfg, **config} if "BV" not in config else config
    BV = cfg["BV"]
    pdl = _use_pdl(q.device, cfg)
    _launch_step(
        (cdiv(V, BV), *grid_rows(B * HV)),
        tuple.__new__(StepArgs, (  # the values in StepArgs' order (its fields name them)
            q, k, v, g, beta, a, b, A_log, dt_bias, state_pool, state_slots, o,
            K**-0.5 if scale is None else float(scale), state_pool.stride(0), T, H, HV, gate_stride, B * HV, K, V,
            pow2(K, 16), BV, a is not None, use_qk_l2norm, bool(cfg.get("STREAM", False)), pdl)),
        {**{key: val for key, val in cfg.items() if key not in ("BV", "STREAM", "PDL")}, **_pdl.options(pdl)})
    return o


STEP_CONFIG_KEYS = ("BV", "num_warps", "num_stages", "STREAM", "PDL")
