"""Image parts of requests, checked before the engine sees them.

On a server whose model takes images, the middleware hands every request of a route that carries
messages (chat, chat batch, `/invocations`, responses, Anthropic messages, `/tokenize` and the render
routes) to `check_images`, after the route's own checks. For each prompt (a conversation) it

- counts the image parts against the server's image limit (vLLM's `limit_mm_per_prompt`): more is a
  400 naming the limit;
- decodes every `data:` URL with `qwen35.image_processor` (the decoder both of our hosts use), in a
  worker thread: a URL that is malformed or not base64, a payload that is not an image, a format
  outside the allowlist (PNG, JPEG, WebP, GIF, BMP, TIFF), a corrupt image, more bytes or pixels than
  the limits (`max_image_bytes`, `max_image_pixels`; the pixel count is read from the header before
  any pixel is decoded) each give a 400 with the decoder's message and the part's path;
- refuses `http(s)` URLs with a 400 unless the config switches fetching on (`fetch_images: true`). Then
  it fetches them itself (timeout `FETCH_TIMEOUT_S`, at most `max_image_bytes`, only the hosts of
  `allowed_media_domains` when that is set), checks the bytes as above and puts them in the request as a
  `data:` URL, so vLLM never fetches; a failed fetch is a 400 naming the URL and why;
- refuses any other URL scheme, and precomputed `image_embeds` parts, with a 400.

The part shapes: chat `{"type": "image_url", "image_url": {"url": ...}}` (or the URL as a string) and
`{"type": "input_image", "image_url": ...}`; responses `{"type": "input_image", "image_url": ...}`;
Anthropic `{"type": "image", "source": {"type": "base64", "media_type": ..., "data": ...}}` or
`{"source": {"type": "url", "url": ...}}`.

`qwen35.image_processor` (and with it torch and PIL) is imported on the first image, never at start-up.
"""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from serve.checks import RequestError

FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_PIXELS = 8192 * 8192
# qwen35.config's ARCHITECTURES whose checkpoints carry a vision tower: models that take images and no other media
IMAGE_ONLY_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
# routes whose bodies hold messages (the image checks run on them; the render and count routes run no model
# but would make vLLM decode, and fetch, the images they name)
IMAGE_ROUTES = ("/v1/chat/completions", "/v1/chat/completions/batch", "/invocations", "/v1/responses",
                "/v1/messages", "/tokenize", "/v1/chat/completions/render", "/v1/messages/render",
                "/v1/responses/render", "/v1/messages/count_tokens")  # fmt: skip
_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True)
class ImagePolicy:
    """What a server whose model takes images accepts."""

    limit: int  # images per prompt
    fetch: bool = False
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    domains: tuple[str, ...] = ()  # hosts fetching may reach (empty: any)
    model_name: str = "the model"


@dataclass
class ImageRef:
    """One image part: where it is (for messages), its URL, and how to put another URL in its place."""

    where: str
    url: object
    replace: Callable[[str], None]


# -- finding the image parts ---------------------------------------------------------------------


def _url_field(holder: dict, key: str, where: str) -> ImageRef:
    value = holder.get(key)
    if isinstance(value, dict):

        def put(url: str, value: dict = value) -> None:
            value["url"] = url

        return ImageRef(f"{where}.{key}.url", value.get("url"), put)

    def set_string(url: str) -> None:
        holder[key] = url

    return ImageRef(f"{where}.{key}", value, set_string)


def _anthropic_source(part: dict, where: str) -> ImageRef:
    source = part.get("source")
    if not isinstance(source, dict):
        return ImageRef(f"{where}.source", source, lambda url: None)

    def put(url: str) -> None:  # a data: URL back into a base64 source
        head, _, data = url.partition(",")
        source.clear()
        source.update(type="base64", media_type=head[5:].split(";")[0], data=data)

    if source.get("type") == "base64":
        url = f"data:{source.get('media_type') or ''};base64,{source.get('data') or ''}"
        return ImageRef(f"{where}.source.data", url, put)
    return ImageRef(f"{where}.source.url", source.get("url"), put)


def _parts(content: object, where: str) -> Iterator[ImageRef]:
    for j, part in enumerate(content if isinstance(content, list) else []):
        if not isinstance(part, dict):
            continue
        at, kind = f"{where}[{j}]", part.get("type")
        if kind in ("image_url", "input_image"):
            yield _url_field(part, "image_url", at)
        elif kind == "image" and "source" in part:
            yield _anthropic_source(part, at)
        elif kind in ("image_embeds", "image_pil"):
            raise RequestError(f"{at}: '{kind}' parts are not accepted here; send the image itself as an "
                               "'image_url' part with a data: URL", f"{at}.type")  # fmt: skip
        nested = part.get("content")
        if isinstance(nested, list):  # tool results carrying parts
            yield from _parts(nested, f"{at}.content")


def _conversation(messages: object, where: str) -> list[ImageRef]:
    refs: list[ImageRef] = []
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(message, dict):
            refs.extend(_parts(message.get("content"), f"{where}[{i}].content"))
    return refs


def image_prompts(template: str, body: dict) -> list[list[ImageRef]]:
    """The image parts of a request, one list per prompt it makes."""
    if template == "/v1/chat/completions/batch":
        conversations = body.get("messages")
        return [_conversation(c, f"messages[{i}]") for i, c in enumerate(conversations or [])
                if isinstance(conversations, list)]  # fmt: skip
    if template in ("/v1/responses", "/v1/responses/render"):
        items = body.get("input")
        refs: list[ImageRef] = []
        for i, item in enumerate(items if isinstance(items, list) else []):
            if isinstance(item, dict):
                refs.extend(_parts(item.get("content"), f"input[{i}].content"))
        return [refs]
    refs = _conversation(body.get("messages"), "messages")
    if template.startswith("/v1/messages"):
        refs = list(_parts(body.get("system"), "system")) + refs
    return [refs]


# -- checking ------------------------------------------------------------------------------------


async def check_images(template: str, body: dict, policy: ImagePolicy) -> bool:
    """Check (and, when fetching, inline) every image of the request; True when the body was changed.
    Raises RequestError (400) naming the part."""
    if template not in IMAGE_ROUTES:
        return False
    prompts = image_prompts(template, body)
    for refs in prompts:
        if len(refs) > policy.limit:
            first = refs[policy.limit].where
            if policy.limit == 0:
                raise RequestError(f"{first}: this server takes no images (its image limit, limit_mm_per_prompt, "
                                   "is 0); send text only", first)  # fmt: skip
            raise RequestError(f"{len(refs)} images in one prompt; this server takes at most {policy.limit} "
                               f"(limit_mm_per_prompt); the first one over is {first}", first)  # fmt: skip
    changed = False
    for refs in prompts:
        for ref in refs:
            changed |= await _check_one(ref, policy)
    return changed


async def _check_one(ref: ImageRef, policy: ImagePolicy) -> bool:
    url = ref.url
    if not isinstance(url, str) or not url.strip():
        raise RequestError(f"{ref.where}: expected an image URL (a data: URL, or http(s) when the server fetches), "
                           f"got {type(url).__name__}", ref.where)  # fmt: skip
    match = _SCHEME.match(url)
    scheme = match.group(1).lower() if match else ""
    if scheme == "data":
        await asyncio.to_thread(_decode, ref, policy, url)
        return False
    if scheme in ("http", "https"):
        if not policy.fetch:
            raise RequestError(f"{ref.where}: this server does not fetch image URLs (fetching is off; config "
                               "fetch_images: true turns it on); send the image inline as a data:image/...;base64 "
                               "URL", ref.where)  # fmt: skip
        data, mime = await _fetch(ref, url, policy)
        await asyncio.to_thread(_decode_bytes, ref, policy, data)
        ref.replace(f"data:{mime};base64," + base64.b64encode(data).decode())
        return True
    accepted = "a data: URL or an http(s) URL" if policy.fetch else "a data: URL (fetching http(s) URLs is off)"
    shown = f"scheme {scheme + ':'!r}" if scheme else f"{url[:16]!r}"
    raise RequestError(f"{ref.where}: unsupported image URL {shown}; send {accepted}", ref.where)


def _limits(policy: ImagePolicy) -> object:
    from qwen35.image_processor import ImageLimits

    return ImageLimits(max_bytes=policy.max_bytes, max_pixels=policy.max_pixels)


def _decode(ref: ImageRef, policy: ImagePolicy, url: str) -> None:
    from qwen35.image_processor import ImageInputError, decode_data_url

    limits = _limits(policy)
    try:
        data = decode_data_url(url, limits)
    except ImageInputError as e:
        raise RequestError(f"{ref.where}: {e}", ref.where) from None
    _decode_bytes(ref, policy, data, limits)


def _decode_bytes(ref: ImageRef, policy: ImagePolicy, data: bytes, limits: object = None) -> None:
    from qwen35.image_processor import ImageInputError, decode_image

    try:
        decode_image(data, limits or _limits(policy))
    except ImageInputError as e:
        raise RequestError(f"{ref.where}: {e}", ref.where) from None


async def _fetch(ref: ImageRef, url: str, policy: ImagePolicy) -> tuple[bytes, str]:
    """The body and media type at ``url``: at most ``policy.max_bytes``, within the timeout and redirect limit,
    from an allowed host."""
    import httpx

    shown = url if len(url) <= 120 else url[:117] + "..."

    def refuse(why: str) -> RequestError:
        return RequestError(f"{ref.where}: could not fetch the image at {shown}: {why}", ref.where)

    if policy.domains and (urlsplit(url).hostname or "") not in policy.domains:
        raise refuse(f"its host is not among this server's allowed_media_domains ({', '.join(policy.domains)})")
    try:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=True,
                                     max_redirects=MAX_REDIRECTS) as client:  # fmt: skip
            async with client.stream("GET", url) as reply:
                if reply.status_code != 200:
                    raise refuse(f"HTTP {reply.status_code}")
                final = reply.url.host or ""
                if policy.domains and final not in policy.domains:
                    raise refuse(f"it redirects to {final}, which is not among allowed_media_domains")
                chunks, size = [], 0
                async for chunk in reply.aiter_bytes():
                    size += len(chunk)
                    if size > policy.max_bytes:
                        raise refuse(f"more than {policy.max_bytes} bytes (max_image_bytes)")
                    chunks.append(chunk)
                mime = reply.headers.get("content-type", "").split(";")[0].strip().lower()
    except httpx.HTTPError as e:
        raise refuse(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
    return b"".join(chunks), mime if mime.startswith("image/") else "image/png"
