"""Recurrent states between the façade's state conventions and a kernel that takes one dense row per sequence it
runs: a vendor GDN kernel (``kernels_cuda.flashqla``) takes ``[M, HV, K, V]`` initial states for the M sequences it
is given (the non-empty ones) and returns their final states the same way.

- :func:`gather_states`: the initial state of each kept sequence into a dense fp32 tensor: from a pool slot (zeros for
  a negative slot or ``has_initial_state`` False), from a per-sequence tensor, or zeros.
- :func:`scatter_states`: every sequence's final state to where the façade puts it: a kept sequence's from the
  kernel's rows, a dropped (empty) sequence's is its initial state. To the pool (slots >= 0 only; an empty
  sequence's slot is left as it is unless it started from zeros, which are then written) or to a new ``[N, HV, K,
  V]`` tensor.

Both run on the device from index tables the caller built once per batch (no read-back of slots or flags), in one
launch each; the state bytes are copied as they are (fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_triton._launch import DirectLauncher
from kernels_triton._util import cdiv

BLOCK = 2048  # state elements per program


@triton.jit(do_not_specialize=["numel", "slot_stride"])
def _gather_states_kernel(dst_ptr, src_ptr, slots_ptr, has_init_ptr, rows_ptr, numel, slot_stride,
                          STATE_IN: tl.constexpr, POOL: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
                          BLOCK: tl.constexpr):
    # Row m of dst [M, numel]: the initial state of sequence rows[m].
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    n = tl.load(rows_ptr + m).to(tl.int64)
    x = tl.zeros((BLOCK,), dtype=tl.float32)
    if POOL:
        slot = tl.load(slots_ptr + n).to(tl.int64)
        use = slot >= 0
        if HAS_INIT_FLAGS:
            use = use & (tl.load(has_init_ptr + n) != 0)
        if use:
            x = tl.load(src_ptr + slot * slot_stride + offs, mask=mask, other=0.0).to(tl.float32)
    elif STATE_IN:
        x = tl.load(src_ptr + n * numel + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + m.to(tl.int64) * numel + offs, x, mask=mask)


@triton.jit(do_not_specialize=["numel", "slot_stride"])
def _scatter_states_kernel(dst_ptr, src_ptr, init_ptr, slots_ptr, has_init_ptr, pos_ptr, numel, slot_stride,
                           STATE_IN: tl.constexpr, POOL: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
                           BLOCK: tl.constexpr):
    # Sequence n = program_id(1): its final state is row pos[n] of src [M, numel], or (pos[n] < 0: an empty sequence)
    # its initial state. POOL: dst is the pool (init_ptr too), written at slot >= 0; an empty sequence's slot keeps
    # its state unless the sequence starts from zeros. Else dst [N, numel], row n.
    n = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    p = tl.load(pos_ptr + n).to(tl.int64)
    if POOL:
        slot = tl.load(slots_ptr + n).to(tl.int64)
        if slot >= 0:
            if p >= 0:
                tl.store(dst_ptr + slot * slot_stride + offs, tl.load(src_ptr + p * numel + offs, mask=mask),
                         mask=mask)
            elif HAS_INIT_FLAGS:  # an empty sequence: its slot is its final state, zeros where it starts from them
                if tl.load(has_init_ptr + n) == 0:
                    tl.store(dst_ptr + slot * slot_stride + offs, tl.zeros((BLOCK,), dtype=tl.float32), mask=mask)
    else:
        if p >= 0:
            x = tl.load(src_ptr + p * numel + offs, mask=mask)
        elif STATE_IN:
            x = tl.load(init_ptr + n * numel + offs, mask=mask).to(tl.float32)
        else:
            x = tl.zeros((BLOCK,), dtype=tl.float32)
        tl.store(dst_ptr + n * numel + offs, x, mask=mask)


launch_gather = DirectLauncher(_gather_states_kernel)
launch_scatter = DirectLauncher(_scatter_states_kernel)


def gather_states(rows: torch.Tensor, numel: int, initial_state: torch.Tensor | None, state_pool: torch.Tensor | None,
                  state_slots: torch.Tensor | None, has_initial_state: torch.Tensor | None) -> torch.Tensor:
    """``[M, numel]`` fp32: the initial state of sequence ``rows[m]`` (int32 ``[M]`` on the device) in row m, by the
    façade's rules (a pool slot, zeros for a negative slot or ``has_initial_state`` False; a per-sequence tensor;
    else zeros). ``numel``: ``HV * K * V``."""
    M = rows.shape[0]
    dst = torch.empty(M, numel, dtype=torch.float32, device=rows.device)
    if M == 0:
        return dst
    pool = state_pool is not None
    src = state_pool if pool else initial_state
    stride = state_pool.stride(0) if pool else numel
    launch_gather((cdiv(numel, BLOCK), M), (dst, src, state_slots, has_initial_state, rows, numel, stride,
                                            initial_state is not None, pool, has_initial_state is not None, BLOCK),
                  {"num_warps": 4})
    return dst


def scatter_states(final: torch.Tensor, pos: torch.Tensor, initial_state: torch.Tensor | None,
                   state_pool: torch.Tensor | None, state_slots: torch.Tensor | None,
                   has_initial_state: torch.Tensor | None, out_shape: tuple[int, ...] | None) -> torch.Tensor | None:
    """Every sequence's final state where the façade puts it: ``final`` ``[M, numel]`` fp32 holds the kept
    sequences' (row ``pos[n]`` for sequence n, ``pos[n] < 0`` for a dropped empty one, whose final state is its
    initial state). With a pool: written to the slots (returns None). Else a new fp32 tensor of ``out_shape``
    ``[N, HV, K, V]`` (None: the caller wants no final states)."""
    N = pos.shape[0]
    numel = final.shape[1]
    pool = state_pool is not None
    if pool:
        dst, init, stride = state_pool, state_pool, state_pool.stride(0)
    elif out_shape is None:
        return None
    else:
        dst = torch.empty(out_shape, dtype=torch.float32, device=pos.device)
        init, stride = initial_state, numel
    if N:
        launch_scatter((cdiv(numel, BLOCK), N), (dst, final, init, state_slots, has_initial_state, pos, numel, stride,
                                                 initial_state is not None, pool, has_initial_state is not None,
                                                 BLOCK), {"num_warps": 4})
    return None if pool else dst
