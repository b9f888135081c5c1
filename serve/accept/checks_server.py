"""Server-level checks: endpoints, legacy completions, error statuses, authentication, concurrency."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from serve.accept.suite import (
    PROTOCOL,
    Suite,
    check,
    choice,
    content,
    expect,
    expect_chat_completion,
    expect_finish_rule,
    expect_finite_logprob,
    first_difference,
    skip,
    usage,
)

# -- endpoints -----------------------------------------------------------------------------------


@check("models_list", PROTOCOL, "GET /v1/models: a list of model objects that includes the model under test")
def models_list(suite: Suite) -> str:
    reply = suite.endpoint.get("models")
    expect(reply.status == 200, "status", f"HTTP {reply.status}: {reply.text[:200]}")
    body = reply.body if isinstance(reply.body, dict) else {}
    expect(body.get("object") == "list", "object", f"expected 'list', got {body.get('object')!r}")
    data = body.get("data")
    expect(isinstance(data, list) and data, "data", f"expected a non-empty list, got {data!r:.100}")
    for i, item in enumerate(data):
        expect(isinstance(item.get("id"), str) and item["id"], f"data[{i}].id", f"got {item.get('id')!r}")
        expect(item.get("object") == "model", f"data[{i}].object", f"expected 'model', got {item.get('object')!r}")
    ids = [item["id"] for item in data]
    expect(suite.model in ids, "data[].id", f"{suite.model!r} not listed: {ids}")
    return ", ".join(ids)


@check("health", PROTOCOL, "GET /health answers 200")
def health(suite: Suite) -> None:
    reply = suite.endpoint.get("/health")
    expect(reply.status == 200, "status", f"HTTP {reply.status} from {suite.endpoint.url('/health')}")


# -- legacy completions --------------------------------------------------------------------------


def _completion_request(suite: Suite, **fields) -> dict:
    return {
        "model": suite.model,
        "prompt": "Once upon a time, in a quiet town,",
        "max_tokens": 8,
        "temperature": 0,
        **fields,
    }


def _expect_text_completion(reply: dict, model: str, limit: int) -> None:
    expect(isinstance(reply.get("id"), str) and reply["id"], "id", f"missing: {reply.get('id')!r}")
    expect(
        reply.get("object") == "text_completion", "object", f"expected 'text_completion', got {reply.get('object')!r}"
    )
    expect(str(reply.get("model", "")).startswith(model), "model", f"expected {model!r}, got {reply.get('model')!r}")
    first = choice(reply)
    expect(first.get("index") == 0, "choices[0].index", f"got {first.get('index')!r}")
    expect(isinstance(first.get("text"), str), "choices[0].text", f"expected a string, got {first.get('text')!r:.80}")
    expect_finish_rule(first.get("finish_reason"), usage(reply)["completion_tokens"], limit, "choices[0]")


@check("completions_basic", PROTOCOL, "POST /v1/completions: text_completion object, text, usage, finish rule")
def completions_basic(suite: Suite) -> None:
    _expect_text_completion(suite.post_ok("completions", _completion_request(suite)), suite.model, 8)


@check("completions_stream", PROTOCOL, "streamed /v1/completions: chunks assemble to the non-streamed text")
def completions_stream(suite: Suite) -> None:
    body = _completion_request(suite)
    expected = choice(suite.post_ok("completions", body)).get("text")
    reply = suite.stream(body, path="completions")
    expect(reply.done, "stream", "did not end with data: [DONE]")
    text, reasons = "", []
    for n, chunk in enumerate(reply.chunks):
        expect(chunk.get("object") == "text_completion", f"chunk[{n}].object", f"got {chunk.get('object')!r}")
        for c in chunk.get("choices") or []:
            text += c.get("text") or ""
            if c.get("finish_reason") is not None:
                reasons.append(c["finish_reason"])
    expect(text == expected, "choices[0].text", "streamed " + first_difference(text, expected or ""))
    expect(len(reasons) == 1, "finish_reason", f"expected one finish_reason, got {reasons}")


@check(
    "completions_logprobs", PROTOCOL, "/v1/completions logprobs=2: tokens, token_logprobs, top_logprobs, text_offset"
)
def completions_logprobs(suite: Suite) -> None:
    reply = suite.post_ok("completions", _completion_request(suite, logprobs=2))
    logprobs = choice(reply).get("logprobs")
    expect(isinstance(logprobs, dict), "choices[0].logprobs", f"expected an object, got {logprobs!r:.80}")
    tokens = logprobs.get("tokens")
    expect(isinstance(tokens, list) and tokens, "choices[0].logprobs.tokens", f"got {tokens!r:.80}")
    count = len(tokens)
    for key in ("token_logprobs", "top_logprobs", "text_offset"):
        value = logprobs.get(key)
        expect(
            isinstance(value, list) and len(value) == count, f"choices[0].logprobs.{key}", f"expected {count} entries"
        )
    for i, value in enumerate(logprobs["token_logprobs"]):
        expect_finite_logprob(value, f"choices[0].logprobs.token_logprobs[{i}]")
    for i, top in enumerate(logprobs["top_logprobs"]):
        expect(
            isinstance(top, dict) and 2 <= len(top) <= 3, f"choices[0].logprobs.top_logprobs[{i}]", f"got {top!r:.80}"
        )
    offsets = logprobs["text_offset"]
    expect(offsets == sorted(offsets), "choices[0].logprobs.text_offset", f"not non-decreasing: {offsets}")
    expect(usage(reply)["completion_tokens"] in (count, count + 1), "usage.completion_tokens", f"!= {count} tokens")


# -- errors --------------------------------------------------------------------------------------


def expect_error(
    suite: Suite, status: int, body: dict | None = None, raw: bytes | None = None, path: str = "chat/completions"
) -> str:
    """The request is refused with `status` and an OpenAI error object carrying a message."""
    reply = suite.endpoint.post(path, body, raw=raw)
    expect(reply.status == status, "status", f"HTTP {reply.status}, expected {status}: {reply.text[:200]}")
    error = reply.body.get("error") if isinstance(reply.body, dict) else None
    expect(
        isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"],
        "error.message",
        f"expected {{'error': {{'message': ...}}}}, got {reply.text[:160]!r}",
    )
    return error["message"][:90]


def _bad_request(name: str, summary: str, build, status: int = 400) -> None:
    """Register a check sending the request `build(suite)` and expecting `status`."""

    def run(suite: Suite) -> str:
        return expect_error(suite, status, build(suite))

    check(name, PROTOCOL, summary)(run)


_bad_request("error_empty_messages", "messages [] -> 400", lambda s: s.request(messages=[]))
_bad_request(
    "error_bad_role", "an unknown role -> 400", lambda s: s.request(messages=[{"role": "wizard", "content": "hi"}])
)
_bad_request("error_messages_not_list", "messages as a string -> 400", lambda s: s.request(messages="hello"))
_bad_request(
    "error_content_wrong_type",
    "message content as a number -> 400",
    lambda s: s.request(messages=[{"role": "user", "content": 42}]),
)
_bad_request("error_max_tokens_string", "max_tokens as a string -> 400", lambda s: s.request(max_tokens="ten"))
_bad_request("error_max_tokens_negative", "max_tokens -1 -> 400", lambda s: s.request(max_tokens=-1))
_bad_request("error_temperature_negative", "temperature -1 -> 400", lambda s: s.request(temperature=-1))
_bad_request("error_top_p_out_of_range", "top_p 1.5 -> 400", lambda s: s.request(top_p=1.5))
_bad_request("error_n_zero", "n 0 -> 400", lambda s: s.request(n=0))
_bad_request("error_unknown_model", "an unknown model -> 404", lambda s: s.request(model="no-such-model-xyz"), 404)
_bad_request(
    "error_top_logprobs_without_logprobs", "top_logprobs without logprobs -> 400", lambda s: s.request(top_logprobs=2)
)
_bad_request(
    "error_top_logprobs_over_20", "top_logprobs 21 -> 400", lambda s: s.request(logprobs=True, top_logprobs=21)
)
_bad_request(
    "error_response_format_type",
    "response_format type 'yaml' -> 400",
    lambda s: s.request(response_format={"type": "yaml"}),
)
_bad_request(
    "error_json_schema_invalid",
    "an invalid JSON schema in response_format -> 400",
    lambda s: s.request(
        response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}
    ),
)
_bad_request(
    "error_tool_choice_unknown_function",
    "tool_choice naming a function not in tools -> 400",
    lambda s: s.request(
        tools=[{"type": "function", "function": {"name": "known", "parameters": {"type": "object"}}}],
        tool_choice={"type": "function", "function": {"name": "unknown"}},
    ),
)
_bad_request(
    "error_tool_choice_without_tools",
    "tool_choice required without tools -> 400",
    lambda s: s.request(tool_choice="required"),
)


@check("error_malformed_json", PROTOCOL, "a body that is not JSON -> 400")
def error_malformed_json(suite: Suite) -> str:
    return expect_error(suite, 400, raw=b'{"model": "x", "messages": [')


@check("error_prompt_over_context", PROTOCOL, "a prompt longer than the context -> 400")
def error_prompt_over_context(suite: Suite) -> str:
    if suite.max_model_len is None:
        skip("context size unknown: the server does not report max_model_len (pass --max-model-len)")
    long_prompt = "hello " * (2 * suite.max_model_len + 16)
    return expect_error(suite, 400, suite.request(long_prompt, max_tokens=1))


@check("error_max_tokens_over_context", PROTOCOL, "max_tokens beyond the context -> 400")
def error_max_tokens_over_context(suite: Suite) -> str:
    if suite.max_model_len is None:
        skip("context size unknown: the server does not report max_model_len (pass --max-model-len)")
    return expect_error(suite, 400, suite.request(max_tokens=suite.max_model_len + 1))


# -- authentication ------------------------------------------------------------------------------


def _needs_key(suite: Suite) -> None:
    if not suite.endpoint.api_key:
        skip("no --api-key given: cannot tell whether the server requires one")


def _auth_status(suite: Suite, auth: bool | str, path: str = "chat/completions") -> None:
    _needs_key(suite)
    if path == "models":
        reply = suite.endpoint.get(path, auth=auth)
    else:
        reply = suite.endpoint.post(path, suite.request(max_tokens=1), auth=auth)
    expect(reply.status == 401, "status", f"HTTP {reply.status}, expected 401: {reply.text[:120]}")


@check("auth_missing_key", PROTOCOL, "a chat request without the API key -> 401")
def auth_missing_key(suite: Suite) -> None:
    _auth_status(suite, auth=False)


@check("auth_wrong_key", PROTOCOL, "a chat request with a wrong API key -> 401")
def auth_wrong_key(suite: Suite) -> None:
    _auth_status(suite, auth="wrong-key-" + "x" * 8)


@check("auth_models_protected", PROTOCOL, "GET /v1/models without the API key -> 401")
def auth_models_protected(suite: Suite) -> None:
    _auth_status(suite, auth=False, path="models")


@check("auth_error_body", PROTOCOL, "the 401 body is an OpenAI error object with a message")
def auth_error_body(suite: Suite) -> None:
    _needs_key(suite)
    reply = suite.endpoint.post("chat/completions", suite.request(max_tokens=1), auth=False)
    expect(reply.status == 401, "status", f"HTTP {reply.status}, expected 401")
    error = reply.body.get("error") if isinstance(reply.body, dict) else None
    expect(
        isinstance(error, dict) and isinstance(error.get("message"), str),
        "error",
        f"expected {{'error': {{'message': ...}}}}, got {reply.text[:120]!r}",
    )


# -- concurrency ---------------------------------------------------------------------------------


@check("concurrency_smoke", PROTOCOL, "8 concurrent chat requests all succeed with sane usage")
def concurrency_smoke(suite: Suite) -> str:
    prompts = [f"Tell me fact number {i} about the sea." for i in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        replies = list(pool.map(lambda p: suite.endpoint.post("chat/completions", suite.request(p)), prompts))
    for i, reply in enumerate(replies):
        expect(reply.status == 200, f"request[{i}].status", f"HTTP {reply.status}: {reply.text[:120]}")
        expect_chat_completion(reply.body, suite.model)
        expect(usage(reply.body)["completion_tokens"] <= 16, f"request[{i}].usage.completion_tokens", "over max_tokens")
    return f"{len(replies)} ok in {max(r.seconds for r in replies):.2f} s"


@check("concurrency_mixed_stream", PROTOCOL, "concurrent streams, plain and n=2 requests all complete")
def concurrency_mixed_stream(suite: Suite) -> str:
    bodies = [suite.request(f"Count to {i}.", stream=True) for i in range(4)]
    bodies += [suite.request(f"Name {i} colours.", n=2, temperature=1.0) for i in range(2)]
    bodies += [suite.request(f"Name {i} animals.") for i in range(2)]

    def send(body: dict) -> tuple[int, bool]:
        if body.get("stream"):
            reply = suite.endpoint.stream("chat/completions", body)
            return reply.status, reply.done
        reply = suite.endpoint.post("chat/completions", body)
        return reply.status, reply.status == 200 and len(reply.body.get("choices", [])) == body.get("n", 1)

    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        results = list(pool.map(send, bodies))
    for i, (status, complete) in enumerate(results):
        expect(status == 200, f"request[{i}].status", f"HTTP {status}")
        expect(complete, f"request[{i}]", "stream without [DONE] or wrong number of choices")
    return f"{len(results)} ok"


@check(
    "server_alive_after_suite", PROTOCOL, "after every other check: /health is 200 and a chat still works", order=100
)
def server_alive_after_suite(suite: Suite) -> None:
    reply = suite.endpoint.get("/health")
    expect(reply.status == 200, "status", f"/health answered HTTP {reply.status} after the suite")
    content(suite.chat(suite.request(max_tokens=2)))
