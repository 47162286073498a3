"""Images in requests: each image part's URL read (a data: URL; an http(s) URL only from a host in
--allowed-media-domains, fetched with a time bound (LLMSERVE_IMAGE_FETCH_TIMEOUT), no redirects and at most
LLMSERVE_MAX_IMAGE_BYTES) and decoded with Pillow (PNG, JPEG, WebP, GIF's first frame; at most
LLMSERVE_MAX_IMAGE_PIXELS); images given as bare base64 (Ollama's `images`) become data: URL parts. Every
failure is a 400 naming the part: an undecodable, too large or unreachable image never reaches the engine."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from urllib.parse import urlsplit

from llmserve import envs
from llmserve.server.errors import APIError
from llmserve.server.protocol import ImagePart

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


def _bad(where: str, message: str, code: str = "invalid_image") -> APIError:
    return APIError(400, f"{where}: {message}", param=where.split("[")[0], code=code)


def _data_url(url: str, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise _bad(where, "a data: URL must be base64 (data:image/png;base64,...)")
    return _base64(payload, where, "the data: URL")


def _base64(payload: str, where: str, what: str) -> bytes:
    if len(payload) * 3 // 4 > envs.LLMSERVE_MAX_IMAGE_BYTES:
        raise _bad(where, f"the image is larger than {envs.LLMSERVE_MAX_IMAGE_BYTES} bytes", "image_too_large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _bad(where, f"{what} is not valid base64 ({e})") from e


def base64_image_parts(images: list[str], where: str) -> list[ImagePart]:
    """Images given as bare base64 (Ollama's `images`: no data: prefix) as image parts with data: URLs, which
    `load_image` reads as any other; each checked here, a 400 naming `where`[j] when it is not base64 (or too
    large), and later errors (undecodable) name it there too."""
    parts = []
    for j, payload in enumerate(images):
        at = f"{where}[{j}]"
        if not isinstance(payload, str) or not payload:
            raise _bad(at, "an image must be a base64 string")
        payload = payload.replace("\n", "").replace("\r", "")  # (line-wrapped base64, as Go's decoder takes it)
        _base64(payload, at, "the image")
        parts.append(ImagePart.named("data:image;base64," + payload, at))
    return parts


async def _fetch(url: str, where: str, allowed: list[str]) -> bytes:
    import httpx

    host = (urlsplit(url).hostname or "").lower()
    if not allowed:
        raise _bad(where, "image URLs must be data: URLs on this server (start it with --allowed-media-domains)")
    if host not in {d.lower() for d in allowed}:
        raise _bad(where, f"the host {host!r} is not in this server's --allowed-media-domains")
    most = envs.LLMSERVE_MAX_IMAGE_BYTES
    try:
        async with httpx.AsyncClient(timeout=envs.LLMSERVE_IMAGE_FETCH_TIMEOUT, follow_redirects=False) as client:
            async with asyncio.timeout(envs.LLMSERVE_IMAGE_FETCH_TIMEOUT):
                async with client.stream("GET", url) as r:
                    if r.status_code != 200:
                        raise _bad(where, f"fetching the image answered HTTP {r.status_code}", "image_unreachable")
                    body = bytearray()
                    async for chunk in r.aiter_bytes():
                        body += chunk
                        if len(body) > most:
                            raise _bad(where, f"the image is larger than {most} bytes", "image_too_large")
                    return bytes(body)
    except (httpx.HTTPError, TimeoutError, OSError) as e:
        raise _bad(where, f"the image could not be fetched ({type(e).__name__}: {e})", "image_unreachable") from e


def decode(data: bytes, where: str):
    """A Pillow image (RGB or RGBA, loaded) from an encoded PNG / JPEG / WebP / GIF; a 400 otherwise."""
    from PIL import Image

    most = envs.LLMSERVE_MAX_IMAGE_PIXELS
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format not in FORMATS:
                raise _bad(where, f"images must be PNG, JPEG, WebP or GIF, not {im.format}")
            if im.width * im.height > most:
                raise _bad(where, f"the image has {im.width}x{im.height} pixels, more than {most}", "image_too_large")
            im.seek(0)  # (a GIF: its first frame)
            return im.convert("RGB")
    except APIError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as e:
        raise _bad(where, f"the image could not be decoded ({e})") from e


async def load_image(url: str, where: str, allowed: list[str]):
    """The decoded image an image part's URL names."""
    if not isinstance(url, str) or not url:
        raise _bad(where, "an image part needs a URL")
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        data = _data_url(url, where)
    elif scheme in ("http", "https"):
        data = await _fetch(url, where, allowed)
    else:
        raise _bad(where, f"image URLs must be data: or http(s): URLs, not {scheme}:")
    return await asyncio.to_thread(decode, data, where)


async def load_images(parts: list[tuple[str, str]], allowed: list[str]) -> list:
    """The decoded images of (url, where) pairs, in order (fetched concurrently)."""
    return list(await asyncio.gather(*(load_image(url, where, allowed) for url, where in parts)))
