"""`qwen35-serve` against the real server (the middleware alone is tested in test_serve_middleware.py).

The tests start `qwen35-serve serve/configs/embedded-cpu.yaml` once for the module as a subprocess
(the embedded tiny Qwen3.5 checkpoint through our vLLM plugin), with an API key read from a file,
`max_n` 4, the thinking-off-with-tools policy on, a 1 MB request limit, and vLLM's development
routes switched on (so the admin routes they add are there to be refused), and check: the route
matrix (every route of the running app is open, key-guarded with our checks, or switched off);
the API answers (chat stream and not, completions, models); thinking is off by default and the
thinking switches change the rendered prompt; tool definitions reach the template; forced and
`required` tool calls are valid against their schemas; a matrix of bad requests each gets a 4xx
with an OpenAI error object and leaves the server healthy; n=2 and other sampling edge cases
never hurt the engine; 100 concurrent requests; and the conformance suite (`serve.accept`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest
from servers import API_KEY, QWEN35_SERVED_NAME, start_qwen35_serve, vllm_available

from serve import routes


def assert_openai_error(reply: httpx.Response, status: int, pattern: str = "") -> str:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert isinstance(error["message"], str) and error["message"], reply.text
    assert error["code"] == status and isinstance(error["type"], str)
    assert re.search(pattern, error["message"]), error["message"]
    return error["message"]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]  # fmt: skip


# -- the real server -----------------------------------------------------------------------------

CONFIG = Path(__file__).resolve().parents[1] / "serve" / "configs" / "embedded-cpu.yaml"
MAX_N = 4
MAX_REQUEST_BYTES = 1_000_000
STARTUP_BUDGET_S = 60.0
# Protocol checks qwen35-serve may fail, with the reason.
KNOWN_DEVIATIONS = {
    "completions_logprobs": "the legacy completions format keys top_logprobs by token text, and vLLM names a "
    "byte-fragment token (an incomplete UTF-8 sequence) '': the random model's two likeliest tokens at one step "
    "are two such fragments, so the dict holds one entry (with return_tokens_as_token_ids it holds both)",
}

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")


@pytest.fixture(scope="module")
def server():
    started = time.monotonic()
    proc = start_qwen35_serve(str(CONFIG), "--max-n", str(MAX_N), "--thinking-off-with-tools",
                              "--max-request-bytes", str(MAX_REQUEST_BYTES),
                              env={"VLLM_SERVER_DEV_MODE": "1"})  # fmt: skip
    proc.startup_s = time.monotonic() - started
    print(f"\nqwen35-serve start-up: {proc.startup_s:.1f} s")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def healthy(server) -> bool:
    return httpx.get(server.root + "/health", timeout=30).status_code == 200


def prompt_text(client, **fields) -> str:
    body = {"model": QWEN35_SERVED_NAME, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "max_tokens": 1, "return_prompt_text": True, **fields}  # fmt: skip
    reply = client.post("chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["prompt_text"]


OPEN_THINK, CLOSED_THINK = "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@needs_vllm
@pytest.mark.slow
def test_startup_budget_and_probe_report_logged_once(server):
    assert server.startup_s <= STARTUP_BUDGET_S, f"start-up took {server.startup_s:.1f} s"
    log = server.log_path.read_text(errors="replace")
    assert log.count("qwen35 backends on") == 1, "the kernel probe report is logged exactly once"
    assert "qwen35-serve: " in log and API_KEY not in log, "the API key is never logged"
    assert "WARNING: the API key given with --api-key" not in log, "a key file raises no warning"


@needs_vllm
@pytest.mark.slow
def test_models_chat_stream_and_completions(server, client):
    models = client.get("models").json()["data"]
    assert [m["id"] for m in models] == [QWEN35_SERVED_NAME] and models[0]["max_model_len"] == 4096
    body = {"model": QWEN35_SERVED_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
            "thinking": {"type": "disabled"}}  # fmt: skip
    reply = client.post("chat/completions", json=body).json()
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 8
    assert isinstance(reply["choices"][0]["message"]["content"], str)
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "chat/completions", json=streamed) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    completion = client.post("completions", json={"model": QWEN35_SERVED_NAME, "prompt": "Once", "max_tokens": 5})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 5


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    "fields,ending",
    [
        ({}, CLOSED_THINK),  # the embedded model serves with thinking off by default
        ({"chat_template_kwargs": {"enable_thinking": True}}, OPEN_THINK),
        ({"enable_thinking": True}, OPEN_THINK),
        ({"thinking": {"type": "disabled"}}, CLOSED_THINK),
        ({"enable_thinking": False}, CLOSED_THINK),
        ({"chat_template_kwargs": {"enable_thinking": False}}, CLOSED_THINK),
        ({"thinking": {"type": "enabled"}}, OPEN_THINK),
        # the server runs with thinking_off_with_tools: tools + auto turn it off unless asked
        ({"tools": TOOLS}, CLOSED_THINK),
        ({"tools": TOOLS, "tool_choice": "auto", "enable_thinking": True}, OPEN_THINK),
        ({"tools": TOOLS, "tool_choice": "required"}, CLOSED_THINK),
        ({"tools": TOOLS, "tool_choice": "required", "thinking": {"type": "enabled"}}, OPEN_THINK),
    ],
)
def test_thinking_switch_changes_the_rendered_prompt(server, client, fields, ending):
    assert prompt_text(client, **fields).endswith(ending)


@needs_vllm
@pytest.mark.slow
def test_thinking_switch_on_tokenize(server, client):
    body = {"model": QWEN35_SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}
    tokenize = server.root + "/tokenize"
    on = client.post(tokenize, json={**body, "thinking": {"type": "enabled"}}).json()
    off = client.post(tokenize, json={**body, "thinking": {"type": "disabled"}}).json()
    default = client.post(tokenize, json=body).json()
    assert on["token_strs"][-2:] == ["<think>", "Ċ"]
    assert off["token_strs"][-6:] == ["<think>", "Ċ", "Ċ", "</think>", "Ċ", "Ċ"] and off["count"] == on["count"] + 4
    assert default["token_strs"] == off["token_strs"], "thinking is off unless asked for"


@needs_vllm
@pytest.mark.slow
def test_tools_and_tool_history_reach_the_template(server, client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    text = prompt_text(client, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ])  # fmt: skip
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and "<tools>\n" in system
    assert json.dumps(TOOLS[0], ensure_ascii=False) in system, "each tool is one JSON line in the system turn"
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>" \
        in text, "the call in qwen3_coder XML form"
    assert "<|im_start|>user\n<tool_response>\n21 C, sunny\n</tool_response><|im_end|>" in text


# -- the route matrix ----------------------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]
# A body each of these routes answers 200 to (with the key).
WORKING_BODIES = {
    "/v1/chat/completions": {"model": QWEN35_SERVED_NAME, "messages": USER, "max_tokens": 2},
    "/v1/completions": {"model": QWEN35_SERVED_NAME, "prompt": "Once", "max_tokens": 2},
    "/invocations": {"model": QWEN35_SERVED_NAME, "messages": USER, "max_tokens": 2},
    "/v1/chat/completions/batch": {"model": QWEN35_SERVED_NAME, "messages": [USER, USER], "max_tokens": 2},
    "/v1/responses": {"model": QWEN35_SERVED_NAME, "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": QWEN35_SERVED_NAME, "messages": USER, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": QWEN35_SERVED_NAME, "messages": USER},
    "/generative_scoring": {"model": QWEN35_SERVED_NAME, "query": "q", "items": ["a", "b"], "label_token_ids": [1, 2]},
    "/tokenize": {"model": QWEN35_SERVED_NAME, "prompt": "hi"},
    "/detokenize": {"model": QWEN35_SERVED_NAME, "tokens": [100, 200]},
}  # fmt: skip


def route_table(server) -> dict[str, list[str]]:
    """The route table the running server logged at start-up (read from its app's routes)."""
    line = next(line for line in server.log_path.read_text(errors="replace").splitlines() if routes.TABLE_LOG in line)
    table = json.loads(line.split(routes.TABLE_LOG, 1)[1])
    return {k: v for k, v in table.items() if isinstance(v, list)}


@needs_vllm
@pytest.mark.slow
def test_route_matrix(server):
    """Every route of the running app is open, key-guarded (with our checks where it runs the model),
    or switched off; a route that a vLLM upgrade adds fails here until serve/routes.py classifies it."""
    table = route_table(server)
    assert not table.get(routes.UNCLASSIFIED), f"classify these routes in serve/routes.py: {table['unclassified']}"
    assert sum(len(v) for v in table.values()) >= 50, "vLLM's dev routes are on: the table has them all"
    assert {"POST /scale_elastic_ep", "POST /collective_rpc", "POST /sleep"} <= set(table[routes.ADMIN])
    assert {"POST /invocations", "POST /generative_scoring"} <= set(table[routes.ENGINE])
    key = {"Authorization": f"Bearer {API_KEY}"}
    seen = []
    with httpx.Client(base_url=server.root, timeout=120) as http:
        for kind, entries in table.items():
            for entry in entries:
                methods, path = entry.split(" ", 1)
                if methods == "*":
                    continue  # a mount: the route of the same path is checked
                method = "POST" if "POST" in methods.split(",") else methods.split(",")[0]
                url = re.sub(r"\{[^}]+\}", "resp_missing", path)
                body = WORKING_BODIES.get(path, {}) if method == "POST" else None
                anonymous = http.request(method, url, json=body)
                keyed = http.request(method, url, json=body, headers=key)
                seen.append(path)
                where = f"{kind} route {entry}: {anonymous.status_code} / {keyed.status_code} {keyed.text[:200]}"
                if kind in (routes.OPEN, routes.METRICS):
                    assert anonymous.status_code == 200 and keyed.status_code == 200, where
                elif kind in (routes.ADMIN, routes.OFF):
                    assert anonymous.status_code == keyed.status_code == 404, where
                    assert "switched off" in keyed.json()["error"]["message"], where
                else:
                    assert anonymous.status_code == 401, where
                    assert keyed.status_code != 401 and "switched off" not in keyed.text, where
                    if path in WORKING_BODIES:
                        assert keyed.status_code == 200, where
    assert set(WORKING_BODIES) <= set(seen)
    assert healthy(server)


# -- thinking off by default, forced tool calls --------------------------------------------------


@needs_vllm
@pytest.mark.slow
def test_plain_chat_returns_content_and_thinking_can_be_asked_for(server, client):
    body = {"model": QWEN35_SERVED_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    plain = client.post("chat/completions", json=body).json()["choices"][0]["message"]
    assert isinstance(plain["content"], str) and plain["content"] and plain.get("reasoning") is None
    for switch in ({"chat_template_kwargs": {"enable_thinking": True}}, {"thinking": {"type": "enabled"}}):
        thinking = client.post("chat/completions", json={**body, **switch}).json()["choices"][0]["message"]
        assert thinking["reasoning"], f"{switch}: the reply reasons ({thinking})"


TOOL_SCHEMAS = {
    "set_forecast": {"type": "object", "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["unit", "days"]},
    "search": {"type": "object", "properties": {
        "filter": {"type": "object", "properties": {
            "tags": {"type": "array", "items": {"type": "string", "enum": ["news", "blog", "paper"]}, "maxItems": 3},
            "limit": {"type": "integer", "minimum": 0, "maximum": 100}},
            "required": ["tags", "limit"], "additionalProperties": False},
        "exact": {"type": "boolean"}}, "required": ["filter", "exact"], "additionalProperties": False},
    "pick_ids": {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1,
                "maxItems": 4},
        "note": {"type": ["string", "null"], "maxLength": 8}}, "required": ["ids"]},
    "book": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "guests": {"type": "integer", "minimum": 1, "maximum": 9},
        "room": {"type": "object", "properties": {
            "kind": {"enum": ["single", "double", "suite"]},
            "floor": {"type": "integer", "minimum": 0, "maximum": 30}}, "required": ["kind"]}},
        "required": ["city", "guests", "room"]},
}  # fmt: skip
FORCED_TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
                for name, schema in TOOL_SCHEMAS.items()]  # fmt: skip


def _tool_request(index: int, kind: str) -> dict:
    names = list(TOOL_SCHEMAS)
    body = {"model": QWEN35_SERVED_NAME, "messages": [{"role": "user", "content": f"Task {index}: use a tool."}],
            "tools": FORCED_TOOLS, "max_tokens": 1024, "temperature": 1.0, "stream": index % 2 == 0}  # fmt: skip
    if kind == "forced":
        body["tool_choice"] = {"type": "function", "function": {"name": names[index % len(names)]}}
    else:
        body["tool_choice"] = "required"
        if index % 4 < 2:
            body["parallel_tool_calls"] = False
    return body


async def _tool_calls(client: httpx.AsyncClient, body: dict) -> tuple[str | None, list[tuple[str, str]]]:
    """(finish_reason, [(name, arguments)]) of one request, streamed or not."""
    if not body["stream"]:
        reply = await client.post("chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        return choice["finish_reason"], [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    calls: dict[int, list[str]] = {}
    finish = None
    async with client.stream("POST", "chat/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices") or []:
                assert not (choice.get("delta") or {}).get("content"), "a forced reply streams no text"
                for call in (choice.get("delta") or {}).get("tool_calls") or []:
                    entry = calls.setdefault(call["index"], ["", ""])
                    function = call.get("function") or {}
                    entry[0] += function.get("name") or ""
                    entry[1] += function.get("arguments") or ""
                finish = choice.get("finish_reason") or finish
    return finish, [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))]


@needs_vllm
@pytest.mark.slow
def test_forced_and_required_tool_calls_are_schema_valid(server):
    """50 forced and 50 `required` tool calls over nested objects, enums, integers and arrays, half of
    them streamed: the random-weight model cannot get one right by chance, so every call being valid
    shows the constraint."""
    jsonschema = pytest.importorskip("jsonschema")
    requests = [_tool_request(i, "forced") for i in range(50)] + [_tool_request(i, "required") for i in range(50)]

    async def run() -> list:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.base_url + "/", headers=headers, timeout=600) as client:
            gate = asyncio.Semaphore(8)

            async def one(body: dict):
                async with gate:
                    return await _tool_calls(client, body)

            return await asyncio.gather(*[one(body) for body in requests])

    problems, counts = [], []
    for body, (finish, calls) in zip(requests, asyncio.run(run()), strict=True):
        choice = body["tool_choice"]
        counts.append(len(calls))
        # OpenAI's finish reason for a named tool choice is "stop", for a required one "tool_calls"
        if finish != ("stop" if isinstance(choice, dict) else "tool_calls") or not calls:
            problems.append(f"{choice}: finish {finish} with {len(calls)} calls")
        if isinstance(choice, dict) and [name for name, _ in calls] != [choice["function"]["name"]]:
            problems.append(f"forced {choice['function']['name']}: calls {[name for name, _ in calls]}")
        if body.get("parallel_tool_calls") is False and len(calls) != 1:
            problems.append(f"parallel_tool_calls false: {len(calls)} calls")
        for name, arguments in calls:
            try:
                jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])
            except (ValueError, KeyError, jsonschema.ValidationError) as error:
                problems.append(f"{name}({arguments[:120]}): {str(error).splitlines()[0]}")
    assert not problems, f"{len(problems)} of 100 replies invalid:\n" + "\n".join(problems[:20])
    assert max(counts) <= 4, "at most max_tool_calls (the embedded default: 4) calls in a reply"
    assert healthy(server)


def _bad_cases() -> list[tuple[str, str, object, dict | None, int, str]]:
    """(id, path, JSON body or raw bytes, headers, status, message pattern)."""
    m = QWEN35_SERVED_NAME
    user = [{"role": "user", "content": "hi"}]

    def chat_body(**fields):
        return {"model": m, "messages": user, "max_tokens": 4, **fields}

    def tool(**function):
        return [{"type": "function", "function": {"name": "f", **function}}]

    huge = "hello world " * 6000
    return [
        ("malformed_json", "chat/completions", b'{"model": "x", "messages": [', None, 400, "not valid JSON"),
        ("array_body", "chat/completions", b"[1]", None, 400, "JSON object"),
        ("nan_literal", "chat/completions", b'{"messages": [], "temperature": NaN}', None, 400, "NaN"),
        ("bad_utf8", "chat/completions", b'{"messages": "\xff"}', None, 400, "UTF-8"),
        ("deep_nesting", "chat/completions", b"[" * 50_000 + b"]" * 50_000, None, 400, "nested"),
        ("body_too_large", "chat/completions", b" " * (MAX_REQUEST_BYTES + 1), None, 413, "limit"),
        ("messages_missing", "chat/completions", {"model": m}, None, 400, "messages"),
        ("messages_empty", "chat/completions", chat_body(messages=[]), None, 400, "at least one message"),
        ("messages_not_list", "chat/completions", chat_body(messages="hi"), None, 400, "messages must be an array"),
        ("invocations_n_above_max", "/invocations", chat_body(n=20), None, 400, f"n=20 is above this server's "
         f"maximum of {MAX_N}"),
        ("invocations_completion_best_of", "/invocations", {"model": m, "prompt": "x", "n": 2, "best_of": 20}, None,
         400, "best_of=20 is above"),
        ("invocations_role_unknown", "/invocations", chat_body(messages=[{"role": "wizard", "content": "x"}]), None,
         400, "wizard"),
        ("invocations_image_part", "/invocations", chat_body(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]), None, 400,
         "the data is not an image, or its header is corrupt"),
        ("invocations_no_key", "/invocations", chat_body(), {"Authorization": ""}, 401, "API key"),
        ("generative_scoring_no_key", "/generative_scoring", {"query": "q", "items": ["a"], "label_token_ids": [1]},
         {"Authorization": ""}, 401, "API key"),
        ("responses_max_output_tokens", "responses", {"model": m, "input": "x",
         "max_output_tokens": 10**6}, None, 400, "above this server's context"),
        ("messages_api_role", "messages", {"model": m, "max_tokens": 4, "messages": [{"role": "tool",
         "content": "x"}]}, None, 400, "is not one of user, assistant"),
        ("admin_route_no_key", "/scale_elastic_ep", {"new_data_parallel_size": 2}, {"Authorization": ""}, 404,
         "admin route, switched off"),
        ("admin_route_with_key", "/collective_rpc", {"method": "x"}, None, 404, "admin route, switched off"),
        ("role_missing", "chat/completions", chat_body(messages=[{"content": "x"}]), None, 400, "role"),
        ("role_unknown", "chat/completions", chat_body(messages=[{"role": "wizard", "content": "x"}]), None, 400,
         "wizard"),
        ("content_wrong_type", "chat/completions", chat_body(messages=[{"role": "user", "content": 5}]), None, 400,
         "content"),
        ("tool_message_without_id", "chat/completions", chat_body(messages=[*user, {"role": "tool", "content": "r"}]),
         None, 400, "tool_call_id"),
        ("model_wrong_type", "chat/completions", chat_body(model=5), None, 400,
         "model: Input should be a valid string"),
        ("model_unknown", "chat/completions", chat_body(model="gpt-17"), None, 404, "gpt-17"),
        ("n_zero", "chat/completions", chat_body(n=0), None, 400, "n must be at least 1"),
        ("n_string", "chat/completions", chat_body(n="2"), None, 400, "n: Input should be a valid integer"),
        ("n_above_max", "chat/completions", chat_body(n=MAX_N + 1), None, 400, f"maximum of {MAX_N}"),
        ("n_greedy", "chat/completions", chat_body(n=2, temperature=0), None, 400, "greedy"),
        ("best_of_above_max", "completions", {"model": m, "prompt": "x", "n": 2, "best_of": MAX_N + 1}, None, 400,
         "best_of"),
        ("max_tokens_negative", "chat/completions", chat_body(max_tokens=-1), None, 400, "max_tokens"),
        ("max_tokens_huge", "chat/completions", chat_body(max_tokens=10**9), None, 400, "max_tokens"),
        ("max_tokens_overflow", "chat/completions", chat_body(max_tokens=10**30), None, 400, "max_tokens"),
        ("max_tokens_string", "chat/completions", chat_body(max_tokens="ten"), None, 400,
         "max_tokens: Input should be a valid integer"),
        ("temperature_string", "chat/completions", chat_body(temperature="hot"), None, 400, "temperature"),
        ("temperature_negative", "chat/completions", chat_body(temperature=-1), None, 400, "temperature"),
        ("top_p_above_one", "chat/completions", chat_body(top_p=2), None, 400, "top_p"),
        ("top_k_negative", "chat/completions", chat_body(top_k=-5), None, 400, "top_k"),
        ("top_logprobs_too_many", "chat/completions", chat_body(logprobs=True, top_logprobs=100), None, 400,
         "logprobs"),
        ("stop_not_strings", "chat/completions", chat_body(stop=[1, 2]), None, 400, "stop"),
        ("min_tokens_above_max", "chat/completions", chat_body(min_tokens=10, max_tokens=2), None, 400, "min_tokens"),
        ("logit_bias_out_of_vocab", "chat/completions", chat_body(logit_bias={"999999": 5}), None, 400, "vocab"),
        ("stream_options_without_stream", "chat/completions", chat_body(stream_options={"include_usage": True}),
         None, 400, "stream"),
        ("prompt_over_context", "chat/completions", chat_body(messages=[{"role": "user", "content": huge}]), None,
         400, "context length"),
        ("token_prompt_over_context", "completions", {"model": m, "prompt": [5] * 5000, "max_tokens": 1}, None, 400,
         ""),
        ("token_out_of_vocab", "completions", {"model": m, "prompt": [10**6], "max_tokens": 1}, None, 400,
         "out of vocabulary"),
        ("completion_prompt_empty", "completions", {"model": m, "prompt": ""}, None, 400, "prompt"),
        ("tool_schema_bad_type", "chat/completions",
         chat_body(tools=tool(parameters={"type": "object", "properties": {"a": {"type": 123}}}),
                   tool_choice="required"),
         None, 400, r"parameters\.properties\.a\.type"),
        ("tool_not_function", "chat/completions", chat_body(tools=[{"type": "retrieval"}]), None, 400, "function"),
        ("tool_name_invalid", "chat/completions", chat_body(tools=tool(name="get weather!")), None, 400, "name"),
        ("tool_choice_unknown_function", "chat/completions",
         chat_body(tools=tool(), tool_choice={"type": "function", "function": {"name": "g"}}), None, 400, "tool"),
        ("tool_choice_bad_string", "chat/completions", chat_body(tools=tool(), tool_choice="always"), None, 400,
         "tool_choice"),
        ("response_format_bad_schema", "chat/completions",
         chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "blob"}}}),
         None, 400, ""),
        ("image_part", "chat/completions", chat_body(messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]), None, 400,
         r"messages\[0\]\.content\[1\]\.image_url\.url: the data is not an image"),
        ("audio_part", "chat/completions", chat_body(messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]), None, 400,
         "takes text and images only"),
        ("thinking_bad_type", "chat/completions", chat_body(thinking={"type": "maybe"}), None, 400, "thinking"),
        ("thinking_conflict", "chat/completions", chat_body(enable_thinking=True, thinking={"type": "disabled"}),
         None, 400, "conflicting"),
        ("api_key_missing", "chat/completions", chat_body(), {"Authorization": ""}, 401, "API key"),
        ("api_key_wrong", "chat/completions", chat_body(n=99), {"Authorization": "Bearer wrong"}, 401, "API key"),
        ("unknown_path", "no/such/endpoint", chat_body(), None, 404, "Not Found"),
        ("wrong_method", "chat/completions", None, None, 405, "Method Not Allowed"),
    ]  # fmt: skip


BAD_CASES = _bad_cases()


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_answers_4xx_with_an_error_object_and_the_server_stays_healthy(server, client, case):
    _, path, body, headers, status, pattern = case
    if path.startswith("/"):
        path = server.root + path
    if body is None:
        reply = client.get(path, headers=headers)
    elif isinstance(body, bytes):
        reply = client.post(path, content=body, headers={"Content-Type": "application/json", **(headers or {})})
    else:
        reply = client.post(path, json=body, headers=headers)
    message = assert_openai_error(reply, status, pattern)
    assert healthy(server), f"unhealthy after {case[0]} ({message})"


def test_the_bad_input_matrix_is_large_enough():
    assert len(BAD_CASES) >= 25 and len({c[0] for c in BAD_CASES}) == len(BAD_CASES)


@needs_vllm
@pytest.mark.slow
def test_n2_and_sampling_edge_cases_keep_the_engine_up(server, client):
    m, user = QWEN35_SERVED_NAME, [{"role": "user", "content": "Tell me a story"}]
    cases = [
        {"n": 2}, {"n": 2, "stream": True}, {"n": MAX_N, "stream": True, "stream_options": {"include_usage": True}},
        {"n": 2, "seed": 7}, {"n": 2, "logprobs": True, "top_logprobs": 5}, {"n": 2, "max_tokens": 1},
        {"n": 2, "stop": ["a", "e"]}, {"n": 2, "response_format": {"type": "json_object"}},
        {"n": 2, "tools": TOOLS, "tool_choice": "required", "stream": True}, {"n": 2, "top_k": 1, "top_p": 0.1},
        {"n": 2, "presence_penalty": 2, "frequency_penalty": -2, "repetition_penalty": 2.0},
        {"n": 2, "min_tokens": 8, "ignore_eos": True}, {"temperature": 0, "seed": 3},
        {"n": MAX_N, "thinking": {"type": "enabled"}, "max_tokens": 32},
    ]  # fmt: skip
    for fields in cases:
        body = {"model": m, "messages": user, "max_tokens": 8, "temperature": 1.0, **fields}
        reply = client.post("chat/completions", json=body)
        assert reply.status_code == 200, f"{fields}: {reply.text[:300]}"
        if not fields.get("stream"):
            indices = sorted(c["index"] for c in reply.json()["choices"])
            assert indices == list(range(fields.get("n", 1))), fields
    reply = client.post("completions", json={"model": m, "prompt": "Once", "n": 2, "best_of": MAX_N, "max_tokens": 4})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 2
    assert healthy(server)


@needs_vllm
@pytest.mark.slow
def test_100_concurrent_chat_requests(server):
    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=100)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.base_url + "/", headers=headers, timeout=300,
                                     limits=limits) as c:  # fmt: skip
            async def one(i: int) -> int:
                body = {"model": QWEN35_SERVED_NAME, "max_tokens": 16, "temperature": 0.8, "n": 1 + i % 2,
                        "messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": f"Question {i}: " + "why? " * (i % 13)}],
                        "stream": i % 2 == 0, **({"tools": TOOLS} if i % 5 == 0 else {})}  # fmt: skip
                async with c.stream("POST", "chat/completions", json=body) as reply:
                    await reply.aread()
                    return reply.status_code

            return await asyncio.gather(*[one(i) for i in range(100)])

    codes = asyncio.run(run())
    assert [c for c in codes if c >= 500] == []
    assert codes == [200] * 100
    assert healthy(server)


@needs_vllm
@pytest.mark.slow
def test_conformance_suite_passes_against_qwen35_serve(server):
    from test_accept import ALLOWED_SKIPS

    from serve.accept.runner import PASS, SKIP, run_suite
    from serve.accept.suite import PROTOCOL

    report = run_suite(server.base_url, api_key=API_KEY)
    results = {r.name: r for r in report.results}
    def allowed_skip(r) -> bool:
        return r.status == SKIP and r.reason.startswith(ALLOWED_SKIPS.get(r.name, "\0"))

    unexpected = [f"{r.name}: {r.status} {r.reason}" for r in report.results
                  if r.kind == PROTOCOL and r.name not in KNOWN_DEVIATIONS and r.status != PASS and not allowed_skip(r)]
    assert not unexpected, "\n".join(unexpected)
    for fixed in ("auth_error_body", "tool_stream_required", "tool_stream_named", "server_alive_after_suite"):
        assert results[fixed].status == PASS, f"{fixed}: {results[fixed].reason}"
    assert healthy(server)
