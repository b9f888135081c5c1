"""A small synchronous HTTP client for OpenAI-compatible endpoints (httpx), with SSE stream capture.

The conformance checks need the raw status, headers and body of every reply, including error
replies and malformed streams, so this deliberately does not use the `openai` package, which
turns those into exceptions and typed objects.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


def parse_sse_data(line: str) -> str | None:
    """The payload of one `data:` line of a server-sent event stream, or None for other lines."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def split_base_url(base_url: str) -> tuple[str, str]:
    """`(base, root)`: the API base as the OpenAI client takes it (`.../v1`) and the server root
    (where `/health` lives)."""
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"base URL {base_url!r} must start with http:// or https://")
    root = base[: -len("/v1")] if base.endswith("/v1") else base
    return base, root


@dataclass
class Reply:
    status: int
    body: Any
    """Parsed JSON, or None when the body was not JSON."""
    text: str
    headers: httpx.Headers
    seconds: float


@dataclass
class StreamReply:
    status: int
    chunks: list[dict] = field(default_factory=list)
    """Parsed `data:` payloads before `[DONE]`, in arrival order."""
    done: bool = False
    """Whether the stream ended with `data: [DONE]`."""
    after_done: int = 0
    """Data lines that arrived after `[DONE]` (should be none)."""
    malformed: list[str] = field(default_factory=list)
    """`data:` payloads that were not JSON."""
    body: Any = None
    """Parsed error body when the status was not 200."""
    content_type: str = ""
    seconds: float = 0.0


class Endpoint:
    """One OpenAI-compatible server: `base_url` like `http://127.0.0.1:8000/v1`."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 120.0) -> None:
        self.base, self.root = split_base_url(base_url)
        self.api_key = api_key
        self._http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def url(self, path: str) -> str:
        """`"/health"` is relative to the server root, `"chat/completions"` to the API base."""
        return self.root + path if path.startswith("/") else f"{self.base}/{path}"

    def headers(self, auth: bool | str = True) -> dict[str, str]:
        """Auth header: the configured key (True), none (False), or the given key (a string)."""
        key = self.api_key if auth is True else (auth or None)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def get(self, path: str, auth: bool | str = True) -> Reply:
        start = time.perf_counter()
        response = self._http.get(self.url(path), headers=self.headers(auth))
        return self._reply(response, start)

    def post(self, path: str, body: Any = None, raw: bytes | None = None, auth: bool | str = True) -> Reply:
        """POST `body` as JSON, or `raw` bytes verbatim with a JSON content type."""
        start = time.perf_counter()
        headers = self.headers(auth)
        if raw is not None:
            headers["Content-Type"] = "application/json"
            response = self._http.post(self.url(path), content=raw, headers=headers)
        else:
            response = self._http.post(self.url(path), json=body, headers=headers)
        return self._reply(response, start)

    def stream(self, path: str, body: dict, auth: bool | str = True) -> StreamReply:
        """POST with `stream: true` semantics and collect every event of the reply."""
        start = time.perf_counter()
        with self._http.stream("POST", self.url(path), json=body, headers=self.headers(auth)) as response:
            reply = StreamReply(status=response.status_code, content_type=response.headers.get("content-type", ""))
            if response.status_code != 200:
                response.read()
                reply.body = _json_or_none(response.text)
            else:
                for line in response.iter_lines():
                    payload = parse_sse_data(line)
                    if payload is None:
                        continue
                    if reply.done:
                        reply.after_done += 1
                    elif payload == "[DONE]":
                        reply.done = True
                    else:
                        chunk = _json_or_none(payload)
                        if isinstance(chunk, dict):
                            reply.chunks.append(chunk)
                        else:
                            reply.malformed.append(payload)
        reply.seconds = time.perf_counter() - start
        return reply

    @staticmethod
    def _reply(response: httpx.Response, start: float) -> Reply:
        return Reply(
            status=response.status_code,
            body=_json_or_none(response.text),
            text=response.text,
            headers=response.headers,
            seconds=time.perf_counter() - start,
        )


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
