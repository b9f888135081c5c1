"""Deny-by-default access and request checks for vLLM's OpenAI server, as pure ASGI middleware.

`qwen35-serve` adds :class:`RequestCompatMiddleware` to vLLM's app through vLLM's `--middleware`
option, which makes it the outermost user middleware: it sees every request before vLLM's own
middleware and routes, and every response on its way out. For each HTTP request it

- finds the app route the path belongs to and its class in `serve.routes` (the table is logged
  at start-up): switched-off routes and admin routes (unless `admin_routes`) answer 404;
- checks the API key on every route but the open ones (`/health`, `/ping`, `/version`, and
  `/metrics` unless `public_metrics` is false): a bearer token, compared in constant time,
  answering 401 with an OpenAI error object; CORS preflights (OPTIONS) pass;
- on the routes that reach the engine, reads the JSON body (at most `max_request_bytes`, else 413)
  and runs that route's checks (`serve.checks`): malformed or non-standard JSON (`NaN`, nesting
  deeper than the parser's limit), the route's vLLM request model in strict mode, and our policy,
  each answered 400 naming the field before the engine sees anything;
- when the model takes images, checks the image parts of every route that carries messages
  (`serve.images`): their number, each `data:` URL decoded by our image decoder, `http(s)` URLs
  refused unless `fetch_images` is on (then fetched here and inlined), each failure a 400;
- drops `delta.content` from streamed replies with a forced tool choice (`required` or a named
  function): the grammar allows nothing but tool calls there, and vLLM's streaming Qwen3 parser
  lets the `<tool_call>` markup through as text when a model spells it with ordinary tokens;
- rewrites every other error body that is not an OpenAI error object (FastAPI's `{"detail": ...}`,
  a plain-text 500) into `{"error": {"message", "type", "param", "code"}}`.

Websocket connections get the same route classes and key check (a refused one is closed with
code 1008). On the app's lifespan start-up it logs the route table, installs our tool-call grammar
builder (`serve.toolcalls`) and starts the engine watch (`serve.lifecycle`).

Settings come from `CompatSettings` passed to the constructor, else from the attribute
`qwen35_compat` (a dict) of vLLM's parsed arguments (`app.state.args`), else the defaults. The API
keys are the configured ones, else vLLM's `--api-key`, else `VLLM_API_KEY`. Nothing here imports
vLLM; what it needs from vLLM's app state it reads by attribute.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields

from serve import images, lifecycle, routes, toolcalls
from serve.checks import Policy, RequestError, Rewrite, check_request, checked_templates, parse_json

log = logging.getLogger("vllm.qwen35.serve")

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SETTINGS_ATTR = "qwen35_compat"
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
    admin_routes: bool = False
    public_metrics: bool = True
    tool_string_max_chars: int | None = None
    max_tool_calls: int | None = 8
    fetch_images: bool = False
    max_image_bytes: int = images.DEFAULT_MAX_BYTES
    max_image_pixels: int = images.DEFAULT_MAX_PIXELS
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: read vLLM's args / VLLM_API_KEY

    @classmethod
    def from_mapping(cls, values: dict) -> CompatSettings:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known and v is not None})


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    error = {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}
    return json.dumps({"error": error}).encode()


async def send_error(send: Send, status: int, message: str, param: str | None = None) -> None:
    body = error_body(status, message, param)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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
                headers = [
                    (k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")
                ]
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


@dataclass(frozen=True)
class _Resolved:
    settings: CompatSettings
    key_hashes: list[bytes]
    policy: Policy
    models: dict[str, object]
    """The pydantic request model of each checked route template, from the app's routes."""
    images: images.ImagePolicy | None = None
    """What the image checks accept; None: the model takes no images (the policy refuses them) or is unknown."""


def _request_models(app: object) -> dict[str, object]:
    models: dict[str, object] = {}
    for route in getattr(app, "routes", None) or []:
        body_field = getattr(route, "body_field", None)
        path = getattr(route, "path", None)
        if body_field is not None and path not in models and "POST" in (getattr(route, "methods", None) or ()):
            models[path] = body_field.field_info.annotation
    return models


class RequestCompatMiddleware:
    """See the module docstring. `settings=None`: read from vLLM's args on the first request."""

    def __init__(self, app, settings: CompatSettings | None = None) -> None:
        self.app = app
        self._settings = settings
        self._resolved: _Resolved | None = None

    def _resolve(self, scope: Scope) -> _Resolved:
        """Settings, key digests, request policy and request models, read once from the app's state."""
        if self._resolved is not None:
            return self._resolved
        app = scope.get("app")
        state = getattr(app, "state", None)
        args = getattr(state, "args", None)
        settings = self._settings or CompatSettings.from_mapping(getattr(args, SETTINGS_ATTR, None) or {})
        keys = list(settings.api_keys) or list(getattr(args, "api_key", None) or [])
        if not keys and os.environ.get("VLLM_API_KEY"):
            keys = [os.environ["VLLM_API_KEY"]]
        names = getattr(args, "served_model_name", None) or [getattr(args, "model", None) or "the model"]
        model_config = getattr(getattr(state, "vllm_config", None), "model_config", None)
        text_only, reason = _text_only(settings, model_config)
        architecture = getattr(model_config, "architecture", None)
        policy = Policy(max_n=settings.max_n, text_only=text_only, text_only_reason=reason, model_name=names[0],
                        images_only=not text_only and architecture in images.IMAGE_ONLY_ARCHITECTURES,
                        max_model_len=getattr(model_config, "max_model_len", None),
                        thinking_off_with_tools=settings.thinking_off_with_tools,
                        max_tool_calls=settings.max_tool_calls)  # fmt: skip
        resolved = _Resolved(settings, [hashlib.sha256(k.encode()).digest() for k in keys], policy,
                             _request_models(app), None if text_only else _image_policy(settings, model_config, args,
                                                                                        names[0]))  # fmt: skip
        if state is None or getattr(state, "vllm_config", None) is not None or self._settings is not None:
            self._resolved = resolved  # cache once vLLM's state is complete
        return resolved

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, self._lifespan(scope, receive), send)
            return
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        resolved = self._resolve(scope)
        settings = resolved.settings
        route, template = routes.match(scope.get("app"), scope)
        kind = routes.kind_of(template)
        refusal = self._refusal(scope, kind, template, resolved)
        if refusal is not None:
            status, message = refusal
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
            else:
                await send_error(_ErrorBodies(send), status, message)
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        send = errors = _ErrorBodies(send)
        method = scope.get("method", "GET")
        checked = template in checked_templates()
        image_checked = resolved.images is not None and template in images.IMAGE_ROUTES
        if method == "POST" and (checked or image_checked):
            try:
                raw = await self._read_body(scope, receive, settings.max_request_bytes)
                rewrite = self._checked(raw, template, resolved, checked)
                if rewrite is not None and image_checked:
                    rewrite.changed |= await images.check_images(template, rewrite.body, resolved.images)
            except RequestError as e:
                await send_error(send, e.status, e.message, e.param)
                return
            if rewrite is None:  # a body the route's own parser answers (no checks of ours on this route)
                rewrite = Rewrite({})
            if rewrite.changed:
                raw = json.dumps(rewrite.body).encode()
                headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
                scope = {**scope, "headers": headers + [(b"content-length", str(len(raw)).encode())]}
            receive = _replay(raw, receive)
            if rewrite.strip_streamed_content:
                send = _StripStreamedContent(send)
            limit_token = toolcalls.CALL_LIMIT.set(rewrite.tool_call_limit)  # read by the grammar builder
        else:
            limit_token = None
        try:
            await self.app(scope, receive, send)
        except Exception:
            if errors.started:
                raise
            log.exception("unhandled error serving %s %s", method, scope.get("path"))
            await send_error(send, 500, "internal server error (logged by the server)")
        finally:
            if limit_token is not None:
                toolcalls.CALL_LIMIT.reset(limit_token)

    @staticmethod
    def _checked(raw: bytes, template: str, resolved: _Resolved, checked: bool) -> Rewrite | None:
        """The route's checks on the body (``checked``); else, for a route that only gets the image checks,
        the body as it is, or None when it is not a JSON object (vLLM answers that)."""
        if not checked:
            try:
                payload = json.loads(raw)
            except (ValueError, RecursionError):
                return None
            return Rewrite(payload) if isinstance(payload, dict) else None
        payload = parse_json(raw)
        if not isinstance(payload, dict):
            raise RequestError(f"request body must be a JSON object, got {type(payload).__name__}")
        return check_request(template, payload, resolved.policy, resolved.models.get)

    def _refusal(self, scope: Scope, kind: str, template: str | None, resolved: _Resolved) -> tuple[int, str] | None:
        """(status, message) when the request is refused before any other check, else None."""
        settings = resolved.settings
        if kind == routes.OFF:
            return 404, f"{template} is switched off on this server: qwen35-serve does not check its requests"
        if kind == routes.ADMIN and not settings.admin_routes:
            return 404, (f"{template} is an admin route, switched off on this server (config admin_routes: true "
                         "turns the admin routes on, behind the API key)")  # fmt: skip
        open_route = kind == routes.OPEN or (kind == routes.METRICS and settings.public_metrics)
        if resolved.key_hashes and not open_route and scope.get("method") != "OPTIONS":
            if not self._authorized(scope, resolved.key_hashes):
                return 401, "Invalid or missing API key: send 'Authorization: Bearer <key>'"
        return None

    def _lifespan(self, scope: Scope, receive: Receive) -> Receive:
        """`receive` for the lifespan protocol: logs the route table and starts the engine watch at
        start-up, checks for a dead engine at shutdown."""

        async def wrapped() -> Message:
            message = await receive()
            app = scope.get("app")
            if message["type"] == "lifespan.startup":
                resolved = self._resolve(scope)
                routes.log_table(routes.app_routes(app), bool(resolved.key_hashes), resolved.settings.admin_routes,
                                 resolved.settings.public_metrics)  # fmt: skip
                if getattr(getattr(app, "state", None), "engine_client", None) is not None:
                    toolcalls.install(resolved.settings.tool_string_max_chars)  # this process builds the grammars
                lifecycle.on_startup(app)
            elif message["type"] == "lifespan.shutdown":
                lifecycle.on_shutdown(app)
            return message

        return wrapped

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


def _text_only(settings: CompatSettings, model_config: object) -> tuple[bool, str]:
    """Whether the server refuses every media part, and why (for the 400's message)."""
    if settings.text_only:
        return True, "this server is configured text_only: true"
    if settings.text_only is None and model_config is not None and not getattr(model_config, "is_multimodal_model",
                                                                                True):  # fmt: skip
        architecture = getattr(model_config, "architecture", None) or "its"
        return True, f"its {architecture} checkpoint has no vision encoder"
    return False, ""


def _image_policy(settings: CompatSettings, model_config: object, args: object, name: str) -> images.ImagePolicy | None:
    """The image checks' settings, when the model takes images: vLLM's image limit per prompt, our fetch switch
    and limits, vLLM's allowed_media_domains (the hosts fetching may reach)."""
    mm = getattr(model_config, "multimodal_config", None)
    if mm is None or not hasattr(mm, "get_limit_per_prompt"):
        return None
    domains = getattr(args, "allowed_media_domains", None) or ()
    return images.ImagePolicy(limit=int(mm.get_limit_per_prompt("image")), fetch=settings.fetch_images,
                              max_bytes=settings.max_image_bytes, max_pixels=settings.max_image_pixels,
                              domains=tuple(domains), model_name=name)  # fmt: skip


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
