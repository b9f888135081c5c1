"""Input checks used by the op façade. Each raises ``ValueError`` naming the value and what is accepted."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Sequence

import torch

from qwen35 import knobs

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    device: torch.device | None = None,
    contiguous: bool = True,
) -> torch.Tensor:
    """Check one tensor argument: type, rank, dtype, device, contiguity."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; accepted: {_dtype_names(dtypes)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    return t


def slot_pool(name: str, pool: object, *, ndim: int, dtypes: Sequence[torch.dtype], device: torch.device) -> None:
    """A pool ``[num_slots, ...]``: each slot's block contiguous; the slot stride may be larger (a strided
    view into a bigger buffer, as vLLM's page-packed hybrid caches are), never smaller."""
    tensor(name, pool, ndim=ndim, dtypes=dtypes, device=device, contiguous=False)
    sizes, strides = pool.shape, pool.stride()
    block_numel, contiguous = 1, True  # from sizes and strides: no view per call (host time on every layer)
    for n, st in zip(reversed(sizes[1:]), reversed(strides[1:]), strict=True):
        contiguous = contiguous and (n == 1 or st == block_numel)
        block_numel *= n
    contiguous = contiguous or block_numel == 0 or sizes[0] == 0
    if not contiguous or (sizes[0] > 1 and strides[0] < block_numel):
        raise ValueError(f"{name} must hold each slot's block contiguously with slot stride >= {block_numel} "
                         f"(shape {tuple(pool.shape)}, stride {pool.stride()})")


def optional(name: str, t: object, **kw) -> torch.Tensor | None:
    return None if t is None else tensor(name, t, **kw)


def shape(name: str, t: torch.Tensor, expected: Sequence[int | None]) -> None:
    """Check a shape; ``None`` entries are free."""
    sizes = t.shape
    ok = len(sizes) == len(expected)
    if ok:
        for s, e in zip(sizes, expected, strict=True):
            if e is not None and e != s:
                ok = False
                break
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name} has shape {list(t.shape)}; expected {want}")


def positive_int(name: str, value: object, *, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (maximum is not None and value > maximum):
        bound = f"1..{maximum}" if maximum is not None else ">= 1"
        raise ValueError(f"{name}={value!r} is not accepted; expected an int in {bound}")
    return value


def divisible(name_num: str, num: int, name_den: str, den: int) -> None:
    if den <= 0 or num % den != 0:
        raise ValueError(f"{name_num}={num} must be a positive multiple of {name_den}={den}")


def planes(name: str, widths: object, channels: int) -> tuple[int, ...]:
    """Plane widths of a plane-layout buffer (e.g. GDN's q | k | v): 1 to 3 non-negative ints summing to
    ``channels``. Returns them as a tuple."""
    ok = isinstance(widths, (tuple, list)) and 1 <= len(widths) <= 3 and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in widths)
    if not ok or sum(widths) != channels:
        raise ValueError(f"{name}={widths!r} is not accepted; expected 1 to 3 non-negative ints summing to the "
                         f"{channels} channels")
    return tuple(widths)


_HOST_BUILT = contextvars.ContextVar("qwen35_host_built_inputs", default=False)


@contextlib.contextmanager
def host_built_inputs() -> Iterator[None]:
    """Within this context the ops' inputs come from a model host that builds the slots and offsets itself:
    checks that read accelerator-resident values (each one a device synchronisation, every layer) are
    skipped; on the CPU, where reading values costs no synchronisation, they still run."""
    token = _HOST_BUILT.set(True)
    try:
        yield
    finally:
        _HOST_BUILT.reset(token)


def value_checks_enabled(t: torch.Tensor) -> bool:
    """Whether to read tensor *values* (which synchronises an accelerator).

    Off when ``QWEN35_CHECK_VALUES=0``; for tensors on an accelerator also while a CUDA graph is being
    captured (a sync would break the capture) and inside :func:`host_built_inputs`; on otherwise.
    """
    kind = t.device.type
    if kind != "cpu" and _HOST_BUILT.get():  # first: the common case inside a model host, no environment read
        return False
    if not knobs.on("QWEN35_CHECK_VALUES"):
        return False
    if kind == "cpu":
        return True
    if kind == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return True


def cu_seqlens(name: str, cu: torch.Tensor, total_tokens: int) -> int:
    """Check offsets [N+1]: int32/int64, 1-D, starts at 0, non-decreasing, ends at T. Returns N."""
    tensor(name, cu, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    if cu.numel() < 1:
        raise ValueError(f"{name} must hold N+1 >= 1 offsets, got an empty tensor")
    if value_checks_enabled(cu):
        vals = cu.tolist()
        if vals[0] != 0:
            raise ValueError(f"{name}[0]={vals[0]}; offsets must start at 0")
        for i in range(1, len(vals)):
            if vals[i] < vals[i - 1]:
                raise ValueError(
                    f"{name} must be non-decreasing; {name}[{i}]={vals[i]} < {name}[{i - 1}]={vals[i - 1]}")
        if vals[-1] != total_tokens:
            raise ValueError(f"{name}[-1]={vals[-1]} must equal the number of tokens T={total_tokens}")
    return cu.numel() - 1


def host_offsets(name: str, offsets: object, count: int) -> list[int]:
    """Host copies of ``count`` sequence offsets: ints, starting at 0, non-decreasing. Returns them as a list."""
    if isinstance(offsets, torch.Tensor):
        raise ValueError(f"{name} must be host ints (a list or tuple), not a tensor")
    vals = list(offsets)
    if len(vals) != count:
        raise ValueError(f"{name} holds {len(vals)} offsets; cu_seqlens holds {count}")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in vals):
        raise ValueError(f"{name} must hold ints, got {vals[:8]}")
    if vals and vals[0] != 0:
        raise ValueError(f"{name}[0]={vals[0]}; offsets must start at 0")
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            raise ValueError(f"{name} must be non-decreasing; {name}[{i}]={vals[i]} < {name}[{i - 1}]={vals[i - 1]}")
    return vals


def slots(name: str, s: torch.Tensor, count: int, pool_size: int, pool_name: str) -> None:
    """Check slot indices [count]: int32/int64; each in [0, pool_size) or negative (padding)."""
    tensor(name, s, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    shape(name, s, [count])
    if value_checks_enabled(s) and s.numel():
        hi = int(s.max())
        if hi >= pool_size:
            raise ValueError(f"{name} holds slot {hi}, but {pool_name} has {pool_size} slots "
                             f"(valid 0..{pool_size - 1}, negative = padding)")
        live = s[s >= 0]
        if live.numel() != torch.unique(live).numel():
            raise ValueError(f"{name} names a slot twice; each sequence needs its own state slot")
