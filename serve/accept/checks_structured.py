"""Structured output, tool calling and reasoning checks.

Protocol checks here rely only on what the server enforces (grammar-constrained JSON, forced tool
calls) or on comparing the server with itself (stream vs non-stream); whether a model *chooses* to
call a tool or to think is a behaviour check (see checks_behaviour).
"""

from __future__ import annotations

import json

from serve.accept.jsoncheck import json_prefix_state, schema_errors
from serve.accept.suite import (
    PROTOCOL,
    Suite,
    assemble,
    check,
    choice,
    expect,
    expect_chat_completion,
    expect_token_count,
    fail,
    first_difference,
    logprob_entries,
    message,
    reasoning_of,
    skip,
    usage,
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_web",
        "description": "Search the web and return the top results.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["query"],
        },
    },
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]
TOOL_NAMES = {tool["function"]["name"] for tool in TOOLS}
WEATHER_QUESTION = "What is the weather in Paris right now?"
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
MARKUP = ("<tool_call>", "</tool_call>", "<function=", "<parameter=")


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


# -- response_format -----------------------------------------------------------------------------


def _judge_json(text: str, finish_reason: str | None, field: str) -> object:
    """The parsed document; a cut but valid prefix skips, anything else fails."""
    state = json_prefix_state(text)
    if state == "prefix" and finish_reason == "length":
        skip(f"cut by max_tokens before the document closed (the {len(text)} chars are a valid JSON prefix)")
    expect(state == "complete", field, f"not valid JSON ({state}, finish_reason {finish_reason!r}): {text!r:.120}")
    return json.loads(text)


@check("response_format_json_object", PROTOCOL, "response_format json_object: the reply is a JSON object")
def response_format_json_object(suite: Suite) -> None:
    prompt = "Describe a cat as a JSON object with a few fields."
    reply = suite.chat(suite.request(prompt, max_tokens=64, response_format={"type": "json_object"}))
    value = _judge_json(
        message(reply).get("content") or "", choice(reply).get("finish_reason"), "choices[0].message.content"
    )
    expect(isinstance(value, dict), "choices[0].message.content", f"JSON {type(value).__name__}, expected an object")


def _json_schema_request(suite: Suite) -> dict:
    return suite.request(
        "Invent a person and give their name, age and favourite colour.",
        max_tokens=96,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
    )


@check("response_format_json_schema", PROTOCOL, "response_format json_schema: the reply parses and validates")
def response_format_json_schema(suite: Suite) -> None:
    reply = suite.chat(_json_schema_request(suite))
    value = _judge_json(
        message(reply).get("content") or "", choice(reply).get("finish_reason"), "choices[0].message.content"
    )
    errors = schema_errors(value, PERSON_SCHEMA)
    expect(not errors, "choices[0].message.content", "; ".join(errors[:3]))


@check("response_format_json_schema_stream", PROTOCOL, "streamed json_schema reply equals the non-streamed one")
def response_format_json_schema_stream(suite: Suite) -> None:
    body = _json_schema_request(suite)
    expected = message(suite.chat(body)).get("content") or ""
    streamed = assemble(suite.stream(body))[0]
    expect(
        streamed.content == expected, "delta.content", "streamed JSON " + first_difference(streamed.content, expected)
    )
    value = _judge_json(streamed.content, (streamed.finish_reasons or [None])[0], "delta.content")
    errors = schema_errors(value, PERSON_SCHEMA)
    expect(not errors, "delta.content", "; ".join(errors[:3]))


@check("response_format_string_bounds", PROTOCOL, "json_schema with maxLength strings: strict JSON that validates")
def response_format_string_bounds(suite: Suite) -> None:
    schema = {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 1, "maxLength": 12}},
        "required": ["word"],
        "additionalProperties": False,
    }
    body = suite.request(
        "Give one word that describes the sea.",
        max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "word", "schema": schema, "strict": True}},
    )
    reply = suite.chat(body)
    text = message(reply).get("content") or ""
    value = _judge_json(text, choice(reply).get("finish_reason"), "choices[0].message.content")
    errors = schema_errors(value, schema)
    expect(not errors, "choices[0].message.content", "; ".join(errors[:3]))


# -- tools ---------------------------------------------------------------------------------------


def _tool_calls(reply: dict) -> list:
    calls = message(reply).get("tool_calls")
    return calls if isinstance(calls, list) else []


def _expect_well_formed_call(call: dict, where: str, names: set[str]) -> dict:
    """id, type, a known name, and arguments that are a JSON object encoded as a string."""
    expect(isinstance(call.get("id"), str) and call["id"], f"{where}.id", f"missing or empty: {call.get('id')!r}")
    expect(call.get("type") == "function", f"{where}.type", f"expected 'function', got {call.get('type')!r}")
    function = call.get("function") or {}
    expect(function.get("name") in names, f"{where}.function.name", f"{function.get('name')!r} not in {sorted(names)}")
    arguments = function.get("arguments")
    expect(isinstance(arguments, str), f"{where}.function.arguments", f"expected a JSON string, got {arguments!r:.80}")
    try:
        parsed = json.loads(arguments)
    except ValueError:
        fail(f"{where}.function.arguments", f"not valid JSON: {arguments!r:.120}")
    expect(isinstance(parsed, dict), f"{where}.function.arguments", f"JSON {type(parsed).__name__}, expected an object")
    return parsed


FORCED_TOKENS = 512
"""max_tokens of the forced and required tool-call checks: room for several complete calls."""


def _expect_forced_finish(reply: dict, limit: int) -> None:
    finish = choice(reply).get("finish_reason")
    expect(
        finish in ("tool_calls", "stop", "length"),
        "choices[0].finish_reason",
        f"got {finish!r} with a forced tool call",
    )
    if finish == "length":
        expect(usage(reply)["completion_tokens"] == limit, "choices[0].finish_reason", "'length' before max_tokens")


@check("tools_reach_prompt", PROTOCOL, "tool definitions reach the prompt (prompt_tokens grows)")
def tools_reach_prompt(suite: Suite) -> None:
    plain = suite.chat(suite.request(WEATHER_QUESTION, max_tokens=1))
    with_tools = suite.chat(suite.request(WEATHER_QUESTION, max_tokens=1, tools=TOOLS, tool_choice="none"))
    expect(
        usage(with_tools)["prompt_tokens"] > usage(plain)["prompt_tokens"],
        "usage.prompt_tokens",
        f"{usage(with_tools)['prompt_tokens']} with tools, {usage(plain)['prompt_tokens']} without",
    )


@check("tool_choice_none", PROTOCOL, "tool_choice none: no tool calls, a text reply")
def tool_choice_none(suite: Suite) -> None:
    reply = suite.chat(suite.request(WEATHER_QUESTION, tools=TOOLS, tool_choice="none"))
    expect_chat_completion(reply, suite.model)
    expect(not _tool_calls(reply), "choices[0].message.tool_calls", f"got {_tool_calls(reply)!r:.120}")
    expect(
        choice(reply).get("finish_reason") != "tool_calls",
        "choices[0].finish_reason",
        "'tool_calls' with tool_choice none",
    )


@check("tool_choice_auto", PROTOCOL, "tool_choice auto: either well-formed tool calls (finish tool_calls) or text")
def tool_choice_auto(suite: Suite) -> str:
    reply = suite.chat(suite.request(WEATHER_QUESTION, max_tokens=64, tools=TOOLS, tool_choice="auto"))
    expect_chat_completion(reply, suite.model)
    calls = _tool_calls(reply)
    for i, call in enumerate(calls):
        _expect_well_formed_call(call, f"choices[0].message.tool_calls[{i}]", TOOL_NAMES)
    if calls:
        expect(
            choice(reply).get("finish_reason") == "tool_calls",
            "choices[0].finish_reason",
            "tool calls need 'tool_calls'",
        )
        return f"{len(calls)} tool call(s)"
    return "text reply"


@check("tool_choice_required", PROTOCOL, "tool_choice required: at least one well-formed call to an offered tool")
def tool_choice_required(suite: Suite) -> str:
    reply = suite.chat(suite.request(WEATHER_QUESTION, max_tokens=FORCED_TOKENS, tools=TOOLS, tool_choice="required"))
    calls = _tool_calls(reply)
    expect(calls, "choices[0].message.tool_calls", "no tool call with tool_choice required")
    for i, call in enumerate(calls):
        _expect_well_formed_call(call, f"choices[0].message.tool_calls[{i}]", TOOL_NAMES)
    _expect_forced_finish(reply, FORCED_TOKENS)
    return ", ".join(call["function"]["name"] for call in calls)


@check("tool_choice_named", PROTOCOL, "tool_choice naming a function: calls exactly that function")
def tool_choice_named(suite: Suite) -> None:
    reply = suite.chat(
        suite.request(WEATHER_QUESTION, max_tokens=FORCED_TOKENS, tools=TOOLS, tool_choice=named("search_web"))
    )
    calls = _tool_calls(reply)
    expect(calls, "choices[0].message.tool_calls", "no tool call with a named tool_choice")
    for i, call in enumerate(calls):
        _expect_well_formed_call(call, f"choices[0].message.tool_calls[{i}]", {"search_web"})
    _expect_forced_finish(reply, FORCED_TOKENS)


@check("tool_strict_schema", PROTOCOL, "strict function + forced call: arguments validate against the parameters")
def tool_strict_schema(suite: Suite) -> None:
    strict = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
    strict["function"]["parameters"] = {**WEATHER_TOOL["function"]["parameters"], "additionalProperties": False}
    reply = suite.chat(suite.request(WEATHER_QUESTION, max_tokens=64, tools=[strict], tool_choice=named("get_weather")))
    calls = _tool_calls(reply)
    expect(calls, "choices[0].message.tool_calls", "no tool call with a named tool_choice")
    if choice(reply).get("finish_reason") == "length":
        skip("cut by max_tokens before the call was complete (a strict grammar still allows whitespace runs)")
    arguments = _expect_well_formed_call(calls[0], "choices[0].message.tool_calls[0]", {"get_weather"})
    errors = schema_errors(arguments, strict["function"]["parameters"])
    expect(not errors, "choices[0].message.tool_calls[0].function.arguments", "; ".join(errors[:3]))


def _streamed_tool_check(suite: Suite, tool_choice: object, names: set[str]) -> str:
    """The stream assembles to the non-streamed message: same tool calls, same (empty) text."""
    body = suite.request(WEATHER_QUESTION, max_tokens=FORCED_TOKENS, tools=TOOLS, tool_choice=tool_choice)
    expected = suite.chat(body)
    streamed = assemble(suite.stream(body))[0]
    expect(streamed.tool_calls, "delta.tool_calls", "no tool-call deltas were streamed")
    for index, call in sorted(streamed.tool_calls.items()):
        where = f"delta.tool_calls[{index}]"
        call_obj = {
            "id": call.get("id"),
            "type": call.get("type"),
            "function": {"name": call.get("name"), "arguments": call["arguments"]},
        }
        _expect_well_formed_call(call_obj, where, names)
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in _tool_calls(expected)]
    got = [(c.get("name"), json.loads(c["arguments"])) for _, c in sorted(streamed.tool_calls.items())]
    expect(got == want, "delta.tool_calls", f"stream assembled {got!r:.150}, non-stream has {want!r:.150}")
    leaked = [m for m in MARKUP if m in streamed.content]
    expect(not leaked, "delta.content", f"tool-call markup streamed as text: {streamed.content!r:.120}")
    text = message(expected).get("content") or ""
    expect(streamed.content == text, "delta.content", "streamed text " + first_difference(streamed.content, text))
    return ", ".join(str(name) for name, _ in got)


@check("tool_stream_required", PROTOCOL, "streamed forced tool call: deltas assemble into the same JSON arguments")
def tool_stream_required(suite: Suite) -> str:
    return _streamed_tool_check(suite, "required", TOOL_NAMES)


@check("tool_stream_named", PROTOCOL, "streamed named tool call: deltas assemble into the same JSON arguments")
def tool_stream_named(suite: Suite) -> str:
    return _streamed_tool_check(suite, named("get_weather"), {"get_weather"})


def tool_conversation(result: str) -> list[dict]:
    """user -> assistant tool call (content null) -> tool result."""
    return [
        {"role": "user", "content": WEATHER_QUESTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]


WEATHER_RESULT = '{"city": "Paris", "temperature_celsius": 21, "condition": "sunny"}'


@check("tool_multi_turn", PROTOCOL, "assistant tool_calls with content null + tool message: a normal reply")
def tool_multi_turn(suite: Suite) -> None:
    reply = suite.chat(suite.request(messages=tool_conversation(WEATHER_RESULT), tools=TOOLS))
    expect_chat_completion(reply, suite.model)


@check("tool_result_reaches_prompt", PROTOCOL, "the tool message's content reaches the prompt")
def tool_result_reaches_prompt(suite: Suite) -> None:
    short = suite.chat(suite.request(messages=tool_conversation("21"), max_tokens=1))
    long = suite.chat(suite.request(messages=tool_conversation(WEATHER_RESULT), max_tokens=1))
    expect(
        usage(long)["prompt_tokens"] > usage(short)["prompt_tokens"],
        "usage.prompt_tokens",
        f"{usage(long)['prompt_tokens']} with a long tool result, {usage(short)['prompt_tokens']} with a short one",
    )


# -- reasoning -----------------------------------------------------------------------------------


def _needs_switch(suite: Suite) -> None:
    if not suite.thinking_switch:
        skip("thinking switch disabled (--no-thinking-switch)")


@check("reasoning_off_absent", PROTOCOL, "enable_thinking false: no reasoning in the reply")
def reasoning_off_absent(suite: Suite) -> None:
    _needs_switch(suite)
    reply = suite.chat(suite.request(thinking=False))
    value = reasoning_of(message(reply))
    expect(not value, "choices[0].message.reasoning", f"present with thinking off: {value!r:.80}")


@check("reasoning_stream_matches", PROTOCOL, "thinking on: streamed reasoning and content equal the non-streamed ones")
def reasoning_stream_matches(suite: Suite) -> None:
    _needs_switch(suite)
    body = suite.request(thinking=True, max_tokens=24)
    reply = suite.chat(body)
    streamed = assemble(suite.stream(body))[0]
    want_reasoning = reasoning_of(message(reply)) or ""
    want_content = message(reply).get("content") or ""
    expect(
        streamed.reasoning == want_reasoning, "delta.reasoning", first_difference(streamed.reasoning, want_reasoning)
    )
    expect(streamed.content == want_content, "delta.content", first_difference(streamed.content, want_content))


@check("reasoning_tokens_counted", PROTOCOL, "thinking on: completion_tokens counts the reasoning tokens too")
def reasoning_tokens_counted(suite: Suite) -> None:
    _needs_switch(suite)
    reply = suite.chat(suite.request(thinking=True, max_tokens=24, logprobs=True))
    generated = len(logprob_entries(choice(reply), "choices[0]"))
    expect_token_count(
        usage(reply)["completion_tokens"], generated, choice(reply).get("finish_reason"), "usage.completion_tokens"
    )
