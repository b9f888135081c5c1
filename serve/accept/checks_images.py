"""Image input checks: an image is accepted and counted, or refused by a text model; bad images get a 400.

The images are built here from the standard library alone (`zlib`, `struct`): PNGs of any size, a
truncated PNG, a PNG whose header claims more pixels than any server should decode, and a PPM (an image
format PIL reads, outside the formats chat APIs take). What the server is: `Suite.vision` (`yes`: the model
takes images, a refusal fails; `no`: a text model, every image must be refused; `auto`: the first image
check decides from the reply). Each refusal must be a 400 with a message, and /health must answer 200
after it.
"""

from __future__ import annotations

import base64
import struct
import zlib

from serve.accept.suite import PROTOCOL, Suite, check, expect, skip, stream_usages, usage

TEXT = "What is in this picture?"
HUGE_SIDE = 9000  # 81 M pixels: above 8192 x 8192 and below the size at which PIL itself refuses to open a file


def png(width: int, height: int, seed: int = 0, rows: int | None = None) -> bytes:
    """An RGB PNG with a deterministic pattern; ``rows`` (fewer than ``height``) writes a header that promises
    more rows than the data holds (a decoder must refuse it before decoding, by its pixel count)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = bytearray()
    for y in range(height if rows is None else rows):
        raw.append(0)  # filter: none
        raw.extend(bytes(((x * 7 + y * 13 + seed * 31 + c * 85) % 256) for x in range(width) for c in range(3)))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(raw))) + chunk(b"IEND", b"")
    )


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def image_request(suite: Suite, *urls: str, **fields) -> dict:
    parts = [{"type": "text", "text": TEXT}, *(image_part(u) for u in urls)]
    return suite.request(messages=[{"role": "user", "content": parts}], max_tokens=2, **fields)


def takes_images(suite: Suite) -> bool:
    """Whether the server's model takes images: ``suite.vision``, or (``auto``) what the server answers to one
    small PNG, decided once."""
    if suite.vision in ("yes", "no"):
        return suite.vision == "yes"

    def probe() -> bool:
        reply = suite.endpoint.post("chat/completions", image_request(suite, data_url(png(64, 64))))
        return reply.status == 200

    return suite.remember("takes_images", probe)


def expect_refused(suite: Suite, body: dict, what: str) -> str:
    """A 400 with an OpenAI error message, then /health 200."""
    reply = suite.endpoint.post("chat/completions", body)
    expect(reply.status == 400, "status", f"{what}: HTTP {reply.status}, expected 400: {reply.text[:200]}")
    error = reply.body.get("error") if isinstance(reply.body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    expect(isinstance(message, str) and message.strip(), "error.message", f"{what}: no message in {reply.text[:200]}")
    health = suite.endpoint.get("/health")
    expect(health.status == 200, "/health", f"HTTP {health.status} after {what}")
    return message[:100]


@check("image_accepted", PROTOCOL, "an image part: a model that takes images answers and counts its tokens in "
                                   "usage; a text model answers 400")  # fmt: skip
def image_accepted(suite: Suite) -> str:
    body = image_request(suite, data_url(png(64, 64)))
    if not takes_images(suite):
        return "text model: " + expect_refused(suite, body, "an image sent to a text model")
    with_image = suite.chat(body)
    without = suite.chat(suite.request(messages=[{"role": "user", "content": [{"type": "text", "text": TEXT}]}],
                                       max_tokens=2))  # fmt: skip
    grown = usage(with_image)["prompt_tokens"] - usage(without)["prompt_tokens"]
    expect(
        grown > 0,
        "usage.prompt_tokens",
        f"{usage(with_image)['prompt_tokens']} with an image, "
        f"{usage(without)['prompt_tokens']} without: the image was not counted",
    )
    return f"the image added {grown} prompt tokens"


@check("image_tokens_by_size", PROTOCOL, "a larger image costs at least as many prompt tokens, streamed usage "
                                         "counts them the same")  # fmt: skip
def image_tokens_by_size(suite: Suite) -> str:
    if not takes_images(suite):
        skip("the model takes no images")
    small = usage(suite.chat(image_request(suite, data_url(png(64, 64)))))["prompt_tokens"]
    large_body = image_request(suite, data_url(png(256, 192, seed=1)))
    large = usage(suite.chat(large_body))["prompt_tokens"]
    expect(large >= small, "usage.prompt_tokens", f"a 256x192 image gives {large} prompt tokens, a 64x64 one {small}")
    streamed = suite.stream({**large_body, "stream_options": {"include_usage": True}})
    usages = stream_usages(streamed)
    expect(usages, "usage", "no usage chunk in the stream")
    expect(usages[-1][1].get("prompt_tokens") == large, "usage.prompt_tokens",
           f"streamed {usages[-1][1].get('prompt_tokens')}, non-streamed {large}")  # fmt: skip
    return f"64x64: {small} prompt tokens, 256x192: {large}"


@check("image_corrupt", PROTOCOL, "a truncated PNG: 400 with a message, /health OK")
def image_corrupt(suite: Suite) -> str:
    whole = png(96, 96, seed=2)
    return expect_refused(suite, image_request(suite, data_url(whole[: len(whole) // 2])), "a truncated PNG")


@check("image_not_an_image", PROTOCOL, "a data: URL whose bytes are no image: 400 with a message, /health OK")
def image_not_an_image(suite: Suite) -> str:
    body = image_request(suite, data_url(b"these bytes are text, not a picture"))
    return expect_refused(suite, body, "a data: URL of text")


@check("image_unsupported_format", PROTOCOL, "a PPM image (not a format chat APIs take): 400, /health OK")
def image_unsupported_format(suite: Suite) -> str:
    ppm = b"P6\n4 4\n255\n" + bytes(range(48))
    return expect_refused(suite, image_request(suite, data_url(ppm, "image/x-portable-pixmap")), "a PPM image")


@check("image_too_many", PROTOCOL, "more images in one request than the server's limit (--max-images): 400, "
                                   "/health OK")  # fmt: skip
def image_too_many(suite: Suite) -> str:
    url = data_url(png(32, 32, seed=3))
    return expect_refused(suite, image_request(suite, *([url] * (suite.max_images + 1))),
                          f"{suite.max_images + 1} images")  # fmt: skip


@check("image_oversized", PROTOCOL, f"a PNG whose header claims {HUGE_SIDE}x{HUGE_SIDE} pixels: 400, /health OK")
def image_oversized(suite: Suite) -> str:
    bomb = png(HUGE_SIDE, HUGE_SIDE, rows=1)
    return expect_refused(suite, image_request(suite, data_url(bomb)), f"a {HUGE_SIDE}x{HUGE_SIDE} image")


@check("image_http_url", PROTOCOL, "an http image URL that no server can fetch: 400 with a message (fetching off, "
                                   "or the fetch failed), /health OK")  # fmt: skip
def image_http_url(suite: Suite) -> str:
    return expect_refused(suite, image_request(suite, "http://qwen35-accept.invalid/picture.png"), "an http URL")
