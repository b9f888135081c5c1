"""Decode attention over per-slot KV caches: split-K ("flash decoding") in two launches.

One query per row, ``G = H / KV`` query heads per kv head. Phase 1 runs one program per
(key split, row, kv head): it loads the G queries of its kv head once, walks its share of the
row's keys in blocks of ``BN`` with an online softmax, and writes an unnormalised partial output
with its running max and sum. Phase 2 merges the partials of each (row, query head).

The grid depends only on shapes (rows, kv heads, cache length), never on the lengths' values:
splits past a row's length exit at once, so one captured CUDA graph serves every step of a
growing context, and a short context costs only the blocks it holds. Splits are sized so that
rows x kv heads x splits covers the GPU about twice (B=1 with 2 kv heads still fills an H200).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from kernels_triton._config import device_facts
from kernels_triton._launch import DirectLauncher
from kernels_triton._util import aligned16, pow2

log = logging.getLogger("qwen35.kernels_triton")


@triton.jit(do_not_specialize=["L", "blocks_per_split", "n_splits"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, lens_ptr, part_ptr, m_ptr, l_ptr,
    scale, L, slot_stride, head_stride, blocks_per_split, n_splits,
    H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    BN: tl.constexpr, DOT_PREC: tl.constexpr,
):
    split = tl.program_id(0)
    bk = tl.program_id(1)  # row * KV + kv head
    b = bk // KV
    kvh = bk % KV
    slot = tl.load(slots_ptr + b).to(tl.int64)
    n = tl.load(lens_ptr + b).to(tl.int32)
    n = tl.where(slot >= 0, tl.minimum(n, L), 0)
    start = split * blocks_per_split * BN
    end = tl.minimum(start + blocks_per_split * BN, n)

    rows = tl.arange(0, GP)
    cols = tl.arange(0, BD)
    cmask = cols < D
    q = tl.load(q_ptr + (b * H + kvh * G + rows[:, None]) * D + cols[None, :],
                mask=(rows < G)[:, None] & cmask[None, :], other=0.0)
    m = tl.full((GP,), float("-inf"), dtype=tl.float32)
    lsum = tl.zeros((GP,), dtype=tl.float32)
    acc = tl.zeros((GP, BD), dtype=tl.float32)
    base = tl.maximum(slot, 0) * slot_stride + kvh * head_stride
    keys = tl.arange(0, BN)
    for s in range(start, end, BN):
        pos = s + keys
        pmask = pos < end
        off = base + pos[:, None].to(tl.int64) * D + cols[None, :]
        kt = tl.load(k_ptr + off, mask=pmask[:, None] & cmask[None, :], other=0.0)
        sc = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * scale
        sc = tl.where(pmask[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))  # finite: every block holds at least one key
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_ptr + off, mask=pmask[:, None] & cmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        m = m_new

    part = (bk * n_splits + split) * G + rows  # [B * KV, n_splits, G] (x D for the output part)
    rmask = rows < G
    tl.store(m_ptr + part, m, mask=rmask)
    tl.store(l_ptr + part, lsum, mask=rmask)
    tl.store(part_ptr + part[:, None].to(tl.int64) * D + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["n_splits"])
def _decode_merge_kernel(
    part_ptr, m_ptr, l_ptr, o_ptr, n_splits,
    H: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
):
    bh = tl.program_id(0)  # row * H + query head
    b = bh // H
    h = bh % H
    kvh = h // G
    g = h % G
    first = (b * KV + kvh) * n_splits  # partial (b, kvh, split, g) sits at (first + split) * G + g
    splits = tl.arange(0, BS)
    mx = tl.full((BS,), float("-inf"), dtype=tl.float32)
    for s0 in range(0, n_splits, BS):
        idx = s0 + splits
        mx = tl.maximum(mx, tl.load(m_ptr + (first + idx) * G + g, mask=idx < n_splits, other=float("-inf")))
    top = tl.max(mx, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no keys at all: every weight below is 0
    cols = tl.arange(0, BD)
    acc = tl.zeros((BD,), dtype=tl.float32)
    total = tl.zeros((BS,), dtype=tl.float32)
    for s0 in range(0, n_splits, BS):
        idx = s0 + splits
        smask = idx < n_splits
        w = tl.exp(tl.load(m_ptr + (first + idx) * G + g, mask=smask, other=float("-inf")) - top)
        total += w * tl.load(l_ptr + (first + idx) * G + g, mask=smask, other=0.0)
        parts = tl.load(part_ptr + ((first + idx) * G + g)[:, None].to(tl.int64) * D + cols[None, :],
                        mask=smask[:, None] & (cols < D)[None, :], other=0.0)
        acc += tl.sum(w[:, None] * parts, axis=0)
    denom = tl.sum(total, axis=0)
    out = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(o_ptr + bh * D + cols, out.to(o_ptr.dtype.element_ty), mask=cols < D)


# ----------------------------------------------------------------------------- host side

_launch_split = DirectLauncher(_decode_split_kernel)  # no per-call argument binding once compiled
_launch_merge = DirectLauncher(_decode_merge_kernel)


@functools.cache
def _warn_unaligned_cache() -> None:
    log.warning("attention_decode: k_cache / v_cache are not 16-byte aligned; they are copied on every call "
                "(allocate the caches, or take views at 16-byte offsets, to avoid it)")


def _aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh (16-byte aligned) copy with the same strides, so the kernel's stride arguments still hold."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)



def split_plan(rows: int, L: int, BN: int, sm_count: int, n_splits: int | None = None) -> tuple[int, int]:
    """(blocks per split, number of splits) for ``rows`` (row, kv head) pairs over a cache of L positions."""
    blocks = max(1, -(-L // BN))
    if n_splits is None:
        n_splits = max(1, -(-2 * sm_count // max(rows, 1)))
    per = -(-blocks // max(1, min(n_splits, blocks)))
    return per, -(-blocks // per)


def attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    config: dict | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`qwen35.ops.attention_decode` (see the module docstring).

    ``config`` (``BN``, ``n_splits``, ``num_warps``, ``num_stages``) overrides the launch plan; tests
    use it to force several splits on small caches.
    """
    B, H, D = q.shape
    S, KV, L = k_cache.shape[:3]
    if k_cache.stride() != v_cache.stride() or k_cache.stride()[1:] != (L * D, D, 1):
        raise ValueError("k_cache and v_cache must share strides, with each slot's [KV, L, D] block contiguous")
    G = H // KV
    BD = pow2(D, 16)
    cfg = dict(config or {})
    elt = q.element_size()
    BN = cfg.pop("BN", 64 if elt * BD <= 512 else 32)
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    per, n_splits = split_plan(B * KV, L, BN, device_facts(q.device)[1], cfg.pop("n_splits", None))
    o = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return o
    rows = B * KV * n_splits * G  # partial results: [rows, D] outputs, then [rows] maxima and [rows] sums
    span = [aligned16(n) for n in (rows * D, rows)]
    part = torch.empty(span[0] + 2 * span[1], dtype=torch.float32, device=q.device)
    m_part, l_part = part[span[0]:span[0] + rows], part[span[0] + span[1]:span[0] + span[1] + rows]
    launch = {"num_warps": cfg.pop("num_warps", 4), "num_stages": cfg.pop("num_stages", 2)}
    if cfg:
        raise ValueError(f"unknown attention_decode config keys {sorted(cfg)}; accepted: BN, n_splits, num_warps, "
                         "num_stages")
    q = q.contiguous()
    if q.data_ptr() & 15:  # a view at a 2-byte offset: pipelined copies from such views misread on an H200 (GDN)
        q = q.clone()
    if (k_cache.data_ptr() | v_cache.data_ptr()) & 15:
        _warn_unaligned_cache()
        k_cache, v_cache = _aligned_copy(k_cache), _aligned_copy(v_cache)
    _launch_split[(n_splits, B * KV)](
        q, k_cache, v_cache, slots, lengths, part, m_part, l_part,
        float(scale), L, k_cache.stride(0), k_cache.stride(1), per, n_splits,
        H=H, KV=KV, G=G, GP=pow2(G, 16), D=D, BD=BD, BN=BN, DOT_PREC=dot_prec, **launch)
    _launch_merge[(B * H,)](part, m_part, l_part, o, n_splits, H=H, KV=KV, G=G, D=D, BD=BD,
                                   BS=min(32, pow2(n_splits, 2)), num_warps=4)
    return o
