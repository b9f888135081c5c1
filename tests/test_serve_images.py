"""Images through `qwen35-serve`: the image checks of the middleware, and the real server on the embedded model.

The middleware tests put `RequestCompatMiddleware` in front of a FastAPI app that records what reaches it,
with vLLM's own request models on the routes and vLLM's own `MultiModalConfig` in the app state (the image
limit comes from it); fetching is tested against a real HTTP server on the loopback interface. The server
tests start `qwen35-serve` on the embedded checkpoint (a `Qwen3_5ForConditionalGeneration` with a tiny
vision tower) with an image limit of 2 and a 200 kB image size limit, and check: a chat with an image is
answered, its usage counts the image's tokens exactly (the placeholder grown as our processor says), and
its greedy tokens equal the standalone host's on the same prompt tokens and image; the bad-image matrix
(corrupt, not an image, unsupported format, too many, too many pixels, too many bytes, an http URL with
fetching off, other URL schemes, audio parts) each gets a 400 with a message and leaves /health OK; and the
conformance suite's image checks pass.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image
from servers import API_KEY, QWEN35_SERVED_NAME, start_qwen35_serve, vllm_available

from serve import images
from serve.accept.checks_images import png
from serve.middleware import CompatSettings, RequestCompatMiddleware

vllm_protocols = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
from vllm.config.multimodal import MultiModalConfig  # noqa: E402
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest  # noqa: E402

BODY_MODELS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/responses": ResponsesRequest,
               "/v1/messages": AnthropicMessagesRequest}  # fmt: skip
PLAIN_ROUTES = ("/tokenize", "/v1/chat/completions/render")
VL = "Qwen3_5ForConditionalGeneration"


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def photo(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A noise image encoded by PIL (the format a client would send)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, fmt)
    return out.getvalue()


def chat(*parts: dict, text: str = "What is this?", **fields) -> dict:
    content = [{"type": "text", "text": text}, *parts]
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def assert_400(reply: httpx.Response, pattern: str, param: str | None = None) -> str:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == 400 and re.search(pattern, error["message"]), error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


# -- the middleware's image checks (no engine) ---------------------------------------------------


class Downstream:
    """The app behind the middleware: records each body it receives."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def app(self, settings: CompatSettings, model_config: object, args: object = None) -> FastAPI:
        app = FastAPI()

        async def record(request: Request) -> JSONResponse:
            self.bodies.append(json.loads(await request.body()))
            return JSONResponse({"ok": True})

        for path, model in BODY_MODELS.items():

            async def typed(body, request: Request) -> JSONResponse:
                return await record(request)

            typed.__annotations__ = {"body": model, "request": Request, "return": JSONResponse}
            app.add_api_route(path, typed, methods=["POST"])
        for path in PLAIN_ROUTES:

            async def plain(request: Request) -> JSONResponse:
                return await record(request)

            app.add_api_route(path, plain, methods=["POST"])
        app.state.vllm_config = SimpleNamespace(model_config=model_config)
        app.state.args = args
        app.add_middleware(RequestCompatMiddleware, settings=settings)
        return app


def model_config(architecture: str = VL, limit: int | None = 2, multimodal: bool = True) -> SimpleNamespace:
    """What the middleware reads from vLLM's model config; the image limit is vLLM's own MultiModalConfig."""
    mm = None if not multimodal else MultiModalConfig(limit_per_prompt={} if limit is None else {"image": limit})
    return SimpleNamespace(max_model_len=4096, is_multimodal_model=multimodal, architecture=architecture,
                           multimodal_config=mm)  # fmt: skip


def call(body: dict, path: str = "/v1/chat/completions", config: SimpleNamespace | None = None,
         downstream: Downstream | None = None, args: object = None, **settings) -> httpx.Response:  # fmt: skip
    downstream = downstream or Downstream()
    app = downstream.app(CompatSettings(**settings), config or model_config(), args)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, timeout=30)

    return asyncio.run(go())


def test_a_valid_image_passes_unchanged():
    downstream = Downstream()
    body = chat(image(data_url(photo(80, 60))), image(data_url(photo(40, 90, 1, "JPEG"), "image/jpeg")))
    reply = call(body, downstream=downstream)
    assert reply.status_code == 200, reply.text
    assert downstream.bodies == [body]


BAD_IMAGES = [
    (data_url(png(96, 96)[:300]), r"corrupt PNG image: image file is truncated"),
    (data_url(b"not an image at all"), r"the data is not an image, or its header is corrupt"),
    (data_url(b"P6\n2 2\n255\n" + bytes(12), "image/x-portable-pixmap"),
     r"unsupported image format PPM; accepted: PNG, JPEG, WEBP, GIF, BMP, TIFF"),
    (data_url(png(9000, 9000, rows=1)), r"image of 9000x9000 = 81000000 pixels exceeds the limit of 67108864 pixels"),
    ("data:text/plain;base64,aGVsbG8=", r"data: URL has media type 'text/plain'; an image/\* type is required"),
    ("data:image/png,rawbytes", r"data: URL is not base64-encoded"),
    ("data:image/png;base64,@@@@", r"data: URL holds invalid base64"),
    ("http://127.0.0.1:9/x.png", r"this server does not fetch image URLs \(fetching is off; config fetch_images: "
                                 r"true turns it on\); send the image inline as a data:image/...;base64 URL"),
    ("file:///etc/passwd", r"unsupported image URL scheme 'file:'; send a data: URL \(fetching http\(s\) URLs is "
                           r"off\)"),
    ("   ", r"expected an image URL"),
]  # fmt: skip


@pytest.mark.parametrize("url,pattern", BAD_IMAGES, ids=[p[:24] for _, p in BAD_IMAGES])
def test_bad_images_are_answered_400_naming_the_part(url, pattern):
    downstream = Downstream()
    reply = call(chat(image(data_url(photo(32, 32))), image(url)), downstream=downstream)
    assert_400(
        reply, r"^messages\[0\]\.content\[2\]\.image_url\.url: " + pattern, "messages[0].content[2].image_url.url"
    )
    assert downstream.bodies == [], "nothing reaches the engine"


def test_image_limits_from_vllm_and_the_config():
    url = data_url(photo(32, 32))
    assert call(chat(image(url), image(url))).status_code == 200
    assert_400(call(chat(image(url), image(url), image(url))),
               r"^3 images in one prompt; this server takes at most 2 \(limit_mm_per_prompt\); the first one over is "
               r"messages\[0\]\.content\[3\]\.image_url\.url$")  # fmt: skip
    assert_400(
        call(chat(image(url)), config=model_config(limit=0)),
        r"this server takes no images \(its image limit, limit_mm_per_prompt, is 0\)",
    )
    many = chat(*[image(url)] * 20)
    assert call(many, config=model_config(limit=None)).status_code == 200, "vLLM's default limit: 999"
    big = data_url(photo(200, 200))
    assert_400(call(chat(image(big)), max_image_bytes=4096), r"image of about \d+ bytes exceeds the limit of 4096")
    assert_400(call(chat(image(url)), max_image_pixels=1000), r"image of 32x32 = 1024 pixels exceeds the limit of 1000")


def test_other_media_and_embeddings_are_refused_on_an_image_model():
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    assert_400(call(chat(audio)), r"model \(the model\) takes text and images only, so 'input_audio' parts are not "
                                  r"accepted", "messages[0].content[1].type")  # fmt: skip
    embeds = {"type": "image_embeds", "image_embeds": "AAAA"}
    assert_400(call(chat(embeds)), r"'image_embeds' parts are not accepted here; send the image itself")


def test_text_models_refuse_images_saying_why():
    url = data_url(photo(32, 32))
    text = model_config("Qwen3_5ForCausalLM", multimodal=False)
    assert_400(call(chat(image(url)), config=text),
               r"takes text only \(its Qwen3_5ForCausalLM checkpoint has no vision encoder\), so 'image_url' parts "
               r"are not accepted", "messages[0].content[1].type")  # fmt: skip
    assert_400(call(chat(image(url)), text_only=True), r"takes text only \(this server is configured text_only: true\)")


def test_responses_anthropic_and_render_routes_check_their_images():
    bad = png(64, 64)[:200]
    responses = {
        "model": "m",
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": data_url(bad)}],
            }
        ],
    }
    assert_400(call(responses, "/v1/responses"), r"^input\[0\]\.content\[1\]\.image_url: corrupt PNG image")
    anthropic = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(bad).decode()}}]}]}  # fmt: skip
    assert_400(call(anthropic, "/v1/messages"), r"^messages\[0\]\.content\[0\]\.source\.data: corrupt PNG image")
    for path in PLAIN_ROUTES:  # vLLM would fetch (or decode) these too: the same checks
        assert_400(call(chat(image("https://example.com/a.png")), path), "does not fetch image URLs")
    good = chat(image(data_url(photo(32, 32))))
    assert call(good, "/tokenize").status_code == 200


class ImageHost:
    """A real HTTP server on the loopback interface with a few image URLs."""

    def __init__(self) -> None:
        pictures = {"/pic.png": (photo(48, 32, 5), "image/png"), "/text": (b"plain words", "text/plain"),
                    "/big.png": (photo(300, 300, 6), "image/png")}  # fmt: skip

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/moved":
                    self.send_response(302)
                    self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/pic.png")
                    self.end_headers()
                    return
                if self.path not in pictures:
                    self.send_error(404)
                    return
                data, mime = pictures[self.path]
                self.send_response(200)
                self.send_header("Content-Type", mime)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.pictures = pictures
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ImageHost:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_fetching_inlines_checked_images_and_refuses_failures():
    with ImageHost() as host:
        downstream = Downstream()
        reply = call(chat(image(host.url + "/pic.png")), downstream=downstream, fetch_images=True)
        assert reply.status_code == 200, reply.text
        sent = downstream.bodies[0]["messages"][0]["content"][1]["image_url"]["url"]
        assert sent == data_url(host.pictures["/pic.png"][0]), "the fetched bytes reach vLLM inline"
        where = r"^messages\[0\]\.content\[1\]\.image_url\.url: could not fetch the image at "
        assert_400(call(chat(image(host.url + "/missing.png")), fetch_images=True), where + r".*: HTTP 404$")
        assert_400(call(chat(image(host.url + "/big.png")), fetch_images=True, max_image_bytes=4096),
                   where + r".*: more than 4096 bytes \(max_image_bytes\)$")  # fmt: skip
        assert_400(call(chat(image(host.url + "/text")), fetch_images=True), r"the data is not an image")
        allowed = SimpleNamespace(allowed_media_domains=["127.0.0.1"])
        assert call(chat(image(host.url + "/pic.png")), fetch_images=True, args=allowed).status_code == 200
        assert_400(
            call(chat(image(host.url + "/moved")), fetch_images=True, args=allowed),
            where + r".*: it redirects to localhost, which is not among allowed_media_domains$",
        )
        others = SimpleNamespace(allowed_media_domains=["images.example"])
        assert_400(
            call(chat(image(host.url + "/pic.png")), fetch_images=True, args=others),
            r"its host is not among this server's allowed_media_domains \(images\.example\)",
        )
        assert_400(
            call(chat(image("ftp://127.0.0.1/a.png")), fetch_images=True),
            r"unsupported image URL scheme 'ftp:'; send a data: URL or an http\(s\) URL",
        )


def test_image_only_architectures_are_qwen35s_vision_checkpoints():
    from qwen35.config import ARCHITECTURES

    assert set(images.IMAGE_ONLY_ARCHITECTURES) == {a for a, (_, nested) in ARCHITECTURES.items() if nested}


# -- the embedded checkpoint ---------------------------------------------------------------------


def test_embedded_checkpoint_takes_images(tmp_path):
    import transformers

    from qwen35.image_processor import ImageProcessorConfig, num_image_tokens
    from qwen35.standalone import Qwen35Standalone
    from serve.embedded import checkpoint as ckpt

    path = ckpt.ensure_checkpoint(cache_root=tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [ckpt.DEFAULT_ARCHITECTURE] == [VL]
    assert config["vision_config"]["out_hidden_size"] == config["text_config"]["hidden_size"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}  # fmt: skip
    assert {key: config[key] for key in ids} == ids
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                             {"type": "text", "text": "and"}, {"type": "image_url"}]}]  # fmt: skip
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    assert f"<|im_start|>user\nLook:{placeholder}and{placeholder}<|im_end|>\n" in text
    cfg = ImageProcessorConfig.from_dir(path)
    assert (cfg.min_pixels, cfg.max_pixels) == (ckpt.EMBEDDED_MIN_PIXELS, ckpt.EMBEDDED_MAX_PIXELS)
    assert num_image_tokens(10, 10, cfg) == 4 and num_image_tokens(3000, 3000, cfg) == 64  # 4 to 64 tokens
    model = Qwen35Standalone.from_pretrained(path, max_seqs=2, max_len=256)
    prompt = tokenizer(text).input_ids
    out = model.generate([prompt, prompt], 4, images=[[photo(64, 64), photo(90, 60)], [photo(64, 64, 1)] * 2])
    assert all(len(o) == 4 for o in out)


# -- the real server -----------------------------------------------------------------------------

LIMIT = 2
MAX_IMAGE_BYTES = 200_000
needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")


@pytest.fixture(scope="module")
def server():
    proc = start_qwen35_serve("--limit-mm-per-prompt", json.dumps({"image": LIMIT}),
                              "--max-image-bytes", str(MAX_IMAGE_BYTES))  # fmt: skip
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def served_checkpoint(server) -> str:
    log = server.log_path.read_text(errors="replace")
    return re.search(r"model\s+(\S+Qwen3_5ForConditionalGeneration-\w+)", log).group(1)


def chat_reply(client, *parts: dict, **fields) -> dict:
    reply = client.post("chat/completions", json={**chat(*parts, **fields), "model": QWEN35_SERVED_NAME,
                                                  "temperature": 0})  # fmt: skip
    assert reply.status_code == 200, reply.text
    return reply.json()


@needs_vllm
@pytest.mark.slow
def test_chat_with_an_image_counts_its_tokens_and_matches_the_standalone_host(server, client):
    from qwen35.image_processor import ImageProcessorConfig, num_image_tokens
    from qwen35.standalone import Qwen35Standalone

    path = served_checkpoint(server)
    cfg = ImageProcessorConfig.from_dir(path)
    pictures = [photo(100, 70, 0), photo(170, 260, 1, "JPEG")]
    urls = [data_url(pictures[0]), data_url(pictures[1], "image/jpeg")]
    text_only = chat_reply(client, max_tokens=12)
    one = chat_reply(client, image(urls[0]), max_tokens=12, return_token_ids=True)
    both = chat_reply(client, *[image(u) for u in urls], max_tokens=12, return_token_ids=True)
    counts = [num_image_tokens(70, 100, cfg), num_image_tokens(260, 170, cfg)]
    assert counts == [6, 40]
    base = text_only["usage"]["prompt_tokens"]  # each image adds <|vision_start|>, its tokens, <|vision_end|>
    assert one["usage"]["prompt_tokens"] == base + counts[0] + 2
    assert both["usage"]["prompt_tokens"] == base + sum(counts) + 4
    assert one["usage"]["prompt_tokens_details"]["multimodal_tokens"] == {"image": counts[0]}

    model = Qwen35Standalone.from_pretrained(path, max_seqs=2, max_len=512)
    image_token = model.cfg.vision.image_token_id
    for reply, imgs in ((one, pictures[:1]), (both, pictures)):
        expanded = reply["prompt_token_ids"]
        assert len(expanded) == reply["usage"]["prompt_tokens"]
        prompt = [t for i, t in enumerate(expanded) if t != image_token or expanded[i - 1] != image_token]
        (reference,) = model.generate([prompt], 12, images=[imgs])
        assert reply["choices"][0]["token_ids"] == reference, "greedy tokens differ from the standalone host's"


@needs_vllm
@pytest.mark.slow
def test_streamed_usage_counts_the_image(client):
    body = {**chat(image(data_url(photo(100, 70))), max_tokens=4), "model": QWEN35_SERVED_NAME, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with client.stream("POST", "chat/completions", json=body) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
    usage = json.loads(lines[-1][6:])["usage"]
    assert usage["prompt_tokens"] == chat_reply(client, image(data_url(photo(100, 70))))["usage"]["prompt_tokens"]


SERVER_BAD_IMAGES = [
    (data_url(png(96, 96)[:300]), "corrupt PNG image"),
    (data_url(b"definitely text"), "the data is not an image"),
    (data_url(b"P6\n2 2\n255\n" + bytes(12), "image/x-portable-pixmap"), "unsupported image format PPM"),
    (data_url(png(9000, 9000, rows=1)), "exceeds the limit of 67108864 pixels"),
    (data_url(photo(300, 300)), f"exceeds the limit of {MAX_IMAGE_BYTES} bytes"),
    ("http://qwen35-test.invalid/a.png", "this server does not fetch image URLs"),
    ("file:///etc/hostname", "unsupported image URL scheme 'file:'"),
]  # fmt: skip


@needs_vllm
@pytest.mark.slow
def test_bad_images_get_400_and_the_server_stays_healthy(server, client):
    small = image(data_url(photo(32, 32)))
    cases = [(chat(image(url)), pattern) for url, pattern in SERVER_BAD_IMAGES]
    cases.append((chat(*[small] * (LIMIT + 1)), f"3 images in one prompt; this server takes at most {LIMIT}"))
    cases.append((chat({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
                  "takes text and images only"))  # fmt: skip
    for body, pattern in cases:
        reply = client.post("chat/completions", json={**body, "model": QWEN35_SERVED_NAME})
        assert_400(reply, re.escape(pattern))
        assert httpx.get(server.root + "/health", timeout=30).status_code == 200
    assert chat_reply(client, small, max_tokens=2)["usage"]["completion_tokens"] == 2, "still serving images"


@needs_vllm
@pytest.mark.slow
def test_conformance_image_checks_pass(server):
    from serve.accept.runner import PASS, run_suite

    report = run_suite(server.base_url, api_key=API_KEY, only="image_*", vision="yes", max_images=LIMIT)
    assert len(report.results) == 8
    failed = [(r.name, r.reason) for r in report.results if r.status != PASS]
    assert not failed, failed
