"""The GPU comparison's CPU-side pieces: agreement arithmetic, the padded tokenizer, the request sets, the table.

(The comparison itself needs vLLM 0.26 on a GPU: tests/gpu/test_gpu_vllm.py and tuning/gpu_vllm.py.)
"""

from __future__ import annotations

import json
import math

import pytest

from tuning import vllm_serving as vs
from tuning.gpu_vllm import table


def _greedy(tokens: list[int], tops: list[dict[int, float]]) -> dict:
    return {"tokens": tokens, "top": tops}


def test_greedy_agreement_counts_matches_prefix_and_divergence_gaps():
    same = _greedy([1, 2, 3, 4], [{1: -0.1, 9: -3.0}, {2: -0.2, 9: -2.0}, {3: -0.1, 9: -4.0}, {4: -0.5, 9: -1.0}])
    # b parts from a at step 2 on a near-tie (3 vs 7: 0.05 apart for a, 0.04 for b), then matches again at step 3
    a = _greedy([5, 6, 3, 8], [{5: -1, 0: -2}, {6: -1, 0: -2}, {3: -0.70, 7: -0.75}, {8: -1, 0: -2}])
    b = _greedy([5, 6, 7, 8], [{5: -1, 0: -2}, {6: -1, 0: -2}, {7: -0.70, 3: -0.74}, {8: -1, 0: -2}])
    g = vs.greedy_agreement([same, a], [same, b], near_tie=0.15)
    assert g["token_match_rate"] == pytest.approx(7 / 8)
    assert g["prefix_match_rate"] == pytest.approx((4 + 2) / 8)
    assert g["divergences"] == 1 and g["clear_divergences"] == 0
    assert g["max_divergence_gap"] == pytest.approx(0.05)
    # a clear divergence: b's token is far below a's choice as a saw it
    b_clear = _greedy([5, 6, 7, 8], [{5: -1, 0: -2}, {6: -1, 0: -2}, {7: -0.1, 3: -2.0}, {8: -1, 0: -2}])
    g = vs.greedy_agreement([a], [b_clear], near_tie=0.15)
    assert g["clear_divergences"] == 1 and g["max_divergence_gap"] == pytest.approx(1.9)
    # the other engine's token not among this engine's two likeliest: an infinite gap, a clear divergence
    b_far = _greedy([5, 6, 7, 8], [{5: -1, 0: -2}, {6: -1, 0: -2}, {7: -0.1, 11: -2.0}, {8: -1, 0: -2}])
    g = vs.greedy_agreement([a], [b_far])
    assert g["clear_divergences"] == 1 and math.isinf(g["max_divergence_gap"])


def test_logprob_diff_and_top1_agreement():
    d = vs.logprob_diff([[-1.0, -2.0], [-3.0]], [[-1.1, -2.0], [-2.5]], "t")
    assert d["positions"] == 3
    assert d["mean_abs"] == pytest.approx(0.2) and d["max_abs"] == pytest.approx(0.5)
    agree = vs.top1_agreement([{"top1": [1, 2]}, {"top1": [3]}], [{"top1": [1, 5]}, {"top1": [3]}])
    assert agree == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="t: 3 vs 2 positions"):
        vs.logprob_diff([[-1.0, -2.0], [-3.0]], [[-1.0], [-3.0]], "t")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="non-finite"):
            vs.logprob_diff([[-1.0, bad]], [[-1.0, -2.0]], "t")


def test_engine_env_switches_the_plugin_and_rejects_unknown_engines():
    assert vs.engine_env("ours")["VLLM_PLUGINS"] == "qwen35"
    assert vs.engine_env("native")["VLLM_PLUGINS"] == ""
    assert vs.engine_env("native")["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    with pytest.raises(ValueError, match="engine='vllm'; accepted: ours, native"):
        vs.engine_env("vllm")


def test_replay_metrics_in_ms_and_score():
    dist = {"p50": 0.010, "p99": 0.030}
    summary = {"tps": {"output": 100.0, "input": 1000.0, "cache": 10.0}, "score": 0.83 * 100 + 0.14 * 1000 + 0.03 * 10,
               "failed": 0, "seconds": 2.0, "latency_seconds": {"ttft": dist, "itl": dist, "tpot": {"p50": None}}}
    m = vs.replay_metrics(summary)
    assert m["score"] == pytest.approx(223.3) and m["itl_p99_ms"] == pytest.approx(30.0)
    assert math.isnan(m["tpot_p99_ms"])


def test_padded_tokenizer_decodes_every_id_and_keeps_control_ids():
    from serve.embedded.tokenizer import CONTROL_TOKENS, MARKUP_TOKENS, train_tokenizer
    from tuning.vllm_ckpt import padded_tokenizer

    base = train_tokenizer()
    tok = padded_tokenizer(4096)
    assert tok.get_vocab_size(with_added_tokens=True) == 4096
    for t in CONTROL_TOKENS + MARKUP_TOKENS:
        assert tok.token_to_id(t) == base.token_to_id(t), t
    assert all(tok.id_to_token(i) is not None for i in range(4096))
    text = "<|im_start|>user\nhow are the tools today<|im_end|>"
    assert tok.encode(text).ids == base.encode(text).ids  # filler tokens are never produced
    with pytest.raises(ValueError, match="vocab_size=100 is smaller than the tokenizer's 820 ids"):
        padded_tokenizer(100)


def test_request_sets_have_the_asked_lengths(tmp_path):
    from tokenizers import Tokenizer

    from tuning.gpu_vllm import request_sets
    from tuning.vllm_ckpt import padded_tokenizer

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    padded_tokenizer(4096).save(str(ckpt / "tokenizer.json"))
    sets = request_sets(ckpt, tmp_path, quick=True)
    assert set(sets) == {"prefill", "decode", "decode_c1", "mixed"}
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    prefill = [json.loads(line) for line in sets["prefill"][0].read_text().splitlines()]
    lengths = [len(tok.encode(b["messages"][0]["content"]).ids) for b in prefill]
    assert min(lengths) >= 2048 - 2 and max(lengths) <= 16384 + 2, lengths
    assert {b["max_tokens"] for b in prefill} == {64}
    decode = [json.loads(line) for line in sets["decode"][0].read_text().splitlines()]
    assert all(abs(len(tok.encode(b["messages"][0]["content"]).ids) - 256) <= 2 for b in decode)
    assert sets["decode"][1] == 64 and sets["decode_c1"][1] == 1
    (tmp_path / "again").mkdir()
    again = request_sets(ckpt, tmp_path / "again", quick=True)
    assert again["prefill"][0].read_text() == sets["prefill"][0].read_text()  # fixed seeds: the same set


def test_table_puts_engines_side_by_side():
    rows = [{"device": "d", "engine": "ours", "mix": "decode", "metric": "score", "value": 120.0},
            {"device": "d", "engine": "native", "mix": "decode", "metric": "score", "value": 100.0},
            {"device": "d", "engine": "ours", "mix": "agree", "metric": "tf_top1_agreement", "value": 0.99}]
    lines = table(rows).splitlines()
    assert lines[1].split()[:4] == ["decode", "score", "120", "100"] and lines[1].split()[-1] == "1.200"
    assert lines[2].split()[:3] == ["agree", "tf_top1_agreement", "0.99"]
