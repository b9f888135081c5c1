"""Embedded tokenizer, chat template and tiny checkpoint (no server: these run in seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from serve.embedded import checkpoint as ckpt
from serve.embedded.tokenizer import CONTROL_TOKENS, MARKUP_TOKENS, train_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    # Qwen3 (plain transformers math on CPU); the Qwen3.5 default has its own test below and HF
    # equivalence in test_model_hf.py (its transformers class reaches for FLA's Triton kernels).
    return ckpt.ensure_checkpoint("Qwen3ForCausalLM", cache_root=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint_dir):
    return transformers.AutoTokenizer.from_pretrained(checkpoint_dir)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


# -- tokenizer -----------------------------------------------------------------------------------


def test_training_is_deterministic_across_processes():
    script = "from serve.embedded.tokenizer import train_tokenizer; print(train_tokenizer().to_str())"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }  # fmt: skip
    assert len(outputs) == 1
    assert outputs.pop().strip() == train_tokenizer().to_str()


def test_added_tokens_are_atomic_and_ordered_after_the_merges():
    tokenizer = train_tokenizer()
    added = tokenizer.get_added_tokens_decoder()
    ids = [tokenizer.token_to_id(t) for t in CONTROL_TOKENS + MARKUP_TOKENS]
    assert ids == list(range(min(ids), min(ids) + len(ids)))
    assert min(ids) == tokenizer.get_vocab_size() - len(ids)
    for token in CONTROL_TOKENS + MARKUP_TOKENS:
        assert tokenizer.encode(f"x{token}y").tokens[1] == token
    assert all(added[tokenizer.token_to_id(t)].special for t in CONTROL_TOKENS)
    assert not any(added[tokenizer.token_to_id(t)].special for t in MARKUP_TOKENS)


def test_decoding_drops_control_tokens_but_keeps_markup():
    tokenizer = train_tokenizer()
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nhm</think>\n\n<tool_call><|im_end|>").ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm</think>\n\n<tool_call>"


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "def f(x):\n    return x * 2\n", "日本語 🙂 Ελληνικά ±×÷", "  spaces\t\ttabs\r\n", "1234567890"],
)
def test_round_trip_is_lossless(text):
    tokenizer = train_tokenizer()
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_digits_are_split():
    tokenizer = train_tokenizer()
    assert tokenizer.encode("2048").tokens == ["2", "0", "4", "8"]


# -- chat template -------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_transformers_sees_every_control_token_as_special(hf_tokenizer):
    assert set(hf_tokenizer.all_special_tokens) == set(CONTROL_TOKENS)
    assert not set(MARKUP_TOKENS) & set(hf_tokenizer.all_special_tokens)


def test_plain_chat_and_thinking_switch(hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    base = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render(hf_tokenizer, messages) == base + "<think>\n"
    assert render(hf_tokenizer, messages, enable_thinking=True) == base + "<think>\n"
    assert render(hf_tokenizer, messages, enable_thinking=False) == base + "<think>\n\n</think>\n\n"


def test_content_parts_render_like_a_string(hf_tokenizer):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    as_parts = render(hf_tokenizer, [{"role": "user", "content": parts}])
    assert as_parts == render(hf_tokenizer, [{"role": "user", "content": "Hello there"}])


def test_tools_are_listed_in_the_system_turn(hf_tokenizer):
    text = render(hf_tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                  tools=[WEATHER])  # fmt: skip
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in system
    assert "<tool_call>\n<function=FUNCTION_NAME>\n<parameter=PARAMETER_NAME>\nVALUE\n</parameter>" in system
    assert text.count("<|im_start|>system") == 1


def test_tool_calls_use_the_qwen3_coder_xml_form_and_results_are_grouped(hf_tokenizer):
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"days": 2}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "21 C"},
        {"role": "tool", "tool_call_id": "b", "content": "18 C"},
    ]
    text = render(hf_tokenizer, messages, tools=[WEATHER])
    expected = (
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\n18 C\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert text.endswith(expected)


def test_reasoning_is_kept_only_after_the_last_user_turn(hf_tokenizer):
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nold thought\n</think>\n\nA"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "B", "reasoning_content": "new thought"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert "old thought" not in text
    assert "<|im_start|>assistant\nA<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nnew thought\n</think>\n\nB<|im_end|>\n")


def test_unknown_role_is_an_error(hf_tokenizer):
    with pytest.raises(Exception, match="unknown role: wizard"):
        render(hf_tokenizer, [{"role": "wizard", "content": "x"}])


# -- checkpoint ----------------------------------------------------------------------------------


def test_checkpoint_is_cached_by_content(tmp_path):
    first = ckpt.ensure_checkpoint(cache_root=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ckpt.ensure_checkpoint(cache_root=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    other_seed = ckpt.ensure_checkpoint(cache_root=tmp_path, seed=1)
    assert other_seed != first
    assert sorted(p.name for p in first.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging directory left behind"


def test_checkpoint_loads_and_runs_in_transformers(checkpoint_dir, hf_tokenizer):
    torch = pytest.importorskip("torch")
    config = json.loads((checkpoint_dir / "config.json").read_text())
    assert config["vocab_size"] >= len(hf_tokenizer) and config["vocab_size"] % 64 == 0
    assert config["head_dim"] == 64
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir)
    ids = hf_tokenizer("Hello there", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"])
    assert torch.isfinite(logits).all()
    generation = json.loads((checkpoint_dir / "generation_config.json").read_text())
    assert hf_tokenizer.convert_tokens_to_ids("<|im_end|>") in generation["eos_token_id"]
    assert set(generation) == {"bos_token_id", "eos_token_id", "pad_token_id"}


def test_architecture_writers_are_pluggable(tmp_path):
    import torch

    def config(vocab_size, max_position, special_ids):
        return {"model_type": "toy", "vocab_size": vocab_size, "hidden_size": 4}

    def weights(config, seed):
        return {"toy.weight": torch.full((config["vocab_size"], 4), float(seed))}

    ckpt.register_architecture(ckpt.ArchitectureWriter("ToyForCausalLM", "1", config, weights))
    path = ckpt.ensure_checkpoint("ToyForCausalLM", cache_root=tmp_path, seed=3)
    assert path.name.startswith("ToyForCausalLM-")
    assert json.loads((path / "config.json").read_text())["architectures"] == ["ToyForCausalLM"]
    with pytest.raises(ValueError, match="unknown architecture"):
        ckpt.get_writer("NoSuchForCausalLM")
    with pytest.raises(ValueError, match="not an ArchitectureWriter"):
        ckpt.get_writer("serve.embedded.checkpoint:DEFAULT_ARCHITECTURE")
    assert ckpt.get_writer(f"{__name__}:TOY_WRITER").architecture == "ImportedToy"


TOY_WRITER = ckpt.ArchitectureWriter("ImportedToy", "1", lambda v, m, s: {}, lambda c, s: {})


def test_qwen35_writer_uses_the_embedded_vocabulary(tmp_path):
    pytest.importorskip("qwen35.tiny")
    from safetensors import safe_open

    path = ckpt.ensure_checkpoint("Qwen3_5ForCausalLM", cache_root=tmp_path)
    config = json.loads((path / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "linear_attention" in config["layer_types"] and "full_attention" in config["layer_types"]
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        assert weights.get_slice("model.embed_tokens.weight").get_shape()[0] == config["vocab_size"]
        assert weights.get_slice("lm_head.weight").get_shape()[0] == config["vocab_size"]
