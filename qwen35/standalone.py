"""Standalone host: runs :class:`qwen35.model.Qwen35Model` without vLLM.

Loads an HF checkpoint directory, keeps per-sequence caches in fixed slots (a KV buffer per
full-attention layer, a conv pool and a recurrent-state pool per GDN layer) and runs batched
steps in which every sequence brings any number of new tokens (prefill, chunked prefill or
decode). :meth:`Qwen35Standalone.generate` does greedy or sampled generation on top.

    m = Qwen35Standalone.from_pretrained("ckpt/", device="cuda", dtype=torch.bfloat16)
    out = m.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)

Dtype: ``dtype`` is a torch dtype or its name (``"float16"``, ``"bfloat16"``, ``"float32"``,
``"float64"``), or ``"auto"``: bf16 on a GPU that computes it, else fp16 (V100, T4, Iluvatar), fp32
on the CPU. Weights, activations, KV caches and conv pools take it; GDN recurrent states, ``A_log``
and ``dt_bias`` stay fp32. ``dtype=float16`` runs end to end on every backend (``cuda_sm70``
computes only fp16 and fp32); a bf16 checkpoint loaded as fp16 reports the values beyond fp16's
range (:mod:`qwen35.checkpoint`, ``QWEN35_FP16_OVERFLOW``).

Images (checkpoints with a ``vision_config``): a prompt names each image by one image token
(``image_token_id``, what a chat template writes between ``<|vision_start|>`` and
``<|vision_end|>``) and the images come alongside, per prompt, as bytes, ``data:`` URLs, PIL images
or ``[H, W, 3]`` uint8 arrays:

    out = m.generate([[5, VS, IMG, VE, 7]], 16, images=[[png_bytes]])

Each placeholder grows into the image's tokens (:func:`qwen35.mrope.expand_image_placeholders`, the
rule vLLM's prompt replacement applies), the images go through :mod:`qwen35.image_processor` and the
vision tower, and their rows replace those tokens' embeddings. The slot keeps the prompt's
multi-axis positions (:func:`qwen35.mrope.mrope_positions`), so steps over it get ``[3, T]``
positions (any chunking of the prompt works) and generated tokens continue at ``index + delta``.
:meth:`Qwen35Standalone.attach_images` does the same for callers of :meth:`~Qwen35Standalone.step`.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np
import torch

from qwen35 import ops, probe
from qwen35.checkpoint import load_checkpoint, load_weights
from qwen35.config import Qwen35Config
from qwen35.model import Qwen35Model, facade_ops, report_backends_once
from qwen35.mrope import expand_image_placeholders, mrope_positions
from qwen35.slots import Batch, StandaloneHost, StepBuffer, token_row
from qwen35.vision import VisionTower, split_by_image

if TYPE_CHECKING:
    from PIL.Image import Image

    from qwen35.image_processor import ImageProcessorConfig

log = logging.getLogger("qwen35.standalone")

# what one image may be: encoded bytes, a data: URL, a PIL image, an [H, W, 3] uint8 array
ImageSource = Union[bytes, str, "Image", np.ndarray]  # noqa: UP007 - a forward reference inside


@dataclass
class _SlotImages:
    """What a slot whose prompt holds images needs at every step: the prompt's multi-axis positions, the decode
    offset, and the vision tower's rows for its image tokens."""

    positions: np.ndarray  # [3, prompt tokens] int32
    delta: int  # token index + delta = position of the tokens after the prompt
    rows: np.ndarray  # [R] int64, ascending: prompt indices of the image tokens
    embeds: torch.Tensor  # [R, hidden] on the model's device


DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                                  "float64": torch.float64}  # fp64: every op on the reference (ground truth)


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str) -> torch.dtype:
    """The model dtype for a ``dtype`` argument: a torch float dtype of :data:`DTYPES`, its name, or ``"auto"``
    (the device's default compute dtype: bf16 where the GPU computes it, else fp16; fp32 on the CPU)."""
    if isinstance(dtype, str):
        if dtype == "auto":
            return probe.device_caps(device).compute_dtype
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}; accepted: {', '.join(DTYPES)}, auto (or a torch dtype of those)")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype={dtype}; accepted: {', '.join(f'torch.{n}' for n in DTYPES)} (or their names, "
                         "or 'auto')")
    return dtype


class Qwen35Standalone:
    """A loaded model with per-sequence caches; see the module docstring."""

    def __init__(self, cfg: Qwen35Config, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str = torch.float32, max_seqs: int = 8, max_len: int = 4096,
                 image_processor: ImageProcessorConfig | None = None):
        if max_seqs < 1 or max_len < 1:
            raise ValueError(f"max_seqs={max_seqs} and max_len={max_len} must be >= 1")
        self.device = torch.device(device)
        dtype = resolve_dtype(dtype, self.device)
        self.cfg, self.dtype = cfg, dtype
        report_backends_once(self.device, log)
        # chosen now, before any decode graph is captured (its host's decode attention included)
        probe.choose_at_load(self.device, dtype, (*facade_ops(cfg), "attention_decode"), log,
                             who="qwen35 (standalone host)")
        self.host = StandaloneHost(device=self.device, dtype=dtype, max_seqs=max_seqs, max_len=max_len)
        with torch.device(self.device):
            self.model = Qwen35Model(cfg, self.host, dtype=dtype, device=self.device)
        self.model.eval()
        self.visual: VisionTower | None = None  # the vision tower, for checkpoints with a vision_config
        self.image_processor: ImageProcessorConfig | None = None
        if cfg.vision is not None:
            self.visual = VisionTower(cfg.vision, dtype=dtype, device=self.device).eval()
            self.image_processor = _image_processor_for(cfg, image_processor)
        self.lengths = [0] * max_seqs
        self.free = list(range(max_seqs))
        self._images: dict[int, _SlotImages] = {}  # slots whose prompt holds images
        self._step_buffer = StepBuffer(pinned=self.device.type == "cuda")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kw) -> Qwen35Standalone:
        """Build from an HF checkpoint directory (config.json + safetensors; ``preprocessor_config.json`` for the
        image processor of a checkpoint with a vision tower, its defaults when absent)."""
        cfg = Qwen35Config.from_dir(path)
        if cfg.vision is not None and kw.get("image_processor") is None:
            from qwen35.image_processor import ImageProcessorConfig

            kw["image_processor"] = ImageProcessorConfig.from_dir(path)
        m = cls(cfg, **kw)
        with torch.no_grad():
            load_checkpoint(m.model, path, visual=m.visual)
        return m

    def load_state(self, weights) -> None:
        """Load (name, tensor) pairs under HF checkpoint names (e.g. an HF model's state_dict().items())."""
        with torch.no_grad():
            load_weights(self.model, weights, visual=self.visual)

    # ---------------------------------------------------------------- sequences

    def allocate(self, n: int) -> list[int]:
        """Reserve ``n`` fresh sequence slots (lowest first)."""
        self._check_free(n)
        self.free.sort()
        slots, self.free = self.free[:n], self.free[n:]
        for s in slots:
            self.lengths[s] = 0
            self._images.pop(s, None)
        return slots

    def _check_free(self, n: int) -> None:
        if n > len(self.free):
            raise ValueError(f"asked for {n} sequences but only {len(self.free)} of {self.host.max_seqs} "
                             "slots are free")

    def release(self, slots: list[int]) -> None:
        for s in slots:
            self._images.pop(s, None)
            if s not in self.free:
                self.free.append(s)

    # ---------------------------------------------------------------- images

    @torch.no_grad()
    def attach_images(self, slot: int, prompt: Sequence[int] | np.ndarray | torch.Tensor,
                      images: Sequence[ImageSource]) -> np.ndarray:
        """Prepare a fresh slot's prompt with images; returns the token ids to feed it (through :meth:`step`, in
        any chunks): the prompt with each image placeholder grown into the image's tokens.

        Raises ValueError when the checkpoint has no vision tower or the placeholders do not match the images,
        :class:`qwen35.image_processor.ImageInputError` for an image that cannot be used.
        """
        if not 0 <= slot < self.host.max_seqs or slot in self.free:
            raise ValueError(f"slot {slot} is not an allocated sequence")
        if self.lengths[slot]:
            raise ValueError(f"slot {slot} already holds {self.lengths[slot]} tokens; images go with a fresh prompt")
        (ids,), (info,) = self._prepare_images([prompt], [images])
        if info is not None:
            self._images[slot] = info
        return ids

    def _prepare_images(self, prompts: Sequence, images: Sequence[Sequence[ImageSource] | None] | None
                        ) -> tuple[list, list[_SlotImages | None]]:
        """(tokens to feed, per-slot image state) for each prompt: placeholders expanded, every image of the batch
        through the processor and one tower call."""
        if images is None:
            return list(prompts), [None] * len(prompts)
        if isinstance(images, (str, bytes)) or len(images) != len(prompts):
            raise ValueError(f"images must hold one list of images per prompt ({len(prompts)} prompts), got "
                             f"{type(images).__name__}" + ("" if isinstance(images, (str, bytes)) else
                                                           f" of {len(images)}"))
        for i, imgs in enumerate(images):
            if imgs is not None and not isinstance(imgs, (list, tuple)):
                raise ValueError(f"images[{i}] must be a list of images (or None), got {type(imgs).__name__}")
        if not any(images):
            return list(prompts), [None] * len(prompts)
        if self.visual is None:
            raise ValueError(_text_only_message(self.cfg))
        from qwen35.image_processor import preprocess

        vc = self.cfg.vision
        flat = [img for imgs in images if imgs for img in imgs]
        processed = preprocess(flat, self.image_processor)
        embeds = self.visual(processed.pixel_values.to(self.device), processed.grid_thw)
        pieces = split_by_image(embeds, processed.grid_thw, vc.spatial_merge_size)
        grids = processed.grid_thw.tolist()
        out_ids, infos, k = [], [], 0
        for prompt, imgs in zip(prompts, images, strict=True):
            if not imgs:
                out_ids.append(prompt)
                infos.append(None)
                continue
            n = len(imgs)
            counts = processed.num_tokens[k:k + n]
            ids = expand_image_placeholders(prompt, counts, vc.image_token_id)
            rows = np.flatnonzero(ids == vc.image_token_id)
            offsets = list(itertools.accumulate(counts[:-1], initial=0))
            positions, delta = mrope_positions(ids, grids[k:k + n], vc.spatial_merge_size, vc.image_token_id,
                                               image_offsets=[int(rows[o]) for o in offsets])
            infos.append(_SlotImages(positions=positions.numpy().astype(np.int32), delta=delta, rows=rows,
                                     embeds=torch.cat(pieces[k:k + n])))
            out_ids.append(ids)
            k += n
        return out_ids, infos

    # ---------------------------------------------------------------- one step

    def _layout(self, slots: list[int], tokens: list, all_logits: bool) -> tuple[torch.Tensor, Batch, torch.Tensor]:
        """(token ids ``[T]``, the step's layout, the rows of the hidden states whose logits :meth:`step` returns).

        Everything the device needs, the GDN chunk table included, is computed on the host in one int32 buffer
        and sent with one pinned, asynchronous copy: on a virtualised host each transfer costs ~0.15-0.2 ms of
        host time with the device idle at the start of a prefill (tuning/notes_model.md).
        Every check on the request runs here, before anything is launched. Work over the tokens is numpy's;
        Python loops run over sequences.
        """
        if len(slots) != len(tokens):
            raise ValueError(f"{len(slots)} slots but {len(tokens)} token lists")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots repeat in one step: {slots}")
        tokens = [token_row(t, s) for t, s in zip(tokens, slots, strict=True)]
        lens_in = [len(t) for t in tokens]
        for s, n in zip(slots, lens_in, strict=True):
            if not 0 <= s < self.host.max_seqs or s in self.free:
                raise ValueError(f"slot {s} is not an allocated sequence")
            if not n:
                raise ValueError(f"sequence in slot {s} brings no tokens")
            if self.lengths[s] + n > self.host.max_len:
                raise ValueError(f"sequence in slot {s} would reach {self.lengths[s] + n} tokens; "
                                 f"max_len={self.host.max_len}")
        N = len(slots)
        is_decode = [n == 1 and self.lengths[s] > 0 for s, n in zip(slots, lens_in, strict=True)]
        order = [i for i in range(N) if is_decode[i]] + [i for i in range(N) if not is_decode[i]]
        nd = sum(is_decode)
        seq_slots = [slots[i] for i in order]
        ctxs = [self.lengths[s] for s in seq_slots]
        lens = [lens_in[i] for i in order]
        starts = list(itertools.accumulate(lens, initial=0))  # first row of each sequence, in step order
        T = starts[-1]
        prefill_cu = [r - starts[nd] for r in starts[nd:]]
        table = ops.gdn_chunk_table(prefill_cu, self.device) if N > nd else None
        images = [self._images.get(s) for s in seq_slots]
        # (sequence in step order, its first and last + 1 image row falling into this step's tokens)
        image_spans = [(j, *(int(k) for k in np.searchsorted(info.rows, [ctxs[j], ctxs[j] + lens[j]])))
                       for j, info in enumerate(images) if info is not None]
        num_image_rows = sum(k1 - k0 for _, k0, k1 in image_spans)
        buf = self._step_buffer
        buf.layout(dict(ids=T, positions=T, slots=T, rows=T if all_logits else N, seq_slots=N, cu=N - nd + 1,
                        decode_lens=nd, has_init=N - nd, chunks=0 if table is None else table.size,
                        mrope=3 * T if image_spans else 0, image_rows=num_image_rows))
        ids, tok_slots, tok_pos = buf.part("ids"), buf.part("slots"), buf.part("positions")
        for j, i in enumerate(order):
            lo, hi = starts[j], starts[j + 1]
            ids[lo:hi] = tokens[i]
            if hi - lo == 1:
                tok_slots[lo], tok_pos[lo] = seq_slots[j], ctxs[j]
            else:
                tok_slots[lo:hi] = seq_slots[j]
                np.add(np.arange(hi - lo, dtype=np.int32), ctxs[j], out=tok_pos[lo:hi])
        if T and not 0 <= int(ids.min()) <= int(ids.max()) < self.cfg.vocab_size:
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if image_spans:
            self._image_layout(buf, ids, tok_pos, images, image_spans, starts, ctxs, seq_slots)
        first_row = [0] * N  # first row of each sequence, in input order
        for j, i in enumerate(order):
            first_row[i] = starts[j]
        if all_logits:  # input order: sequence i's rows first_row[i] .. + lens_in[i]
            offsets = np.repeat(np.asarray(first_row) - np.asarray(
                list(itertools.accumulate(lens_in, initial=0))[:-1]), lens_in)
            np.add(np.arange(T, dtype=np.int32), offsets, out=buf.part("rows"), casting="unsafe")
        else:
            buf.part("rows")[:] = [first_row[i] + lens_in[i] - 1 for i in range(N)]
        buf.part("seq_slots")[:] = seq_slots
        buf.part("cu")[:] = prefill_cu
        buf.part("decode_lens")[:] = [c + 1 for c in ctxs[:nd]]
        buf.flags("has_init")[:] = [c > 0 for c in ctxs[nd:]]
        if table is not None:
            buf.part("chunks")[:] = table.reshape(-1)
        d = buf.send(self.device, flags=("has_init",))
        seq_slots_d, cu = d["seq_slots"], d["cu"]
        prefills = [(seq_slots[j], ctxs[j], lens[j], starts[j]) for j in range(nd, N)]
        gdn = dict(
            num_decodes=nd, decode_slots=seq_slots_d[:nd] if nd else None, num_prefill_tokens=prefill_cu[-1],
            prefill_cu_seqlens=cu if prefills else None, prefill_slots=seq_slots_d[nd:] if prefills else None,
            prefill_has_initial_state=d["has_init"] if prefills else None)
        if prefills:  # no device read-back: the host's offsets (and its table, when the backend takes one)
            gdn["prefill_metadata"] = ops.prepare_gdn_metadata(
                cu, offsets=prefill_cu, table=None if table is None else d["chunks"].view(table.shape))
        batch = Batch(num_decodes=nd, decode_slots=seq_slots_d[:nd], decode_lens=d["decode_lens"] if nd else None,
                       prefills=prefills, token_slots=d["slots"], token_positions=d["positions"], gdn=gdn)
        if image_spans:
            batch.rope_positions = d["mrope"].view(3, T)
            if num_image_rows:
                batch.image_rows = d["image_rows"]
                batch.image_embeds = torch.cat([images[j].embeds[k0:k1] for j, k0, k1 in image_spans])
        return d["ids"], batch, d["rows"]

    def _image_layout(self, buf: StepBuffer, ids: np.ndarray, tok_pos: np.ndarray, images: list,
                      image_spans: list[tuple[int, int, int]], starts: list[int], ctxs: list[int],
                      seq_slots: list[int]) -> None:
        """Fill the step's ``[3, T]`` positions and image rows (a step in which a sequence holds images): text
        sequences repeat their index on the three rows; a sequence with images takes its prompt's positions,
        then ``index + delta`` past the prompt. ValueError when a token at an image row is not the image
        token (the slot was fed other tokens than :meth:`attach_images` returned)."""
        T = len(ids)
        pos = buf.part("mrope").reshape(3, T)
        for j, info in enumerate(images):
            lo, hi, ctx = starts[j], starts[j + 1], ctxs[j]
            if info is None:
                pos[:, lo:hi] = tok_pos[lo:hi]
                continue
            known = min(hi - lo, max(0, info.positions.shape[1] - ctx))  # tokens of the prompt
            pos[:, lo:lo + known] = info.positions[:, ctx:ctx + known]
            pos[:, lo + known:hi] = tok_pos[lo + known:hi] + info.delta
        out, at = buf.part("image_rows"), 0
        image_token = self.cfg.vision.image_token_id
        for j, k0, k1 in image_spans:
            rows = images[j].rows[k0:k1] - ctxs[j] + starts[j]
            wrong = np.flatnonzero(ids[rows] != image_token)
            if len(wrong):
                r = int(rows[wrong[0]])
                raise ValueError(f"sequence in slot {seq_slots[j]}: token {r - starts[j] + ctxs[j]} is {int(ids[r])}; "
                                 f"its image was attached there, so it must be the image token {image_token} (feed "
                                 "the ids attach_images returned)")
            out[at:at + len(rows)] = rows
            at += len(rows)

    @torch.no_grad()
    def step(self, slots: list[int], tokens: list[list[int]] | list[np.ndarray] | list[torch.Tensor], *,
             all_logits: bool = False) -> torch.Tensor:
        """Feed each sequence its new tokens (a list of ints, or a 1-D integer numpy array / CPU tensor each);
        returns fp32 logits.

        ``all_logits=False``: ``[N, vocab]``, the last new token of each sequence (input order).
        ``all_logits=True``: ``[sum of new tokens, vocab]`` in input order.
        A slot given images by :meth:`attach_images` takes the ids it returned, in any chunks: the image rows
        and multi-axis positions of each chunk come from the slot.
        """
        ids, batch, rows = self._layout(slots, tokens, all_logits)
        self.host.batch = batch
        try:
            with ops.host_built_inputs():  # this host built the slots and offsets: no value checks on the GPU
                embeds = None if batch.image_rows is None else self.model.embed(ids, batch.image_rows,
                                                                                batch.image_embeds)
                positions = batch.token_positions if batch.rope_positions is None else batch.rope_positions
                hidden = self.model(ids, positions, inputs_embeds=embeds)
        finally:
            self.host.batch = None
        for s, toks in zip(slots, tokens, strict=True):
            self.lengths[s] += len(toks)
        return self.model.logits(hidden[rows]).float()

    def capture_decode(self, slots: list[int]) -> DecodeGraph:
        """A CUDA graph of one decode step for these (consecutive, allocated) slots; see :class:`DecodeGraph`."""
        return DecodeGraph(self, slots)

    # ---------------------------------------------------------------- generation

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = False,
                 images: Sequence[Sequence[ImageSource] | None] | None = None) -> list[list[int]]:
        """Generate up to ``max_new_tokens`` per prompt; greedy when ``temperature == 0``.

        ``images``: per prompt, a list of images (or None), one image placeholder token in the prompt for each
        (see the module docstring). ValueError when the checkpoint has no vision tower or the placeholders do not
        match; :class:`qwen35.image_processor.ImageInputError` for an image that cannot be used.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"temperature={temperature} (>= 0), top_p={top_p} (in (0, 1]), top_k={top_k} (>= 0)")
        self._check_free(len(prompts))  # before any image goes through the tower
        feed, infos = self._prepare_images(prompts, images)
        gen = torch.Generator(device=self.device)
        if seed is not None:
            gen.manual_seed(seed)
        slots = self.allocate(len(prompts))
        for s, info in zip(slots, infos, strict=True):
            if info is not None:
                self._images[s] = info
        out: list[list[int]] = [[] for _ in prompts]
        try:
            live = list(range(len(prompts)))
            logits = self.step(slots, feed)
            for _ in range(max_new_tokens):
                nxt = sample(logits, temperature, top_k, top_p, gen).tolist()
                still = []
                for j, i in enumerate(live):
                    out[i].append(nxt[j])
                    if not (stop_at_eos and nxt[j] in self.cfg.eos_token_id) and len(out[i]) < max_new_tokens:
                        still.append((i, nxt[j]))
                if not still:
                    break
                live = [i for i, _ in still]
                logits = self.step([slots[i] for i in live], [[t] for _, t in still])
        finally:
            self.release(slots)
        return out


class DecodeGraph:
    """One decode step (one token for each of B consecutive slots) captured as a CUDA graph.

    Decode attention takes each row's length from a device buffer and launches work fixed by the
    cache shapes alone, so one capture serves every later step. Capture needs every op's backend to be free of host
    synchronisation (the reference ops are not); if it fails, the slots' states are restored and
    ``RuntimeError`` says why. :meth:`step` advances the sequences like :meth:`Qwen35Standalone.step`.
    """

    def __init__(self, owner: Qwen35Standalone, slots: list[int]):
        if owner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {owner.device}")
        B = len(slots)
        if B < 1 or slots != list(range(slots[0], slots[0] + B)) or any(s in owner.free for s in slots):
            raise ValueError(f"capture_decode needs consecutive allocated slots, got {slots}")
        if any(owner.lengths[s] == 0 for s in slots):
            raise ValueError("capture_decode needs sequences that already hold a prompt")
        self.owner, self.slots, dev = owner, slots, owner.device
        self.ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.positions = torch.tensor([owner.lengths[s] for s in slots], device=dev)
        self.lens = torch.zeros(B, dtype=torch.int32, device=dev)
        # rotary position = token index + the slot's delta (non-zero after a prompt with images)
        self._deltas = self._slot_deltas()
        self.deltas = torch.tensor(self._deltas, dtype=torch.long, device=dev)
        self.rope_positions = torch.zeros(B, dtype=torch.long, device=dev)
        slot_ids = torch.tensor(slots, dtype=torch.int32, device=dev)
        self.batch = Batch(
            num_decodes=B, decode_slots=slot_ids, decode_lens=self.lens, prefills=[], token_slots=slot_ids.long(),
            token_positions=self.positions,
            gdn=dict(num_decodes=B, decode_slots=slot_ids, num_prefill_tokens=0, prefill_cu_seqlens=None,
                     prefill_slots=None, prefill_has_initial_state=None))
        saved = self._save_states()
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles kernels, settles the allocator
                    self._forward()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._forward()
        except Exception as e:
            torch.cuda.synchronize()
            raise RuntimeError(f"decode graph capture failed ({type(e).__name__}: {e}); an op's backend "
                               "probably synchronises with the host (see the probe report)") from e
        finally:
            self._restore_states(saved)  # warm-up and capture ran real steps on these slots

    def _slot_deltas(self) -> list[int]:
        images = self.owner._images
        return [images[s].delta if s in images else 0 for s in self.slots]

    @torch.no_grad()
    def _forward(self) -> torch.Tensor:
        self.lens.copy_(self.positions + 1)
        torch.add(self.positions, self.deltas, out=self.rope_positions)
        self.owner.host.batch = self.batch
        try:
            with ops.host_built_inputs():
                hidden = self.owner.model(self.ids, self.rope_positions)
        finally:
            self.owner.host.batch = None
        return self.owner.model.logits(hidden).float()

    def _save_states(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(view of the slots' rows in each GDN pool, a copy of those rows)."""
        s0, n = self.slots[0], len(self.slots)
        pools = [p for layer in self.owner.model.layers if hasattr(layer.mixer, "state")
                 for p in (layer.mixer.state.conv_pool, layer.mixer.state.state_pool)]
        return [(p[s0:s0 + n], p[s0:s0 + n].clone()) for p in pools]

    @staticmethod
    def _restore_states(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for rows, copy in saved:
            rows.copy_(copy)
        torch.cuda.synchronize()

    def step(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """Feed one token per slot; returns fp32 logits ``[B, vocab]`` (a buffer the next step overwrites)."""
        owner = self.owner
        for s in self.slots:
            if owner.lengths[s] + 1 > owner.host.max_len:
                raise ValueError(f"sequence in slot {s} would exceed max_len={owner.host.max_len}")
        self.ids.copy_(torch.as_tensor(tokens, device=owner.device))
        self.positions.copy_(torch.tensor([owner.lengths[s] for s in self.slots], device=owner.device))
        deltas = self._slot_deltas()
        if deltas != self._deltas:  # slots given new prompts since the last step
            self.deltas.copy_(torch.tensor(deltas, device=owner.device))
            self._deltas = deltas
        self.graph.replay()
        for s in self.slots:
            owner.lengths[s] += 1
        return self.logits


def _text_only_message(cfg: Qwen35Config) -> str:
    """Why a checkpoint without a vision tower refuses images."""
    if not cfg.nested_text:
        return (f"this {cfg.architecture} checkpoint is text-only (no vision tower): images need a "
                "*ForConditionalGeneration checkpoint with a vision_config")
    return (f"this {cfg.architecture} checkpoint has no vision tower (its config.json has no vision_config): it takes "
            "text only, so images cannot be given")


def _image_processor_for(cfg: Qwen35Config, given: ImageProcessorConfig | None) -> ImageProcessorConfig:
    """The processor settings (``given``, else the defaults at the tower's patch sizes); ValueError unless its
    patch, temporal-patch and merge sizes are the tower's."""
    from qwen35.image_processor import ImageProcessorConfig

    return ImageProcessorConfig.for_tower(cfg.vision, given)


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
           gen: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``logits [N, vocab]``: argmax at temperature 0, else top-k / top-p sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if top_k:
        kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1:
        sorted_scores, idx = scores.sort(dim=-1, descending=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum - sorted_scores.softmax(-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        scores = scores.scatter(-1, idx, sorted_scores.masked_fill(drop, float("-inf")))
    return torch.multinomial(scores.softmax(-1), 1, generator=gen)[:, 0]
