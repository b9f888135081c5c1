"""The Qwen3.5 text decoder (dense and MoE), one definition for every host.

Reads top to bottom in the order data flows: token embedding -> N decoder layers (a Gated
DeltaNet or a gated full-attention mixer, then a dense MLP or a sparse MoE, each behind a
zero-centred RMSNorm with the residual carried alongside) -> final norm -> LM head.

Tokens are flattened: one forward takes ``input_ids [T]`` and ``positions [T]`` (or the
multi-axis ``[3, T]`` of prompts with images) for a whole batch of sequences. All numerics go
through the op façade :mod:`qwen35.ops`; the only plain torch here are the projections (matmuls),
the rotary embedding, the attention output gate and the dense MLP's SiLU·mul. The vision tower
(:mod:`qwen35.vision`) is the host's: its rows enter through ``inputs_embeds``.

What a host supplies (:class:`Host`), so the model never knows which one runs it:

- ``parallel``: tensor-parallel rank/size and the two collectives. Every projection, the GDN
  heads, the attention heads, the experts and the vocabulary are sharded by it; size 1 means
  plain, unsharded layers.
- ``attention(...)``: the full-attention implementation for one layer, with its own KV cache
  (standalone: SDPA over per-sequence buffers; vLLM: vLLM's paged ``Attention``). It is called
  as ``attn(q, k, v) -> o`` on ``[T, heads * head_dim]`` tensors (q/k already normed and rotated)
  and knows the batch layout from the host.
- ``gdn_state(...)``: the state caches of one GDN layer. ``run(core, qkv, a, b, out)`` hands the
  layer's :meth:`GatedDeltaNet.core` a :class:`GDNStep` (conv pool, recurrent-state pool and the
  batch layout) for this forward; the vLLM host routes that call through an opaque custom op.
  ``qkv`` is a flat buffer holding the q, k and v planes; hosts pass it through untouched.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from qwen35 import ops
from qwen35.config import Qwen35Config
from qwen35.mrope import mrope_angles, mrope_column_axes

# ----------------------------------------------------------------------------- host contract


@dataclass(frozen=True)
class Parallel:
    """Tensor parallelism as the model sees it: this rank, the group size and the collectives."""

    rank: int = 0
    size: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    all_gather_last_dim: Callable[[torch.Tensor], torch.Tensor] = lambda x: x

    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's even share of ``n`` items."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor parallel size {self.size}")
        share = n // self.size
        return self.rank * share, share


@dataclass
class GDNStep:
    """One forward's view of a GDN layer's caches and batch layout.

    Tokens are ordered decode rows first (one token each), then the prefill tokens, then any
    padding the host added (left untouched). Slots index the pools; a negative slot is padding.
    """

    conv_pool: torch.Tensor  # [slots, conv_dim_local, W - 1], activation dtype
    state_pool: torch.Tensor  # [slots, HV_local, K, V], fp32
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes]
    num_prefill_tokens: int
    prefill_cu_seqlens: torch.Tensor | None  # [num_prefills + 1], offsets within the prefill tokens
    prefill_slots: torch.Tensor | None  # [num_prefills]
    prefill_has_initial_state: torch.Tensor | None  # [num_prefills] bool
    prefill_metadata: object | None = None  # ops.prepare_gdn_metadata(prefill_cu_seqlens), shared by all layers


class GDNState(Protocol):
    def run(self, core: Callable[..., None], qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            out: torch.Tensor) -> None: ...


class Host(Protocol):
    parallel: Parallel

    def attention(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  scale: float) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]: ...

    def gdn_state(self, layer_idx: int, conv_shape: tuple[int, int], state_shape: tuple[int, int, int],
                  conv_dtype: torch.dtype) -> GDNState: ...


def facade_ops(cfg: Qwen35Config) -> tuple[str, ...]:
    """The façade ops a forward of :class:`Qwen35Model` calls for ``cfg`` (each with a first tensor in the model's
    dtype): hosts choose their backends at load (:func:`qwen35.probe.choose_at_load`), before any graph capture."""
    kinds = set(cfg.layer_types)
    gdn = ("causal_conv1d_prefill", "causal_conv1d_update", "gdn_chunk_prefill", "gdn_recurrent_step",
           "rms_norm_gated") if "linear_attention" in kinds else ()
    attention = ("qk_norm_rope", "sigmoid_gate_mul") if "full_attention" in kinds else ()
    return ("rms_norm_zero_centered", *gdn, *attention, *(("moe_block",) if cfg.is_moe else ()))


_REPORTED: set[str] = set()


def report_backends_once(device: torch.device | str, log: logging.Logger) -> None:
    """Hosts call this at start: logs the probe's per-op backend table once per process and device."""
    key = str(device)
    if key in _REPORTED:
        return
    _REPORTED.add(key)
    from qwen35 import probe

    log.info("qwen35 backends on %s:\n%s", key, probe.format_report(probe.report(device)))


# ----------------------------------------------------------------------------- local (per-rank) sizes


@dataclass(frozen=True)
class Shards:
    """Sizes this rank holds: the one place the model and the weight loader agree on."""

    heads: int  # attention query heads
    kv_heads: int
    kv_head_start: int  # first global kv head held here (kv heads replicate when tp > kv heads)
    gdn_key_heads: int
    gdn_value_heads: int
    mlp: int  # dense intermediate, or routed-expert intermediate for MoE
    shared_mlp: int
    vocab: int  # rows of the (padded) vocabulary shard
    vocab_start: int

    @classmethod
    def of(cls, cfg: Qwen35Config, par: Parallel) -> Shards:
        cfg.check_tensor_parallel(par.size)
        kv = cfg.num_key_value_heads
        if kv >= par.size:
            kv_start, kv_local = par.split(kv, "num_key_value_heads")
        else:  # fewer kv heads than ranks: each kv head is replicated on size // kv ranks
            kv_start, kv_local = par.rank // (par.size // kv), 1
        vocab_local = -(-cfg.vocab_size // par.size)  # padded so every rank holds the same number of rows
        return cls(
            heads=cfg.num_attention_heads // par.size,
            kv_heads=kv_local,
            kv_head_start=kv_start,
            gdn_key_heads=cfg.linear_num_key_heads // par.size,
            gdn_value_heads=cfg.linear_num_value_heads // par.size,
            mlp=(cfg.moe_intermediate_size if cfg.is_moe else cfg.intermediate_size) // par.size,
            shared_mlp=cfg.shared_expert_intermediate_size // par.size,
            vocab=vocab_local,
            vocab_start=par.rank * vocab_local,
        )


ROW_BLOCK_PROJ_MIN_TOKENS = 512  # GDN input projection: one matmul per row block from this many tokens


def _param(*shape: int, dtype: torch.dtype | None, device=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T`` with this rank's slice of W; ``reduce`` all-reduces a row-parallel result."""

    def __init__(self, in_features: int, out_features: int, *, dtype, device, reduce: Parallel | None = None):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)
        self._reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return self._reduce.all_reduce(y) if self._reduce is not None and self._reduce.size > 1 else y


def _norm(weight: torch.Tensor, eps: float, x: torch.Tensor, residual: torch.Tensor | None):
    """Zero-centred RMSNorm; with a residual, also returns the new residual ``x + residual``."""
    if residual is None:
        return ops.rms_norm_zero_centered(x, weight, eps), x
    return ops.rms_norm_zero_centered(x, weight, eps, residual)


# ----------------------------------------------------------------------------- embedding


class VocabEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks (rows outside this shard give zeros)."""

    def __init__(self, cfg: Qwen35Config, sh: Shards, par: Parallel, *, dtype, device):
        super().__init__()
        self.weight = _param(sh.vocab, cfg.hidden_size, dtype=dtype, device=device)
        self.start, self.par = sh.vocab_start, par

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.par.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside[:, None].to(self.weight.dtype)
        return self.par.all_reduce(out)


# ----------------------------------------------------------------------------- rotary embedding


class Rotary:
    """Partial NeoX-style RoPE on the first ``rotary_dim`` dims of each head: the angles here, the rotation in
    :func:`qwen35.ops.qk_norm_rope`.

    Positions ``[T]`` give plain RoPE; ``[3, T]`` (time, row, column) give the interleaved multi-axis RoPE of
    the multimodal checkpoints (:func:`qwen35.mrope.mrope_angles`, ``cfg.mrope_section``). Text tokens carry
    one value on all three rows, so a text-only prompt gets the same angles either way, bit for bit.
    """

    def __init__(self, cfg: Qwen35Config):
        self.dim = cfg.rotary_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))
        self.axes = mrope_column_axes(self.inv_freq.shape[0], cfg.mrope_section)
        # (inv_freq, axes) per device: no host-to-device copy per step (CUDA-graph capture)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``[T, rotary_dim / 2]`` each, for positions ``[T]`` or ``[3, T]``."""
        constants = self._on_device.get(positions.device)
        if constants is None:
            constants = self._on_device[positions.device] = (self.inv_freq.to(positions.device),
                                                             self.axes.to(positions.device))
        inv_freq, axes = constants
        freqs = mrope_angles(positions, inv_freq, axes=axes)
        return freqs.cos(), freqs.sin()


class _StepRope:
    """``(rotary, cos, sin)`` of one step, unpacked by the attention layers (which rotate q and k with
    :func:`qwen35.ops.qk_norm_rope`); cos/sin are computed when the first one does. A prefill's first layers
    are GDN layers: its first launches are then their work, not these small kernels, while the device still
    waits for the step's first kernels."""

    def __init__(self, rotary: Rotary, positions: torch.Tensor):
        self.rotary, self.positions = rotary, positions
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def __iter__(self):  # noqa: ANN204
        if self._cos_sin is None:
            self._cos_sin = self.rotary.cos_sin(self.positions)
        return iter((self.rotary, *self._cos_sin))


# ----------------------------------------------------------------------------- token mixers


class GatedDeltaNet(nn.Module):
    """Linear attention: projections -> causal conv1d -> gated delta rule -> gated RMSNorm -> out proj.

    ``in_proj`` stacks this rank's rows of HF's in_proj_qkv (q, k, v heads), in_proj_z,
    in_proj_b and in_proj_a. The kernels read q, k and v as three planes of one buffer (``qkv``
    below), each convolved on its own channels, so that no copy sits between the convolution and
    the delta rule. Long inputs multiply by row blocks of ``in_proj``, landing every product
    contiguous (slicing the columns of one wide product costs five strided copies per layer, about
    a tenth of a 1x8192 prefill: tuning/notes_model.md); a few tokens take one product and small copies
    (fewer launches).
    """

    def __init__(self, cfg: Qwen35Config, layer_idx: int, sh: Shards, host: Host, *, dtype, device):
        super().__init__()
        self.H, self.HV = sh.gdn_key_heads, sh.gdn_value_heads
        self.K, self.V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.eps = cfg.rms_norm_eps
        self.conv_dim = 2 * self.H * self.K + self.HV * self.V
        self.planes = (self.H * self.K, self.H * self.K, self.HV * self.V)  # q | k | v channels
        self.channel_ranges = list(itertools.pairwise(itertools.accumulate(self.planes, initial=0)))
        self.in_proj = Linear(cfg.hidden_size, self.conv_dim + self.HV * self.V + 2 * self.HV,
                              dtype=dtype, device=device)  # rows: q | k | v | z | b | a
        self.conv1d_weight = _param(self.conv_dim, cfg.linear_conv_kernel_dim, dtype=dtype, device=device)
        self.A_log = _param(self.HV, dtype=torch.float32, device=device)
        self.dt_bias = _param(self.HV, dtype=torch.float32, device=device)
        self.norm_weight = _param(self.V, dtype=dtype, device=device)
        self.out_proj = Linear(self.HV * self.V, cfg.hidden_size, dtype=dtype, device=device, reduce=host.parallel)
        conv_dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.state = host.gdn_state(layer_idx, (self.conv_dim, cfg.linear_conv_kernel_dim - 1),
                                    (self.HV, self.K, self.V), conv_dtype)

    def forward(self, x: torch.Tensor, rope: object = None) -> torch.Tensor:
        T, c, zv, w = x.shape[0], self.conv_dim, self.HV * self.V, self.in_proj.weight
        if T >= ROW_BLOCK_PROJ_MIN_TOKENS:
            qkv = x.new_empty(T * c)  # q, k, v planes back to back, each [T, channels] contiguous
            for (lo, hi), plane in zip(self.channel_ranges, self._planes(qkv, T), strict=True):
                torch.matmul(x, w[lo:hi].t(), out=plane)
            z, ba = F.linear(x, w[c:c + zv]), F.linear(x, w[c + zv:])
        elif T == 1:  # one row: its q | k | v columns are the three planes already
            y = self.in_proj(x)
            qkv, z, ba = y[0, :c], y[:, c:c + zv], y[:, c + zv:]
        else:
            y = self.in_proj(x)
            qkv = x.new_empty(T * c)
            for (lo, hi), plane in zip(self.channel_ranges, self._planes(qkv, T), strict=True):
                plane.copy_(y[:, lo:hi])
            z, ba = y[:, c:c + zv].contiguous(), y[:, c + zv:]
        out = x.new_empty(T, self.HV, self.V)  # the core writes every row
        self.state.run(self.core, qkv, ba[:, self.HV:], ba[:, :self.HV], out)  # a, b: views, rows 2 HV apart
        out = ops.rms_norm_gated(out, z.view(T, self.HV, self.V), self.norm_weight, self.eps)
        return self.out_proj(out.view(T, -1))

    def _planes(self, qkv: torch.Tensor, T: int) -> list[torch.Tensor]:
        """Views ``[T, channels]`` of the q, k and v planes of a flat ``qkv`` buffer."""
        return [p.view(T, n) for p, n in zip(qkv.split([T * n for n in self.planes]), self.planes, strict=True)]

    def _conv(self, qkv: torch.Tensor, planes: list[torch.Tensor], step: GDNStep, rows: slice,
              decode: bool) -> list[torch.Tensor]:
        """Causal conv of each plane's ``rows`` over its own channels (and its channels of the conv pool): one
        call over the three planes when the rows are all of them, else one call per plane."""
        T = planes[0].shape[0]
        if rows.start == 0 and rows.stop == T:
            x = qkv.view(T, self.conv_dim)  # rows of nothing: the memory holds the planes
            if decode:
                y = ops.causal_conv1d_update(x, self.conv1d_weight, conv_pool=step.conv_pool,
                                             conv_slots=step.decode_slots, planes=self.planes)
            else:
                y = ops.causal_conv1d_prefill(
                    x, self.conv1d_weight, cu_seqlens=step.prefill_cu_seqlens, conv_pool=step.conv_pool,
                    conv_slots=step.prefill_slots, has_initial_state=step.prefill_has_initial_state,
                    planes=self.planes)
            q, k, v = self._planes(y.view(-1), T)
            return [q.view(T, self.H, self.K), k.view(T, self.H, self.K), v.view(T, self.HV, self.V)]
        outs = []
        for (lo, hi), plane in zip(self.channel_ranges, planes, strict=True):
            pool, weight = step.conv_pool[:, lo:hi], self.conv1d_weight[lo:hi]
            if decode:
                outs.append(ops.causal_conv1d_update(plane[rows], weight, conv_pool=pool, conv_slots=step.decode_slots))
            else:
                outs.append(ops.causal_conv1d_prefill(
                    plane[rows], weight, cu_seqlens=step.prefill_cu_seqlens, conv_pool=pool,
                    conv_slots=step.prefill_slots, has_initial_state=step.prefill_has_initial_state))
        q, k, v = outs
        n = q.shape[0]
        return [q.view(n, self.H, self.K), k.view(n, self.H, self.K), v.view(n, self.HV, self.V)]

    def core(self, step: GDNStep, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """Conv + delta rule for one forward, writing every row of ``out [T, HV, V]`` in place (decode rows, then
        prefills, then zeros on rows the host padded the batch with).

        ``qkv`` is the flat buffer of the q, k and v planes (see :meth:`forward`); ``a``, ``b`` ``[T, HV]``.
        """
        planes = self._planes(qkv, a.shape[0])
        nd = step.num_decodes
        if nd:
            q, k, v = self._conv(qkv, planes, step, slice(0, nd), decode=True)
            ops.gdn_recurrent_step(
                q[:, None], k[:, None], v[:, None], state_pool=step.state_pool, state_slots=step.decode_slots,
                a=a[:nd, None], b=b[:nd, None], A_log=self.A_log, dt_bias=self.dt_bias, use_qk_l2norm=True,
                out=out[:nd, None])
        if step.num_prefill_tokens:
            s, e = nd, nd + step.num_prefill_tokens
            q, k, v = self._conv(qkv, planes, step, slice(s, e), decode=False)
            ops.gdn_chunk_prefill(
                q, k, v, a=a[s:e], b=b[s:e], A_log=self.A_log, dt_bias=self.dt_bias,
                cu_seqlens=step.prefill_cu_seqlens, state_pool=step.state_pool, state_slots=step.prefill_slots,
                has_initial_state=step.prefill_has_initial_state, use_qk_l2norm=True,
                metadata=step.prefill_metadata, out=out[s:e])
        if nd + step.num_prefill_tokens < out.shape[0]:
            out[nd + step.num_prefill_tokens:].zero_()  # rows the host padded the batch with


class GatedAttention(nn.Module):
    """Full attention with per-head q/k norms, partial RoPE and a sigmoid output gate.

    ``qkv_proj`` stacks this rank's rows of q_proj (per head: ``head_dim`` query rows then
    ``head_dim`` gate rows, as HF lays them out), k_proj and v_proj.
    """

    def __init__(self, cfg: Qwen35Config, layer_idx: int, sh: Shards, host: Host, *, dtype, device):
        super().__init__()
        self.H, self.KV, self.D = sh.heads, sh.kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.splits = [self.H * 2 * self.D, self.KV * self.D, self.KV * self.D]
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.splits), dtype=dtype, device=device)
        self.q_norm_weight = _param(self.D, dtype=dtype, device=device)
        self.k_norm_weight = _param(self.D, dtype=dtype, device=device)
        self.o_proj = Linear(self.H * self.D, cfg.hidden_size, dtype=dtype, device=device, reduce=host.parallel)
        self.attn = host.attention(layer_idx, self.H, self.KV, self.D, self.D**-0.5)

    def forward(self, x: torch.Tensor, rope: tuple[Rotary, torch.Tensor, torch.Tensor] | _StepRope) -> torch.Tensor:
        T = x.shape[0]
        qg, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        q, gate = qg.reshape(T, self.H, 2 * self.D).chunk(2, dim=-1)  # strided views of the projection
        _, cos, sin = rope
        q, k = ops.qk_norm_rope(q, k.reshape(T, self.KV, self.D), self.q_norm_weight, self.k_norm_weight, cos, sin,
                                self.eps)
        o = self.attn(q.view(T, -1), k.view(T, -1), v.contiguous())
        o = ops.sigmoid_gate_mul(o.view(T, self.H, self.D), gate)
        return self.o_proj(o.view(T, -1))


# ----------------------------------------------------------------------------- MLPs


class DenseMLP(nn.Module):
    def __init__(self, cfg: Qwen35Config, sh: Shards, par: Parallel, *, dtype, device):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * sh.mlp, dtype=dtype, device=device)
        self.down_proj = Linear(sh.mlp, cfg.hidden_size, dtype=dtype, device=device, reduce=par)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """Softmax top-k routed experts plus the sigmoid-gated shared expert (experts split by I under TP)."""

    def __init__(self, cfg: Qwen35Config, sh: Shards, par: Parallel, *, dtype, device):
        super().__init__()
        E, H = cfg.num_experts, cfg.hidden_size
        self.top_k, self.renormalize, self.par = cfg.num_experts_per_tok, cfg.norm_topk_prob, par
        self.router_weight = _param(E, H, dtype=dtype, device=device)
        self.w13 = _param(E, 2 * sh.mlp, H, dtype=dtype, device=device)
        self.w2 = _param(E, H, sh.mlp, dtype=dtype, device=device)
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_w13 = _param(2 * sh.shared_mlp, H, dtype=dtype, device=device)
            self.shared_w2 = _param(H, sh.shared_mlp, dtype=dtype, device=device)
            self.shared_gate_weight = _param(1, H, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = dict(shared_w13=self.shared_w13, shared_w2=self.shared_w2,
                      shared_gate_weight=self.shared_gate_weight) if self.has_shared else {}
        y = ops.moe_block(x, self.router_weight, self.w13, self.w2, self.top_k, renormalize=self.renormalize, **shared)
        return self.par.all_reduce(y) if self.par.size > 1 else y


# ----------------------------------------------------------------------------- decoder


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen35Config, layer_idx: int, sh: Shards, host: Host, *, dtype, device):
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        self.eps = cfg.rms_norm_eps
        self.input_norm_weight = _param(cfg.hidden_size, dtype=dtype, device=device)
        mixer = GatedDeltaNet if self.layer_type == "linear_attention" else GatedAttention
        self.mixer = mixer(cfg, layer_idx, sh, host, dtype=dtype, device=device)
        self.post_norm_weight = _param(cfg.hidden_size, dtype=dtype, device=device)
        mlp = SparseMoE if cfg.is_moe else DenseMLP
        self.mlp = mlp(cfg, sh, host.parallel, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = _norm(self.input_norm_weight, self.eps, h, residual)
        x = self.mixer(x, rope)
        x, residual = _norm(self.post_norm_weight, self.eps, x, residual)
        return self.mlp(x), residual


class Qwen35Model(nn.Module):
    """The whole decoder. ``forward`` returns final-normed hidden states; ``logits`` applies the LM head."""

    def __init__(self, cfg: Qwen35Config, host: Host, *, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.cfg, self.par = cfg, host.parallel
        self.shards = sh = Shards.of(cfg, host.parallel)
        self.embed_tokens = VocabEmbedding(cfg, sh, host.parallel, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, sh, host, dtype=dtype, device=device) for i in range(cfg.num_hidden_layers))
        self.norm_weight = _param(cfg.hidden_size, dtype=dtype, device=device)
        if not cfg.tie_word_embeddings:
            self.lm_head_weight = _param(sh.vocab, cfg.hidden_size, dtype=dtype, device=device)
        self.rotary = Rotary(cfg)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids [T]``; ``positions [T]`` or mrope ``[3, T]`` (see :class:`Rotary`); ``inputs_embeds
        [T, hidden]``, when given, replaces the token embeddings (a host puts image rows there, see
        :meth:`embed`)."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = _StepRope(self.rotary, positions)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, rope)
        h, _ = ops.rms_norm_zero_centered(h, self.norm_weight, self.cfg.rms_norm_eps, residual)
        return h

    def embed(self, input_ids: torch.Tensor, image_rows: torch.Tensor | None = None,
              image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` with rows ``image_rows`` replaced by ``image_embeds`` (the vision
        tower's output for those placeholder tokens, in the same order)."""
        h = self.embed_tokens(input_ids)
        if image_rows is not None:
            h[image_rows] = image_embeds.to(h.dtype)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, vocab_size]`` logits in the hidden dtype (vocab shards gathered across ranks)."""
        weight = self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head_weight
        out = F.linear(hidden, weight)
        if self.par.size > 1:
            out = self.par.all_gather_last_dim(out)
        return out[..., : self.cfg.vocab_size]
