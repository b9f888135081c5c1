"""The request middleware on its own (no engine): route classes, the API key, per-route request checks
on vLLM's own request models, thinking switches, streamed tool-choice filtering and error bodies.

Requests go through `RequestCompatMiddleware` into a FastAPI app whose routes carry vLLM's paths and
vLLM's request models as their bodies (so the checks read the models from the routes, as they do in
the server); its endpoints record the raw body they receive and answer a canned reply.
"""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from serve import routes
from serve.checks import Policy, RequestError, check_schema, validate_with
from serve.middleware import CompatSettings, RequestCompatMiddleware

vllm_protocols = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest  # noqa: E402
from vllm.entrypoints.generate.generative_scoring.serving import GenerativeScoringRequest  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: E402
    BatchChatCompletionRequest,
    ChatCompletionRequest,
)
from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: E402
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest  # noqa: E402

BODY_MODELS = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions/batch": BatchChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": AnthropicMessagesRequest,
    "/generative_scoring": GenerativeScoringRequest,
}
PLAIN_ROUTES = [("/health", "GET"), ("/ping", "GET"), ("/version", "GET"), ("/metrics", "GET"), ("/v1/models", "GET"),
                ("/invocations", "POST"), ("/tokenize", "POST"), ("/scale_elastic_ep", "POST"), ("/sleep", "POST"),
                ("/v1/embeddings", "POST"), ("/v1/responses/{response_id}", "GET"), ("/docs", "GET"),
                ("/brand_new_route", "POST")]  # fmt: skip


class Downstream:
    """The app behind the middleware: records each body it receives, answers with a canned reply."""

    def __init__(self, status: int = 200, chunks: list[bytes] | None = None, content_type: str = "application/json",
                 raises: Exception | None = None) -> None:  # fmt: skip
        self.status, self.chunks, self.content_type, self.raises = status, chunks or [b"{}"], content_type, raises
        self.bodies: list[bytes] = []

    async def reply(self, request: Request) -> Response:
        self.bodies.append(await request.body())
        if self.raises is not None:
            raise self.raises

        async def chunks():
            for chunk in self.chunks:
                yield chunk

        return StreamingResponse(chunks(), self.status, media_type=self.content_type)

    def app(self, settings: CompatSettings) -> FastAPI:
        app = FastAPI()
        for path, model in BODY_MODELS.items():

            async def typed(body, request: Request) -> Response:
                return await self.reply(request)

            typed.__annotations__ = {"body": model, "request": Request, "return": Response}  # the route's body model
            app.add_api_route(path, typed, methods=["POST"])
        for path, method in PLAIN_ROUTES:

            async def plain(request: Request) -> Response:
                return await self.reply(request)

            app.add_api_route(path, plain, methods=[method])
        # what the middleware reads from vLLM's app state: the served context and the model's inputs
        app.state.vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=4096,
                                                                             is_multimodal_model=False))
        app.add_middleware(RequestCompatMiddleware, settings=settings)
        return app

    def last(self) -> dict:
        return json.loads(self.bodies[-1])


def call(downstream: Downstream, path: str = "/v1/chat/completions", body: object = None, raw: bytes | None = None,
         headers: dict | None = None, method: str = "POST", **settings) -> httpx.Response:  # fmt: skip
    app = downstream.app(CompatSettings(**settings))

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            content = raw if raw is not None else None if body is None else json.dumps(body).encode()
            sent = {"Content-Type": "application/json", **(headers or {})} if content is not None else headers or {}
            return await client.request(method, path, content=content, headers=sent)

    return asyncio.run(go())


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]  # fmt: skip


def assert_openai_error(reply: httpx.Response, status: int, pattern: str = "") -> str:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert isinstance(error["message"], str) and error["message"], reply.text
    assert error["code"] == status and isinstance(error["type"], str)
    assert re.search(pattern, error["message"]), error["message"]
    return error["message"]


# -- route classes and the key -------------------------------------------------------------------

KEYED = {"api_keys": ("secret",)}
GOOD = {"Authorization": "Bearer secret"}


@pytest.mark.parametrize(
    "path,method,body,without_key,with_key",
    [
        ("/health", "GET", None, 200, 200),
        ("/ping", "GET", None, 200, 200),
        ("/version", "GET", None, 200, 200),
        ("/metrics", "GET", None, 200, 200),
        ("/v1/models", "GET", None, 401, 200),
        ("/docs", "GET", None, 401, 200),
        ("/v1/responses/resp_1", "GET", None, 401, 200),
        ("/tokenize", "POST", {"prompt": "x"}, 401, 200),
        ("/v1/chat/completions", "POST", chat(), 401, 200),
        ("/invocations", "POST", chat(), 401, 200),
        ("/generative_scoring", "POST", {"query": "q", "items": ["a"], "label_token_ids": [1]}, 401, 200),
        ("/brand_new_route", "POST", {}, 401, 200),
        ("/no/such/route", "GET", None, 401, 404),
        ("/scale_elastic_ep", "POST", {"new_data_parallel_size": 2}, 404, 404),
        ("/sleep", "POST", {}, 404, 404),
        ("/v1/embeddings", "POST", {"input": "x"}, 404, 404),
    ],
)  # fmt: skip
def test_deny_by_default(path, method, body, without_key, with_key):
    downstream = Downstream()
    assert call(downstream, path, body=body, method=method, **KEYED).status_code == without_key
    assert call(downstream, path, body=body, method=method, headers=GOOD, **KEYED).status_code == with_key
    assert call(downstream, path, body=body, method=method, headers={"Authorization": "Bearer nope"},
                **KEYED).status_code == without_key  # fmt: skip


def test_off_and_admin_routes_say_why_and_admin_routes_can_be_turned_on():
    downstream = Downstream()
    assert_openai_error(call(downstream, "/sleep", body={}, headers=GOOD, **KEYED), 404,
                        "admin route, switched off.*admin_routes: true")  # fmt: skip
    assert_openai_error(call(downstream, "/v1/embeddings", body={}, headers=GOOD, **KEYED), 404,
                        "switched off on this server")  # fmt: skip
    assert downstream.bodies == []
    on = {**KEYED, "admin_routes": True}
    assert_openai_error(call(downstream, "/scale_elastic_ep", body={}, **on), 401, "API key")
    assert call(downstream, "/scale_elastic_ep", body={}, headers=GOOD, **on).status_code == 200
    assert call(downstream, "/v1/embeddings", body={}, headers=GOOD, **on).status_code == 404, "off stays off"


def test_metrics_can_be_closed_and_nothing_needs_a_key_without_one():
    downstream = Downstream()
    assert call(downstream, "/metrics", method="GET", public_metrics=False, **KEYED).status_code == 401
    assert call(downstream, "/metrics", method="GET", public_metrics=False, headers=GOOD, **KEYED).status_code == 200
    assert call(downstream, "/v1/models", method="GET").status_code == 200
    assert call(downstream, "/brand_new_route", body={}).status_code == 200
    assert call(downstream, "/sleep", body={}).status_code == 404, "admin routes are off with or without a key"


def test_authentication_comes_before_any_other_check():
    downstream = Downstream()
    assert_openai_error(call(downstream, body=chat(n=99), **KEYED), 401, "API key")
    assert_openai_error(call(downstream, body=chat(n=99), headers={"Authorization": "Basic secret"}, **KEYED), 401)
    assert_openai_error(call(downstream, raw=b"{not json", **KEYED), 401)
    assert downstream.bodies == []
    options = call(downstream, "/v1/models", method="OPTIONS", **KEYED)
    assert options.status_code != 401, "CORS preflights carry no key"


def test_every_vllm_route_class_is_known():
    assert set(routes.ROUTES.values()) <= {routes.OPEN, routes.METRICS, routes.ENGINE, routes.KEYED, routes.ADMIN,
                                           routes.OFF}  # fmt: skip
    from serve.checks import checked_templates

    engine = {p for p, k in routes.ROUTES.items() if k == routes.ENGINE}
    assert engine <= set(checked_templates()), "every engine route has a checker"
    assert routes.kind_of("/v9/whatever") == routes.UNCLASSIFIED and routes.kind_of(None) == routes.KEYED


# -- request checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"thinking": {"type": "disabled"}}, False),
        ({"thinking": {"type": "enabled", "budget_tokens": 512}}, True),
        ({"enable_thinking": False}, False),
        ({"chat_template_kwargs": {"enable_thinking": True, "x": 1}}, True),
        ({"enable_thinking": False, "thinking": {"type": "disabled"}}, False),
        ({}, None),
    ],
)
def test_thinking_spellings_become_the_template_switch(fields, expected):
    downstream = Downstream()
    assert call(downstream, body=chat(**fields)).status_code == 200
    seen = downstream.last()
    assert "thinking" not in seen and "enable_thinking" not in seen
    assert (seen.get("chat_template_kwargs") or {}).get("enable_thinking") == expected
    if "x" in json.dumps(fields):
        assert seen["chat_template_kwargs"]["x"] == 1, "other template kwargs are kept"


def test_unchanged_requests_pass_byte_for_byte():
    downstream = Downstream()
    raw = b'{"model": "m",  "messages": [{"role": "user", "content": "hi"}], "seed": 1}'
    call(downstream, raw=raw)
    assert downstream.bodies == [raw]


@pytest.mark.parametrize(
    "fields,policy,expected",
    [
        ({"tools": TOOLS}, True, False),
        ({"tools": TOOLS, "tool_choice": "auto"}, True, False),
        ({"tools": TOOLS, "thinking": {"type": "enabled"}}, True, True),
        ({"tools": TOOLS, "tool_choice": "required"}, True, None),
        ({"tools": TOOLS, "tool_choice": "none"}, True, None),
        ({}, True, None),
        ({"tools": TOOLS}, False, None),
    ],
)
def test_thinking_off_with_tools_policy(fields, policy, expected):
    downstream = Downstream()
    call(downstream, body=chat(**fields), thinking_off_with_tools=policy)
    assert (downstream.last().get("chat_template_kwargs") or {}).get("enable_thinking") == expected


@pytest.mark.parametrize(
    "path,body,pattern,param",
    [
        ("/v1/chat/completions", chat(thinking={"type": "maybe"}), "thinking.type must be 'enabled' or 'disabled'",
         "thinking.type"),
        ("/v1/chat/completions", chat(thinking="off"), "thinking must be an object", "thinking"),
        ("/v1/chat/completions", chat(enable_thinking=True, thinking={"type": "disabled"}),
         "conflicting thinking switches", None),
        ("/v1/chat/completions", chat(chat_template_kwargs={"enable_thinking": "no"}),
         "enable_thinking must be a boolean", None),
        ("/v1/chat/completions", chat(n=5), r"n=5 is above this server's maximum of 4", "n"),
        ("/v1/chat/completions", chat(n="2"), r'n: Input should be a valid integer, got "2"', "n"),
        ("/v1/chat/completions", chat(temperature=True), "temperature: Input should be a valid number, got true",
         "temperature"),
        ("/v1/chat/completions", chat(stop=[1]), "stop", "stop"),
        ("/v1/chat/completions", chat(max_tokens=0), "max_tokens must be an integer of at least 1, got 0",
         "max_tokens"),
        ("/v1/chat/completions", chat(max_tokens=10**30), "max_tokens=1000000000000000000000000000000 is above this "
         "server's context of 4096 tokens", "max_tokens"),
        ("/v1/chat/completions", chat(max_completion_tokens=5000), "above this server's context",
         "max_completion_tokens"),
        ("/v1/chat/completions", chat(stream_options={"include_usage": True}), "Stream options can only be defined",
         "stream_options"),
        ("/v1/chat/completions", {"model": "m"}, "messages is required", "messages"),
        ("/v1/chat/completions", chat(messages=[]), "at least one message", "messages"),
        ("/v1/chat/completions", chat(messages=[{"role": "robot", "content": "x"}]),
         r'messages\[0\].role: "robot" is not one of', "messages[0].role"),
        ("/v1/chat/completions", chat(messages=[{"role": "user"}]), r"messages\[0\].content is required", None),
        ("/v1/chat/completions", chat(messages=[{"role": "tool", "content": "r"}]), r"messages\[0\].tool_call_id",
         None),
        ("/v1/chat/completions",
         chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         r"takes text only \(this server is configured text_only: true\), so 'image_url' parts are not accepted",
         "messages[0].content[0].type"),
        ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "has space"}}]),
         "function.name must be", None),
        ("/v1/chat/completions", chat(tools=[{"type": "retrieval"}]), r"tools\[0\] must be an object with type "
         "'function'", "tools[0]"),
        ("/v1/chat/completions",
         chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
         "JSON Schema of type 'object'", None),
        ("/v1/chat/completions", chat(tools=TOOLS, tool_choice="sometimes"), "tool_choice must be", "tool_choice"),
        ("/v1/chat/completions", chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}),
         "tool_choice names 'g', which is not among the tools", "tool_choice"),
        ("/v1/completions", {"model": "m", "prompt": [1, "a"]}, "prompt", "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "x", "best_of": 9}, "best_of=9 is above", "best_of"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": -1}, "at least 1", "max_tokens"),
        ("/invocations", chat(n=20), r"n=20 is above this server's maximum of 4", "n"),
        ("/invocations", {"model": "m", "prompt": "x", "n": 20}, r"n=20 is above", "n"),
        ("/invocations", chat(messages=[{"role": "wizard", "content": "x"}]), "wizard", "messages[0].role"),
        ("/invocations", {"model": "m", "input": "x"}, "/invocations takes a chat completion request", None),
        ("/v1/chat/completions/batch", {"messages": [[{"role": "user", "content": "a"}], [{"role": "x"}]]},
         r"messages\[1\]\[0\].role", "messages[1][0].role"),
        ("/v1/responses", {"model": "m", "input": [{"role": "wizard", "content": "x"}]},
         r"input\[0\].role: \"wizard\" is not one of", "input[0].role"),
        ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, "takes text only",
         "input[0].content[0].type"),
        ("/v1/responses", {"model": "m", "input": "x", "max_output_tokens": 0}, "at least 1", "max_output_tokens"),
        ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "system", "content": "x"}]},
         "the system prompt goes in 'system'", "messages[0].role"),
        ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
         "takes text only", "messages[0].content[0].type"),
        ("/v1/messages", {"model": "m", "max_tokens": 99999, "messages": [{"role": "user", "content": "x"}]},
         "above this server's context", "max_tokens"),
        ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens: Field required",
         "max_tokens"),
        ("/generative_scoring", {"query": "q", "items": ["a"] * 5, "label_token_ids": [1]}, "5 items are above",
         "items"),
    ],
)  # fmt: skip
def test_bad_requests_are_answered_400_before_the_engine(path, body, pattern, param):
    downstream = Downstream()
    reply = call(downstream, path, body=body, max_n=4, text_only=True)
    assert_openai_error(reply, 400, pattern)
    if param is not None:
        assert reply.json()["error"]["param"] == param
    assert downstream.bodies == [], "the request must not reach vLLM"


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", chat(n=4, max_tokens=4096, temperature=1, top_p=0.5, seed=3, stop="x",
                                      logit_bias={"5": 1}, tools=TOOLS, tool_choice="required", stream=True,
                                      stream_options={"include_usage": True}, response_format={"type": "json_object"})),
        ("/v1/completions", {"model": "m", "prompt": [1, 2, 3], "n": 2, "best_of": 4, "max_tokens": 5, "echo": True}),
        ("/invocations", {"model": "m", "prompt": "Once", "max_tokens": 3}),
        ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 8}),
        ("/v1/messages", {"model": "m", "max_tokens": 8, "system": "be brief",
                          "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
        ("/generative_scoring", {"query": "q", "items": ["a", "b"], "label_token_ids": [1, 2]}),
    ],
)  # fmt: skip
def test_good_requests_pass_unchanged(path, body):
    downstream = Downstream()
    reply = call(downstream, path, body=body, max_n=4, text_only=True)
    assert reply.status_code == 200, reply.text
    assert downstream.last() == body


def test_validation_uses_the_route_model_in_strict_mode():
    with pytest.raises(RequestError) as info:
        validate_with(CompletionRequest, {"model": "m", "prompt": "x", "echo": "yes"})
    assert info.value.param == "echo" and "valid boolean" in info.value.message and '"yes"' in info.value.message
    validate_with(CompletionRequest, {"model": "m", "prompt": "x", "temperature": 1})  # an integer is a number
    assert Policy().max_n == 8


@pytest.mark.parametrize(
    "raw,pattern",
    [
        (b'{"model": "m", "messages": [', "not valid JSON"),
        (b'{"model": "m", "temperature": NaN, "messages": []}', "NaN is not valid JSON"),
        (b'{"model": "m", "top_p": -Infinity, "messages": []}', "-Infinity is not valid JSON"),
        (b'{"x": "\xff"}', "not valid UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"[1, 2]", "must be a JSON object, got list"),
    ],
)
def test_malformed_bodies(raw, pattern):
    for path in ("/v1/chat/completions", "/invocations", "/v1/responses"):
        downstream = Downstream()
        assert_openai_error(call(downstream, path, raw=raw), 400, pattern)
        assert downstream.bodies == []


def test_body_size_limit():
    downstream = Downstream()
    assert_openai_error(call(downstream, raw=b" " * 5000, max_request_bytes=4096), 413, "above this server's limit")
    assert_openai_error(call(downstream, "/v1/messages", raw=b" " * 5000, max_request_bytes=4096), 413)
    assert downstream.bodies == []


@pytest.mark.parametrize(
    "downstream,pattern",
    [
        (Downstream(404, [b'{"detail":"Not Found"}']), "^Not Found$"),
        (Downstream(401, [b'{"error":"Unauthorized"}']), "^Unauthorized$"),
        (Downstream(422, [b'{"detail":[{"loc":["body","n"],"msg":"bad"}]}']), r"^body\.n: bad$"),
        (Downstream(500, [b"Internal ", b"Server Error"], "text/plain"), "^Internal Server Error$"),
        (Downstream(raises=RuntimeError("boom")), "internal server error"),
    ],
)
def test_error_bodies_become_openai_error_objects(downstream, pattern):
    reply = call(downstream, "/v1/models", method="GET")
    assert_openai_error(reply, downstream.status if downstream.raises is None else 500, pattern)
    assert reply.headers["content-type"] == "application/json"
    assert int(reply.headers["content-length"]) == len(reply.content)


def test_openai_errors_pass_unchanged():
    body = b'{"error":{"message":"n must be at least 1","type":"BadRequestError","param":null,"code":400}}'
    assert call(Downstream(400, [body]), body=chat()).content == body


def sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_forced_tool_choice_streams_drop_markup_text():
    def chunk(delta, finish=None):
        return {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta,
                                                                           "finish_reason": finish}]}  # fmt: skip

    call_delta = {"tool_calls": [{"index": 0, "id": "t", "type": "function", "function": {"name": "get_weather"}}]}
    stream = sse(chunk({"role": "assistant", "content": ""}), chunk({"content": "<tool_call>\n"}), chunk(call_delta),
                 chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}),
                 chunk({"content": "</tool_call>"}), chunk({}, "tool_calls"),
                 {"error": {"message": "late"}})  # fmt: skip
    pieces = [stream[i : i + 37] for i in range(0, len(stream), 37)]  # events split across ASGI messages
    for tool_choice, stripped in [("required", True), ({"type": "function", "function": {"name": "get_weather"}}, True),
                                  ("auto", False)]:  # fmt: skip
        for path in ("/v1/chat/completions", "/invocations"):
            reply = call(Downstream(200, pieces, "text/event-stream"), path,
                         body=chat(tools=TOOLS, tool_choice=tool_choice, stream=True))  # fmt: skip
            events = [e for e in reply.content.split(b"\n\n") if e]
            assert events[-2:] == [b'data: {"error": {"message": "late"}}', b"data: [DONE]"], "others pass as sent"
            deltas = [c["delta"] for e in events[:-2] for c in json.loads(e[6:])["choices"]]
            text = "".join(d.get("content") or "" for d in deltas)
            assert (text == "") is stripped and ("<tool_call>" in text) is not stripped
            assert sum("tool_calls" in d for d in deltas) == 2 and deltas[0]["role"] == "assistant"
            if stripped:
                assert len(events) == 6, "chunks left empty are dropped, the finish chunk is kept"


def test_schema_checker():
    check_schema({"type": ["string", "null"], "anyOf": [True, {"$ref": "#/$defs/a"}], "$defs": {"a": {}}}, "p")
    check_schema({"type": "array", "items": [{"type": "integer", "minimum": 0}], "maxItems": 3}, "p")
    for bad, where in [({"properties": {"a": {"type": "text"}}}, "p.properties.a.type"),
                       ({"anyOf": []}, "p.anyOf"), ({"required": "a"}, "p.required"),
                       ({"items": {"maxLength": -1}}, "p.items.maxLength"),
                       ({"properties": {"a": 3}}, "p.properties.a"),
                       ({"not": {"pattern": 5}}, "p.not.pattern")]:  # fmt: skip
        with pytest.raises(RequestError) as info:
            check_schema(bad, "p")
        assert info.value.param == where, info.value.message
    deep: dict = {"type": "object"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(RequestError, match="nested deeper"):
        check_schema(deep, "p")


def test_tool_call_limit_follows_parallel_tool_calls_and_the_policy():
    from serve.checks import check_chat

    policy = Policy(max_tool_calls=3)
    assert check_chat(chat(tools=TOOLS, tool_choice="required"), policy, None).tool_call_limit == 3
    assert check_chat(chat(tools=TOOLS, parallel_tool_calls=False), policy, None).tool_call_limit == 1
    assert check_chat(chat(), policy, None).tool_call_limit is None, "no tools, no limit"
