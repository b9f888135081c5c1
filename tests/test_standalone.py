"""Standalone host: batching, chunked prefill, slots, generation, layouts, bad requests (fp32, CPU)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from helpers import rel_err

from qwen35.standalone import Qwen35Standalone, sample
from qwen35.tiny import TinySpec, write_checkpoint

TOL = 1e-5


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("moe"), TinySpec(moe=True))


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dense"), TinySpec(moe=False))


def _alone(model: Qwen35Standalone, prompt: list[int], continuation: list[int]) -> list[torch.Tensor]:
    """Logits of one sequence run by itself: after the prompt, then after each continuation token."""
    slot = model.allocate(1)
    out = [model.step(slot, [prompt])[0]]
    out += [model.step(slot, [[t]])[0] for t in continuation]
    model.release(slot)
    return out


def test_batched_steps_match_single_sequences(moe_ckpt):
    """Mixed prefill/decode batches (decode rows reordered first) give each sequence its own logits."""
    m = Qwen35Standalone.from_pretrained(moe_ckpt, max_seqs=4, max_len=256)
    prompts = _prompts([5, 70, 1, 33])
    cont = _prompts([3, 3, 3, 3], seed=1)
    refs = [_alone(m, p, c) for p, c in zip(prompts, cont, strict=True)]
    slots = m.allocate(4)
    # sequences 0 and 2 start first, so later steps mix their decodes with the others' prefills
    first = m.step([slots[0], slots[2]], [prompts[0], prompts[2]])
    got = {0: [first[0]], 2: [first[1]]}
    mixed = m.step([slots[1], slots[0], slots[3], slots[2]], [prompts[1], [cont[0][0]], prompts[3], [cont[2][0]]])
    got[1], got[3] = [mixed[0]], [mixed[2]]
    got[0].append(mixed[1])
    got[2].append(mixed[3])
    for _ in range(3):
        rows = [i for i in range(4) if len(got[i]) < 4]
        toks = [[cont[i][len(got[i]) - 1]] for i in rows]
        for i, row in zip(rows, m.step([slots[i] for i in rows], toks), strict=True):
            got[i].append(row)
    for i in range(4):
        for j, (a, b) in enumerate(zip(got[i], refs[i], strict=True)):
            assert rel_err(a, b) <= TOL, f"sequence {i} logits {j}: rel err {rel_err(a, b):.3e}"


def test_chunked_prefill_matches_whole_prompt(dense_ckpt):
    """A prompt fed in pieces (conv history, GDN state and KV carried across) = the prompt in one go."""
    m = Qwen35Standalone.from_pretrained(dense_ckpt, max_seqs=2, max_len=256)
    (prompt,) = _prompts([150])
    whole = m.step(m.allocate(1), [prompt], all_logits=True)
    slot = m.allocate(1)
    pieces = [m.step(slot, [prompt[a:b]], all_logits=True) for a, b in ((0, 64), (64, 65), (65, 130), (130, 150))]
    err = rel_err(torch.cat(pieces), whole)
    assert err <= TOL, f"chunked prefill: rel err {err:.3e}"


def test_non_consecutive_decode_slots(dense_ckpt):
    """Decode rows whose slots are not consecutive take the gathered-KV path; same logits."""
    m = Qwen35Standalone.from_pretrained(dense_ckpt, max_seqs=3, max_len=64)
    prompts = _prompts([9, 4, 17])
    refs = [_alone(m, p, [7, 8]) for p in prompts]
    slots = m.allocate(3)
    m.step(slots, prompts)
    rows = [slots[2], slots[0]]  # reversed and with a gap
    for k, tok in enumerate([7, 8]):
        out = m.step(rows, [[tok], [tok]])
        assert rel_err(out[0], refs[2][k + 1]) <= TOL
        assert rel_err(out[1], refs[0][k + 1]) <= TOL


def test_generate_greedy_and_sampling(moe_ckpt):
    m = Qwen35Standalone.from_pretrained(moe_ckpt, max_seqs=4, max_len=128)
    prompts = _prompts([6, 40, 13])
    greedy = m.generate(prompts, 12)
    assert [len(g) for g in greedy] == [12, 12, 12]
    # greedy = the argmax chain of single-sequence steps
    for p, g in zip(prompts, greedy, strict=True):
        logits = _alone(m, p, g[:-1])
        assert [int(x.argmax()) for x in logits] == g
    assert m.generate(prompts, 12, temperature=0.7, top_k=1, seed=5) == greedy  # top-k 1 is greedy
    a = m.generate(prompts, 12, temperature=1.0, top_p=0.9, seed=11)
    b = m.generate(prompts, 12, temperature=1.0, top_p=0.9, seed=11)
    assert a == b, "sampling with a seed must be reproducible"
    assert a != greedy, "temperature-1 sampling should leave the greedy path somewhere in 36 tokens"
    assert len(m.free) == 4, "generate must release its slots"


def test_sample_top_p_keeps_the_nucleus():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]])
    gen = torch.Generator().manual_seed(0)
    drawn = {int(sample(logits, 1.0, 0, 0.5, gen)) for _ in range(50)}
    assert drawn == {0}, "top_p=0.5 with p(token 0) > 0.5 must always draw token 0"
    drawn = {int(sample(logits, 1.0, 2, 1.0, gen)) for _ in range(200)}
    assert drawn == {0, 1}, "top_k=2 draws only the two best tokens (both, over 200 draws)"


def test_stop_at_eos(dense_ckpt):
    m = Qwen35Standalone.from_pretrained(dense_ckpt, max_seqs=1, max_len=64)
    (prompt,) = _prompts([8])
    (greedy,) = m.generate([prompt], 6)
    m.cfg = dataclasses.replace(m.cfg, eos_token_id=(greedy[2],))
    (stopped,) = m.generate([prompt], 6, stop_at_eos=True)
    assert stopped == greedy[: greedy.index(greedy[2]) + 1]


def test_conditional_generation_layout_matches_causal_lm(tmp_path, caplog):
    """Same weights under model.language_model.* (with a vision tower beside, and an MTP tensor to skip) = the
    CausalLM layout."""
    causal = write_checkpoint(tmp_path / "causal", TinySpec(moe=True, seed=7))
    cond = write_checkpoint(tmp_path / "cond", TinySpec(moe=True, seed=7, conditional=True, per_expert=True))
    (prompt,) = _prompts([20])
    a = Qwen35Standalone.from_pretrained(causal, max_seqs=1, max_len=32)
    with caplog.at_level(logging.INFO, logger="qwen35.checkpoint"):
        b = Qwen35Standalone.from_pretrained(cond, max_seqs=1, max_len=32)
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "skipped 1 MTP tensors" in skipped[0].getMessage()
    assert a.visual is None and b.visual is not None  # the tower's tensors went to the tower
    la = a.step(a.allocate(1), [prompt], all_logits=True)
    lb = b.step(b.allocate(1), [prompt], all_logits=True)
    assert torch.equal(la, lb)


def test_gdn_projection_paths_agree(moe_ckpt, monkeypatch):
    """The GDN input projection by row blocks (long inputs) and as one product plus copies (few tokens)
    give the same logits, over a prefill and decode steps."""
    import qwen35.model

    (prompt,) = _prompts([40])
    runs = []
    for threshold in (1, 10**9):
        monkeypatch.setattr(qwen35.model, "ROW_BLOCK_PROJ_MIN_TOKENS", threshold)
        m = Qwen35Standalone.from_pretrained(moe_ckpt, max_seqs=1, max_len=64)
        runs.append(_alone(m, prompt, [3, 4]))
    for j, (a, b) in enumerate(zip(*runs, strict=True)):
        assert rel_err(a, b) <= TOL, f"logits {j}: rel err {rel_err(a, b):.3e}"


def test_padded_prefill_attention_matches_exact(dense_ckpt):
    """A fresh prompt's attention padded to the next PREFILL_BUCKET (room in the cache) = unpadded."""
    from qwen35.slots import PREFILL_BUCKET

    (prompt,) = _prompts([70])
    padded = Qwen35Standalone.from_pretrained(dense_ckpt, max_seqs=1, max_len=PREFILL_BUCKET)
    exact = Qwen35Standalone.from_pretrained(dense_ckpt, max_seqs=1, max_len=72)  # no room: not padded
    a = padded.step(padded.allocate(1), [prompt], all_logits=True)
    b = exact.step(exact.allocate(1), [prompt], all_logits=True)
    assert rel_err(a, b) <= TOL, f"padded prefill: rel err {rel_err(a, b):.3e}"


def test_bad_requests_raise_clear_errors(dense_ckpt):
    m = Qwen35Standalone.from_pretrained(dense_ckpt, max_seqs=2, max_len=16)
    with pytest.raises(ValueError, match="only 2 of 2 slots are free"):
        m.allocate(3)
    slots = m.allocate(1)
    with pytest.raises(ValueError, match="slot 1 is not an allocated sequence"):
        m.step([1], [[1, 2]])
    with pytest.raises(ValueError, match="would reach 17 tokens; max_len=16"):
        m.step(slots, [list(range(17))])
    with pytest.raises(ValueError, match="brings no tokens"):
        m.step(slots, [[]])
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        m.generate([[1]], 0)
    vocab = m.cfg.vocab_size
    with pytest.raises(ValueError, match=rf"token id {vocab} is outside the vocabulary \[0, {vocab}\)"):
        m.step(slots, [[1, vocab]])
    with pytest.raises(ValueError, match=r"token id -1 is outside"):
        m.step(slots, [np.array([3, -1])])
    with pytest.raises(ValueError, match="must be a 1-D integer array, got shape \\(2,\\) dtype float32"):
        m.step(slots, [np.array([1.0, 2.0], dtype=np.float32)])
    assert m.lengths[slots[0]] == 0  # nothing was run: the sequence is still empty
    assert torch.isfinite(m.step(slots, [[1, 2]])).all()


def test_token_arrays_match_token_lists(moe_ckpt):
    """numpy int32 / int64 arrays and CPU tensors give the same logits as lists of ints."""
    m = Qwen35Standalone.from_pretrained(moe_ckpt, max_seqs=4, max_len=64)
    prompts = _prompts([9, 1, 20], seed=4)
    want = m.step(m.allocate(3), prompts, all_logits=True)
    m.release([0, 1, 2])
    for kind in (lambda p: np.asarray(p, dtype=np.int32), np.asarray, lambda p: torch.tensor(p)):
        got = m.step(m.allocate(3), [kind(p) for p in prompts], all_logits=True)
        m.release([0, 1, 2])
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_decode_graph_matches_eager_steps(tmp_path):
    """A captured decode step replays the eager step's logits (CUDA; needs graph-safe backends)."""
    from qwen35 import probe

    path = write_checkpoint(tmp_path / "ckpt", TinySpec(moe=True))
    m = Qwen35Standalone.from_pretrained(path, device="cuda", max_seqs=4, max_len=96)
    on_reference = [r["op"] for r in probe.report("cuda")["ops"] if r["backend"] == "reference"]
    if on_reference:
        pytest.skip(f"the reference backend (host syncs, not capturable) serves {on_reference}")
    prompts = _prompts([5, 40, 17])
    cont = _prompts([4, 4, 4], seed=2)
    eager_slots = m.allocate(3)
    m.step(eager_slots, prompts)
    expected = [m.step(eager_slots, [[c[i]] for c in cont]) for i in range(4)]
    m.release(eager_slots)
    slots = m.allocate(3)
    m.step(slots, prompts)
    graph = m.capture_decode(slots)
    for i in range(4):
        got = graph.step([c[i] for c in cont])
        assert rel_err(got, expected[i]) <= TOL, f"graph step {i}: rel err {rel_err(got, expected[i]):.3e}"


def test_triton_gdn_prefill_takes_the_steps_chunk_table(moe_ckpt, fresh_probe, monkeypatch):
    """With the GDN ops on the Triton backend (interpreted on CPU) and every other op on the reference, the chunk
    table travels in the step's one copy and the logits of mixed prefill/decode steps match the reference
    backend's."""
    from qwen35 import ops

    prompts, cont = _prompts([70, 5]), _prompts([2, 2], seed=1)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs interpreted on CPU (conftest)
    tol = 1e-4 if dev == "cpu" else 1e-3  # the GDN kernels' fp32 dots run in tf32x3 on a GPU

    def run() -> list[torch.Tensor]:
        m = Qwen35Standalone.from_pretrained(moe_ckpt, device=dev, max_seqs=3, max_len=128)
        slots = m.allocate(2)
        out = [m.step(slots[:1], prompts[:1])]
        out.append(m.step(slots, [[cont[0][0]], prompts[1]]))  # a decode row and a prefill in one step
        out.append(m.step(slots, [[cont[0][1]], [cont[1][0]]]))
        return out

    monkeypatch.setenv("QWEN35_BACKEND", "reference")  # the expected side: every op on the reference
    fresh_probe.reset()
    assert ops.gdn_chunk_table([0, 70, 75], dev) is None  # the reference takes no table
    expected = run()
    monkeypatch.setenv("QWEN35_BACKEND_GDN_CHUNK_PREFILL", "triton")
    monkeypatch.setenv("QWEN35_BACKEND_GDN_RECURRENT_STEP", "triton")
    fresh_probe.reset()
    assert {op: fresh_probe.choose(op, dev).backend for op in ("gdn_chunk_prefill", "gdn_recurrent_step",
                                                              "moe_block")} == {
        "gdn_chunk_prefill": "triton", "gdn_recurrent_step": "triton", "moe_block": "reference"}
    table = ops.gdn_chunk_table([0, 70, 75], dev)
    assert table is not None and table.tolist() == [[0, 64], [64, 70], [70, 75]]
    for got, want in zip(run(), expected, strict=True):
        assert rel_err(got, want) <= tol, f"rel err {rel_err(got, want):.3e}"
