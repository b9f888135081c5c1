"""Programmatic dependent launch (PDL, sm_90+) for the MoE block's launches: at decode-sized batches by default.

The mechanism and the rule every kernel launched this way keeps (wait before touching anything a launch before it
touches) are in :mod:`kernels_triton._pdl`. A launch can also begin work that does not depend on its predecessor
before waiting: at one token the down GEMM prefetches its weight tiles into L2 while the gate_up GEMM finishes (the
alignment it reads them by is two launches back, finished by the time any down program runs: every gate_up program
waited for it before letting down start).

The default is PDL where ``M * top_k <= align.ALIGN_LAST_MAX_SLOTS`` (routing and alignment in one launch) on
sm_90+, the down GEMM's prefetch at one token only: measured on the H200 by graph replay, 1.4-3.3 µs less per block
at 2-32 tokens, slower from 32 tokens of 397B-TP8 on, the prefetch slower from 4 tokens on (tuning/notes_moe.md).
``QWEN35_MOE_PDL=1`` / ``0`` turns PDL on at every size / off. One token takes the decode path
(:mod:`kernels_triton.moe.decode`), whose launches measured slower with PDL: there it applies only with
``QWEN35_MOE_PDL=1``; the one-token default above holds for the general pipeline (``QWEN35_MOE_DECODE=0``). The CPU
interpreter never takes this path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_triton._pdl import enter, let_next_start, options, supported
from kernels_triton._util import cdiv, pow2
from qwen35 import knobs as qwen35_knobs

__all__ = ["ENV", "enabled", "enter", "forced", "let_next_start", "options", "prefetch_lines", "prefetch_rows_l2"]

ENV = "QWEN35_MOE_PDL"


def enabled(x: torch.Tensor, by_default: bool = True) -> bool:
    """Whether the MoE launches for the tokens ``x`` use PDL: on a CUDA device of sm_90+ where ``by_default`` (the
    caller's size rule: see the module docstring) unless ``QWEN35_MOE_PDL`` says ``1`` (every size) or ``0``
    (never)."""
    if not x.is_cuda:
        return False
    choice = forced()
    if choice is False or (choice is None and not by_default):
        return False
    return supported(x.device)


def forced() -> bool | None:
    """``QWEN35_MOE_PDL``: True (``1``, every size), False (``0``, never) or None (unset: the size rule)."""
    return qwen35_knobs.on(ENV)


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
    return pow2(cdiv(row_len, line_elems)), line_elems
