"""The standalone host's side of the model: per-slot caches and the step's host buffer.

:class:`StandaloneHost` is what :class:`qwen35.model.Qwen35Model` asks its host for (no tensor
parallelism, attention, GDN state pools); :class:`SlotAttention` keeps a KV buffer per full-attention
layer, :class:`SlotGDNState` a conv pool and a recurrent-state pool per GDN layer, one slot per
sequence; :class:`StepBuffer` carries one step's int32 values to the device in one copy. The running
step's layout (:class:`Batch`) is set on the host by :mod:`qwen35.standalone` before each forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from qwen35 import ops
from qwen35.model import GDNStep, Parallel


@dataclass
class Batch:
    """The layout of one step, shared by every layer: decode rows first, then prefill rows."""

    num_decodes: int
    decode_slots: torch.Tensor  # [nd] (device)
    decode_lens: torch.Tensor | None  # [nd] keys each decode row attends to, its own included (device)
    prefills: list[tuple[int, int, int, int]]  # (slot, context, new tokens, first token row)
    token_slots: torch.Tensor  # [T] slot of every token
    token_positions: torch.Tensor  # [T] index of every token in its sequence (its KV-cache row)
    gdn: dict  # batch fields of GDNStep
    rope_positions: torch.Tensor | None = None  # [3, T] when a sequence of the step holds images
    image_rows: torch.Tensor | None = None  # [R] rows of the step whose embeddings are image rows
    image_embeds: torch.Tensor | None = None  # [R, hidden] those rows


# SDPA kernels for prefill shapes that change from step to step (continued prefills). cuDNN's kernel is
# left out there: it builds an execution plan per new shape (~70 ms each on an H200 with torch 2.11; see
# tuning/notes_model.md). Where shapes come from a small fixed set (fresh prompts padded to PREFILL_BUCKET)
# torch's own choice stands, cuDNN first on Hopper (0.85 ms against flash's 1.9 ms for a 1x8192 causal
# prefill at 16 heads of 256). Decode rows use ops.attention_decode.
VARYING_SHAPE_SDPA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
PREFILL_BUCKET = 256  # fresh prompts are padded to a multiple of this many tokens for attention


def _sdpa_backends(fixed_shapes: bool):
    return contextlib.nullcontext() if fixed_shapes else sdpa_kernel(VARYING_SHAPE_SDPA)


class SlotAttention(nn.Module):
    """Full attention over per-slot KV buffers ``[slots, kv_heads, max_len, head_dim]``: decode rows through
    :func:`qwen35.ops.attention_decode`, prefills through SDPA."""

    def __init__(self, host: StandaloneHost, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.host, self.H, self.KV, self.D, self.scale = host, num_heads, num_kv_heads, head_dim, scale
        shape = (host.max_seqs, num_kv_heads, host.max_len, head_dim)
        self.k_cache = torch.zeros(shape, dtype=host.dtype, device=host.device)
        self.v_cache = torch.zeros(shape, dtype=host.dtype, device=host.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.host.batch
        T, H, KV, D = q.shape[0], self.H, self.KV, self.D
        if not b.num_decodes and len(b.prefills) == 1:  # one prompt: its keys go to one slot's consecutive rows
            slot, ctx, n, _ = b.prefills[0]
            self.k_cache[slot, :, ctx:ctx + n] = k.view(T, KV, D).transpose(0, 1)
            self.v_cache[slot, :, ctx:ctx + n] = v.view(T, KV, D).transpose(0, 1)
            return self._prefill(q, slot, ctx, n)
        self.k_cache[b.token_slots, :, b.token_positions] = k.view(T, KV, D)
        self.v_cache[b.token_slots, :, b.token_positions] = v.view(T, KV, D)
        out = q.new_empty(T, H * D)
        if b.num_decodes:
            nd = b.num_decodes
            o = ops.attention_decode(q[:nd].view(nd, H, D), self.k_cache, self.v_cache, slots=b.decode_slots,
                                     lengths=b.decode_lens, scale=self.scale)
            out[:nd] = o.view(nd, H * D)
        for slot, ctx, n, row in b.prefills:
            out[row:row + n] = self._prefill(q[row:row + n], slot, ctx, n)
        return out

    def _prefill(self, q: torch.Tensor, slot: int, ctx: int, n: int) -> torch.Tensor:
        H, KV, D, cache_len = self.H, self.KV, self.D, self.k_cache.shape[2]
        if ctx == 0:
            # A fresh prompt, causal: padding it at the end changes none of its rows (no real query sees
            # a later key), and a bounded set of lengths lets torch use its planned (cuDNN) kernel.
            padded = -(-n // PREFILL_BUCKET) * PREFILL_BUCKET
            fixed = padded <= cache_len
            m = padded if fixed else n
            qs = q.view(n, H, D).transpose(0, 1)
            if m > n:
                qs = torch.cat([qs, qs.new_zeros(H, m - n, D)], dim=1)
            keys, values = self.k_cache[slot, :, :m][None], self.v_cache[slot, :, :m][None]
            with _sdpa_backends(fixed):
                o = F.scaled_dot_product_attention(qs[None], keys, values, is_causal=True, scale=self.scale,
                                                   enable_gqa=H != KV)
            return o[0, :, :n].transpose(0, 1).reshape(n, H * D)
        # continuing a sequence: query i sees keys 0 .. ctx + i (kv heads repeated: the masked kernels
        # take no grouped heads)
        qs = q.view(n, H, D).transpose(0, 1)[None]
        key_pos = torch.arange(ctx + n, device=q.device)
        mask = key_pos[None, :] <= (ctx + torch.arange(n, device=q.device))[:, None]
        keys = self.k_cache[slot, :, : ctx + n].repeat_interleave(H // KV, dim=0)[None]
        values = self.v_cache[slot, :, : ctx + n].repeat_interleave(H // KV, dim=0)[None]
        with _sdpa_backends(False):
            o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=self.scale)
        return o[0].transpose(0, 1).reshape(n, H * D)


def aligned16(n: int) -> int:
    """``n`` int32 values rounded up to a multiple of 16 bytes (as kernels_triton._util.aligned16)."""
    return -(-n // 4) * 4


class StepBuffer:
    """The int32 values one step sends to the device: named parts of one host buffer (pinned for a
    CUDA device), filled in place through numpy and copied with one asynchronous transfer.

    The host memory is kept from step to step (pinning memory costs a system call; the caching allocator's
    per-step bookkeeping is host time too) and grows when a step needs more. Before it is written again, the
    event recorded after the last copy is awaited: the copy reads the host memory when the device gets to it,
    so a buffer rewritten earlier would send the next step's values.
    """

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.host = torch.empty(0, dtype=torch.int32)
        self._np = self.host.numpy()
        self.parts: dict[str, tuple[int, int]] = {}
        self._copied: torch.cuda.Event | None = None  # recorded after the last copy, until awaited
        self._event: torch.cuda.Event | None = None

    def layout(self, sizes: dict[str, int]) -> None:
        """Lay out the parts (each 16-byte aligned: Triton specialises kernels on pointer alignment)."""
        self.parts, at = {}, 0
        for name, n in sizes.items():
            self.parts[name] = (at, n)
            at += aligned16(n)
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self.host.numel() < at:
            self.host = torch.empty(max(at, 2 * self.host.numel(), 256), dtype=torch.int32, pin_memory=self.pinned)
            self._np = self.host.numpy()

    def part(self, name: str) -> np.ndarray:
        at, n = self.parts[name]
        return self._np[at:at + n]

    def flags(self, name: str) -> np.ndarray:
        """A part holding bools, one byte each (read on the device as a bool tensor, no conversion kernel)."""
        at, n = self.parts[name]
        return self._np.view(np.uint8)[4 * at:4 * at + n]

    def send(self, device: torch.device, flags: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """Device views of every part, sent with one asynchronous copy (``flags``: parts read as bools)."""
        hi = max((at + aligned16(n) for at, n in self.parts.values()), default=0)
        if device.type == "cpu":
            buf = self.host[:hi]  # used by this step only, which has finished when the next one rewrites it
        else:
            buf = self.host[:hi].to(device, non_blocking=True)
            if self.pinned:
                self._event = self._event or torch.cuda.Event()
                self._event.record()  # after the copy: guards the buffer until the device has read it
                self._copied = self._event
        raw = buf.view(torch.uint8)
        return {name: raw[4 * at:4 * at + n].view(torch.bool) if name in flags else buf[at:at + n]
                for name, (at, n) in self.parts.items()}


def token_row(tokens, slot: int):  # noqa: ANN001, ANN202
    """One sequence's new tokens as given (a list of ints) or as a 1-D integer array (numpy, or a CPU tensor:
    copied into the step's buffer without a Python loop over the tokens)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.device.type != "cpu":
            raise ValueError(f"tokens for slot {slot} are on {tokens.device}; pass them as a CPU tensor or a list")
        tokens = tokens.numpy()
    if isinstance(tokens, np.ndarray) and (tokens.ndim != 1 or tokens.dtype.kind not in "iu"):
        raise ValueError(f"tokens for slot {slot} must be a 1-D integer array, got shape {tuple(tokens.shape)} "
                         f"dtype {tokens.dtype}")
    return tokens


class SlotGDNState:
    """Conv and recurrent-state pools of one GDN layer, one slot per sequence."""

    def __init__(self, host: StandaloneHost, conv_shape: tuple[int, int], state_shape: tuple[int, int, int],
                 conv_dtype: torch.dtype):
        self.host = host
        self.conv_pool = torch.zeros(host.max_seqs, *conv_shape, dtype=conv_dtype, device=host.device)
        self.state_pool = torch.zeros(host.max_seqs, *state_shape, dtype=torch.float32, device=host.device)

    def run(self, core, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        step = GDNStep(conv_pool=self.conv_pool, state_pool=self.state_pool, **self.host.batch.gdn)
        core(step, qkv, a, b, out)


class StandaloneHost:
    """What the model needs from its host: no tensor parallelism, SDPA attention, slot pools."""

    parallel = Parallel()

    def __init__(self, *, device: torch.device, dtype: torch.dtype, max_seqs: int, max_len: int):
        self.device, self.dtype, self.max_seqs, self.max_len = device, dtype, max_seqs, max_len
        self.batch: Batch | None = None  # the running step's layout

    def attention(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  scale: float) -> SlotAttention:
        return SlotAttention(self, num_heads, num_kv_heads, head_dim, scale)

    def gdn_state(self, layer_idx: int, conv_shape: tuple[int, int], state_shape: tuple[int, int, int],
                  conv_dtype: torch.dtype) -> SlotGDNState:
        return SlotGDNState(self, conv_shape, state_shape, conv_dtype)
