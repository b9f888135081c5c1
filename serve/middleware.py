"""Request compatibility for vLLM's OpenAI server, as pure ASGI middleware.

`qwen35-serve` adds :class:`RequestCompatMiddleware` to vLLM's app through vLLM's `--middleware`
option, which makes it the outermost user middleware: it sees every request before vLLM's own
middleware and routes, and every response on its way out. It

- checks the API key first (vLLM's rule: bearer token, paths under `/v1`, `/v2`, `/inference`,
  `/cohere`), answering 401 with an OpenAI error object where vLLM's middleware answers
  `{"error": "Unauthorized"}`;
- reads the JSON body of chat/completion requests (at most `max_request_bytes`, else 413) and
  answers 400 naming the field for what the engine should never see: malformed or non-standard JSON
  (`NaN`, nesting deeper than the parser's limit), wrong JSON types for the standard fields (vLLM's
  parser would coerce `"2"` to 2), `n` or `best_of` above the configured maximum, empty
  `messages`, unknown roles, tool messages without `tool_call_id`, malformed tool definitions and
  JSON Schemas, and image/audio/video parts when the served model takes text only;
- translates the thinking switches clients send: `thinking: {"type": "enabled" | "disabled"}`
  (Anthropic style; `budget_tokens` is accepted and ignored) and a top-level `enable_thinking`
  (Qwen style) become `chat_template_kwargs.enable_thinking`; with `thinking_off_with_tools`, a
  request that offers tools with `tool_choice` auto and does not ask for thinking gets it off;
- drops `delta.content` from streamed replies with a forced tool choice (`required` or a named
  function): the grammar allows nothing but tool calls there, and vLLM's streaming Qwen3 parser
  lets the `<tool_call>` markup through as text when a model spells it with ordinary tokens
  (the non-streamed reply has content ``""``);
- rewrites every other error body that is not an OpenAI error object (FastAPI's `{"detail": ...}`,
  a plain-text 500) into `{"error": {"message", "type", "param", "code"}}`.

Settings come from `CompatSettings` passed to the constructor, else from the attribute
`qwen35_compat` (a dict) of vLLM's parsed arguments (`app.state.args`), else the defaults. Nothing
here imports vLLM; what it needs from vLLM's app state it reads by attribute.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields

log = logging.getLogger("vllm.qwen35.serve")

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SETTINGS_ATTR = "qwen35_compat"
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
CHAT_PATH, COMPLETIONS_PATH, TOKENIZE_PATH = "/v1/chat/completions", "/v1/completions", "/tokenize"
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MEDIA_PARTS = ("image_url", "input_image", "image", "image_pil", "image_embeds", "input_audio", "audio_url",
               "audio", "video_url", "video", "file", "input_file")  # fmt: skip
JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
MAX_SCHEMA_DEPTH = 64
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError",
               422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}  # fmt: skip


@dataclass(frozen=True)
class CompatSettings:
    max_n: int = 8
    thinking_off_with_tools: bool = False
    text_only: bool | None = None  # None: ask vLLM's model config
    max_request_bytes: int = 32 * 1024 * 1024
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: read vLLM's args / VLLM_API_KEY

    @classmethod
    def from_mapping(cls, values: dict) -> CompatSettings:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known and v is not None})


class RequestError(Exception):
    """A request refused before it reaches vLLM."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    error = {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}
    return json.dumps({"error": error}).encode()


async def send_error(send: Send, status: int, message: str, param: str | None = None) -> None:
    body = error_body(status, message, param)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# -- request checks ------------------------------------------------------------------------------


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return _is_int(v) or isinstance(v, float)


_TYPES: dict[str, tuple[str, Callable[[object], bool]]] = {
    "str": ("a string", lambda v: isinstance(v, str)),
    "int": ("an integer", _is_int),
    "number": ("a number", _is_number),
    "bool": ("a boolean", lambda v: isinstance(v, bool)),
    "object": ("an object", lambda v: isinstance(v, dict)),
    "list": ("an array", lambda v: isinstance(v, list)),
    "stop": ("a string or an array of strings",
             lambda v: isinstance(v, str) or isinstance(v, list) and all(isinstance(s, str) for s in v)),
    "tool_choice": ("a string or an object", lambda v: isinstance(v, (str, dict))),
}  # fmt: skip
SAMPLING_FIELDS = {
    "model": "str", "n": "int", "best_of": "int", "max_tokens": "int", "max_completion_tokens": "int",
    "min_tokens": "int", "temperature": "number", "top_p": "number", "top_k": "int", "min_p": "number",
    "presence_penalty": "number", "frequency_penalty": "number", "repetition_penalty": "number", "seed": "int",
    "stream": "bool", "stream_options": "object", "stop": "stop", "user": "str", "logit_bias": "object",
    "ignore_eos": "bool",
}  # fmt: skip
CHAT_FIELDS = {
    **SAMPLING_FIELDS, "messages": "list", "logprobs": "bool", "top_logprobs": "int", "tools": "list",
    "tool_choice": "tool_choice", "parallel_tool_calls": "bool", "response_format": "object",
    "chat_template_kwargs": "object", "enable_thinking": "bool", "thinking": "object",
}  # fmt: skip
COMPLETION_FIELDS = {**SAMPLING_FIELDS, "logprobs": "int", "echo": "bool", "suffix": "str"}


def check_types(body: dict, table: dict[str, str]) -> None:
    """Standard fields must have their JSON type (null means absent)."""
    for name, kind in table.items():
        value = body.get(name)
        if value is None:
            continue
        label, test = _TYPES[kind]
        if not test(value):
            raise RequestError(f"{name} must be {label}, got {json.dumps(value)[:80]}", name)


def check_n(body: dict, max_n: int) -> None:
    for name in ("n", "best_of"):
        n = body.get(name)
        if n is not None and n > max_n:
            raise RequestError(f"{name}={n} is above this server's maximum of {max_n}", name)


def check_prompt(body: dict) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        return  # prompt_embeds, or vLLM's own message
    ok = (
        isinstance(prompt, str)
        or isinstance(prompt, list)
        and (
            all(isinstance(p, str) for p in prompt)
            or all(_is_int(t) for t in prompt)
            or all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt)
        )
    )
    if not ok:
        raise RequestError("prompt must be a string, an array of strings, or token ids (an array of integers "
                           "or of integer arrays)", "prompt")  # fmt: skip


def check_messages(messages: list, text_only: bool, model_name: str) -> None:
    if not messages:
        raise RequestError("messages must contain at least one message", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with a role, got {json.dumps(message)[:60]}", where)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role: {json.dumps(role)[:40]} is not one of {', '.join(ROLES)}",
                               f"{where}.role")  # fmt: skip
        content = message.get("content")
        if content is None and role in ("system", "developer", "user", "tool"):
            raise RequestError(f"{where}.content is required for a {role} message", f"{where}.content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"{where}.content must be a string or an array of content parts, got "
                               f"{json.dumps(content)[:60]}", f"{where}.content")  # fmt: skip
        for j, part in enumerate(content if isinstance(content, list) else []):
            part_type = part.get("type") if isinstance(part, dict) else None
            if not isinstance(part_type, str):
                raise RequestError(f"{where}.content[{j}] must be an object with a type", f"{where}.content[{j}]")
            if text_only and part_type in MEDIA_PARTS:
                raise RequestError(
                    f"{where}.content[{j}]: this server's model ({model_name}) takes text only, so "
                    f"'{part_type}' parts are not accepted; send the content as text",
                    f"{where}.content[{j}].type",
                )
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise RequestError(f"{where}.tool_call_id: a tool message needs the id of the call it answers",
                               f"{where}.tool_call_id")  # fmt: skip
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls must be an array", f"{where}.tool_calls")


def check_tools(tools: list, tool_choice: object) -> None:
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(f"{where} must be an object with type 'function'", where)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"{where}.function must be an object with a name", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise RequestError(f"{where}.function.name must be 1-64 letters, digits, '_', '-', '.' or ':', got "
                               f"{json.dumps(name)[:70]}", f"{where}.function.name")  # fmt: skip
        for key, kind in (("description", str), ("strict", bool)):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise RequestError(f"{where}.function.{key} must be a {kind.__name__}", f"{where}.function.{key}")
        parameters = function.get("parameters")
        if parameters is None:
            continue
        path = f"{where}.function.parameters"
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise RequestError(f"{path} must be a JSON Schema of type 'object'", path)
        check_schema(parameters, path)
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise RequestError(f"tool_choice must be 'none', 'auto', 'required' or a function, got '{tool_choice}'",
                           "tool_choice")  # fmt: skip
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError("tool_choice: expected {'type': 'function', 'function': {'name': ...}}", "tool_choice")


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("not", "if", "then", "else", "contains", "propertyNames", "additionalProperties",
               "additionalItems", "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")  # fmt: skip


def check_schema(schema: object, path: str, depth: int = 0) -> None:
    """Structural check of a JSON Schema (the keywords grammar compilers read); raises RequestError."""
    if isinstance(schema, bool):
        return
    if depth > MAX_SCHEMA_DEPTH:
        raise RequestError(f"{path}: schema nested deeper than {MAX_SCHEMA_DEPTH} levels", path)
    if not isinstance(schema, dict):
        raise RequestError(f"{path}: a schema must be an object or a boolean, got {json.dumps(schema)[:60]}", path)

    def bad(key: str, expected: str) -> RequestError:
        return RequestError(f"{path}.{key}: expected {expected}, got {json.dumps(schema[key])[:60]}", f"{path}.{key}")

    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
            raise bad("type", f"one of {', '.join(JSON_TYPES)} (or an array of them)")
    for key in _SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                raise bad(key, "an object of schemas")
            for name, sub in schema[key].items():
                check_schema(sub, f"{path}.{key}.{name}", depth + 1)
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                raise bad(key, "a non-empty array of schemas")
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{path}.{key}[{i}]", depth + 1)
    for key in _SCHEMA_ONE:
        if key in schema:
            check_schema(schema[key], f"{path}.{key}", depth + 1)
    if "items" in schema:
        items = schema["items"]
        for i, sub in enumerate(items) if isinstance(items, list) else [(None, items)]:
            check_schema(sub, f"{path}.items" + ("" if i is None else f"[{i}]"), depth + 1)
    if "required" in schema and not (
        isinstance(schema["required"], list) and all(isinstance(r, str) for r in schema["required"])
    ):
        raise bad("required", "an array of property names")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise bad("enum", "an array")
    for key in _COUNTS:
        if key in schema and not (_is_int(schema[key]) and schema[key] >= 0):
            raise bad(key, "a non-negative integer")
    for key in ("minimum", "maximum", "multipleOf"):
        if key in schema and not _is_number(schema[key]):
            raise bad(key, "a number")
    for key in ("pattern", "$ref", "format"):
        if key in schema and not isinstance(schema[key], str):
            raise bad(key, "a string")


def thinking_switch(body: dict) -> bool | None:
    """The client's thinking request from any of the three spellings (None: not asked); removes the two
    that vLLM does not know. Spellings that disagree are an error."""
    asked: dict[str, bool] = {}
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    if "enable_thinking" in kwargs:
        if not isinstance(kwargs["enable_thinking"], bool):
            raise RequestError("chat_template_kwargs.enable_thinking must be a boolean",
                               "chat_template_kwargs.enable_thinking")  # fmt: skip
        asked["chat_template_kwargs.enable_thinking"] = kwargs["enable_thinking"]
    thinking = body.pop("thinking", None)
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled"):
            raise RequestError(f"thinking.type must be 'enabled' or 'disabled', got {json.dumps(kind)[:40]}",
                               "thinking.type")  # fmt: skip
        asked["thinking.type"] = kind == "enabled"
    enable = body.pop("enable_thinking", None)
    if enable is not None:
        if not isinstance(enable, bool):
            raise RequestError("enable_thinking must be a boolean", "enable_thinking")
        asked["enable_thinking"] = enable
    if len(set(asked.values())) > 1:
        spelled = ", ".join(f"{k}={v}" for k, v in asked.items())
        raise RequestError(f"conflicting thinking switches: {spelled}", next(iter(asked)))
    return next(iter(asked.values())) if asked else None


@dataclass
class Rewrite:
    body: dict
    changed: bool = False
    strip_streamed_content: bool = False


def rewrite_chat(body: dict, settings: CompatSettings, text_only: bool, model_name: str) -> Rewrite:
    check_types(body, CHAT_FIELDS)
    check_n(body, settings.max_n)
    if "messages" not in body:
        raise RequestError("messages is required", "messages")
    check_messages(body["messages"], text_only, model_name)
    tools, tool_choice = body.get("tools") or [], body.get("tool_choice")
    check_tools(tools, tool_choice)
    result = Rewrite(body)
    had_spellings = "thinking" in body or "enable_thinking" in body
    enable = thinking_switch(body)
    if enable is None and settings.thinking_off_with_tools and tools and tool_choice in (None, "auto"):
        enable = False
    if enable is not None:
        kwargs = body.get("chat_template_kwargs") or {}
        if kwargs.get("enable_thinking") is not enable:
            body["chat_template_kwargs"] = {**kwargs, "enable_thinking": enable}
            result.changed = True
    result.changed |= had_spellings
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    result.strip_streamed_content = bool(body.get("stream") and tools and forced)
    return result


def rewrite_completion(body: dict, settings: CompatSettings) -> Rewrite:
    check_types(body, COMPLETION_FIELDS)
    check_n(body, settings.max_n)
    check_prompt(body)
    return Rewrite(body)


def rewrite_tokenize(body: dict) -> Rewrite:
    had_spellings = "thinking" in body or "enable_thinking" in body
    enable = thinking_switch(body) if "messages" in body else None
    if enable is not None:
        body["chat_template_kwargs"] = {**(body.get("chat_template_kwargs") or {}), "enable_thinking": enable}
    return Rewrite(body, changed=had_spellings)


def parse_json(raw: bytes) -> object:
    def no_constants(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(raw, parse_constant=no_constants)
    except RecursionError:
        raise RequestError("request body is nested too deeply") from None
    except UnicodeDecodeError:
        raise RequestError("request body is not valid UTF-8") from None
    except ValueError as e:
        raise RequestError(f"request body is not valid JSON: {e}") from None


# -- response rewriting --------------------------------------------------------------------------


def openai_error(status: int, raw: bytes) -> bytes | None:
    """An OpenAI error body for an error response whose body is not one (None: it already is)."""
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = raw.decode(errors="replace").strip()
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return None
        detail = payload.get("detail", error if error is not None else payload.get("message", payload))
    else:
        detail = payload
    if isinstance(detail, list):  # FastAPI validation errors
        detail = "; ".join(f"{'.'.join(map(str, d.get('loc', ())))}: {d.get('msg')}" if isinstance(d, dict) else str(d)
                           for d in detail)  # fmt: skip
    message = detail if isinstance(detail, str) and detail else json.dumps(detail)[:500]
    return error_body(status, message or f"HTTP {status}")


class _ErrorBodies:
    """Wraps `send`: error responses leave with an OpenAI error body."""

    def __init__(self, send: Send) -> None:
        self.send, self.start, self.chunks = send, None, []
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            if message["status"] >= 400:
                self.start = message
                return
        elif message["type"] == "http.response.body" and self.start is not None:
            self.chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            start, self.start = self.start, None
            raw = b"".join(self.chunks)
            body = openai_error(start["status"], raw)
            if body is not None:
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length",
                                                                                           b"content-type")]
                headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                start = {**start, "headers": headers}
            await self.send(start)
            await self.send({"type": "http.response.body", "body": raw if body is None else body})
            return
        await self.send(message)


class _StripStreamedContent:
    """Wraps `send` for a streamed chat reply: removes non-empty `delta.content` from every event."""

    def __init__(self, send: Send) -> None:
        self.send, self.pending = send, b""

    async def __call__(self, message: Message) -> None:
        if message["type"] != "http.response.body":
            await self.send(message)
            return
        data = self.pending + message.get("body", b"")
        more = message.get("more_body", False)
        events = data.split(b"\n\n")
        self.pending = events.pop() if more else b""
        if not more and events and events[-1] == b"":
            events.pop()
        out = b"".join(self._filter(event) for event in events)
        if out or not more:
            await self.send({"type": "http.response.body", "body": out, "more_body": more})

    @staticmethod
    def _filter(event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event + b"\n\n"
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return event + b"\n\n"
        if not isinstance(chunk, dict) or not chunk.get("choices"):
            return event + b"\n\n"  # usage-only and error events pass as they are
        if not any((c.get("delta") or {}).get("content") for c in chunk["choices"]):
            return event + b"\n\n"
        kept = []
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                del delta["content"]
                if not delta and choice.get("finish_reason") is None and not choice.get("logprobs"):
                    continue
            kept.append(choice)
        if not kept and not chunk.get("usage"):
            return b""
        chunk["choices"] = kept
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"


# -- the middleware ------------------------------------------------------------------------------


class RequestCompatMiddleware:
    """See the module docstring. `settings=None`: read from vLLM's args on the first request."""

    def __init__(self, app, settings: CompatSettings | None = None) -> None:
        self.app = app
        self._settings = settings
        self._resolved: tuple[CompatSettings, list[bytes], bool, str] | None = None

    def _resolve(self, scope: Scope) -> tuple[CompatSettings, list[bytes], bool, str]:
        """(settings, sha256 of accepted keys, text only, model name), read once from the app's state."""
        if self._resolved is not None:
            return self._resolved
        state = getattr(scope.get("app"), "state", None)
        args = getattr(state, "args", None)
        settings = self._settings or CompatSettings.from_mapping(getattr(args, SETTINGS_ATTR, None) or {})
        keys = list(settings.api_keys) or list(getattr(args, "api_key", None) or [])
        if not keys and os.environ.get("VLLM_API_KEY"):
            keys = [os.environ["VLLM_API_KEY"]]
        names = getattr(args, "served_model_name", None) or [getattr(args, "model", None) or "the model"]
        model_config = getattr(getattr(state, "vllm_config", None), "model_config", None)
        text_only = settings.text_only
        if text_only is None:
            text_only = model_config is not None and not getattr(model_config, "is_multimodal_model", True)
        resolved = (settings, [hashlib.sha256(k.encode()).digest() for k in keys], text_only, names[0])
        if state is None or getattr(state, "vllm_config", None) is not None or self._settings is not None:
            self._resolved = resolved  # cache once vLLM's state is complete
        return resolved

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings, key_hashes, text_only, model_name = self._resolve(scope)
        send = errors = _ErrorBodies(send)
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        method = scope.get("method", "GET")
        if key_hashes and method != "OPTIONS" and path.startswith(GUARDED_PREFIXES):
            if not self._authorized(scope, key_hashes):
                await send_error(send, 401, "Invalid or missing API key: send 'Authorization: Bearer <key>'")
                return
        if method == "POST" and path in (CHAT_PATH, COMPLETIONS_PATH, TOKENIZE_PATH):
            try:
                raw = await self._read_body(scope, receive, settings.max_request_bytes)
                payload = parse_json(raw)
                if not isinstance(payload, dict):
                    raise RequestError(f"request body must be a JSON object, got {type(payload).__name__}")
                if path == CHAT_PATH:
                    rewrite = rewrite_chat(payload, settings, text_only, model_name)
                elif path == COMPLETIONS_PATH:
                    rewrite = rewrite_completion(payload, settings)
                else:
                    rewrite = rewrite_tokenize(payload)
            except RequestError as e:
                await send_error(send, e.status, e.message, e.param)
                return
            if rewrite.changed:
                raw = json.dumps(rewrite.body).encode()
                headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
                scope = {**scope, "headers": headers + [(b"content-length", str(len(raw)).encode())]}
            receive = _replay(raw, receive)
            if rewrite.strip_streamed_content:
                send = _StripStreamedContent(send)
        try:
            await self.app(scope, receive, send)
        except Exception:
            if errors.started:
                raise
            log.exception("unhandled error serving %s %s", method, path)
            await send_error(send, 500, "internal server error (logged by the server)")

    @staticmethod
    def _authorized(scope: Scope, key_hashes: list[bytes]) -> bool:
        header = next((v for k, v in scope.get("headers", []) if k.lower() == b"authorization"), b"")
        scheme, _, token = header.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        return any([hmac.compare_digest(digest, h) for h in key_hashes])  # every key compared: constant time

    @staticmethod
    async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
        declared = next((v for k, v in scope.get("headers", []) if k.lower() == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(f"request body of {int(declared)} bytes is above this server's limit of {limit}",
                               status=413)  # fmt: skip
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestError("client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise RequestError(f"request body is above this server's limit of {limit} bytes", status=413)
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the already-read body over once, then waits on the real one (disconnects)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
