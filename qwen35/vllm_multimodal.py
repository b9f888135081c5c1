"""vLLM host, images: the model class of ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``.

:class:`Qwen35VisionForVllm` is :class:`qwen35.vllm_host.Qwen35ForVllm` plus vLLM's multimodal contract, built on
our own pieces only (vLLM's ``qwen3_vl`` module is never imported: it needs torchvision, which the CPU build
lacks):

- **processing** (:class:`Qwen35ImageProcessor`, run by vLLM's renderer): images go through
  :mod:`qwen35.image_processor` (PIL and numpy), giving ``pixel_values`` (the patch rows of every image, one
  field sliced per image by its patch count) and ``image_grid_thw`` (one ``(t, h, w)`` row per image, kept on
  the CPU). The prompt names each image by one image token (what the chat template writes between
  ``<|vision_start|>`` and ``<|vision_end|>``); vLLM replaces it with the image's ``t * h * w / m^2`` tokens, the
  rule :func:`qwen35.mrope.expand_image_placeholders` applies in the standalone host, so one prompt and its
  images give the same token sequence in both hosts;
- **encoding** (:meth:`Qwen35VisionForVllm.embed_multimodal`): :class:`qwen35.vision.VisionTower`, replicated on
  every tensor-parallel rank, one call per batch of images, cut into one tensor per image;
- **merging** (:meth:`Qwen35VisionForVllm.embed_input_ids`): the token embeddings with the rows vLLM marks as
  image rows replaced, in order, by ``masked_scatter`` (no read-back of the mask or the counts);
- **positions** (:meth:`Qwen35VisionForVllm.get_mrope_input_positions`): :func:`qwen35.mrope.mrope_positions` at
  the placeholder offsets vLLM recorded.

The processor's settings come from the checkpoint's ``preprocessor_config.json`` (vLLM reads it), checked
against the tower's patch sizes; the tower's defaults when there is none. Version-specific internals (the
processor's main step, where dummy inputs are built) come from :mod:`qwen35.vllm_adapter`.

With every image limit at zero (``--limit-mm-per-prompt '{"image": 0}'`` or ``--language-model-only``) no
tower is built and its tensors are skipped at load, as for a text-only host.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np
import torch
from PIL import Image

from qwen35 import vllm_adapter
from qwen35.checkpoint import load_weights
from qwen35.config import Qwen35Config
from qwen35.image_processor import (
    ImageProcessorConfig,
    max_image_tokens,
    preprocess,
)
from qwen35.mrope import mrope_positions
from qwen35.vision import VisionConfig, VisionTower, split_by_image
from qwen35.vllm_host import Qwen35ForVllm, VllmConfig, log

mm = vllm_adapter.multimodal_api()  # raises UnsupportedVllm (an ImportError) outside the supported range

IMAGE = "image"


def _placeholder_ids(vision: VisionConfig) -> list[int]:
    """What a chat template writes for one image: ``<|vision_start|><|image_pad|><|vision_end|>``."""
    return [vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id]


def _as_image(item: object) -> Image.Image | np.ndarray | bytes | str:
    """One image as vLLM's parser hands it (a PIL image, or an array / tensor in HWC or CHW order from the
    offline API) in a form :func:`qwen35.image_processor.load_image` takes."""
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu().numpy()
    if isinstance(item, np.ndarray) and item.ndim == 3 and item.shape[0] in (1, 3, 4) and item.shape[-1] not in (3, 4):
        item = item.transpose(1, 2, 0)  # CHW -> HWC
    if isinstance(item, np.ndarray) and item.ndim == 3 and item.shape[-1] == 4:
        item = np.ascontiguousarray(item)
        return Image.fromarray(item.astype(np.uint8) if item.dtype != np.uint8 else item, "RGBA")
    return item


# ----------------------------------------------------------------------------- processing


class Qwen35ProcessingInfo(mm.BaseProcessingInfo):
    """What vLLM asks about the model's inputs: one modality (images), their settings and their largest size."""

    @cached_property
    def qwen35_config(self) -> Qwen35Config:
        cfg = Qwen35Config.from_hf(self.ctx.model_config.hf_config)
        if cfg.vision is None:
            raise ValueError(f"qwen35: this {cfg.architecture} checkpoint has no vision_config, so it takes no images")
        return cfg

    @property
    def vision(self) -> VisionConfig:
        return self.qwen35_config.vision

    @cached_property
    def image_config(self) -> ImageProcessorConfig:
        """``preprocessor_config.json`` (read by vLLM), checked against the tower; the tower's defaults without it."""
        raw = self.ctx.get_hf_image_processor_config() or {}
        return ImageProcessorConfig.for_tower(self.vision, ImageProcessorConfig.from_dict(raw) if raw else None)

    def get_hf_processor(self, **kwargs: object) -> object:
        raise NotImplementedError("qwen35 processes images itself (qwen35.image_processor); it uses no HF processor")

    def get_supported_mm_processor_kwargs(self) -> dict[str, set[str]]:
        return {}  # no per-request processor options

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {IMAGE: None}

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {IMAGE: max_image_tokens(self.image_config)}

    def largest_image_side(self) -> int:
        """Side of the square dummy image: the largest multiple of the patch grid within ``max_pixels``."""
        cfg = self.image_config
        return max(cfg.factor, int(cfg.max_pixels**0.5) // cfg.factor * cfg.factor)


class Qwen35DummyInputsBuilder(mm.BaseDummyInputsBuilder):
    """Profiling inputs: per image, the placeholder and a white square image at the largest size."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return "<|vision_start|><|image_pad|><|vision_end|>" * mm_counts.get(IMAGE, 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Any = None) -> dict:
        side = self.info.largest_image_side()
        overrides = mm_options.get(IMAGE) if isinstance(mm_options, Mapping) else None
        return {
            IMAGE: self._get_dummy_images(
                width=side, height=side, num_images=mm_counts.get(IMAGE, 0), overrides=overrides
            )
        }

    def get_dummy_processor_inputs(self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Any = None) -> Any:
        """vLLM 0.26 asks the builder for the whole dummy request: the prompt as token ids, so no tokenizer is
        needed (the placeholder's ids come from the config)."""
        return _dummy_inputs(self.info, seq_len, mm_counts, mm_options, self)


def _dummy_inputs(
    info: Qwen35ProcessingInfo,
    seq_len: int,
    mm_counts: Mapping[str, int],
    mm_options: Any,
    builder: Qwen35DummyInputsBuilder,
) -> Any:
    images = info.parse_mm_data(builder.get_dummy_mm_data(seq_len, mm_counts, mm_options), validate=False)
    return mm.ProcessorInputs(prompt=_placeholder_ids(info.vision) * mm_counts.get(IMAGE, 0), mm_data_items=images)


class Qwen35ImageProcessor(mm.BaseMultiModalProcessor):
    """Images -> ``pixel_values`` and ``image_grid_thw`` (:mod:`qwen35.image_processor`); each image token grows
    into the image's tokens."""

    requires_tokenizer = False  # prompts arrive as token ids, the placeholder ids come from the config

    _apply_hf_processor_main = vllm_adapter.image_processor_main_step(mm)

    def get_dummy_inputs(self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Any = None) -> Any:
        """vLLM 0.32 asks the processor for the dummy request (see :meth:`Qwen35DummyInputsBuilder.
        get_dummy_processor_inputs`)."""
        return _dummy_inputs(self.info, seq_len, mm_counts, mm_options, self.dummy_inputs)

    def _prompt_ids(self, prompt: str | list[int], tokenization_kwargs: Mapping[str, object]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        add_special = bool((tokenization_kwargs or {}).get("add_special_tokens", True))
        return list(self.info.get_tokenizer().encode(prompt, add_special_tokens=add_special))

    def _process_media(self, mm_items: Any) -> Any:
        """The tensors of every image in ``mm_items``; ValueError (ImageInputError) naming what is wrong."""
        kinds = {modality for modality, items in mm_items.items() if len(items)}
        if kinds - {IMAGE}:
            raise ValueError(f"qwen35 takes images only; got {', '.join(sorted(kinds - {IMAGE}))}")
        if IMAGE not in kinds:
            return mm.BatchFeature({})
        items = mm_items[IMAGE]
        if not isinstance(items, mm.ImageProcessorItems):
            raise ValueError(
                f"qwen35 takes images as pixels; {type(items).__name__} (precomputed image embeddings) "
                "are not supported"
            )
        images = [_as_image(items.get(i)) for i in range(len(items))]
        processed = preprocess(images, self.info.image_config)
        return mm.BatchFeature({"pixel_values": processed.pixel_values, "image_grid_thw": processed.grid_thw})

    def _get_mm_fields_config(self, hf_inputs: Any, hf_processor_mm_kwargs: Mapping[str, object]) -> Mapping:
        grid = hf_inputs.get("image_grid_thw", torch.empty((0, 3), dtype=torch.int64))
        return {
            "pixel_values": mm.MultiModalFieldConfig.flat_from_sizes(IMAGE, grid.prod(-1)),
            "image_grid_thw": mm.MultiModalFieldConfig.batched(IMAGE, keep_on_cpu=True),
        }

    def _get_prompt_updates(
        self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs: Any
    ) -> Sequence[Any]:
        image_token, m2 = self.info.vision.image_token_id, self.info.vision.spatial_merge_size**2

        def tokens(item_idx: int) -> list[int]:
            grid = out_mm_kwargs[IMAGE][item_idx]["image_grid_thw"].data
            return [image_token] * (int(grid.prod()) // m2)

        return [mm.PromptReplacement(modality=IMAGE, target=[image_token], replacement=tokens)]


# ----------------------------------------------------------------------------- the model class


@mm.registry.register_processor(Qwen35ImageProcessor, info=Qwen35ProcessingInfo, dummy_inputs=Qwen35DummyInputsBuilder)
class Qwen35VisionForVllm(Qwen35ForVllm, mm.SupportsMultiModal):
    """:class:`Qwen35ForVllm` with the vision tower and vLLM's multimodal contract (see the module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if self.cfg.vision is None:
            raise ValueError(
                f"qwen35: this {self.cfg.architecture} checkpoint has no vision_config; serve it as a "
                "*ForCausalLM checkpoint or add its vision tower"
            )
        mm_config = vllm_config.model_config.multimodal_config
        images_on = mm_config is None or mm_config.get_limit_per_prompt(IMAGE) > 0
        self.visual = VisionTower(self.cfg.vision, dtype=vllm_config.model_config.dtype).eval() if images_on else None

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith(IMAGE):
            return "<|vision_start|><|image_pad|><|vision_end|>"
        raise ValueError(f"qwen35 takes images only, not {modality}")

    def get_language_model(self) -> torch.nn.Module:
        return self

    def embed_multimodal(self, **kwargs: object) -> tuple[torch.Tensor, ...]:
        """One ``[tokens, hidden]`` tensor per image, in the order of ``image_grid_thw``."""
        pixels, grid = kwargs.get("pixel_values"), kwargs.get("image_grid_thw")
        if pixels is None:
            return ()
        if self.visual is None:
            raise ValueError("qwen35: images are switched off on this server (image limit 0)")
        if isinstance(pixels, (list, tuple)):
            pixels = torch.cat(list(pixels))
        if isinstance(grid, (list, tuple)):
            grid = torch.stack([torch.as_tensor(g).reshape(3) for g in grid])
        grid = grid.reshape(-1, 3).cpu()
        with torch.no_grad():
            embeds = self.visual(pixels, grid)
        return tuple(split_by_image(embeds, grid, self.cfg.vision.spatial_merge_size))

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: Sequence[torch.Tensor] | None = None,
        *,
        is_multimodal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with the rows ``is_multimodal`` marks replaced by the image rows, in order."""
        h = self.model.embed_tokens(input_ids)
        if not multimodal_embeddings:
            return h
        if is_multimodal is None:
            raise ValueError("qwen35: image embeddings came without the mask of their rows (is_multimodal)")
        rows = (
            torch.cat([e.to(h.dtype) for e in multimodal_embeddings])
            if len(multimodal_embeddings) > 1
            else multimodal_embeddings[0].to(h.dtype)
        )
        mask = is_multimodal.to(h.device, non_blocking=True).unsqueeze(-1)
        return h.masked_scatter(mask, rows)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        """The prompt's ``[3, T]`` positions and decode offset, images at vLLM's placeholder offsets."""
        features = sorted(mm_features, key=lambda f: f.mm_position.offset)
        other = sorted({f.modality for f in features} - {IMAGE})
        if other:
            raise ValueError(f"qwen35 takes images only; got {', '.join(other)}")
        vision = self.cfg.vision
        grids = [f.data["image_grid_thw"].data.reshape(3).tolist() for f in features]
        offsets = [int(f.mm_position.offset) for f in features]
        return mrope_positions(
            input_tokens, grids or None, vision.spatial_merge_size, vision.image_token_id, image_offsets=offsets or None
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Decoder and tower through one explicit mapping (qwen35.checkpoint, qwen35.vision_checkpoint)."""
        with torch.no_grad():
            load_weights(self.model, weights, logger=log, visual=self.visual)
        return {name for name, _ in self.named_parameters()}
