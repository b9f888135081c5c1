"""Multi-axis rotary positions (mrope) of Qwen3.5's multimodal checkpoints: positions and angles.

Every prompt token gets three positions (time, row, column). Text tokens get the same value on all three
rows, counting on from where the previous segment stopped. An image's ``t * (h / m) * (w / m)`` placeholder
tokens (``m`` the spatial merge size; in the tower's merged-token order: frame, then merged row, then merged
column) get ``start + (frame, row, column)`` with ``start`` the position the next text token would have had;
the text after the image resumes at ``start + max(h, w) / m``. Tokens generated after a prompt of ``T`` tokens
sit at index ``p >= T`` and get ``p + delta`` on all three rows, ``delta = max(prompt positions) + 1 - T``
(zero for text-only prompts, usually negative with images: an image advances the position by its side, not
by its token count). Compared with HF transformers 5.19's ``Qwen3_5Model.get_rope_index`` (image inputs).

The angles interleave the axes over the rotary frequencies: frequency ``j`` turns with the row position when
``j % 3 == 1`` and ``j < 3 * section[1]``, with the column position when ``j % 3 == 2`` and
``j < 3 * section[2]``, and with the time position otherwise (``section`` is the config's ``mrope_section``,
``[11, 11, 10]`` for Qwen3.5; HF applies the interleaved layout whatever ``mrope_interleaved`` says).

Both hosts call these pure functions: the vLLM host from ``get_mrope_input_positions`` (with the placeholder
offsets vLLM records), the standalone host when it builds a prompt with images (after
:func:`expand_image_placeholders` turns each image's one placeholder token into its tokens, the rule vLLM's
prompt replacement follows).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

DEFAULT_MROPE_SECTION = (11, 11, 10)


def _ids(input_ids: Sequence[int] | torch.Tensor | np.ndarray) -> np.ndarray:
    ids = input_ids.detach().cpu().numpy() if isinstance(input_ids, torch.Tensor) else np.asarray(input_ids)
    if ids.ndim != 1:
        raise ValueError(f"input_ids must be one sequence (1-D), got shape {list(ids.shape)}")
    return ids.astype(np.int64, copy=False)


def _grids(image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None, merge: int) -> list[tuple[int, int, int]]:
    if image_grid_thw is None:
        return []
    rows = image_grid_thw.tolist() if isinstance(image_grid_thw, torch.Tensor) else [list(g) for g in image_grid_thw]
    out = []
    for i, g in enumerate(rows):
        if len(g) != 3:
            raise ValueError(f"image_grid_thw[{i}]={g}: expected (t, h, w)")
        t, h, w = (int(x) for x in g)
        if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
            raise ValueError(f"image_grid_thw[{i}]=({t}, {h}, {w}): t, h, w must be positive and h, w multiples of "
                             f"spatial_merge_size={merge}")
        out.append((t, h, w))
    return out


def expand_image_placeholders(input_ids: Sequence[int] | torch.Tensor | np.ndarray, num_tokens: Sequence[int],
                              image_token_id: int) -> np.ndarray:
    """The prompt with its ``i``-th ``image_token_id`` repeated ``num_tokens[i]`` times (int64).

    A prompt names each image by one ``image_token_id`` (what a chat template writes between
    ``<|vision_start|>`` and ``<|vision_end|>``); the image takes as many tokens as its merged grid has
    (:func:`image_token_counts`). vLLM's prompt replacement for these checkpoints applies the same rule, so a
    prompt and its images give one token sequence in both hosts. ValueError unless the prompt holds exactly
    one placeholder per image.
    """
    ids = _ids(input_ids)
    where = np.flatnonzero(ids == image_token_id)
    if len(where) != len(num_tokens):
        raise ValueError(f"the prompt holds {len(where)} image placeholder(s) (token id {image_token_id}) for "
                         f"{len(num_tokens)} image(s); put one placeholder where each image goes, in order")
    if any(int(n) <= 0 for n in num_tokens):
        raise ValueError(f"image token counts {list(num_tokens)} must be positive")
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[where] = np.asarray(num_tokens, dtype=np.int64)
    return np.repeat(ids, repeats)


def image_token_counts(image_grid_thw: torch.Tensor | Sequence[Sequence[int]], spatial_merge_size: int) -> list[int]:
    """Placeholder tokens of each image: ``t * h * w / m^2``."""
    return [t * h * w // spatial_merge_size**2 for t, h, w in _grids(image_grid_thw, spatial_merge_size)]


def find_image_offsets(input_ids: Sequence[int] | torch.Tensor | np.ndarray,
                       image_grid_thw: torch.Tensor | Sequence[Sequence[int]], spatial_merge_size: int,
                       image_token_id: int) -> list[int]:
    """Index of each image's first placeholder token: images take consecutive runs of ``image_token_id`` in
    order, each as many tokens as its grid says (two images with nothing between them share one run).

    ValueError when the prompt's image tokens do not add up to the grids'.
    """
    ids = _ids(input_ids)
    counts = image_token_counts(image_grid_thw, spatial_merge_size)
    where = np.flatnonzero(ids == image_token_id)
    if len(where) != sum(counts):
        raise ValueError(f"the prompt holds {len(where)} image tokens (id {image_token_id}); the {len(counts)} "
                         f"image grid(s) need {sum(counts)} ({counts})")
    offsets, used = [], 0
    for i, n in enumerate(counts):
        start = int(where[used])
        if where[used + n - 1] != start + n - 1:
            raise ValueError(f"image {i} needs {n} consecutive image tokens from index {start}; the run is shorter")
        offsets.append(start)
        used += n
    return offsets


def mrope_positions(input_ids: Sequence[int] | torch.Tensor | np.ndarray,
                    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None, spatial_merge_size: int,
                    image_token_id: int, image_offsets: Sequence[int] | None = None) -> tuple[torch.Tensor, int]:
    """The ``[3, T]`` int64 positions of one prompt and its decode ``delta`` (see the module docstring).

    ``image_grid_thw``: ``(t, h, w)`` in patches per image, in prompt order (the processor's ``grid_thw``).
    ``image_offsets``: index of each image's first placeholder token, when the host knows them (vLLM's
    placeholder ranges); otherwise they are found from ``image_token_id`` runs (:func:`find_image_offsets`).
    Raises ValueError naming the image whose placeholders do not fit.
    """
    ids = _ids(input_ids)
    T, m = len(ids), int(spatial_merge_size)
    if m <= 0:
        raise ValueError(f"spatial_merge_size={spatial_merge_size} must be positive")
    grids = _grids(image_grid_thw, m)
    if image_offsets is None:
        image_offsets = find_image_offsets(ids, grids, m, image_token_id) if grids else []
    if len(image_offsets) != len(grids):
        raise ValueError(f"{len(image_offsets)} image offsets for {len(grids)} image grids")
    pieces: list[np.ndarray] = []
    pos, cursor = 0, 0  # next text position, next token index
    for i, ((t, h, w), offset) in enumerate(zip(grids, image_offsets, strict=True)):
        n = t * h * w // m**2
        if offset < cursor or offset + n > T:
            raise ValueError(f"image {i} at token {offset} with {n} tokens overlaps the previous image or runs past "
                             f"the prompt's {T} tokens")
        if not (ids[offset:offset + n] == image_token_id).all():
            raise ValueError(f"image {i}: tokens {offset}..{offset + n - 1} are not all the image token "
                             f"{image_token_id}")
        pieces.append(np.broadcast_to(np.arange(pos, pos + offset - cursor), (3, offset - cursor)))
        pos += offset - cursor
        frame, row, col = np.indices((t, h // m, w // m)).reshape(3, -1)
        pieces.append(np.stack([frame, row, col]) + pos)
        pos += max(h, w) // m
        cursor = offset + n
    pieces.append(np.broadcast_to(np.arange(pos, pos + T - cursor), (3, T - cursor)))
    positions = torch.from_numpy(np.concatenate(pieces, axis=1).astype(np.int64))
    delta = int(positions.max()) + 1 - T if T else 0
    return positions, delta


def decode_positions(first_index: int, count: int, delta: int) -> torch.Tensor:
    """``[3, count]`` positions of the tokens at indices ``first_index ..`` after a prompt with this ``delta``."""
    return (torch.arange(first_index, first_index + count, dtype=torch.int64) + delta).expand(3, -1)


def mrope_column_axes(num_freqs: int, mrope_section: Sequence[int] = DEFAULT_MROPE_SECTION) -> torch.Tensor:
    """For each of ``num_freqs`` rotary frequencies, the position row (0 time, 1 row, 2 column) it turns with."""
    if len(mrope_section) != 3 or any(int(s) < 0 for s in mrope_section):
        raise ValueError(f"mrope_section={list(mrope_section)}: expected three non-negative counts (t, h, w)")
    j = torch.arange(num_freqs)
    axes = torch.zeros(num_freqs, dtype=torch.int64)
    axes[(j % 3 == 1) & (j < 3 * int(mrope_section[1]))] = 1
    axes[(j % 3 == 2) & (j < 3 * int(mrope_section[2]))] = 2
    return axes


def mrope_angles(positions: torch.Tensor, inv_freq: torch.Tensor,
                 mrope_section: Sequence[int] = DEFAULT_MROPE_SECTION, *,
                 axes: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 angles ``[T, len(inv_freq)]`` for positions ``[3, T]`` (or ``[T]``: text, every axis equal).

    ``axes``: :func:`mrope_column_axes` already on the positions' device (a model keeps it, so that a step
    under CUDA-graph capture copies nothing from the host); computed from ``mrope_section`` when left out.
    A position row repeated on all three axes gives the angles of the same ``[T]`` positions bit for bit.
    ``cos`` / ``sin`` of the result are what :func:`qwen35.ops.qk_norm_rope` takes.
    """
    if positions.dim() == 1:
        return positions.float()[:, None] * inv_freq.float()[None, :]
    if positions.dim() != 2 or positions.shape[0] != 3:
        raise ValueError(f"positions has shape {list(positions.shape)}; expected [3, T] or [T]")
    if axes is None:
        axes = mrope_column_axes(inv_freq.shape[0], mrope_section).to(positions.device)
    return positions.float().t().index_select(1, axes) * inv_freq.float()[None, :]  # contiguous [T, freqs]
