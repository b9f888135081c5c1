"""``cuda_sm70`` backend: the GDN, conv, norm and MoE ops in CUDA C++ restricted to SM70 (Volta) features.

For devices whose Triton has no tensor cores (V100, T4-class, Iluvatar BI-V100 through CoreX's CUDA-compatible
compiler). The kernels are in ``kernels_cuda/csrc`` and are JIT-built at first use (:mod:`kernels_cuda.build`:
compiler, target arch, cache). Signatures and semantics are those of :mod:`qwen35.ops`, which validates every
input before dispatch; this module only prepares dtypes and layouts and launches.

Ops
---
- ``gdn_chunk_prefill``: chunked form (64-token chunks), three launches: a chunk table (varlen), a parallel
  prepare per (chunk, value head) and a scan per (sequence, value head, 32-column V block) that keeps the
  state on chip across the sequence's chunks (``csrc/gdn_chunk.cu`` has the algebra). Decays enter only as
  chunk-local cumulative sums and ``exp`` only ever sees a non-positive number; gating, state and every
  accumulation are fp32. Long batches run in windows of chunks so the workspace stays under
  :data:`GDN_WORKSPACE_BYTES`. ``chunk_size`` is accepted for the façade's signature (always 64 here) and
  ``metadata`` is ignored: the chunk table is built on the device each call, without a host synchronisation.
- ``gdn_recurrent_step``: 1-8 tokens, fp32 state slice in registers, pool updated in place.
- ``causal_conv1d_prefill`` / ``causal_conv1d_update``, ``rms_norm_gated`` / ``rms_norm_zero_centered``.
- ``moe_route`` (softmax -> top-k with ties to the lowest id -> renormalise), ``moe_experts`` (alignment of the
  picks by expert, then grouped GEMMs over expert-aligned blocks; a weight-streaming form for a few tokens) and
  ``moe_block``. In ``moe_block`` the router logits and the shared expert's sigmoid gate are one fp32 GEMM each
  through torch (cuBLAS); the shared expert runs through the same grouped kernels as a one-expert group.

Numerics and dtypes
-------------------
- fp16 activations: fp16 operands into WMMA m16n16k16 with fp32 accumulation (GDN chunk products, MoE GEMMs);
  elementwise work, reductions, gates and states in fp32.
- fp32 activations: the same algorithms on CUDA cores in fp32 (no tensor cores), for fp32 accuracy.
- bf16 activations are **refused** with a ``ValueError`` naming this backend: SM70 has no bf16 arithmetic, and
  converting would cost a full fp32 copy of every expert weight per MoE call and of every bf16 conv pool. Run the
  model in float16 (or float32) on this backend. The probe reads :data:`DTYPES` and passes over this backend for
  bf16 calls ("cuda_sm70 computes fp16/fp32, not bf16"), so a bf16 model gets the next backend of the policy instead
  of this error (and a forced ``cuda_sm70`` a ``RuntimeError`` from the probe); only a direct call meets it. Side
  inputs (norm / conv weights, biases, gates, ``A_log``, ``dt_bias``, router weights) may be of any float dtype:
  those are converted to fp32 when not fp16 / fp32.
- State pools are fp32 (fp64 pools are converted and written back); conv pools have the activations' dtype.

Limits (``ValueError`` naming the value): GDN head dims K, V <= 128; RMSNorm rows of at most 32768 values; MoE
hidden and intermediate sizes multiples of 8 (fp16) / 4 (fp32), at most 1024 experts and top-k <= 32.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from kernels_cuda import build

BACKEND = "cuda_sm70"
DTYPES = (torch.float16, torch.float32)  # activation dtypes the kernels compute in
CHUNK = 64
MAX_HEAD_DIM = 128
MAX_NORM_WIDTH = 32768
GDN_WORKSPACE_BYTES = 256 << 20  # per call; longer batches run in windows of chunks
GEMV_MAX_TOKENS = 32  # MoE calls of at most this many tokens take the weight-streaming form
GEMV_MAX_SMEM = 96 * 1024  # its staged rows must fit the SM70 shared-memory budget

_MODULES: dict[int, ModuleType] = {}


def availability(caps) -> str | None:  # noqa: ANN001 - qwen35.probe.DeviceCaps
    """None when this backend can run on the probed device, else why not. The toolchain is the build's
    business (:func:`prepare`): a missing nvcc or ninja is a failed build, which the probe reports with a
    WARNING before it falls back."""
    if caps.vendor == "cpu":
        return "needs a CUDA device"
    if caps.vendor == "nvidia" and caps.capability is not None and tuple(caps.capability) < (7, 0):
        return "compute capability {}.{} < 7.0".format(*caps.capability)
    return None


def prepare(device: torch.device) -> None:
    """Build (or load from the cache) the extension for ``device``; the probe calls this before the first
    self-test. Raises :class:`kernels_cuda.build.CudaBuildError` (no compiler, no ninja, a compile error quoted
    by its first lines)."""
    extension(device)


def extension(device: torch.device) -> ModuleType:
    """The built extension for a CUDA device (built on the first call, :func:`kernels_cuda.build.load`)."""
    if device.type != "cuda":
        raise ValueError(f"{BACKEND} runs on CUDA tensors; got a tensor on {device}")
    idx = device.index if device.index is not None else torch.cuda.current_device()
    mod = _MODULES.get(idx)
    if mod is None:
        mod = _MODULES[idx] = build.load(torch.device("cuda", idx))
    return mod


def _act(name: str, t: torch.Tensor) -> int:
    """Dtype code of an activation tensor (1 fp16, 0 fp32); bf16 and others are refused."""
    if t.dtype == torch.float16:
        return 1
    if t.dtype == torch.float32:
        return 0
    raise ValueError(f"{BACKEND} computes in float16 or float32 (SM70 has no bf16 arithmetic); {name} is {t.dtype}. "
                     "Run the model with dtype=float16 on this backend, or choose another backend for bf16")


def _side(t: torch.Tensor | None) -> torch.Tensor | None:
    """A small float input (weights, biases, gates) in a dtype the kernels read: fp16 / fp32 as given, else fp32."""
    if t is None or t.dtype in (torch.float16, torch.float32):
        return t
    return t.float()


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a 16-byte aligned start (the kernels read it in 16-byte vectors)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _gate_rows(g, beta, a, b) -> tuple:  # noqa: ANN001
    """(g, beta, a, b, row stride) for the kernels: the given pair as rows of HV values one common stride apart;
    g fp32, the others fp16 / fp32 (a and b of one dtype). Views into a wider buffer keep their memory."""
    raw = a is not None
    x, y = (a, b) if raw else (g, beta)
    if raw:
        if x.dtype != y.dtype or x.dtype not in (torch.float16, torch.float32):
            x, y = x.float(), y.float()
    else:
        x = x if x.dtype == torch.float32 else x.float()
        y = _side(y)
    HV = x.shape[-1]
    if x.is_contiguous() and y.is_contiguous():
        stride = HV
    else:
        try:
            xs, ys = x.view(-1, HV), y.view(-1, HV)
            ok = xs.stride(0) == ys.stride(0) and (HV <= 1 or xs.stride(1) == ys.stride(1) == 1)
        except RuntimeError:
            ok = False
        if ok:
            stride = xs.stride(0)
        else:
            x, y, stride = x.contiguous(), y.contiguous(), HV
    return (None, None, x, y, stride) if raw else (x, y, None, None, stride)


def _head_dims(K: int, V: int) -> None:
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"{BACKEND} GDN kernels take head dims K, V <= {MAX_HEAD_DIM}; got K={K}, V={V}")


def _windows(n_rows: int, rows: int) -> list[tuple[int, int]]:
    """Chunk-row windows of at most ``rows`` covering ``[0, n_rows)``; one empty window when there are none (the
    scan still carries empty sequences' states)."""
    if n_rows <= 0:
        return [(0, 0)]
    return [(r, min(r + rows, n_rows)) for r in range(0, n_rows, rows)]


# ----------------------------------------------------------------------------- GDN


def gdn_chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    state_pool: torch.Tensor | None = None,
    state_slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    metadata: object | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CUDA implementation of :func:`qwen35.ops.gdn_chunk_prefill` (see the module docstring)."""
    code = _act("q", q)
    ext = extension(q.device)
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    _head_dims(K, V)
    g, beta, a, b, stride = _gate_rows(g, beta, a, b)
    A_log, dt_bias = _side(A_log), _side(dt_bias)
    scale = K**-0.5 if scale is None else float(scale)
    dev = q.device
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else 1
    rec = ext.gdn_record_bytes(code, K, V)
    if cu_seqlens is not None:
        seq_first = torch.empty(N + 1, dtype=torch.int32, device=dev)
        if N > 0:
            ext.gdn_chunk_table(cu_seqlens, seq_first)
        n_rows = T // CHUNK + N
    else:
        seq_first = None
        n_rows = -(-T // CHUNK)
    per_window = max(1, GDN_WORKSPACE_BYTES // max(HV * rec, 1))
    windows = _windows(n_rows, per_window)
    ws = torch.empty(max(min(n_rows, per_window) * HV * rec, 16), dtype=torch.uint8, device=dev)
    carry = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if len(windows) > 1 else None

    pool32 = final = None
    slots = has_init = None
    if state_pool is not None:
        pool32 = state_pool if state_pool.dtype == torch.float32 else state_pool.float()
        state_in = state_out = pool32
        sstride = pool32.stride(0)
        slots, has_init = state_slots, has_initial_state
    else:
        state_in = None if initial_state is None else initial_state.float().contiguous()
        final = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
        state_out = final
        sstride = HV * K * V
    o = out if out is not None else torch.empty(T, HV, V, dtype=q.dtype, device=dev)
    for r0, r1 in windows:
        ext.gdn_prepare(q, k, v, g, beta, a, b, A_log, dt_bias, stride, cu_seqlens, seq_first, r0, r1, ws, scale,
                        use_qk_l2norm)
        if N > 0:
            ext.gdn_scan(ws, seq_first, cu_seqlens, o, state_in, state_out, sstride, slots, has_init, carry, r0, r1,
                         N, T, K)
    if pool32 is not None and pool32 is not state_pool:
        state_pool.copy_(pool32)
    return o, final


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
    """CUDA implementation of :func:`qwen35.ops.gdn_recurrent_step` (see the module docstring)."""
    _act("q", q)
    ext = extension(q.device)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _head_dims(K, V)
    o = out if out is not None else torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    if B == 0:
        return o
    g, beta, a, b, stride = _gate_rows(g, beta, a, b)
    pool32 = state_pool if state_pool.dtype == torch.float32 else state_pool.float()
    ext.gdn_step(q, k, v, g, beta, a, b, _side(A_log), _side(dt_bias), stride, pool32, state_slots, o,
                 K**-0.5 if scale is None else float(scale), use_qk_l2norm)
    if pool32 is not state_pool:
        state_pool.copy_(pool32)
    return o


# ----------------------------------------------------------------------------- conv1d


def _conv_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> tuple:
    _act("x", x)
    if activation not in (None, "silu"):
        raise ValueError(f"activation={activation!r}; accepted: None, 'silu'")
    return _side(weight).contiguous(), _side(bias), activation == "silu"


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    conv_pool: torch.Tensor | None = None,
    conv_slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """CUDA implementation of :func:`qwen35.ops.causal_conv1d_prefill` (two launches: outputs, then histories)."""
    w, bias, silu = _conv_args(x, weight, bias, activation)
    ext = extension(x.device)
    y = torch.empty_like(x)
    ext.conv_prefill(x, w, bias, y, cu_seqlens, conv_pool, conv_slots if conv_pool is not None else None,
                     has_initial_state if conv_pool is not None else None, silu)
    return y


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_pool: torch.Tensor,
    conv_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """CUDA implementation of :func:`qwen35.ops.causal_conv1d_update`: one token per row, pool in place."""
    w, bias, silu = _conv_args(x, weight, bias, activation)
    ext = extension(x.device)
    y = torch.empty_like(x)
    if x.shape[0] and x.shape[1]:
        ext.conv_update(x, w, bias, y, conv_pool, conv_slots, silu)
    return y


# ----------------------------------------------------------------------------- norms


def _norm_width(x: torch.Tensor) -> None:
    if x.shape[-1] > MAX_NORM_WIDTH:
        raise ValueError(f"{BACKEND} RMSNorm takes rows of at most {MAX_NORM_WIDTH} values; got {x.shape[-1]}")


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """CUDA implementation of :func:`qwen35.ops.rms_norm_gated`."""
    _act("x", x)
    _norm_width(x)
    ext = extension(x.device)
    y = torch.empty_like(x)
    ext.rms_norm(x, _side(z).contiguous(), None, _side(weight).contiguous(), y, None, float(eps), True, False)
    return y


def rms_norm_zero_centered(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """CUDA implementation of :func:`qwen35.ops.rms_norm_zero_centered` (the residual add fused)."""
    _act("x", x)
    _norm_width(x)
    ext = extension(x.device)
    y = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else None
    ext.rms_norm(x, None, residual, _side(weight).contiguous(), y, s, float(eps), False, True)
    return (y, s) if residual is not None else y


# ----------------------------------------------------------------------------- MoE

_BLOCK_M: dict[tuple[int, bool], int] = {}


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA implementation of :func:`qwen35.ops.moe_route`: a warp per token, top-k on the fp32 logits (the order
    of the probabilities), ties to the lowest id."""
    logits = router_logits if router_logits.dtype in DTYPES else router_logits.float()
    ext = extension(logits.device)
    M = logits.shape[0]
    weights = torch.empty(M, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(M, top_k, dtype=torch.int32, device=logits.device)
    if M:
        ext.moe_route(logits.contiguous(), weights, ids, int(top_k), bool(renormalize))
    return weights, ids


def _moe_dims(H: int, I: int, code: int) -> None:
    step = 8 if code == 1 else 4
    if H % step or I % step:
        raise ValueError(f"{BACKEND} MoE kernels take hidden size H and intermediate size I that are multiples of "
                         f"{step} for {'float16' if code == 1 else 'float32'}; got H={H}, I={I}")


def _experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             expert_map: torch.Tensor | None, extra: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts of ``ids`` (with ``extra`` [M, H] added in the combine)."""
    code = _act("x", x)
    ext = extension(x.device)
    M, H = x.shape
    E, I, k = w13.shape[0], w2.shape[2], ids.shape[1]
    if M == 0:
        return torch.empty_like(x)
    _moe_dims(H, I, code)
    esize = x.element_size()
    rows = 8 if code == 1 else 4
    gemv = M <= GEMV_MAX_TOKENS and rows * max(H, I) * esize <= GEMV_MAX_SMEM
    bm = _BLOCK_M.get((code, gemv))
    if bm is None:
        bm = _BLOCK_M[(code, gemv)] = int(ext.moe_block_m(code, gemv))
    x, w13, w2 = _aligned(x), _aligned(w13), _aligned(w2)
    ids32 = ids if ids.dtype == torch.int32 else ids.to(torch.int32)
    weights32 = weights if weights.dtype == torch.float32 else weights.float()
    picks = M * k
    max_blocks = -(-picks // bm) + min(E, picks)
    dev = x.device
    sorted_ids = torch.empty(max_blocks * bm, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    meta = torch.empty(2, dtype=torch.int32, device=dev)
    ext.moe_align(ids32.contiguous(), expert_map, E, bm, sorted_ids, block_expert, meta)
    h = torch.empty(picks, I, dtype=x.dtype, device=dev)
    y = torch.empty(picks, H, dtype=x.dtype, device=dev)
    ext.moe_gate_up(x, w13, h, sorted_ids, block_expert, meta, bm, k, gemv)
    ext.moe_down(h, w2, y, weights32.contiguous(), sorted_ids, block_expert, meta, bm, k, gemv)
    out = torch.empty_like(x)
    ext.moe_combine(y, ids32.contiguous(), expert_map, extra, out)
    return out


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """CUDA implementation of :func:`qwen35.ops.moe_experts` (see the module docstring)."""
    return _experts(x, w13, w2, topk_weights, topk_ids, expert_map)


def moe_block(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    shared_gate_weight: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """CUDA implementation of :func:`qwen35.ops.moe_block`: router logits (fp32 GEMM), routing, routed experts and
    the sigmoid-gated shared expert, summed in one combine."""
    _act("x", x)
    M = x.shape[0]
    if M == 0:
        return torch.empty_like(x)
    xf = x.float()
    weights, ids = moe_route(F.linear(xf, router_weight.float()), top_k, renormalize)
    extra = None
    if shared_w13 is not None:
        if shared_gate_weight is not None:
            gate = torch.sigmoid(F.linear(xf, shared_gate_weight.float()))
        else:
            gate = torch.ones(M, 1, dtype=torch.float32, device=x.device)
        zeros = torch.zeros(M, 1, dtype=torch.int32, device=x.device)
        extra = _experts(x, shared_w13.unsqueeze(0), shared_w2.unsqueeze(0), gate, zeros, None)
    return _experts(x, w13, w2, weights, ids, expert_map, extra)


__all__ = [
    "BACKEND", "DTYPES", "availability", "extension", "gdn_chunk_prefill", "gdn_recurrent_step",
    "causal_conv1d_prefill", "causal_conv1d_update", "rms_norm_gated", "rms_norm_zero_centered", "moe_route",
    "moe_experts", "moe_block",
]
