"""vLLM host: runs :class:`qwen35.model.Qwen35Model` inside vLLM's V1 engine.

Registered (by :mod:`qwen35.vllm_plugin`) for ``Qwen3_5ForCausalLM`` and ``Qwen3_5MoeForCausalLM``: this
class declares no multimodal support, so vLLM refuses image/video input before it reaches the engine. The
``*ForConditionalGeneration`` architectures get its subclass :class:`qwen35.vllm_multimodal.Qwen35VisionForVllm`,
which adds the vision tower.

What this host supplies to the model:

- tensor parallelism from vLLM's TP group (rank, world size, all-reduce, all-gather);
- full attention = vLLM's ``Attention`` layer (paged KV cache, prefix caching, chunked prefill);
- GDN state = one :class:`VllmGDNState` per GDN layer: a ``MambaBase`` layer of type
  ``gdn_attention`` whose (conv_state, recurrent_state) pools vLLM binds per block;
  each forward reads vLLM's ``GDNAttentionMetadata`` (decode rows first, then prefills; slots
  from ``non_spec_state_indices_tensor`` / ``prefill_state_indices``) and runs the model's GDN
  core inside the opaque custom op ``torch.ops.qwen35.gdn_core``.

State layout is ours, declared through ``get_state_shape``: conv state ``[conv_dim, W - 1]`` in
the model dtype, recurrent state ``[HV, K, V]`` in fp32 (the layout of :mod:`qwen35.ops`).

Every vLLM internal comes from :func:`qwen35.vllm_adapter.host_api`, which checks the installed
version against the supported range (``>=0.26,<0.33``) when this module is imported and raises an
``ImportError`` with the version, its location and the range outside it.

**CUDA graphs: full-graph decode capture, not ``support_torch_compile``.** On CUDA, vLLM wraps any
model in its full-graph ``CUDAGraphWrapper`` when the cudagraph mode has a FULL part (the default
``FULL_AND_PIECEWISE``, or ``FULL_DECODE_ONLY``): uniform decode batches of each capture size are
captured once and replayed as one graph launch per step, while prefills and mixed batches run eagerly
(for a class without ``support_torch_compile`` there are no compiled pieces, so the PIECEWISE half is
eager). The alternative, ``support_torch_compile`` with every op registered as a custom op, is not
taken because

- the model's numerics are already fused kernels behind the op façade (Triton launched through our own
  launcher, host-side argument checks); Dynamo would have to see each façade op as an opaque custom op
  with a fake implementation, leaving inductor only the few plain-torch ops between them (rotary
  angles, the dense MLP's SiLU·mul, embedding), and every façade change would have to keep those
  registrations in step;
- piecewise graphs would split at every GDN and attention op anyway, so a mixed batch would still pay
  one launch sequence per layer; a full decode graph removes the host from the decode step entirely
  (the standalone host: 5.3 ms eager vs 0.85 ms through a graph, 8 layers at 35B-A3B width);
- nothing is compiled at start-up (no Dynamo tracing, guards or recompiles).

What capture needs from this host: no host reads of device values (the façade's value checks are off
inside :func:`qwen35.ops.host_built_inputs` on an accelerator and whenever the stream is capturing), no
host-to-device copies (the rotary table is cached per device on the first eager step), and per-step
inputs read from vLLM's persistent buffers: in full-graph mode the GDN builder copies each step's decode
slots into ``non_spec_state_indices_tensor``'s persistent buffer (padding rows point at the null block)
and attention's block tables live in the backend's own buffers, so the captured kernels read every
replay's slots. Every op's backend is chosen at load (:func:`qwen35.probe.choose_at_load`): the probe's
self-tests never run inside a capture, and an op left on the reference on a GPU (whose host reads a capture
cannot hold) is one ERROR at start-up, or a refusal to start under ``QWEN35_REQUIRE_ACCELERATED=1``. Scratch
that ops keep between eager calls is never kept during a capture
(``kernels_triton._kept``): a graph owns its memory. ``-cc.mode=none -cc.cudagraph_mode=FULL_DECODE_ONLY``
asks for exactly this (and skips capturing the eager piecewise sizes); ``--enforce-eager`` turns graphs off.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from qwen35 import ops, probe, vllm_adapter
from qwen35.checkpoint import load_weights
from qwen35.config import Qwen35Config
from qwen35.model import GDNStep, Parallel, Qwen35Model, Shards, facade_ops, report_backends_once

# under "vllm." so that vLLM's logging configuration prints it in every vLLM process
log = logging.getLogger("vllm.qwen35")

api = vllm_adapter.host_api()  # raises UnsupportedVllm (an ImportError) outside the supported range
SUPPORTED_VLLM = vllm_adapter.SUPPORTED_RANGE
VllmConfig = api.VllmConfig


# ----------------------------------------------------------------------------- GDN state layer


@torch.library.custom_op("qwen35::gdn_core", mutates_args=("out",))
def gdn_core(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    """Opaque to torch.compile / CUDA-graph splitting: conv + delta rule of one GDN layer, in place."""
    api.get_forward_context().no_compile_layers[layer_name].forward_core(qkv, a, b, out)


@gdn_core.register_fake
def _gdn_core_fake(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    return None


class VllmGDNState(api.MambaBase, nn.Module):
    """The state caches of one GDN layer as vLLM's hybrid KV-cache manager sees them."""

    def __init__(self, prefix: str, conv_shape: tuple[int, int], state_shape: tuple[int, int, int],
                 conv_dtype: torch.dtype):
        nn.Module.__init__(self)
        self.prefix = prefix
        self.shapes = (tuple(conv_shape), tuple(state_shape))
        self.dtypes = (conv_dtype, torch.float32)
        self._core = None
        self._vllm_config = api.get_current_vllm_config()
        context = self._vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix!r}")
        context[prefix] = self

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.dtypes

    @property
    def mamba_type(self) -> object:
        """vLLM's ``MambaAttentionBackendEnum.GDN_ATTN``: vLLM's GDN metadata builder serves this layer."""
        return api.gdn_mamba_type

    def run(self, core, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        self._core = core
        torch.ops.qwen35.gdn_core(qkv, a, b, out, self.prefix)

    def forward_core(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        metadata = api.get_forward_context().attn_metadata
        md = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if md is None:  # profiling / dummy run: no state to touch
            return
        assert isinstance(md, api.GDNAttentionMetadata)
        if md.spec_sequence_masks is not None:
            raise NotImplementedError("qwen35: speculative decoding is not supported by the GDN layers yet")
        nd, np_ = md.num_decodes, md.num_prefills
        slots = md.non_spec_state_indices_tensor
        decode_slots = slots[:nd] if nd else None
        prefill_slots = md.prefill_state_indices[:np_] if np_ else None
        # vLLM packs each block's conv and recurrent state into one page: the pools are strided views
        # (each slot's block contiguous), which the ops update in place.
        conv_pool, state_pool = vllm_adapter.gdn_state_pools(self)
        cu = md.prefill_query_start_loc[: np_ + 1] if np_ else None
        step = GDNStep(
            conv_pool=conv_pool, state_pool=state_pool, num_decodes=nd, decode_slots=decode_slots,
            num_prefill_tokens=md.num_prefill_tokens, prefill_cu_seqlens=cu, prefill_slots=prefill_slots,
            prefill_has_initial_state=md.prefill_has_initial_state[:np_] if np_ else None,
            prefill_metadata=_prefill_metadata(md, cu, self._vllm_config) if np_ else None)
        self._core(step, qkv, a, b, out)


def _prefill_metadata(md: object, cu: torch.Tensor, vllm_config: object) -> object | None:
    """Chunk metadata for this batch's prefills, computed by the first GDN layer and reused by the rest
    (every GDN layer of a step shares one metadata object). From the FLA chunk indices vLLM's GDN builder
    computed on the host and sent (no read-back of ``cu``) when it did; else from ``cu`` (one read-back)."""
    cached = getattr(md, "_qwen35_prefill_metadata", None)
    if cached is None:
        indices = vllm_adapter.fla_chunk_indices(md, vllm_config)
        if indices is not None and api.fla_chunk_size is not None:
            cached = ops.prepare_gdn_metadata(cu, api.fla_chunk_size, chunk_indices=indices)
        else:
            cached = ops.prepare_gdn_metadata(cu)
        md._qwen35_prefill_metadata = cached
    return cached


# ----------------------------------------------------------------------------- host


class VllmHost:
    def __init__(self, vllm_config: VllmConfig, prefix: str):
        self.vllm_config, self.prefix = vllm_config, prefix
        self.parallel = Parallel(
            rank=api.tp_rank(), size=api.tp_size(), all_reduce=api.all_reduce,
            all_gather_last_dim=lambda x: api.all_gather(x, dim=-1))

    def attention(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> nn.Module:
        return api.Attention(num_heads, head_dim, scale, num_kv_heads=num_kv_heads,
                             cache_config=self.vllm_config.cache_config, quant_config=None,
                             prefix=f"{self.prefix}.layers.{layer_idx}.self_attn.attn")

    def gdn_state(self, layer_idx: int, conv_shape: tuple[int, int], state_shape: tuple[int, int, int],
                  conv_dtype: torch.dtype) -> VllmGDNState:
        return VllmGDNState(f"{self.prefix}.layers.{layer_idx}.linear_attn", conv_shape, state_shape, conv_dtype)


def _local_state_shapes(cfg: Qwen35Config, tp_size: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    sh = Shards.of(cfg, Parallel(size=tp_size))
    conv_dim = 2 * sh.gdn_key_heads * cfg.linear_key_head_dim + sh.gdn_value_heads * cfg.linear_value_head_dim
    return ((conv_dim, cfg.linear_conv_kernel_dim - 1),
            (sh.gdn_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))


class Qwen35ForVllm(nn.Module, api.HasInnerState, api.IsHybrid, api.SupportsMRoPE):
    """The vLLM model class of the text-only Qwen3.5 architectures (dense / MoE ``*ForCausalLM``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.cfg = Qwen35Config.from_hf(vllm_config.model_config.hf_config)
        report_backends_once(vllm_config.device_config.device, log)
        # every op the model calls, chosen now: never inside a graph capture; loud (or fatal) on the reference
        probe.choose_at_load(vllm_config.device_config.device, vllm_config.model_config.dtype, facade_ops(self.cfg),
                             log, who="qwen35 (vLLM host)")
        host = VllmHost(vllm_config, prefix=f"{prefix}.model" if prefix else "model")
        self.model = Qwen35Model(self.cfg, host, dtype=vllm_config.model_config.dtype)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        if intermediate_tensors is not None:
            raise NotImplementedError("qwen35: pipeline parallelism is not supported")
        with ops.host_built_inputs():  # vLLM built the slots and offsets: no per-layer value checks on a GPU
            return self.model(input_ids, positions, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Explicit mapping (qwen35.checkpoint); raises naming unknown / missing / mis-shaped tensors."""
        with torch.no_grad():
            load_weights(self.model, weights, logger=log)
        return {name for name, _ in self.named_parameters()}

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        """Text-only: all three mrope rows are the plain positions."""
        if mm_features:
            raise ValueError("qwen35: this checkpoint is text-only (a *ForCausalLM without a vision tower): it takes "
                             "no image/video inputs")
        return torch.arange(len(input_tokens), dtype=torch.long).unsqueeze(0).expand(3, -1), 0

    # ---- hybrid-cache contract (classmethods: vLLM sizes pages before building the model)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        cfg = Qwen35Config.from_hf(vllm_config.model_config.hf_config)
        return _local_state_shapes(cfg, vllm_config.parallel_config.tensor_parallel_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
        return vllm_config.model_config.dtype, torch.float32

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        return api.gdn_state_copy_funcs()
