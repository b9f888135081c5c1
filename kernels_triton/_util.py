"""Small host-side helpers every kernel family uses: ceil division, powers of two, 16-byte aligned buffer parts.

Plain Python on purpose: ``triton.cdiv`` and ``triton.next_power_of_2`` cost microseconds a call on the host path,
and short prefills and decode steps are host-bound.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -(-a // b)


def pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two that is >= ``n`` and >= ``lo``."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def aligned16(n: int) -> int:
    """``n`` 4-byte elements rounded up so that the next part of a shared buffer starts 16-byte aligned: Triton
    specialises on pointer alignment, and parts whose alignment varied with a batch's size would compile new
    kernel variants in the middle of serving."""
    return -(-n // 4) * 4


def aligned_parts(sizes: list[int] | tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """(4-byte elements in all, start of each part) of parts of ``sizes`` 4-byte elements laid out one after another
    in one buffer, each starting 16-byte aligned (:func:`aligned16`)."""
    starts, total = [], 0
    for n in sizes:
        starts.append(total)
        total += aligned16(n)
    return total, tuple(starts)
