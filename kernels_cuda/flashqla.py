"""``flashqla`` backend: the GDN chunked prefill through FlashQLA (QwenLM's TileLang kernels, MIT licensed; the
optional extra ``qwen35[flashqla]``) for the batches a measured crossover table gives to it, the ``triton`` backend's
for every other batch. It defines ``gdn_chunk_prefill`` and its per-batch helpers only; the probe takes every other op
from the next backend of its policy.

**When it runs** (:func:`availability`, once per device): an NVIDIA sm90 / sm100 device, ``flash_qla`` imports,
and this device's crossover table gives at least one batch shape to FlashQLA; bf16 / fp16 activations (``DTYPES``:
the probe passes it over for fp32 calls, which run on triton). Then, at probe time (:func:`prepare`, the probe's
build hook, run once per device before the first self-test): FlashQLA's own self-test (output and states against an
fp64 recurrence on a K = V = 128 varlen batch with empty and one-token sequences, a state pool, a padded slot,
``has_initial_state`` False rows) and the warm-up: TileLang compiles each kernel at first use (10-30 s per kernel and
shape class), so every class the table's buckets reach is compiled here (:func:`warm_up`) and only warmed head shapes
are routed to FlashQLA: no compilation inside a request. (The probe's generic self-test of the op then runs its
small-head case, which this backend hands to triton.)

**Per batch** (:func:`route`): FlashQLA takes bf16 / fp16 with K = V = 128 (fp32, other head dims: triton, with the
reason); among those, the table's pick for the batch's shape, triton where the table has no entry near it.

**The crossover table** (written by ``qwen35-tune``; read like the tuned kernel configs: ``$QWEN35_CONFIG_DIR/<device
slug>/gdn_prefill_backend.json`` first, then ``kernels_triton/configs/<device slug>/``)::

    {"device": "NVIDIA H200", "op": "gdn_prefill_backend", "flash_qla": "0.1.3", "triton": "3.6.0",
     "entries": {"H=16,HV=48,dtype=bfloat16,seqs=8": {"4096": {"pick": "flashqla", "triton_ms": 1.70,
                                                               "flashqla_ms": 1.08}, ...}, ...}}

A shape key names the key heads, value heads, activation dtype and ``seqs``, the batch's sequence count rounded to the
nearest power of two; its buckets are tokens per sequence (``T // N``), ``pick`` is ``"flashqla"`` or ``"triton"``
and any other fields are the record of what was measured. A batch takes the pick of the nearest bucket (in log space)
of its shape key when that bucket is within a factor of two of its tokens per sequence, else triton.

**The wrapper** (:func:`flashqla_prefill`): FlashQLA takes one dense initial state per sequence it runs and rejects
zero-length sequences; the façade allows both pools and empty sequences. Empty sequences are dropped from its
``cu_seqlens`` (their final state is their initial state, written as the façade's rules say); initial states are
gathered from the pool (zeros for a negative slot or ``has_initial_state`` False) or tensor into dense rows and the
final states scattered back (:mod:`kernels_triton.gdn.state_io`), on the device; raw gating becomes fp32 ``g`` and
``beta``. The per-batch pieces (the kept sequences' offsets, the index tables, FlashQLA's context-parallel plan per
value-head count) are built at the batch's first FlashQLA call, kept in its metadata (the triton backend's, which
this backend's ``prepare_gdn_metadata`` returns) and shared by every layer.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels_triton import _config

log = logging.getLogger("qwen35.kernels_cuda")

SUPPORTED_CAPABILITIES = ((9, 0), (10, 0), (10, 3))  # Hopper, Blackwell datacenter
HEAD_DIM = 128  # FlashQLA's kernels are built for K = V = 128
DTYPES = (torch.bfloat16, torch.float16)
TABLE_OP = "gdn_prefill_backend"
BUCKET_FACTOR = 2.0  # a table bucket decides for batches within this factor of its tokens per sequence
CU_DTYPE = torch.int64  # cu_seqlens as FLA hands them to FlashQLA
SELFTEST_TOLERANCE = {torch.bfloat16: 2.5e-2, torch.float16: 1e-2}  # the probe's budgets for these dtypes
WARMUP_MAX_TOKENS = 1 << 18  # a warm-up batch of a table bucket holds at most this many tokens
CALLS = {"flashqla": 0, "triton": 0}  # batches run by each, in this process (diagnostics and tests)
WARMUP: dict[tuple, float] = {}  # (device, H, HV, dtype name) -> seconds its warm-up took
_WARMED: set[tuple] = set()  # (device, H, HV, dtype) whose FlashQLA kernels are compiled


class Kernel(NamedTuple):
    """The FlashQLA entry points the wrapper calls. ``run``: ``flash_qla.chunk_gated_delta_rule`` (q, k, v ``[1, T,
    ...]``, fp32 ``g`` / ``beta`` ``[1, T, HV]``, keywords ``scale``, ``initial_state``, ``output_final_state``,
    ``use_qk_l2norm_in_kernel``, ``cu_seqlens``, ``cp_context``); ``context``: ``(cu_seqlens, HV) -> cp_context``, its
    context-parallel plan of a batch (built once per batch)."""

    run: Callable
    context: Callable
    version: str


@functools.cache
def kernel() -> Kernel:
    """FlashQLA's entry points; ImportError (or whatever importing it raises) when it cannot load."""
    import flash_qla
    from flash_qla.ops.gated_delta_rule.chunk import CHUNK_SIZE, build_cp_context

    def context(cu_seqlens: torch.Tensor, HV: int) -> object:
        return build_cp_context(cu_seqlens, enable_intra=True, num_v_heads=HV, chunk_size=CHUNK_SIZE, is_train=False)

    return Kernel(flash_qla.chunk_gated_delta_rule, context, getattr(flash_qla, "__version__", "unknown"))


def _triton():  # noqa: ANN202 - the module
    import kernels_triton

    return kernels_triton


def gdn_chunk_table(offsets: Sequence[int], out=None):  # noqa: ANN001, ANN201 - kernels_triton.chunk_table
    """The triton backend's host chunk table (this backend's metadata wraps the triton backend's)."""
    return _triton().gdn_chunk_table(offsets, out)


# ----------------------------------------------------------------------------- availability and routing


def availability(caps) -> str | None:  # noqa: ANN001 - qwen35.probe.DeviceCaps
    """None when this backend can run on the probed device, else why not (cheap: FlashQLA's self-test and warm-up
    are :func:`prepare`'s). Computed once per device."""
    return _availability(caps.vendor, caps.capability, caps.name)


@functools.cache
def _availability(vendor: str, capability: tuple[int, int] | None, name: str) -> str | None:
    if vendor != "nvidia":
        return f"FlashQLA runs on NVIDIA GPUs only (this device: {vendor})"
    if capability not in SUPPORTED_CAPABILITIES:
        cc = "".join(map(str, capability or ()))
        return f"FlashQLA kernels are built for sm90 / sm100 (this device: sm{cc or '?'})"
    try:
        kernel()
    except Exception as e:  # noqa: BLE001 - any import failure means the extra is not usable here
        return f"flash_qla does not import ({type(e).__name__}: {str(e)[:200]}); pip install 'qwen35[flashqla]'"
    if not table_heads(name):
        return (f"no crossover table gives a batch to FlashQLA on {name} ({TABLE_OP}.json under "
                f"{' or '.join(str(d / _config.device_slug(name)) for d in _table_dirs())}, written by qwen35-tune): "
                "every batch runs on triton")
    return None


def prepare(device: torch.device) -> None:
    """The probe's build hook (once per device, before the first self-test): FlashQLA's self-test in every dtype the
    crossover table routes, then the warm-up of every head shape it routes (:func:`warm_up`; the seconds are logged
    and kept in :data:`WARMUP`). RuntimeError naming what failed: the probe then passes the op to triton."""
    loaded = kernel()
    name = _config.device_facts(device)[0]
    heads = table_heads(name)
    for dtype in sorted({d for _, _, d in heads}, key=str):
        err = self_test(device, dtype, loaded)
        if err:
            raise RuntimeError(f"FlashQLA {loaded.version} self-test failed on {device}: {err}")
    secs = warm_up(device, heads, loaded)
    log.info("qwen35: FlashQLA %s ready on %s: %d head shapes warmed in %.1f s", loaded.version, device, len(heads),
             secs)


def supports(dtype: torch.dtype, K: int, V: int) -> str | None:
    """Why FlashQLA cannot take a batch of this dtype and head dims, or None."""
    if dtype not in DTYPES:
        return f"FlashQLA takes bf16 or fp16 activations, got {str(dtype).replace('torch.', '')}"
    if K != HEAD_DIM or V != HEAD_DIM:
        return f"FlashQLA takes K = V = {HEAD_DIM}, got K={K}, V={V}"
    return None


def _table_dirs() -> list:
    return [_config.user_dir(), _config.SHIPPED_DIR]


@_config.derived  # cleared with the tuned configs (kernels_triton.bench_api.clear_config_cache)
@functools.lru_cache(maxsize=16)
def crossover_table(device_name: str) -> dict:
    """This device's crossover table's entries (module docstring), ``{}`` when there is none."""
    for d in _table_dirs():
        path = d / _config.device_slug(device_name) / f"{TABLE_OP}.json"
        if path.is_file():
            with open(path) as f:
                return json.load(f).get("entries", {})
    return {}


def shape_key(H: int, HV: int, dtype: torch.dtype, N: int) -> str:
    """The table's shape key of a batch of N sequences (``seqs``: N rounded to the nearest power of two)."""
    seqs = 1 << max(0, math.floor(math.log2(max(N, 1)) + 0.5))
    return f"H={H},HV={HV},dtype={str(dtype).replace('torch.', '')},seqs={seqs}"


def table_pick(device_name: str, H: int, HV: int, dtype: torch.dtype, N: int, per_seq: int) -> str | None:
    """The table's pick for a batch (N sequences, ``per_seq`` tokens each on average), or None where no bucket of
    its shape key lies within :data:`BUCKET_FACTOR` of ``per_seq``."""
    buckets = crossover_table(device_name).get(shape_key(H, HV, dtype, N))
    if not buckets:
        return None
    target = math.log(max(per_seq, 1))
    best = min(buckets, key=lambda b: abs(math.log(max(int(b), 1)) - target))
    if abs(math.log(max(int(best), 1)) - target) > math.log(BUCKET_FACTOR) + 1e-9:
        return None
    pick = buckets[best].get("pick")
    return pick if pick in ("flashqla", "triton") else None


def table_heads(device_name: str) -> dict[tuple[int, int, torch.dtype], list[tuple[int, int]]]:
    """``{(H, HV, dtype): [(seqs, tokens per sequence), ...]}`` of the table's buckets that pick FlashQLA."""
    out: dict[tuple[int, int, torch.dtype], list[tuple[int, int]]] = {}
    for key, buckets in crossover_table(device_name).items():
        try:
            f = dict(part.split("=", 1) for part in key.split(","))
            head = (int(f["H"]), int(f["HV"]), getattr(torch, f["dtype"]))
            seqs = int(f["seqs"])
        except (KeyError, ValueError, AttributeError):
            log.warning("qwen35: crossover table key %r is not H=..,HV=..,dtype=..,seqs=..; ignored", key)
            continue
        for tokens, rec in buckets.items():
            if isinstance(rec, dict) and rec.get("pick") == "flashqla" and head[2] in DTYPES:
                out.setdefault(head, []).append((seqs, int(tokens)))
    return out


def route(device: torch.device, dtype: torch.dtype, H: int, HV: int, K: int, V: int, N: int,
          T: int) -> tuple[str, str]:
    """(``"flashqla"`` or ``"triton"``, why) for a batch of N sequences and T tokens."""
    if device.type != "cuda":
        return "triton", "not a CUDA device"
    why = supports(dtype, K, V)
    if why:
        return "triton", why
    per_seq = max(1, T // max(N, 1))
    pick = _pick(device, dtype, H, HV, N, 1 << max(0, math.floor(math.log2(per_seq) + 0.5)))
    if pick != "flashqla":
        return "triton", "the crossover table picks triton" if pick else "no crossover table entry near this batch"
    if (str(device), H, HV, dtype) not in _WARMED:
        return "triton", "FlashQLA's kernels are not warmed up for these heads (compiling inside a request is not done)"
    return "flashqla", "the crossover table picks FlashQLA"


@_config.derived
@functools.lru_cache(maxsize=4096)
def _pick(device: torch.device, dtype: torch.dtype, H: int, HV: int, N: int, per_seq: int) -> str | None:
    return table_pick(_config.device_facts(device)[0], H, HV, dtype, N, per_seq)


def reset() -> None:
    """Forget availability verdicts, warmed shapes, loaded tables and routes (tests; after a new table)."""
    _availability.cache_clear()
    _WARMED.clear()
    WARMUP.clear()
    crossover_table.cache_clear()
    _pick.cache_clear()


# ----------------------------------------------------------------------------- per-batch data


def prepare_gdn_metadata(cu_seqlens: torch.Tensor, chunk_size: int = 64, *, offsets: Sequence[int] | None = None,
                         table: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None) -> object:
    """The triton backend's metadata (:class:`kernels_triton.gdn.GdnChunkMetadata`): batches routed to triton use it
    as it is, and FlashQLA's per-batch pieces are kept in it (its ``derived`` tables) at the batch's first FlashQLA
    call, built from its host offsets where it has them."""
    kt = _triton()
    if chunk_indices is not None:
        return kt.prepare_gdn_metadata(cu_seqlens, chunk_size, chunk_indices=chunk_indices)
    return kt.prepare_gdn_metadata(cu_seqlens, chunk_size, offsets=offsets, table=table)


class Layout(NamedTuple):
    """A batch as FlashQLA runs it: ``M`` non-empty sequences of ``N``; ``cu_kept`` their offsets (``[M + 1]``),
    ``rows`` the sequence of each (``[M]``), ``pos`` each sequence's row among them or -1 (``[N]``), all views of one
    device tensor; ``contexts``: FlashQLA's context-parallel plan by value-head count."""

    M: int
    N: int
    cu_kept: torch.Tensor
    rows: torch.Tensor
    pos: torch.Tensor
    contexts: dict


def layout_of(offsets: Sequence[int], device: torch.device) -> Layout:
    """The :class:`Layout` of a batch at ``offsets`` (cu_seqlens' values), its tables on ``device`` in one copy."""
    kept = [n for n, (s, e) in enumerate(itertools.pairwise(offsets)) if e > s]
    M, N = len(kept), len(offsets) - 1
    pos = [-1] * N
    for m, n in enumerate(kept):
        pos[n] = m
    cu = [0, *itertools.accumulate(offsets[n + 1] - offsets[n] for n in kept)]
    host = torch.tensor([*cu, *kept, *pos], dtype=CU_DTYPE)
    dev = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    return Layout(M, N, dev[:M + 1], dev[M + 1:2 * M + 1], dev[2 * M + 1:], {})


_DENSE: dict[tuple, Layout] = {}  # layouts of calls without cu_seqlens, by length


def batch_layout(metadata: object | None, cu_seqlens: torch.Tensor | None, T: int, device: torch.device) -> Layout:
    """This call's :class:`Layout`: kept with the batch's metadata (built at its first call), per length for one
    sequence without cu_seqlens, else built here from cu_seqlens' values (one read-back)."""
    if cu_seqlens is None:
        found = _DENSE.get((T, device))
        if found is None:
            if len(_DENSE) >= 64:
                _DENSE.clear()
            found = _DENSE[(T, device)] = layout_of((0, T), device)
        return found
    from kernels_triton.gdn import GdnChunkMetadata

    if (not isinstance(metadata, GdnChunkMetadata) or metadata.cu_seqlens.data_ptr() != cu_seqlens.data_ptr()
            or metadata.version != cu_seqlens._version):  # none, or built for a batch this buffer held before
        return layout_of(cu_seqlens.tolist(), device)
    found = metadata.derived.get("flashqla_layout")
    if found is None:
        found = metadata.derived["flashqla_layout"] = layout_of(metadata.offsets or cu_seqlens.tolist(), device)
    return found


def gating(g: torch.Tensor | None, beta: torch.Tensor | None, a: torch.Tensor | None, b: torch.Tensor | None,
           A_log: torch.Tensor | None, dt_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 contiguous ``(g, beta)`` ``[T, HV]``: as given, or from the raw projections (``g = -exp(A_log)
    softplus(a + dt_bias)``, ``beta = sigmoid(b)``)."""
    if a is not None:
        g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
        beta = torch.sigmoid(b.float())
    return g.float().contiguous(), beta.float().contiguous()


# ----------------------------------------------------------------------------- the op


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
    """:func:`qwen35.ops.gdn_chunk_prefill`: FlashQLA where :func:`route` gives it the batch, else the triton
    backend's."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    impl, _ = route(q.device, q.dtype, H, HV, K, V, N, T)
    CALLS[impl] += 1
    kw = dict(g=g, beta=beta, a=a, b=b, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
              initial_state=initial_state, state_pool=state_pool, state_slots=state_slots,
              has_initial_state=has_initial_state, output_final_state=output_final_state, scale=scale,
              use_qk_l2norm=use_qk_l2norm, out=out)
    if impl == "flashqla":
        return flashqla_prefill(q, k, v, **kw, metadata=metadata)
    return _triton().gdn_chunk_prefill(q, k, v, **kw, chunk_size=chunk_size, metadata=metadata)


def flashqla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor | None = None,
                     beta: torch.Tensor | None = None, a: torch.Tensor | None = None, b: torch.Tensor | None = None,
                     A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                     cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                     state_pool: torch.Tensor | None = None, state_slots: torch.Tensor | None = None,
                     has_initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                     scale: float | None = None, use_qk_l2norm: bool = False, metadata: object | None = None,
                     out: torch.Tensor | None = None,
                     kernel_fn: Kernel | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op through FlashQLA whatever the table says (benchmarks, tests, the probe-time self-test): the façade's
    arguments and results (module docstring: the wrapper). ValueError for what FlashQLA cannot take (fp32, head dims
    other than 128). ``kernel_fn``: the entry points to call (default :func:`kernel`; tests pass a stand-in)."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    why = supports(q.dtype, K, V)
    if why:
        raise ValueError(f"{why}; the triton backend takes this call")
    kern = kernel() if kernel_fn is None else kernel_fn
    from kernels_triton.gdn.state_io import gather_states, scatter_states

    lay = batch_layout(metadata, cu_seqlens, T, q.device)
    numel = HV * K * V
    h0 = gather_states(lay.rows, numel, initial_state, state_pool, state_slots, has_initial_state)
    if lay.M:
        ctx = lay.contexts.get(HV)
        if ctx is None and HV not in lay.contexts:
            ctx = lay.contexts[HV] = kern.context(lay.cu_kept, HV)
        gg, bb = gating(g, beta, a, b, A_log, dt_bias)
        o, ht = kern.run(q[None], k[None], v[None], gg[None], bb[None], scale=scale,
                         initial_state=h0.view(lay.M, HV, K, V), output_final_state=True,
                         use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=lay.cu_kept, cp_context=ctx)
        o, ht = o[0], ht.reshape(lay.M, numel)
    else:
        o, ht = q.new_empty(T, HV, V), h0
    want_final = None if state_pool is not None or not output_final_state else (lay.N, HV, K, V)
    final = scatter_states(ht, lay.pos, initial_state, state_pool, state_slots, has_initial_state, want_final)
    if out is not None:
        out.copy_(o)
        o = out
    return o, final


# ----------------------------------------------------------------------------- self-test and warm-up


def recurrence64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 scale: float, use_qk_l2norm: bool, offsets: Sequence[int],
                 h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token in fp64 (the definition): (o ``[T, HV, V]``, final states ``[N, HV, K,
    V]``) from per-sequence initial states ``h0``; gating already resolved (``g``, ``beta`` ``[T, HV]``)."""
    q, k, v, g, beta, h0 = (x.double() for x in (q, k, v, g, beta, h0))
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, 1) * scale, k.repeat_interleave(rep, 1)
    o = torch.zeros_like(v)
    finals = []
    for n, (s, e) in enumerate(itertools.pairwise(offsets)):
        S = h0[n].clone()
        for t in range(s, e):
            S = S * g[t].exp()[:, None, None]
            S = S + k[t][:, :, None] * (beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t])))[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", S, q[t])
        finals.append(S)
    return o, torch.stack(finals)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.double()
    if not torch.isfinite(x).all():
        return math.inf
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def self_test(device: torch.device, dtype: torch.dtype, kern: Kernel | None = None) -> str | None:
    """FlashQLA through the wrapper against :func:`recurrence64` on a varlen batch (empty and one-token sequences, a
    state pool with a padded slot and ``has_initial_state`` False rows, raw gating, L2 norms in the kernel): None, or
    what failed and by how much. Slots no sequence names must stay untouched."""
    lens, H, HV, K = [70, 0, 1, 130], 1, 2, HEAD_DIM
    gen = torch.Generator().manual_seed(0)
    T = sum(lens)
    offsets = [0, *itertools.accumulate(lens)]

    def rnd(*shape, scale=1.0):  # noqa: ANN002, ANN202
        return torch.randn(*shape, generator=gen) * scale

    q, k, v = rnd(T, H, K).to(dtype), rnd(T, H, K).to(dtype), rnd(T, HV, K).to(dtype)
    a, b = rnd(T, HV).to(dtype), rnd(T, HV).to(dtype)
    A_log, dt_bias = rnd(HV, scale=0.5), rnd(HV, scale=0.5)
    pool = rnd(6, HV, K, K, scale=0.1)
    slots = torch.tensor([3, 0, -1, 5], dtype=torch.int32)
    flags = torch.tensor([True, False, True, True])
    h0 = torch.stack([pool[s] if s >= 0 and f else torch.zeros(HV, K, K)
                      for s, f in zip(slots.tolist(), flags.tolist(), strict=True)])
    g, beta = gating(None, None, a, b, A_log, dt_bias)
    ro, rfinal = recurrence64(q, k, v, g, beta, K**-0.5, True, offsets, h0)
    dev_pool = pool.to(device)
    to = functools.partial(torch.Tensor.to, device=device)
    o, _ = flashqla_prefill(to(q), to(k), to(v), a=to(a), b=to(b), A_log=to(A_log), dt_bias=to(dt_bias),
                            cu_seqlens=to(torch.tensor(offsets, dtype=torch.int32)), state_pool=dev_pool,
                            state_slots=to(slots), has_initial_state=to(flags), use_qk_l2norm=True, kernel_fn=kern)
    got = dev_pool.cpu()
    tol = SELFTEST_TOLERANCE[dtype]
    err_o = _rel(o.cpu(), ro)
    err_s = max(_rel(got[s], rfinal[n]) for n, s in enumerate(slots.tolist()) if s >= 0 and lens[n])
    if not (err_o <= tol and err_s <= tol):
        return f"rel err output {err_o:.3g}, states {err_s:.3g} > {tol:g} ({str(dtype).replace('torch.', '')})"
    if not torch.equal(got[0], torch.zeros_like(got[0])):
        return "an empty sequence without an initial state did not zero its slot"
    if not all(torch.equal(got[s], pool[s]) for s in (1, 2, 4)):
        return "a slot no sequence names changed"
    return None


def warm_up(device: torch.device, heads: dict[tuple[int, int, torch.dtype], Iterable[tuple[int, int]]],
            kern: Kernel | None = None) -> float:
    """Compile FlashQLA's kernels for every (H, HV, dtype) of ``heads`` (``{(H, HV, dtype): [(seqs, tokens per
    sequence), ...]}``, the table's buckets that pick FlashQLA): one call per bucket (its context-parallel plan as a
    request of that shape gets it), calls of 1-64 one-chunk sequences (every launch-grid class), both L2 settings,
    pool states in and out as the model passes them. Marks the heads as warmed (:func:`route` gives FlashQLA only
    those); returns the seconds it took, also kept in :data:`WARMUP`."""
    total = 0.0
    for (H, HV, dtype), buckets in heads.items():
        t0 = time.perf_counter()
        shapes = [[64] * n for n in (1, 2, 4, 8, 16, 32, 64)]
        for seqs, tokens in sorted(set(buckets)):
            n = max(1, min(seqs, WARMUP_MAX_TOKENS // max(tokens, 1)))
            shapes.append([min(tokens, WARMUP_MAX_TOKENS)] * n)
        _warm_call(device, H, HV, dtype, [64], use_l2=False, kern=kern)  # FlashQLA's L2 norm is its own kernel
        for lens in shapes:
            _warm_call(device, H, HV, dtype, lens, use_l2=True, kern=kern)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        secs = time.perf_counter() - t0
        WARMUP[(str(device), H, HV, str(dtype).replace("torch.", ""))] = round(secs, 2)
        _WARMED.add((str(device), H, HV, dtype))
        total += secs
    return total


def _warm_call(device: torch.device, H: int, HV: int, dtype: torch.dtype, lens: list[int], use_l2: bool,
               kern: Kernel | None) -> None:
    T, N, K = sum(lens), len(lens), HEAD_DIM
    offsets = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)

    def rnd(*shape):  # noqa: ANN002, ANN202
        return torch.randn(*shape, device=device).to(dtype)

    pool = torch.zeros(N, HV, K, K, device=device)
    flashqla_prefill(rnd(T, H, K), rnd(T, H, K), rnd(T, HV, K), a=rnd(T, HV), b=rnd(T, HV),
                     A_log=torch.zeros(HV, device=device), dt_bias=torch.zeros(HV, device=device),
                     cu_seqlens=offsets, state_pool=pool, state_slots=torch.arange(N, dtype=torch.int32,
                                                                                   device=device),
                     use_qk_l2norm=use_l2, kernel_fn=kern)
