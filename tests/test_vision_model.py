"""Images in the model and the standalone host: the whole tiny vision-language model against HF transformers'
Qwen3_5(Moe)ForConditionalGeneration in fp32 (same checkpoint, mixed text + image prompts, prefill and decode),
chunked and batched steps with images, generation, the checkpoint mapping of the tower, and the errors for
images a checkpoint or a prompt cannot take."""

from __future__ import annotations

import base64
import io
import logging
import os

import numpy as np
import pytest
import torch
from helpers import rel_err
from PIL import Image

from qwen35.checkpoint import CheckpointError
from qwen35.config import Qwen35Config
from qwen35.image_processor import ImageInputError, ImageLimits, ImageProcessorConfig, preprocess
from qwen35.model import Rotary
from qwen35.mrope import expand_image_placeholders
from qwen35.standalone import Qwen35Standalone
from qwen35.tiny import TinySpec, checkpoint_tensors, config_json, write_checkpoint

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # fp32 both sides; measured prefill 2e-6 (dense) / 3e-6 (MoE), decode <= 3.4e-6
STEP_TOL = 1e-5  # our own host against itself: batched / chunked vs alone (as tests/test_standalone.py)
DECODE_STEPS = 8
RAW = config_json(TinySpec(conditional=True))
IMG, VS, VE = RAW["image_token_id"], RAW["vision_start_token_id"], RAW["vision_end_token_id"]


def _noise(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


# 70x100 -> a 4x6 patch grid (6 tokens); 150x60 -> 10x4 (10 tokens); 300x400 is scaled down to the 16-token bound
IMAGES = [_noise(70, 100, 0), _noise(150, 60, 1), _noise(300, 400, 2)]


def _prompt(n_images: int, tail: int = 40) -> list[int]:
    """Text, then each image as <vision_start> <image> <vision_end> with text between, then ``tail`` text tokens."""
    ids = [5, 6, 7]
    for i in range(n_images):
        ids += [VS, IMG, VE] + [20 + i, 21 + i]
    return ids + [(37 * j + 11) % 900 for j in range(tail)]


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("vl"), TinySpec(conditional=True))


@pytest.fixture(scope="module")
def vl(vl_ckpt):
    return Qwen35Standalone.from_pretrained(vl_ckpt, max_seqs=4, max_len=256)


@pytest.fixture
def hf_torch_gdn(monkeypatch):
    """HF's Qwen3.5 modules on their PyTorch GDN / conv functions (FLA's kernels need a GPU)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as dense
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as moe

    for mod in (dense, moe):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update"):
            fn = getattr(mod, name)
            monkeypatch.setattr(mod, name, getattr(fn, "__wrapped__", fn))


def _hf_reference(path: str, ids: list[int], images: list) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """HF's prefill logits over the expanded prompt, then greedy decode: the tokens fed and the logits after each.

    HF takes the expanded ids, the processor's pixels and grids, and finds the image rows and the positions
    itself (``mm_token_type_ids``); decode steps get its stored rope delta."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,
                                                                     attn_implementation="sdpa").eval()
    assert type(model).__name__.endswith("ForConditionalGeneration")
    x = torch.tensor([ids])
    kw = {}
    if images:
        pre = preprocess(images, ImageProcessorConfig.from_dir(path))
        kw = dict(pixel_values=pre.pixel_values, image_grid_thw=pre.grid_thw, mm_token_type_ids=(x == IMG).int())
    with torch.no_grad():
        out = model(input_ids=x, use_cache=True, **kw)
        prefill, cache = out.logits[0], out.past_key_values
        fed, steps, nxt = [], [], int(prefill[-1].argmax())
        for _ in range(DECODE_STEPS):
            o = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
            fed.append(nxt)
            steps.append(o.logits[0, -1])
            nxt = int(o.logits[0, -1].argmax())
    return prefill, fed, steps


@pytest.mark.parametrize("spec", [TinySpec(conditional=True), TinySpec(moe=True, conditional=True, seed=3)],
                         ids=["dense", "moe"])
def test_logits_match_hf_with_images(tmp_path, hf_torch_gdn, spec):
    path = write_checkpoint(tmp_path / "ckpt", spec)
    ours = Qwen35Standalone.from_pretrained(path, max_seqs=1, max_len=256)
    images = IMAGES[:2]
    slot = ours.allocate(1)
    ids = ours.attach_images(slot[0], _prompt(2), images).tolist()
    assert ids.count(IMG) == 6 + 10 and len(ids) == len(_prompt(2)) - 2 + 16
    ref_prefill, fed, ref_steps = _hf_reference(path, ids, images)
    assert ref_prefill.abs().max() > 0.1  # the reference is not degenerate

    prefill = ours.step(slot, [ids], all_logits=True)
    err = rel_err(prefill, ref_prefill)
    assert err <= TOL, f"prefill logits: rel err {err:.3e} > {TOL:g}"
    for i, (tok, ref) in enumerate(zip(fed, ref_steps, strict=True)):
        err = rel_err(ours.step(slot, [[tok]])[0], ref)
        assert err <= TOL, f"decode step {i} (positions index + delta): rel err {err:.3e} > {TOL:g}"

    # the check can fail: the same embeddings at plain text positions are far from HF
    ours.release(slot)
    slot = ours.allocate(1)
    ours.attach_images(slot[0], _prompt(2), images)
    state = ours._images[slot[0]]
    state.positions = np.broadcast_to(np.arange(len(ids), dtype=np.int32), (3, len(ids))).copy()
    wrong = rel_err(ours.step(slot, [ids], all_logits=True), ref_prefill)
    assert wrong > 100 * TOL, f"plain positions gave rel err {wrong:.3e}: the comparison does not see positions"


def test_text_prompt_matches_hf_on_a_vision_checkpoint(vl_ckpt, vl, hf_torch_gdn):
    """Text-only prompts on a checkpoint with a tower: HF's ConditionalGeneration logits, decode included."""
    prompt = _prompt(0, tail=67)
    ref_prefill, fed, ref_steps = _hf_reference(vl_ckpt, prompt, [])
    slot = vl.allocate(1)
    try:
        assert rel_err(vl.step(slot, [prompt], all_logits=True), ref_prefill) <= TOL
        for tok, ref in zip(fed, ref_steps, strict=True):
            assert rel_err(vl.step(slot, [[tok]])[0], ref) <= TOL
    finally:
        vl.release(slot)


def test_equal_position_rows_give_plain_rope_bit_for_bit():
    """[3, T] positions with equal rows (text) = [T] positions: the angles are the same floats."""
    rot = Rotary(Qwen35Config.from_dict(RAW))
    pos = torch.tensor([0, 1, 2, 5, 900, 4095], dtype=torch.int32)
    for a, b in zip(rot.cos_sin(pos), rot.cos_sin(pos.expand(3, -1)), strict=True):
        assert torch.equal(a, b) and b.is_contiguous()
    mixed = torch.stack([pos, pos + 1, pos + 2])  # differing rows do change the angles
    assert not torch.equal(rot.cos_sin(mixed)[0], rot.cos_sin(pos)[0])


def test_chunked_prefill_with_images_matches_whole_prompt(vl):
    """A prompt fed in pieces that cut through its images (sliced embeddings, [3, T] positions per piece)."""
    prompt = _prompt(2)
    slot = vl.allocate(1)
    ids = vl.attach_images(slot[0], prompt, IMAGES[:2])
    whole = vl.step(slot, [ids], all_logits=True)
    after = vl.step(slot, [[3]])
    vl.release(slot)
    first = ids.tolist().index(IMG)
    cuts = [0, first + 2, first + 3, first + 12, len(ids) - 5, len(ids)]  # inside image 1, across into image 2
    slot = vl.allocate(1)
    vl.attach_images(slot[0], prompt, IMAGES[:2])
    pieces = [vl.step(slot, [ids[a:b]], all_logits=True) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    assert rel_err(torch.cat(pieces), whole) <= STEP_TOL
    assert rel_err(vl.step(slot, [[3]]), after) <= STEP_TOL
    vl.release(slot)


def test_batched_image_and_text_prompts_match_each_alone(vl):
    """One step holding a prompt with images, a text prompt and a decode row = each sequence alone."""
    text = _prompt(0, tail=30)

    def alone(prompt, images):
        slot = vl.allocate(1)
        ids = vl.attach_images(slot[0], prompt, images) if images else prompt
        out = [vl.step(slot, [ids], all_logits=True), vl.step(slot, [[9]])[0]]
        vl.release(slot)
        return ids, out

    ids_a, ref_a = alone(_prompt(1), IMAGES[1:2])
    _, ref_b = alone(text, None)
    ids_c, ref_c = alone(_prompt(2, tail=3), [IMAGES[2], IMAGES[0]])
    slots = vl.allocate(3)
    vl.attach_images(slots[0], _prompt(1), IMAGES[1:2])
    vl.attach_images(slots[2], _prompt(2, tail=3), [IMAGES[2], IMAGES[0]])
    vl.step(slots[2:], [ids_c])
    both = vl.step(slots, [ids_a, text, [9]], all_logits=True)  # a decode row (images, delta) and two prefills
    n_a = len(ids_a)
    assert rel_err(both[:n_a], ref_a[0]) <= STEP_TOL
    assert rel_err(both[n_a:-1], ref_b[0]) <= STEP_TOL
    assert rel_err(both[-1], ref_c[1]) <= STEP_TOL
    last = vl.step(slots[:2], [[9], [9]])
    assert rel_err(last[0], ref_a[1]) <= STEP_TOL and rel_err(last[1], ref_b[1]) <= STEP_TOL
    vl.release(slots)


def test_generate_with_images(vl):
    """Greedy generation with an image: deterministic, the argmax chain of single steps, the same for every way
    of passing the image, and changed by the image."""
    prompt = _prompt(1, tail=2)
    image = IMAGES[0]
    out = vl.generate([prompt], 10, images=[[image]])
    assert out == vl.generate([prompt], 10, images=[[image]])
    slot = vl.allocate(1)
    logits = logits_first = vl.step(slot, [vl.attach_images(slot[0], prompt, [image])])
    chain = []
    for _ in range(10):
        chain.append(int(logits[0].argmax()))
        logits = vl.step(slot, [[chain[-1]]])
    vl.release(slot)
    assert out == [chain]
    png = _png(image)
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    for same in (png, data_url, np.asarray(image)):
        assert vl.generate([prompt], 10, images=[[same]]) == out
    no_image = [t for t in prompt if t != IMG]
    assert vl.generate([no_image], 10) != out, "the image did not change the output"
    assert vl.generate([prompt], 10, images=[[IMAGES[1]]]) != out, "another image gave the same output"
    slot = vl.allocate(1)
    other = vl.step(slot, [no_image])
    vl.release(slot)
    assert rel_err(other, logits_first) > 0.05
    mixed = vl.generate([no_image, prompt, _prompt(2)], 10, images=[None, [image], IMAGES[:2]])
    assert mixed[:2] == [vl.generate([no_image], 10)[0], out[0]]
    assert mixed[2] == vl.generate([_prompt(2)], 10, images=[IMAGES[:2]])[0]
    assert len(vl.free) == 4


def test_text_only_generation_is_unchanged_by_the_tower(tmp_path):
    """The same decoder weights with and without a vision tower (ConditionalGeneration vs CausalLM layout)
    generate the same tokens from text prompts, bit for bit."""
    causal = Qwen35Standalone.from_pretrained(write_checkpoint(tmp_path / "c", TinySpec(seed=4)), max_len=128)
    cond = Qwen35Standalone.from_pretrained(write_checkpoint(tmp_path / "v", TinySpec(seed=4, conditional=True)),
                                            max_len=128)
    assert causal.visual is None and cond.visual is not None
    prompts = [_prompt(0, tail=n) for n in (4, 50)]
    assert cond.generate(prompts, 12) == causal.generate(prompts, 12)


# ----------------------------------------------------------------------------- checkpoint and config


def test_tower_loads_from_the_checkpoint(vl_ckpt, caplog):
    tensors = checkpoint_tensors(TinySpec(conditional=True))
    with caplog.at_level(logging.INFO, logger="qwen35.checkpoint"):
        m = Qwen35Standalone.from_pretrained(vl_ckpt, max_seqs=1, max_len=32)
    assert "skipped 1 MTP tensors (mtp.*)" in caplog.text
    assert torch.equal(m.visual.blocks[0].attn.qkv.weight, tensors["model.visual.blocks.0.attn.qkv.weight"])
    assert torch.equal(m.visual.patch_embed.weight,
                       tensors["model.visual.patch_embed.proj.weight"].reshape(64, -1))
    assert m.image_processor.max_pixels == 128 * 128  # from preprocessor_config.json, not the defaults


@pytest.mark.parametrize("change, match", [
    ("drop", r"missing vision tensors: model\.visual\.merger\.linear_fc2\.bias"),
    ("extra", r"unknown vision tensors \(not part of a Qwen3\.5 vision tower of depth 1\): "
              r"model\.visual\.blocks\.1\.norm1\.weight"),
    ("shape", r"model\.visual\.pos_embed\.weight has shape \[49, 64\]; the vision config implies \[64, 64\]"),
])
def test_bad_vision_tensors_are_named(tmp_path, change, match):
    spec = TinySpec(conditional=True)
    tensors = checkpoint_tensors(spec)
    if change == "drop":
        del tensors["model.visual.merger.linear_fc2.bias"]
    elif change == "extra":
        tensors["model.visual.blocks.1.norm1.weight"] = torch.ones(64)
    else:
        tensors["model.visual.pos_embed.weight"] = torch.zeros(49, 64)
    path = write_checkpoint(tmp_path / "ckpt", spec, tensors)
    with pytest.raises(CheckpointError, match=match):
        Qwen35Standalone.from_pretrained(path, max_seqs=1, max_len=32)


def test_config_reads_the_vision_tower_and_mrope_section():
    cfg = Qwen35Config.from_dict(RAW)
    assert cfg.vision is not None and cfg.vision.image_token_id == IMG and cfg.vision.depth == 1
    assert cfg.mrope_section == (11, 11, 10)
    causal = config_json(TinySpec())
    assert Qwen35Config.from_dict(causal).vision is None
    raw = {**RAW, "text_config": {**RAW["text_config"], "rope_parameters": {
        **RAW["text_config"]["rope_parameters"], "mrope_section": [8, 12, 12]}}}
    assert Qwen35Config.from_dict(raw).mrope_section == (8, 12, 12)


@pytest.mark.parametrize("section", [[11, 11], [11, -1, 10], "11,11,10", [11.0, 11, 10]])
def test_bad_mrope_sections_are_named(section):
    raw = {**RAW, "text_config": {**RAW["text_config"], "rope_parameters": {
        **RAW["text_config"]["rope_parameters"], "mrope_section": section}}}
    with pytest.raises(ValueError, match=r"mrope_section=.*expected three non-negative integers"):
        Qwen35Config.from_dict(raw)


def test_processor_must_fit_the_tower(vl_ckpt):
    with pytest.raises(ValueError, match=r"image processor \(patch_size, temporal_patch_size, merge_size\)="
                                         r"\(14, 2, 2\) differs from the vision tower's \(16, 2, 2\)"):
        Qwen35Standalone(Qwen35Config.from_dir(vl_ckpt), image_processor=ImageProcessorConfig(patch_size=14))


def test_expand_image_placeholders():
    ids = expand_image_placeholders([1, IMG, 2, IMG, IMG, 3], [3, 1, 2], IMG)
    assert ids.tolist() == [1, IMG, IMG, IMG, 2, IMG, IMG, IMG, 3]
    assert expand_image_placeholders([1, 2], [], IMG).tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"holds 1 image placeholder\(s\) \(token id 1000\) for 2 image\(s\)"):
        expand_image_placeholders([1, IMG], [4, 4], IMG)


# ----------------------------------------------------------------------------- errors


def test_images_on_a_text_only_checkpoint_are_refused(tmp_path):
    m = Qwen35Standalone.from_pretrained(write_checkpoint(tmp_path / "t", TinySpec()), max_seqs=2, max_len=64)
    with pytest.raises(ValueError, match=r"Qwen3_5ForCausalLM checkpoint is text-only \(no vision tower\): images "
                                         r"need a \*ForConditionalGeneration checkpoint"):
        m.generate([_prompt(1, tail=2)], 4, images=[[IMAGES[0]]])
    assert len(m.free) == 2 and m.generate([[1, 2]], 2, images=[None])  # None or empty lists: text


def test_images_on_a_conditional_checkpoint_without_vision_config(tmp_path):
    spec = TinySpec(conditional=True)
    path = write_checkpoint(tmp_path / "ckpt", spec)
    raw = config_json(spec)
    del raw["vision_config"]
    with open(os.path.join(path, "config.json"), "w") as f:
        import json

        json.dump(raw, f)
    m = Qwen35Standalone.from_pretrained(path, max_seqs=1, max_len=64)  # the tower's tensors are skipped
    with pytest.raises(ValueError, match=r"has no vision tower \(its config.json has no vision_config\): it takes "
                                         r"text only"):
        m.generate([_prompt(1, tail=2)], 4, images=[[IMAGES[0]]])


PNG = _png(_noise(40, 30, 7))
BAD_IMAGES = {
    "corrupt PNG": (PNG[: len(PNG) // 2], r"corrupt PNG image"),
    "data: URL of text": ("data:text/plain;base64,aGVsbG8=", r"media type 'text/plain'; an image/\* type"),
    "not an image": (b"just text", r"not an image"),
    "unsupported format": (None, r"unsupported image format PPM"),
    "over the pixel limit": (_png(_noise(130, 130, 3)), r"130x130 = 16900 pixels exceeds the limit of 10000 pixels"),
    "http URL": ("http://example.com/a.png", r"only data: URLs are decoded here"),
    "a number": (7, r"cannot read an image from int"),
}


@pytest.mark.parametrize("source, match", list(BAD_IMAGES.values()), ids=list(BAD_IMAGES))
def test_bad_images_raise_image_input_errors(vl_ckpt, source, match):
    if source is None:
        buf = io.BytesIO()
        _noise(8, 8, 0).save(buf, "PPM")
        source = buf.getvalue()
    m = Qwen35Standalone.from_pretrained(vl_ckpt, max_seqs=2, max_len=64, image_processor=ImageProcessorConfig.from_dir(
        vl_ckpt, ImageLimits(max_pixels=10_000)))
    with pytest.raises(ImageInputError, match=match):
        m.generate([_prompt(1, tail=2), _prompt(1, tail=2)], 4, images=[[IMAGES[0]], [source]])
    assert len(m.free) == 2, "a refused request must not hold slots"
    assert m.generate([_prompt(1, tail=2)], 4, images=[[IMAGES[0]]]) == \
        m.generate([_prompt(1, tail=2)], 4, images=[[IMAGES[0]]])


def test_bad_image_requests_are_named(vl):
    prompt = _prompt(2, tail=2)
    with pytest.raises(ValueError, match=r"holds 2 image placeholder\(s\) \(token id 1000\) for 1 image\(s\)"):
        vl.generate([prompt], 4, images=[[IMAGES[0]]])
    with pytest.raises(ValueError, match=r"one list of images per prompt \(2 prompts\), got list of 1"):
        vl.generate([prompt, prompt], 4, images=[IMAGES[:2]])
    with pytest.raises(ValueError, match=r"images\[0\] must be a list of images \(or None\), got Image"):
        vl.generate([prompt], 4, images=[IMAGES[0]])
    assert len(vl.free) == 4
    slot = vl.allocate(1)
    ids = vl.attach_images(slot[0], prompt, IMAGES[:2])
    bad = ids.copy()
    bad[list(ids).index(IMG) + 1] = 5
    with pytest.raises(ValueError, match=r"slot 0: token 5 is 5; its image was attached there, so it must be the image "
                                         r"token 1000"):
        vl.step(slot, [bad])
    assert vl.lengths[slot[0]] == 0  # nothing ran
    vl.step(slot, [ids[:4]])
    with pytest.raises(ValueError, match=r"already holds 4 tokens; images go with a fresh prompt"):
        vl.attach_images(slot[0], prompt, IMAGES[:2])
    vl.release(slot)
    with pytest.raises(ValueError, match=r"slot 3 is not an allocated sequence"):
        vl.attach_images(3, prompt, IMAGES[:2])
