"""The check registry, the per-run context (`Suite`) and the helpers checks share.

A check is a function `fn(suite) -> str | None` registered with `@check(name, kind, summary)`.
It passes by returning (optionally a short note), fails by raising `CheckFailed(field, message)` —
`field` names what was wrong, e.g. `choices[0].finish_reason` — and skips by raising `CheckSkipped`.

Kinds:
- `protocol`: must hold for any model behind the server (shapes, counts, status codes, enforced
  constraints). These decide the exit code.
- `behaviour`: needs a capable model (answers a question, follows a system prompt, decides to call a
  tool). A tiny random model fails or skips them; that says nothing about the server.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from serve.accept.client import Endpoint, StreamReply

PROTOCOL = "protocol"
BEHAVIOUR = "behaviour"

PROMPT = "Write a short story about a robot who learns to paint."
DROP = object()
"""Pass as a field value to `Suite.request` to remove that field from the default request."""

FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call"}


class CheckFailed(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CheckSkipped(Exception):
    pass


def fail(field: str, message: str) -> NoReturn:
    raise CheckFailed(field, message)


def skip(reason: str) -> NoReturn:
    raise CheckSkipped(reason)


def expect(condition: object, field: str, message: str) -> None:
    if not condition:
        raise CheckFailed(field, message)


@dataclass(frozen=True)
class Check:
    name: str
    kind: str
    summary: str
    run: Callable[[Suite], str | None]
    order: int = 0
    """Checks run by (order, registration); the final server-health check uses a higher order."""


CHECKS: dict[str, Check] = {}


def check(name: str, kind: str, summary: str, order: int = 0) -> Callable:
    """Register the decorated function as a check."""
    if kind not in (PROTOCOL, BEHAVIOUR):
        raise ValueError(f"kind {kind!r} must be {PROTOCOL!r} or {BEHAVIOUR!r}")

    def register(fn: Callable[[Suite], str | None]) -> Callable[[Suite], str | None]:
        if name in CHECKS:
            raise ValueError(f"check {name!r} registered twice")
        CHECKS[name] = Check(name, kind, summary, fn, order)
        return fn

    return register


@dataclass
class Suite:
    """Everything a check needs: the endpoint, the model, what the server told us about it."""

    endpoint: Endpoint
    model: str
    max_model_len: int | None = None
    thinking_switch: bool = True
    """Send `chat_template_kwargs.enable_thinking` (vLLM / Qwen). Off: reasoning checks skip."""
    vision: str = "auto"
    """Whether the model takes images: `yes`, `no`, or `auto` (the server's answer to one image decides)."""
    max_images: int = 16
    """The server's limit of images per request (one more must be refused)."""
    memo: dict[str, Any] = field(default_factory=dict)

    # -- building requests -------------------------------------------------------------------

    def thinking_fields(self, thinking: bool | None) -> dict:
        if thinking is None or not self.thinking_switch:
            return {}
        return {"chat_template_kwargs": {"enable_thinking": thinking}}

    def request(self, prompt: str = PROMPT, messages: list | None = None, thinking: bool | None = False, **fields):
        """A chat request: greedy, 16 tokens, thinking off unless asked; `fields` override, `DROP` removes.

        Thinking is off by default because constrained decoding (JSON, forced tool calls) only starts
        once reasoning has ended, which a random test model never does.
        """
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages if messages is not None else [{"role": "user", "content": prompt}],
            "max_tokens": 16,
            "temperature": 0,
        }
        body.update(self.thinking_fields(thinking))
        for key, value in fields.items():
            if value is DROP:
                body.pop(key, None)
            else:
                body[key] = value
        return body

    # -- sending ----------------------------------------------------------------------------

    def chat(self, body: dict) -> dict:
        """POST a chat completion; anything but HTTP 200 with a JSON object fails the check."""
        return self.post_ok("chat/completions", body)

    def post_ok(self, path: str, body: dict) -> dict:
        reply = self.endpoint.post(path, body)
        expect(reply.status == 200, "status", f"HTTP {reply.status}, expected 200: {reply.text[:300]}")
        expect(isinstance(reply.body, dict), "body", f"not a JSON object: {reply.text[:200]!r}")
        return reply.body

    def stream(self, body: dict, path: str = "chat/completions") -> StreamReply:
        """POST with `stream: true`; anything but HTTP 200 fails the check."""
        reply = self.endpoint.stream(path, {**body, "stream": True})
        expect(reply.status == 200, "status", f"HTTP {reply.status}, expected 200: {str(reply.body)[:300]}")
        expect(not reply.malformed, "stream", f"data line is not JSON: {reply.malformed[:1]}")
        return reply

    def remember(self, key: str, compute: Callable[[], Any]) -> Any:
        """Compute a value shared by several checks once (e.g. the greedy reference reply)."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def reference(self) -> dict:
        """The greedy 16-token reply to PROMPT, with logprobs: the baseline many checks compare to.

        Sent twice, the second reply kept: with prefix caching the first request computes the whole
        prompt and later ones reuse cached blocks, which can round differently; every later request
        with this prompt sees the warm cache, like the kept reply."""

        def compute() -> dict:
            body = self.request(logprobs=True, top_logprobs=2)
            self.chat(body)
            return self.chat(body)

        return self.remember("reference", compute)


# -- reading replies ----------------------------------------------------------------------------


def choice(reply: dict, index: int = 0) -> dict:
    choices = reply.get("choices")
    expect(
        isinstance(choices, list) and len(choices) > index, "choices", f"expected > {index} choices: {choices!r:.200}"
    )
    expect(isinstance(choices[index], dict), f"choices[{index}]", "not an object")
    return choices[index]


def message(reply: dict, index: int = 0) -> dict:
    value = choice(reply, index).get("message")
    expect(isinstance(value, dict), f"choices[{index}].message", f"not an object: {value!r:.100}")
    return value


def content(reply: dict, index: int = 0) -> str:
    value = message(reply, index).get("content")
    expect(isinstance(value, str), f"choices[{index}].message.content", f"expected a string, got {value!r:.100}")
    return value


def reasoning_of(part: dict) -> str | None:
    """Reasoning text of a message or delta: vLLM's `reasoning` or the older `reasoning_content`."""
    value = part.get("reasoning")
    return value if value is not None else part.get("reasoning_content")


def usage(reply: dict) -> dict:
    """`usage` with integer counts and total = prompt + completion."""
    value = reply.get("usage")
    expect(isinstance(value, dict), "usage", f"missing or not an object: {value!r:.100}")
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        count = value.get(key)
        expect(isinstance(count, int) and not isinstance(count, bool), f"usage.{key}", f"not an integer: {count!r}")
        expect(count >= 0, f"usage.{key}", f"negative: {count}")
    expect(
        value["total_tokens"] == value["prompt_tokens"] + value["completion_tokens"],
        "usage.total_tokens",
        f"{value['total_tokens']} != prompt_tokens {value['prompt_tokens']} + completion_tokens "
        f"{value['completion_tokens']}",
    )
    return value


def logprob_entries(choice_obj: dict, where: str) -> list:
    logprobs = choice_obj.get("logprobs")
    expect(isinstance(logprobs, dict), f"{where}.logprobs", f"expected an object, got {logprobs!r:.100}")
    entries = logprobs.get("content")
    expect(isinstance(entries, list), f"{where}.logprobs.content", f"expected a list, got {entries!r:.100}")
    return entries


def expect_token_count(completion_tokens: int, generated: int, finish_reason: str | None, field: str) -> None:
    """`completion_tokens` counts every generated token; a server may leave the end-of-sequence
    token out of logprobs, so one fewer logprob entry is fine when the reply ended by `stop`."""
    allowed = {generated, generated + 1} if finish_reason == "stop" else {generated}
    expect(
        completion_tokens in allowed,
        field,
        f"{completion_tokens} but {generated} tokens were generated (by logprob entries, finish_reason "
        f"{finish_reason!r})",
    )


def expect_finish_rule(finish_reason: Any, completion_tokens: int, limit: int, where: str) -> None:
    """`length` exactly when the reply was cut at `limit` tokens; `stop` when it ended earlier."""
    expect(
        finish_reason in ("stop", "length"), f"{where}.finish_reason", f"expected stop or length, got {finish_reason!r}"
    )
    expect(completion_tokens <= limit, "usage.completion_tokens", f"{completion_tokens} exceeds the limit {limit}")
    if finish_reason == "length":
        expect(
            completion_tokens == limit,
            f"{where}.finish_reason",
            f"'length' but only {completion_tokens} of {limit} tokens were generated",
        )
    if completion_tokens < limit:
        expect(
            finish_reason == "stop",
            f"{where}.finish_reason",
            f"{finish_reason!r} but the reply ended after {completion_tokens} < {limit} tokens",
        )


def expect_chat_completion(reply: dict, model: str, n: int = 1) -> None:
    """The non-streamed `chat.completion` object shape."""
    expect(isinstance(reply.get("id"), str) and reply["id"], "id", f"missing or empty: {reply.get('id')!r}")
    expect(
        reply.get("object") == "chat.completion", "object", f"expected 'chat.completion', got {reply.get('object')!r}"
    )
    expect(
        isinstance(reply.get("created"), int), "created", f"expected an integer timestamp, got {reply.get('created')!r}"
    )
    expect(
        isinstance(reply.get("model"), str) and reply["model"].startswith(model),
        "model",
        f"expected {model!r}, got {reply.get('model')!r}",
    )
    choices = reply.get("choices")
    expect(isinstance(choices, list) and len(choices) == n, "choices", f"expected {n} choices, got {choices!r:.200}")
    indices = sorted(c.get("index") for c in choices if isinstance(c, dict))
    expect(indices == list(range(n)), "choices[].index", f"expected {list(range(n))}, got {indices}")
    for i, c in enumerate(choices):
        msg = c.get("message")
        expect(isinstance(msg, dict), f"choices[{i}].message", "not an object")
        expect(
            msg.get("role") == "assistant",
            f"choices[{i}].message.role",
            f"expected 'assistant', got {msg.get('role')!r}",
        )
        expect(
            msg.get("content") is None or isinstance(msg.get("content"), str),
            f"choices[{i}].message.content",
            f"expected a string or null, got {msg.get('content')!r:.100}",
        )
        expect(
            c.get("finish_reason") in FINISH_REASONS,
            f"choices[{i}].finish_reason",
            f"expected one of {sorted(FINISH_REASONS)}, got {c.get('finish_reason')!r}",
        )
    usage(reply)


def expect_finite_logprob(value: Any, field: str) -> None:
    expect(isinstance(value, (int, float)) and not isinstance(value, bool), field, f"not a number: {value!r}")
    expect(math.isfinite(value) or value == -math.inf, field, f"not finite: {value!r}")
    expect(value <= 1e-6, field, f"a log-probability must be <= 0, got {value}")


# -- assembling streams -------------------------------------------------------------------------


@dataclass
class StreamedChoice:
    role: str | None = None
    content: str = ""
    reasoning: str = ""
    finish_reasons: list = field(default_factory=list)
    logprob_entries: int = 0
    tool_calls: dict[int, dict] = field(default_factory=dict)
    """By tool-call index: id, type, name, arguments (concatenated)."""
    deltas_after_finish: int = 0


def assemble(reply: StreamReply) -> dict[int, StreamedChoice]:
    """Concatenate the deltas of a chat stream per choice index."""
    result: dict[int, StreamedChoice] = {}
    for n, chunk in enumerate(reply.chunks):
        for c in chunk.get("choices") or []:
            index = c.get("index")
            expect(isinstance(index, int), f"chunk[{n}].choices[].index", f"not an integer: {index!r}")
            streamed = result.setdefault(index, StreamedChoice())
            delta = c.get("delta") or {}
            expect(isinstance(delta, dict), f"chunk[{n}].choices[{index}].delta", "not an object")
            if streamed.finish_reasons and (delta.get("content") or reasoning_of(delta) or delta.get("tool_calls")):
                streamed.deltas_after_finish += 1
            if delta.get("role") is not None and streamed.role is None:
                streamed.role = delta["role"]
            streamed.content += delta.get("content") or ""
            streamed.reasoning += reasoning_of(delta) or ""
            for call in delta.get("tool_calls") or []:
                slot = streamed.tool_calls.setdefault(call.get("index", 0), {"arguments": ""})
                for key in ("id", "type"):
                    if call.get(key):
                        slot.setdefault(key, call[key])
                function = call.get("function") or {}
                if function.get("name"):
                    slot["name"] = slot.get("name", "") + function["name"]
                slot["arguments"] += function.get("arguments") or ""
            if isinstance(c.get("logprobs"), dict):
                streamed.logprob_entries += len(c["logprobs"].get("content") or [])
            if c.get("finish_reason") is not None:
                streamed.finish_reasons.append(c["finish_reason"])
    return result


def stream_usages(reply: StreamReply) -> list[tuple[int, dict]]:
    """(chunk position, usage) for every chunk carrying a non-null usage."""
    return [(n, chunk["usage"]) for n, chunk in enumerate(reply.chunks) if chunk.get("usage")]


def first_difference(a: str, b: str) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"differ at char {i}: {a[i : i + 20]!r} vs {b[i : i + 20]!r}"
    return f"lengths differ: {len(a)} vs {len(b)} chars ({a[-20:]!r} vs {b[-20:]!r})"
