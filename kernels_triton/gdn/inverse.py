"""``(I + A)^-1`` of a strictly lower-triangular fp32 ``[C, C]`` tile (C in 16, 32, 64), the WY inverse of the
chunked prefill's prepare kernel.

Diagonal blocks of ``DIAG_ROWS`` rows (16, 8 or 4) are inverted by column-oriented forward substitution
(``DIAG_ROWS - 1`` dependent steps, each a cross-warp reduction), then merged into larger diagonal blocks,
``T_21 = -T_22 A_21 T_11``, two dots per merge level with fp32 operands at ``DOT_PREC``. Merges do not cancel, so
tf32 dots keep bf16-level accuracy even for strongly correlated keys with beta near 1 (a product-series inverse,
whose intermediates cancel, does not: tuning/notes_gdn.md).

Two forms: :func:`unit_lower_inverse` works on the full tile throughout; :func:`blocked_lower_inverse` runs the
substitution and the merges up to 16 rows on the ``C / 16`` diagonal 16-row blocks only (the same products without
the full tile's zeros) and merges 16 -> C on the full tile.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _merge_blocks(A, X, i, j, B: tl.constexpr, DOT_PREC: tl.constexpr):
    """Inverse on ``2B``-row diagonal blocks from the inverse ``X`` on ``B``-row ones:
    ``T_21 = -T_22 A_21 T_11`` for every pair of neighbouring blocks at once, in two dots."""
    off = ((i // (2 * B)) == (j // (2 * B))) & ((i // B) != (j // B))
    P = tl.dot(tl.where(off, A, 0.0), X, input_precision=DOT_PREC)
    return X - tl.dot(X, P, input_precision=DOT_PREC)


@triton.jit
def unit_lower_inverse(A, C: tl.constexpr, DOT_PREC: tl.constexpr, DIAG_ROWS: tl.constexpr = 16):
    """``(I + A)^-1`` on the full ``[C, C]`` tile: ``DIAG_ROWS``-row diagonal blocks by substitution, all at once,
    then block merges up to ``C`` rows."""
    rows = tl.arange(0, C)
    i = rows[:, None]
    j = rows[None, :]
    eye = tl.where(i == j, 1.0, 0.0)
    same_block = (i // DIAG_ROWS) == (j // DIAG_ROWS)
    Ad = tl.where(same_block, A, 0.0)
    X = eye
    sub = rows % DIAG_ROWS
    for p in tl.static_range(DIAG_ROWS - 1):
        # Ad and X are block-diagonal, so "column / row p of my own block" needs no block test; the
        # outer product is cut back to the diagonal blocks. Column p of each block is final in X's row
        # (block start + p) and is subtracted from the later rows (Ad[i, block + p] is 0 for i <= p).
        a_col = tl.sum(tl.where((sub == p)[None, :], Ad, 0.0), axis=1)  # Ad[i, block(i) + p]
        x_row = tl.sum(tl.where((sub == p)[:, None], X, 0.0), axis=0)  # X[block(c) + p, c]
        X = X - tl.where(same_block, a_col[:, None] * x_row[None, :], 0.0)
    if DIAG_ROWS <= 4:
        X = _merge_blocks(A, X, i, j, 4, DOT_PREC)
    if DIAG_ROWS <= 8:
        X = _merge_blocks(A, X, i, j, 8, DOT_PREC)
    if C > 16:
        X = _merge_blocks(A, X, i, j, 16, DOT_PREC)
        if C > 32:
            X = _merge_blocks(A, X, i, j, 32, DOT_PREC)
    return X


@triton.jit
def _diag_blocks(M, C: tl.constexpr, B: tl.constexpr):
    """The ``C / B`` diagonal ``[B, B]`` blocks of a ``[C, C]`` tile, as one ``[C / B, B, B]`` tensor."""
    NB: tl.constexpr = C // B
    M4 = tl.permute(tl.reshape(M, (NB, B, NB, B)), (0, 2, 1, 3))  # [row block, col block, B, B]
    b = tl.arange(0, NB)
    same = (b[:, None] == b[None, :])[:, :, None, None]
    return tl.sum(tl.where(same, M4, 0.0), axis=1)


@triton.jit
def _block_diag(Xb, C: tl.constexpr, B: tl.constexpr):
    """The block-diagonal ``[C, C]`` tile whose diagonal blocks are ``Xb`` ``[C / B, B, B]`` (zero elsewhere)."""
    NB: tl.constexpr = C // B
    b = tl.arange(0, NB)
    same = (b[:, None] == b[None, :])[:, :, None, None]
    X4 = tl.where(same, tl.broadcast_to(Xb[:, None, :, :], (NB, NB, B, B)), 0.0)
    return tl.reshape(tl.permute(X4, (0, 2, 1, 3)), (C, C))


@triton.jit
def _merge_batched(A, X, B: tl.constexpr, DOT_PREC: tl.constexpr):
    """:func:`_merge_blocks` on a batch of diagonal blocks ``A``, ``X`` ``[n, R, R]`` (R >= 16): inverse on
    ``2B``-row blocks from ``B``-row ones inside each ``R``-row block. Only the blocks' own products are formed, not
    the full tile's (a ``[C, C]`` merge spends ``C / R`` times the multiply-adds on zeros)."""
    r = tl.arange(0, A.shape[1])
    i = r[None, :, None]
    j = r[None, None, :]
    off = ((i // (2 * B)) == (j // (2 * B))) & ((i // B) != (j // B))
    P = tl.dot(tl.where(off, A, 0.0), X, input_precision=DOT_PREC)
    return X - tl.dot(X, P, input_precision=DOT_PREC)


@triton.jit
def blocked_lower_inverse(A, C: tl.constexpr, DOT_PREC: tl.constexpr, DIAG_ROWS: tl.constexpr):
    """:func:`unit_lower_inverse`'s substitution and merges (same products, same precision), those up to 16 rows on
    the ``C / 16`` diagonal 16-row blocks as one batch, then 16 -> C on the full tile. At C = 64 the tensor-core
    work of the inverse is 64 K + 1 M multiply-adds instead of the full tile's 2.1 M; the price is the tiles'
    reshuffles between layouts."""
    A16 = _diag_blocks(A, C, 16)
    r = tl.arange(0, 16)
    i = r[None, :, None]
    j = r[None, None, :]
    same_block = (i // DIAG_ROWS) == (j // DIAG_ROWS)
    Ad = tl.where(same_block, A16, 0.0)
    X = tl.where(i == j, 1.0, 0.0) + tl.zeros_like(A16)
    sub = r % DIAG_ROWS
    for p in tl.static_range(DIAG_ROWS - 1):  # as in unit_lower_inverse, one batch of 16-row blocks
        a_col = tl.sum(tl.where((sub == p)[None, None, :], Ad, 0.0), axis=2)
        x_row = tl.sum(tl.where((sub == p)[None, :, None], X, 0.0), axis=1)
        X = X - tl.where(same_block, a_col[:, :, None] * x_row[:, None, :], 0.0)
    if DIAG_ROWS <= 4:
        X = _merge_batched(A16, X, 4, DOT_PREC)
    if DIAG_ROWS <= 8:
        X = _merge_batched(A16, X, 8, DOT_PREC)
    # (One return at the end: Triton builds the code after a constexpr-guarded return too.)
    if C == 16:
        T = tl.reshape(X, (C, C))
    else:
        rows = tl.arange(0, C)
        T = _block_diag(X, C, 16)
        T = _merge_blocks(A, T, rows[:, None], rows[None, :], 16, DOT_PREC)
        if C > 32:
            T = _merge_blocks(A, T, rows[:, None], rows[None, :], 32, DOT_PREC)
    return T
