"""Request checks for every route that reaches the engine.

Each engine route of `serve.routes` has a checker here. A checker gets the parsed JSON body and
answers `RequestError` (400, naming the field) or a `Rewrite`. Every checker does the same three
things:

1. our structural checks, which give clearer messages than a failed union of pydantic models:
   message roles, content part shapes, tool definitions and their JSON Schemas;
2. the body parsed by the route's own vLLM pydantic request model (`ChatCompletionRequest`,
   `ResponsesRequest`, ...), in pydantic's strict JSON mode: `"2"` is not the integer 2, `true` is not
   a number, and vLLM's own validators (stream options, logprobs, ...) run before anything is queued;
3. our policy: the `n` cap (`best_of`, generative-scoring items and the generate route's
   `sampling_params.n` alike), output token bounds (at least 1, at most the served context),
   no image/audio/video on a text-only model (saying why: the checkpoint has no vision encoder, or the
   config says `text_only`), no audio/video/file parts on a model that takes images only, and the
   thinking switches of chat requests. The images themselves are checked by `serve.images`.

The thinking switches: `thinking: {"type": "enabled" | "disabled"}` (Anthropic style; `budget_tokens`
is accepted and ignored) and a top-level `enable_thinking` (Qwen style) become
`chat_template_kwargs.enable_thinking`; with `thinking_off_with_tools`, a chat request that offers
tools with `tool_choice` auto and does not ask for thinking gets it off. A streamed chat request
with a forced tool choice (`required` or a named function) is marked so the middleware drops
`delta.content` from its reply (only tool calls may come out of it).

vLLM is imported only to name its client errors, when a body is validated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
RESPONSES_ROLES = ("system", "developer", "user", "assistant")
MEDIA_PARTS = ("image_url", "input_image", "image", "image_pil", "image_embeds", "input_audio", "audio_url",
               "audio", "video_url", "video", "file", "input_file", "document")  # fmt: skip
IMAGE_PARTS = ("image_url", "input_image", "image", "image_pil", "image_embeds")
JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
MAX_SCHEMA_DEPTH = 64
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json", "tuple"}


class RequestError(Exception):
    """A request refused before it reaches vLLM."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass(frozen=True)
class Policy:
    """What the checks enforce on this server."""

    max_n: int = 8
    text_only: bool = False
    text_only_reason: str = ""
    """Why the server takes text only, e.g. 'its Qwen3_5ForCausalLM checkpoint has no vision encoder'."""
    images_only: bool = False
    """The model takes images but no audio, video or files."""
    model_name: str = "the model"
    max_model_len: int | None = None
    thinking_off_with_tools: bool = False
    max_tool_calls: int | None = 8


@dataclass
class Rewrite:
    body: dict
    changed: bool = False
    strip_streamed_content: bool = False
    tool_call_limit: int | None = None
    """Tool calls the reply may hold (see `serve.toolcalls.CALL_LIMIT`); None: no limit of ours."""


ModelFor = Callable[[str], object | None]
"""The pydantic request model of a route template (None: the route has none)."""


# -- shared pieces -------------------------------------------------------------------------------


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return _is_int(v) or isinstance(v, float)


def _shown(value: object, limit: int = 80) -> str:
    return json.dumps(value, default=str)[:limit]


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


@lru_cache(maxsize=64)
def _adapter(model: object):
    from pydantic import TypeAdapter

    return TypeAdapter(model)


@lru_cache(maxsize=1)
def _client_errors() -> tuple[type[BaseException], ...]:
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return ()
    return (VLLMClientError,)


def _param(loc: tuple) -> str | None:
    """'a.b[0].c' from a pydantic error location, without the union member tags pydantic adds."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif isinstance(part, str) and _FIELD.match(part) and part not in _TYPE_TAGS:
            text += f".{part}" if text else part
    return text or None


def validate_with(model: object, body: dict) -> object:
    """`body` parsed by vLLM's request model (strict JSON mode); RequestError naming the first bad field."""
    from pydantic import ValidationError

    try:
        return _adapter(model).validate_json(json.dumps(body), strict=True)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = min(errors, key=lambda d: len(d["loc"]))  # the shallowest: the field itself, not a union branch
        param = _param(first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        got = f", got {_shown(first['input'])}" if "input" in first and not isinstance(first["input"], dict) else ""
        raise RequestError(f"{param}: {message}{got}" if param else f"{message}{got}", param) from None
    except _client_errors() as e:
        raise RequestError(str(e), getattr(e, "parameter", None)) from None


def check_n(body: dict, fields: tuple[str, ...], max_n: int, where: str = "") -> None:
    for name in fields:
        n = body.get(name)
        if _is_int(n) and n > max_n:
            raise RequestError(f"{where}{name}={n} is above this server's maximum of {max_n}", where + name)


def check_output_tokens(body: dict, fields: tuple[str, ...], policy: Policy, where: str = "") -> None:
    """Output token limits are at least 1 and at most the served context."""
    for name in fields:
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise RequestError(f"{where}{name} must be an integer of at least 1, got {_shown(value)}", where + name)
        if policy.max_model_len is not None and value > policy.max_model_len:
            raise RequestError(f"{where}{name}={value} is above this server's context of {policy.max_model_len} "
                               "tokens", where + name)  # fmt: skip


def _media_refused(where: str, part_type: str, policy: Policy) -> RequestError:
    why = f" ({policy.text_only_reason})" if policy.text_only_reason else ""
    return RequestError(f"{where}: this server's model ({policy.model_name}) takes text only{why}, so "
                        f"'{part_type}' parts are not accepted; send the content as text", f"{where}.type")  # fmt: skip


def check_parts(content: object, where: str, policy: Policy) -> None:
    """Content parts are objects with a type; media parts are refused on a text-only model."""
    for j, part in enumerate(content if isinstance(content, list) else []):
        part_type = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part_type, str):
            raise RequestError(f"{where}[{j}] must be an object with a type", f"{where}[{j}]")
        if policy.text_only and part_type in MEDIA_PARTS:
            raise _media_refused(f"{where}[{j}]", part_type, policy)
        if policy.images_only and part_type in MEDIA_PARTS and part_type not in IMAGE_PARTS:
            raise RequestError(f"{where}[{j}]: this server's model ({policy.model_name}) takes text and images "
                               f"only, so '{part_type}' parts are not accepted", f"{where}[{j}].type")  # fmt: skip
        nested = part.get("content")
        if isinstance(nested, list):  # tool results carrying parts (Anthropic)
            check_parts(nested, f"{where}[{j}].content", policy)


def check_messages(messages: object, policy: Policy, where: str = "messages") -> None:
    if not isinstance(messages, list):
        raise RequestError(f"{where} must be an array of messages, got {_shown(messages, 60)}", where)
    if not messages:
        raise RequestError(f"{where} must contain at least one message", where)
    for i, message in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{at} must be an object with a role, got {_shown(message, 60)}", at)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{at}.role: {_shown(role, 40)} is not one of {', '.join(ROLES)}", f"{at}.role")
        content = message.get("content")
        if content is None and role in ("system", "developer", "user", "tool"):
            raise RequestError(f"{at}.content is required for a {role} message", f"{at}.content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"{at}.content must be a string or an array of content parts, got "
                               f"{_shown(content, 60)}", f"{at}.content")  # fmt: skip
        check_parts(content, f"{at}.content", policy)
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise RequestError(f"{at}.tool_call_id: a tool message needs the id of the call it answers",
                               f"{at}.tool_call_id")  # fmt: skip
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise RequestError(f"{at}.tool_calls must be an array", f"{at}.tool_calls")


def check_tools(tools: object, tool_choice: object) -> None:
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise RequestError(f"tools must be an array, got {_shown(tools, 60)}", "tools")
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
                               f"{_shown(name, 70)}", f"{where}.function.name")  # fmt: skip
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
        names = [t["function"]["name"] for t in tools]
        if function["name"] not in names:
            raise RequestError(f"tool_choice names {function['name']!r}, which is not among the tools "
                               f"({', '.join(names) or 'none given'})", "tool_choice")  # fmt: skip


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
        raise RequestError(f"{path}: a schema must be an object or a boolean, got {_shown(schema, 60)}", path)

    def bad(key: str, expected: str) -> RequestError:
        return RequestError(f"{path}.{key}: expected {expected}, got {_shown(schema[key], 60)}", f"{path}.{key}")

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
        if not isinstance(thinking, dict):
            raise RequestError(f"thinking must be an object such as {{'type': 'disabled'}}, got {_shown(thinking, 40)}",
                               "thinking")  # fmt: skip
        kind = thinking.get("type")
        if kind not in ("enabled", "disabled"):
            raise RequestError(f"thinking.type must be 'enabled' or 'disabled', got {_shown(kind, 40)}",
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


def _apply_thinking(body: dict, policy: Policy, result: Rewrite) -> None:
    had_spellings = "thinking" in body or "enable_thinking" in body
    enable = thinking_switch(body)
    tools, tool_choice = body.get("tools"), body.get("tool_choice")
    if enable is None and policy.thinking_off_with_tools and tools and tool_choice in (None, "auto"):
        enable = False
    if enable is not None:
        kwargs = body.get("chat_template_kwargs") or {}
        if kwargs.get("enable_thinking") is not enable:
            body["chat_template_kwargs"] = {**kwargs, "enable_thinking": enable}
            result.changed = True
    result.changed |= had_spellings


# -- one checker per engine route ----------------------------------------------------------------


def check_chat(body: dict, policy: Policy, model: object | None) -> Rewrite:
    result = Rewrite(body)
    _apply_thinking(body, policy, result)
    if "messages" not in body:
        raise RequestError("messages is required", "messages")
    check_messages(body["messages"], policy)
    check_tools(body.get("tools"), body.get("tool_choice"))
    if model is not None:
        validate_with(model, body)
    check_n(body, ("n",), policy.max_n)
    check_output_tokens(body, ("max_tokens", "max_completion_tokens"), policy)
    tool_choice = body.get("tool_choice")
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    result.strip_streamed_content = bool(body.get("stream") and body.get("tools") and forced)
    if body.get("tools"):
        result.tool_call_limit = 1 if body.get("parallel_tool_calls") is False else policy.max_tool_calls
    return result


def check_completion(body: dict, policy: Policy, model: object | None) -> Rewrite:
    if model is not None:
        validate_with(model, body)
    check_n(body, ("n", "best_of"), policy.max_n)
    check_output_tokens(body, ("max_tokens",), policy)
    return Rewrite(body)


def check_chat_batch(body: dict, policy: Policy, model: object | None) -> Rewrite:
    result = Rewrite(body)
    _apply_thinking(body, policy, result)
    conversations = body.get("messages")
    if not isinstance(conversations, list) or not conversations:
        raise RequestError("messages must be a non-empty array of conversations (arrays of messages)", "messages")
    for i, conversation in enumerate(conversations):
        check_messages(conversation, policy, f"messages[{i}]")
    if model is not None:
        validate_with(model, body)
    check_n(body, ("n",), policy.max_n)
    check_output_tokens(body, ("max_tokens", "max_completion_tokens"), policy)
    return result


def check_responses(body: dict, policy: Policy, model: object | None) -> Rewrite:
    items = body.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            continue  # the model names the shape it expects
        if "role" in item and item.get("type", "message") == "message":
            if item["role"] not in RESPONSES_ROLES:
                raise RequestError(f"{at}.role: {_shown(item['role'], 40)} is not one of {', '.join(RESPONSES_ROLES)}",
                                   f"{at}.role")  # fmt: skip
            check_parts(item.get("content"), f"{at}.content", policy)
    if model is not None:
        validate_with(model, body)
    check_output_tokens(body, ("max_output_tokens",), policy)
    return Rewrite(body)


def check_anthropic_messages(body: dict, policy: Policy, model: object | None) -> Rewrite:
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(message, dict):
            if message.get("role") not in ("user", "assistant"):
                raise RequestError(f"messages[{i}].role: {_shown(message.get('role'), 40)} is not one of user, "
                                   "assistant (the system prompt goes in 'system')", f"messages[{i}].role")  # fmt: skip
            check_parts(message.get("content"), f"messages[{i}].content", policy)
    check_parts(body.get("system"), "system", policy)
    if model is not None:
        validate_with(model, body)
    check_output_tokens(body, ("max_tokens",), policy)
    return Rewrite(body)


def check_generate(body: dict, policy: Policy, model: object | None) -> Rewrite:
    if model is not None:
        validate_with(model, body)
    if policy.text_only and (body.get("features") or body.get("content_parts")):
        raise _media_refused("features" if body.get("features") else "content_parts", "multimodal", policy)
    params = body.get("sampling_params")
    if isinstance(params, dict):
        check_n(params, ("n",), policy.max_n, "sampling_params.")
        check_output_tokens(params, ("max_tokens",), policy, "sampling_params.")
    return Rewrite(body)


def check_generative_scoring(body: dict, policy: Policy, model: object | None) -> Rewrite:
    if model is not None:
        validate_with(model, body)
    items = body.get("items")
    if isinstance(items, list) and len(items) > policy.max_n:
        raise RequestError(f"items: {len(items)} items are above this server's maximum of {policy.max_n} (each item "
                           "is scored as a sequence of its own, like n)", "items")  # fmt: skip
    return Rewrite(body)


def check_structured_decision(body: dict, policy: Policy, model: object | None) -> Rewrite:
    if model is not None:
        validate_with(model, body)
    for key in ("images", "audio", "videos"):
        if policy.text_only and body.get(key):
            raise RequestError(f"{key}: this server's model ({policy.model_name}) takes text only", key)
    return Rewrite(body)


def rewrite_tokenize(body: dict, policy: Policy, model: object | None) -> Rewrite:
    """`/tokenize` runs no model: only the thinking switches are translated, so a tokenized chat
    matches what the chat route would render."""
    had_spellings = "thinking" in body or "enable_thinking" in body
    enable = thinking_switch(body) if "messages" in body else None
    if enable is not None:
        body["chat_template_kwargs"] = {**(body.get("chat_template_kwargs") or {}), "enable_thinking": enable}
    return Rewrite(body, changed=had_spellings)


Checker = Callable[[dict, Policy, object | None], Rewrite]

CHECKS: dict[str, Checker] = {
    "/v1/chat/completions": check_chat,
    "/v1/completions": check_completion,
    "/v1/chat/completions/batch": check_chat_batch,
    "/v1/responses": check_responses,
    "/v1/messages": check_anthropic_messages,
    "/inference/v1/generate": check_generate,
    "/generative_scoring": check_generative_scoring,
    "/v1/systemone": check_structured_decision,
    "/tokenize": rewrite_tokenize,
}
INVOCATIONS = "/invocations"
INVOCATION_ORDER = ("/v1/chat/completions", "/v1/completions")
"""vLLM's `/invocations` tries these request types in this order and serves the first that parses."""


def check_invocation(body: dict, policy: Policy, model_for: ModelFor) -> Rewrite:
    """`/invocations` serves a chat request when the body has `messages`, a completion when it has
    `prompt`; it gets that route's checks."""
    for template in INVOCATION_ORDER:
        model = model_for(template)
        if model is None:
            continue
        if template == "/v1/chat/completions" and "messages" in body:
            return check_chat(body, policy, model)
        if template == "/v1/completions" and "prompt" in body:
            return check_completion(body, policy, model)
    raise RequestError("/invocations takes a chat completion request (with 'messages') or a completion request "
                       "(with 'prompt')")  # fmt: skip


def check_request(template: str, body: dict, policy: Policy, model_for: ModelFor) -> Rewrite:
    """Run the checks of route `template` on `body` (a JSON object)."""
    if template == INVOCATIONS:
        return check_invocation(body, policy, model_for)
    return CHECKS[template](body, policy, model_for(template))


def checked_templates() -> tuple[str, ...]:
    return (*CHECKS, INVOCATIONS)
