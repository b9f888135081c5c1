"""Programmatic dependent launch (PDL, sm_90+) for the MoE block's launches: at decode-sized batches by default.

The mechanism and the rule every kernel launched this way keeps (wait before touching anything a launch before it
touches) are in :mod:`kernels_triton._pdl`. A launch can also begin work that does not depend on its predecessor
before waiting: at one token the down GEMM prefetches its weight tiles into L2 while the gate_up GEMM finishes (the
alignment it reads them by is two launches back, finished by the time any down program runs: every gate_up program
waited for it before letting down start).

H200, whole block by graph replay, same bits: one token 26.85 -> 25.24 µs (35B-A3B), 28.02 -> 25.86 (397B-TP8)
(tuning/results/moe_pdl_nvidia_h200.json); from 4 tokens on the down GEMM's prefetch made it slower (35B M=16 176 ->
183: its early prefetches compete with the gate_up's weight stream), but PDL without that prefetch is faster
wherever routing and alignment are one launch (tuning/results/moe_pdl_s16_nvidia_h200.json, 8 batches cycled, µs:
35B M=4 67.4 -> 64.9, M=16 167.3 -> 164.2; 397B-TP8 M=4 56.8 -> 54.6, M=16 134.0 -> 131.9; the sweep of
moe_pdl_sweep_s16_nvidia_h200.json, four models with and without the shared expert: 1.4-3.3 µs faster at M = 2-32 of
35B and 2-24 of 122B, 2.0-2.8 at M = 2-16 of 397B TP4 / TP8, within 1.5 either way at 24 tokens there), not beyond
(397B-TP8 M=32 213.7 -> 220.9, M=64 323.0 -> 339.1; 122B M=64 956 -> 964). So the default is PDL where
``M * top_k <= align.ALIGN_LAST_MAX_SLOTS`` (routing and alignment in one launch) on sm_90+, the prefetch at one
token only; ``QWEN35_MOE_PDL=1`` / ``0`` turns PDL on at every size / off. One token takes the decode path
(:mod:`kernels_triton.moe.decode`) since session 11, whose launches were slower with PDL: there it applies only with
``QWEN35_MOE_PDL=1``; the one-token default above holds for the general pipeline (``QWEN35_MOE_DECODE=0``). The CPU
interpreter never takes this path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_triton._pdl import enter, env_choice, let_next_start, options, supported

__all__ = ["ENV", "enabled", "enter", "let_next_start", "options", "prefetch_lines", "prefetch_rows_l2"]

ENV = "QWEN35_MOE_PDL"


def enabled(x: torch.Tensor, by_default: bool = True) -> bool:
    """Whether the MoE launches for the tokens ``x`` use PDL: on a CUDA device of sm_90+ where ``by_default`` (the
    caller's size rule: see the module docstring) unless ``QWEN35_MOE_PDL`` says ``1`` (every size) or ``0``
    (never)."""
    if not x.is_cuda:
        return False
    forced = env_choice(ENV)
    if forced is False or (forced is None and not by_default):
        return False
    return supported(x.device)


@triton.jit
def prefetch_rows_l2(base, row0, n_rows, row_len, ROWS: tl.constexpr, LINES: tl.constexpr,
                     LINE_ELEMS: tl.constexpr):
    """Prefetch rows ``row0 .. row0 + ROWS`` (of ``n_rows``, each ``row_len`` elements) into L2, one 128-byte line
    per request (``LINE_ELEMS`` elements; ``LINES`` lines cover a row). Out-of-range rows and lines are clamped to
    the last valid ones: a repeated prefetch costs nothing, and no address outside the tensor is touched."""
    r = tl.minimum(row0 + tl.arange(0, ROWS), n_rows - 1).to(tl.int64)
    c = tl.minimum(tl.arange(0, LINES) * LINE_ELEMS, row_len - 1)
    ptrs = base + r[:, None] * row_len + c[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


def prefetch_lines(row_len: int, elem_bytes: int) -> tuple[int, int]:
    """(LINES, LINE_ELEMS) for :func:`prefetch_rows_l2`: 128-byte lines covering a row, padded to a power of two."""
    line_elems = 128 // elem_bytes
    return triton.next_power_of_2(max(1, -(-row_len // line_elems))), line_elems
