"""The tool-call grammar of `serve.toolcalls`, without a server: compiled by xgrammar for the embedded
tokenizer, walked by a random "model" (random logits under the grammar's token mask), and the text
it produces parsed by vLLM's own Qwen3 call parser and type coercion, then checked against the JSON
Schema. The real server's calls are checked in test_serve.py.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from serve import toolcalls

MAX_CALLS = 8

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = {
    "forecast": {"type": "object", "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["unit", "days"]},
    "search": {"type": "object", "properties": {
        "filter": {"type": "object", "properties": {
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
            "limit": {"type": "integer", "minimum": 0, "maximum": 100}},
            "required": ["tags", "limit"], "additionalProperties": False},
        "exact": {"type": "boolean"}}, "required": ["filter", "exact"], "additionalProperties": False,
        "$defs": {"tag": {"type": "string", "enum": ["news", "blog"]}}},
    "pick": {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1,
                "maxItems": 4},
        "note": {"type": ["string", "null"], "maxLength": 8},
        "city": {"type": "string", "minLength": 2, "maxLength": 10},
        "mode": {"const": "fast"}}, "required": ["ids", "city"]},
    "ping": {"type": "object", "properties": {}},
}  # fmt: skip


def _tool(name: str, strict: bool | None = None) -> SimpleNamespace:
    return SimpleNamespace(function=SimpleNamespace(name=name, parameters=SCHEMAS[name], strict=strict))


@pytest.fixture(scope="module")
def tokenizer_and_compiler():
    from transformers import AutoTokenizer

    from serve.embedded.checkpoint import DEFAULT_ARCHITECTURE, ensure_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(ensure_checkpoint(DEFAULT_ARCHITECTURE))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    return tokenizer, info, xgr.GrammarCompiler(info)


def _walk(compiled, info, tokenizer, generator: torch.Generator, budget: int = 1500) -> tuple[str, bool]:
    """Text sampled by random logits under the grammar's mask, and whether the grammar finished."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    ids: list[int] = []
    while not matcher.is_terminated() and len(ids) < budget:
        matcher.fill_next_token_bitmask(bitmask)
        logits = torch.randn(1, info.vocab_size, generator=generator)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        ids.append(token)
    text = tokenizer.decode([t for t in ids if t not in info.stop_token_ids])
    return text, matcher.is_terminated()


def _parsed_calls(text: str) -> list[tuple[str, dict]]:
    """The calls in `text` as vLLM's Qwen3 parser reads them (raw values, then schema coercion)."""
    from vllm.parser.engine.parser_engine import ParserEngine
    from vllm.parser.qwen3 import _qwen3_arg_converter

    calls = []
    for name, raw in re.findall(r"<tool_call>\n<function=([^>]+)>\n(.*?)</function>\n</tool_call>", text, re.S):
        arguments = json.loads(_qwen3_arg_converter(raw, False))
        ParserEngine._coerce_dict(arguments, SCHEMAS[name]["properties"])
        calls.append((name, arguments))
    return calls


@pytest.mark.parametrize("choice", ["forced", "required", "required-single"])
def test_random_walks_give_schema_valid_calls(tokenizer_and_compiler, choice):
    tokenizer, info, compiler = tokenizer_and_compiler
    generator = torch.Generator().manual_seed(7)
    valid = 0
    for name in SCHEMAS:
        tools = [_tool(name, strict=False)] if choice == "forced" else [_tool(n) for n in SCHEMAS]
        token = toolcalls.CALL_LIMIT.set(1 if choice == "required-single" else MAX_CALLS)
        try:
            tag = toolcalls.build(tools, [], "forced" if choice == "forced" else "required", False)
        finally:
            toolcalls.CALL_LIMIT.reset(token)
        compiled = compiler.compile_structural_tag(tag)
        for _ in range(6):
            text, finished = _walk(compiled, info, tokenizer, generator)
            assert finished, f"the grammar did not end within the budget: {text[-300:]!r}"
            calls = _parsed_calls(text)
            assert text.count("<tool_call>") == len(calls) >= 1, text
            if choice != "required":
                assert len(calls) == 1
            assert len(calls) <= MAX_CALLS
            for called, arguments in calls:
                if choice == "forced":
                    assert called == name
                jsonschema.validate(arguments, SCHEMAS[called])
                valid += 1
    assert valid >= 4 * 6


@pytest.mark.parametrize(
    "text,accepted",
    [
        ("<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n</parameter>\n", True),
        ("<parameter=unit>\nkelvin\n</parameter>\n<parameter=days>\n3\n</parameter>\n", False),
        ("<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n15\n</parameter>\n", False),
        ("<parameter=unit>\ncelsius\n</parameter>\n", False),  # a required parameter missing
        ("<parameter=unit> celsius\n</parameter>\n<parameter=days>\n3\n</parameter>\n", False),  # free whitespace
        ("<parameter=days>\n3\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n", False),  # schema order
        ("<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=x>\n1\n"
         "</parameter>\n", False),  # a key the schema does not have
    ],
)  # fmt: skip
def test_the_forced_grammar_accepts_only_the_template_form(tokenizer_and_compiler, text, accepted):
    _, info, compiler = tokenizer_and_compiler
    compiled = compiler.compile_structural_tag(toolcalls.build([_tool("forecast")], [], "forced", False))
    matcher = xgr.GrammarMatcher(compiled)
    whole = f"<tool_call>\n<function=forecast>\n{text}</function>\n</tool_call>"
    ok = matcher.accept_string(whole) and matcher.accept_token(info.stop_token_ids[0])
    assert ok is accepted


def test_required_calls_are_capped_and_auto_leaves_text_free(tokenizer_and_compiler):
    _, info, compiler = tokenizer_and_compiler
    call = "<tool_call>\n<function=ping>\n</function>\n</tool_call>"
    token = toolcalls.CALL_LIMIT.set(2)
    try:
        compiled = compiler.compile_structural_tag(toolcalls.build([_tool("ping")], [], "required", False))
    finally:
        toolcalls.CALL_LIMIT.reset(token)
    two = xgr.GrammarMatcher(compiled)
    assert two.accept_string(f"{call}\n{call}") and two.accept_token(info.stop_token_ids[0])
    assert not xgr.GrammarMatcher(compiled).accept_string(f"{call}\n{call}\n{call}")
    assert not xgr.GrammarMatcher(compiled).accept_string("Sure: " + call), "required: nothing but calls"
    auto = xgr.GrammarMatcher(compiler.compile_structural_tag(toolcalls.build([_tool("forecast")], [], "auto", False)))
    assert auto.accept_string("Some text, then a call: <tool_call>\n<function=forecast>\n<parameter=unit>\n")
    assert not auto.accept_string("kelvin"), "a started call follows the schema"


def test_install_registers_the_builder_for_the_qwen3_call_format():
    pytest.importorskip("vllm")
    from vllm.tool_parsers import structural_tag_registry as registry

    assert toolcalls.install()
    assert registry._VLLM_STRUCTURAL_TAG_REGISTRY[toolcalls.FORMAT_NAME] is toolcalls.build
