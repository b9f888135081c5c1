"""Behaviour checks: they need a capable model. A tiny random test model fails them, which says
nothing about the server; they never decide the exit code."""

from __future__ import annotations

import json

from serve.accept.checks_structured import TOOLS, WEATHER_QUESTION, WEATHER_RESULT, tool_conversation
from serve.accept.suite import BEHAVIOUR, Suite, check, choice, expect, message, reasoning_of, skip


def _answer(suite: Suite, messages: list[dict], max_tokens: int = 64, **fields) -> str:
    reply = suite.chat(suite.request(messages=messages, max_tokens=max_tokens, **fields))
    return message(reply).get("content") or ""


@check("b_arithmetic", BEHAVIOUR, "answers 17 + 25 with 42")
def b_arithmetic(suite: Suite) -> None:
    text = _answer(suite, [{"role": "user", "content": "What is 17 + 25? Answer with the number only."}])
    expect("42" in text, "choices[0].message.content", f"no 42 in {text!r:.80}")


@check("b_follows_system_prompt", BEHAVIOUR, "follows a system prompt that dictates the answer")
def b_follows_system_prompt(suite: Suite) -> None:
    messages = [
        {"role": "system", "content": "Whatever the user says, reply with exactly the single word BANANA."},
        {"role": "user", "content": "What colour is the sky?"},
    ]
    text = _answer(suite, messages)
    expect("banana" in text.lower(), "choices[0].message.content", f"no BANANA in {text!r:.80}")


@check("b_multi_turn_memory", BEHAVIOUR, "remembers a name from an earlier turn")
def b_multi_turn_memory(suite: Suite) -> None:
    messages = [
        {"role": "user", "content": "Hello, my name is Zephyrine."},
        {"role": "assistant", "content": "Nice to meet you, Zephyrine!"},
        {"role": "user", "content": "What is my name? Answer with the name only."},
    ]
    text = _answer(suite, messages)
    expect("zephyrine" in text.lower(), "choices[0].message.content", f"no Zephyrine in {text!r:.80}")


@check("b_stops_naturally", BEHAVIOUR, "a short request ends by stop well before 128 tokens")
def b_stops_naturally(suite: Suite) -> None:
    reply = suite.chat(suite.request("Say hello.", max_tokens=128))
    finish = choice(reply).get("finish_reason")
    expect(finish == "stop", "choices[0].finish_reason", f"{finish!r} after a one-line request")


@check("b_tool_auto_call", BEHAVIOUR, "tool_choice auto: calls get_weather for a weather question")
def b_tool_auto_call(suite: Suite) -> None:
    reply = suite.chat(suite.request(WEATHER_QUESTION, max_tokens=128, tools=TOOLS, tool_choice="auto"))
    calls = message(reply).get("tool_calls") or []
    expect(calls, "choices[0].message.tool_calls", f"no tool call; replied {message(reply).get('content')!r:.80}")
    function = calls[0].get("function") or {}
    expect(
        function.get("name") == "get_weather",
        "choices[0].message.tool_calls[0].function.name",
        f"got {function.get('name')!r}",
    )
    try:
        arguments = json.loads(function.get("arguments") or "")
    except ValueError:
        arguments = {}
    expect(
        "paris" in str(arguments.get("city", "")).lower(),
        "choices[0].message.tool_calls[0].function.arguments",
        f"city is not Paris: {function.get('arguments')!r:.80}",
    )


@check("b_tool_result_used", BEHAVIOUR, "answers from the tool result (21 degrees)")
def b_tool_result_used(suite: Suite) -> None:
    text = _answer(suite, tool_conversation(WEATHER_RESULT), max_tokens=96, tools=TOOLS)
    expect("21" in text, "choices[0].message.content", f"no 21 in {text!r:.80}")


@check("b_json_schema_extracts", BEHAVIOUR, "json_schema: extracts the right values from the prompt")
def b_json_schema_extracts(suite: Suite) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    text = _answer(
        suite,
        [{"role": "user", "content": "Extract the person: Alice is 30 years old."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    expect(value == {"name": "Alice", "age": 30}, "choices[0].message.content", f"got {text!r:.80}")


@check("b_reasoning_present", BEHAVIOUR, "enable_thinking true: the reply carries reasoning")
def b_reasoning_present(suite: Suite) -> None:
    if not suite.thinking_switch:
        skip("thinking switch disabled (--no-thinking-switch)")
    reply = suite.chat(suite.request("Is 91 a prime number?", thinking=True, max_tokens=64))
    value = reasoning_of(message(reply))
    expect(value, "choices[0].message.reasoning", "no reasoning with thinking on")
