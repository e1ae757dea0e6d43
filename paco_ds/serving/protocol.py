"""The part of the OpenAI HTTP API that the reward servers share: request schema, error bodies,
bearer-token check, body-size and image-count limits, data-URI images, and running an app.

Errors use OpenAI's body, `{"error": {"message", "type", "code"}}`, so the `openai` client shows
the server's message in its exception. Limits are checked before anything is decoded: the body
size while it streams in, the image count on the parsed JSON, each image's pixels from its header,
and the memory a request's images will take while they are prepared (MemoryBudget).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import io
import json
import logging
import os
import re
import signal
import threading
import time
import warnings
from typing import Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from paco_ds.recipe.servers import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_PREPARE_MEMORY_MB

log = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error",
                413: "request_too_large", 502: "bad_gateway", 503: "service_unavailable", 504: "gateway_timeout"}


class ApiError(Exception):
    """An HTTP error with a message for the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "server_error"),
                          "code": self.status}}


# ------------------------------------------------------------------------------------------------
# Request schema (the subset the rewards send)
# ------------------------------------------------------------------------------------------------
class ImageURL(BaseModel):
    url: str


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # other OpenAI fields (seed, top_p, ...) do not change greedy output
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    n: int = 1
    stream: bool = False


def parse_chat_request(body: dict) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(x) for x in e["loc"]) or "body"
        raise ApiError(400, f"invalid request: '{where}': {e['msg']}") from None


def image_parts(body: Any) -> list[Any]:
    """The image parts of a chat request, found without trusting its structure."""
    out = []
    messages = body.get("messages") if isinstance(body, dict) else None
    for msg in messages if isinstance(messages, list) else []:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            out += [p for p in content if isinstance(p, dict) and p.get("type") == "image_url"]
    return out


def check_image_count(body: Any, max_images: int) -> None:
    n = len(image_parts(body))
    if n > max_images:
        raise ApiError(400, f"request has {n} images; this server accepts at most {max_images} per request "
                            "(max_images)")


# Peak bytes per image pixel while the engine prepares a request: PIL's decode and convert("RGB")
# (8 B/px) and the Qwen2.5-VL processor's copies before it resizes (about 10 B/px more); measured
# with ru_maxrss on a 4000x4000 PNG. An 8000x8000 PNG of 263 KiB costs about 0.8 GiB.
PREPARE_BYTES_PER_PIXEL = 20
# The largest image a judge decodes: a 4096x4096 square (about 340 MB to prepare). The judge sees
# 512-2048 px renders; anything much larger is a mistake or an attack, refused from its header.
_HEADER_B64_CHARS = 1 << 16  # enough base64 for a PNG's IHDR or a JPEG's SOF after common EXIF


def _data_uri_payload(url: str) -> str:
    if not url.startswith("data:image/") or ";base64," not in url[:64]:
        raise ApiError(400, f"image_url must be a base64 data URI (data:image/...;base64,...), got '{url[:40]}...'")
    return url.split(",", 1)[1]


def image_size(url: str) -> tuple[int, int]:
    """(width, height) of a data-URI image from its header: a prefix of the base64 is decoded, the
    whole only when the header lies further in (a JPEG with a large EXIF block)."""
    from PIL import Image, UnidentifiedImageError

    def header_size(b64: str) -> tuple[int, int]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(base64.b64decode(b64, validate=True))) as im:  # reads the header only
                return im.size

    payload = _data_uri_payload(url)
    unreadable = (binascii.Error, ValueError, UnidentifiedImageError, OSError)
    try:
        if len(payload) > _HEADER_B64_CHARS:
            with contextlib.suppress(*unreadable):
                return header_size(payload[:_HEADER_B64_CHARS])
        return header_size(payload)
    except Image.DecompressionBombError as err:
        raise ApiError(400, f"image exceeds this server's limit of {Image.MAX_IMAGE_PIXELS} pixels ({err})") from None
    except unreadable as err:
        raise ApiError(400, f"image_url data URI does not hold a readable image ({type(err).__name__})") from None


def check_image_pixels(body: Any, max_pixels: int) -> int:
    """Refuse (400) a request holding an image over `max_pixels`, read from each header before any
    image is decoded; returns the request's total pixels (what preparing it will cost)."""
    total = 0
    for part in image_parts(body):
        url = part.get("image_url", {}).get("url") if isinstance(part.get("image_url"), dict) else None
        if not isinstance(url, str):
            continue  # the schema check names it
        w, h = image_size(url)
        if w * h > max_pixels:
            raise ApiError(400, f"image of {w}x{h} = {w * h} pixels exceeds this server's limit of {max_pixels} "
                                "pixels (max_image_pixels)")
        total += w * h
    return total


class MemoryBudget:
    """Bytes that requests being prepared may hold at once. The preparation pool has 40 threads; a
    budget in bytes (not a count) keeps 40 large images from being decoded together, while small
    requests still run 40 wide. A request that alone exceeds the budget is refused (413)."""

    def __init__(self, capacity: int):
        self.capacity, self.used, self.waits = capacity, 0, 0
        self._cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        if nbytes > self.capacity:
            raise ApiError(413, f"preparing this request's images takes about {nbytes / 2**20:.1f} MiB, over this "
                                f"server's budget of {self.capacity / 2**20:.1f} MiB (prepare_memory_mb)")
        async with self._cond:
            if self.used + nbytes > self.capacity:
                self.waits += 1
                await self._cond.wait_for(lambda: self.used + nbytes <= self.capacity)
            self.used += nbytes
        try:
            yield
        finally:
            async with self._cond:
                self.used -= nbytes
                self._cond.notify_all()


def decode_data_uri(url: str):
    """A PIL RGB image from `data:image/...;base64,...`. Remote URLs are refused: a reward server
    must not fetch from the network on a client's behalf."""
    from PIL import Image, UnidentifiedImageError

    payload = _data_uri_payload(url)
    limit = Image.MAX_IMAGE_PIXELS or 0  # PIL's decompression-bomb bound (about 89 M pixels)
    try:
        raw = base64.b64decode(payload, validate=True)
        with warnings.catch_warnings():  # over the limit is answered below, not logged
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(raw))  # reads the header only: the size is known before decoding
        w, h = im.size
        if limit and w * h > limit:  # a small file can decode to gigabytes: the client's error, not ours
            raise ApiError(400, f"image of {w}x{h} = {w * h} pixels exceeds this server's limit of {limit} pixels")
        return im.convert("RGB")
    except Image.DecompressionBombError as err:
        raise ApiError(400, f"image exceeds this server's limit of {limit} pixels ({err})") from None
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as err:
        raise ApiError(400, f"image_url data URI does not hold a readable image ({type(err).__name__})") from None


# ------------------------------------------------------------------------------------------------
# Plumbing shared by the engine and the gateway
# ------------------------------------------------------------------------------------------------
async def read_json(request, max_bytes: int) -> dict:
    """The request body as a JSON object, refusing bodies over `max_bytes` before reading them all."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body of {int(declared)} bytes exceeds the limit of {max_bytes} bytes (max_body_mb)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"request body exceeds the limit of {max_bytes} bytes (max_body_mb)")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"malformed JSON body: {err}") from None
    except RecursionError:  # the parser recurses per level: a body nested 200,000 deep is the client's error
        raise ApiError(400, f"malformed JSON body: nested deeper than this server accepts ({MAX_JSON_DEPTH})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the JSON body must be an object")
    check_json_text(body)
    return body


# A chat request is a few levels deep; anything much deeper is refused before code that walks it
# recursively (validation, re-encoding, a forward to a backend) can hit the recursion limit.
MAX_JSON_DEPTH = 64
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_json_text(body: Any) -> None:
    """Refuse (400) a parsed JSON body nested deeper than MAX_JSON_DEPTH, or holding a string (key
    or value) with a lone surrogate (JSON's "\\ud83d" without its pair): such a string is not
    Unicode text and could not even be written back in an error message. Iterative: no recursion."""
    stack = [(body, "body", 1)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"malformed JSON body: nested deeper than this server accepts ({MAX_JSON_DEPTH})")
        if isinstance(node, str):
            if _LONE_SURROGATE.search(node):
                raise ApiError(400, f"invalid request: '{where}' holds a lone UTF-16 surrogate (not Unicode text)")
        elif isinstance(node, dict):
            for k, v in node.items():
                if _LONE_SURROGATE.search(k):
                    raise ApiError(400, f"invalid request: a key of '{where}' holds a lone UTF-16 surrogate "
                                        "(not Unicode text)")
                stack.append((v, f"{where}.{k}" if where != "body" else k, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(node))


def is_loopback(host: str | None) -> bool:
    import ipaddress

    try:
        return host is not None and ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def guard_admin_paths(app, api_key_env: str | None, paths: tuple[str, ...]) -> None:
    """Endpoints that change what the server does for everyone (sleep, wake): with a token set,
    install_common already demands it on every path; with none, only this machine may call them
    (403 for any other peer), so that no one on the network can put a judge to sleep."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    if api_key_env and os.environ.get(api_key_env):
        return

    @app.middleware("http")
    async def _local_only(request: Request, call_next):
        if request.url.path in paths and not is_loopback(request.client.host if request.client else None):
            msg = f"{request.url.path} is refused from {request.client.host if request.client else 'an unknown peer'}: " \
                  f"without a token (set {api_key_env or 'an API key'}) only loopback peers may call it"
            return JSONResponse(ApiError(403, msg).body(), status_code=403)
        return await call_next(request)


def install_common(app, api_key_env: str | None, open_paths: tuple[str, ...] = ("/health",)) -> None:
    """OpenAI-style error bodies for ApiError, and the bearer-token check when the environment
    variable `api_key_env` holds a token (every path except `open_paths`)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    token = os.environ.get(api_key_env) if api_key_env else None
    if not token:
        return
    expected = f"Bearer {token}".encode()

    @app.middleware("http")
    async def _bearer(request: Request, call_next):
        if request.url.path not in open_paths:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return JSONResponse(ApiError(401, "missing or wrong bearer token").body(), status_code=401)
        return await call_next(request)


# While it is the client's turn (no request yet, or one still arriving), a connection that sends
# no byte for IDLE_TIMEOUT seconds is closed, and a request must arrive whole within
# REQUEST_TIMEOUT seconds of its first byte: idle or half-sent connections (slow or gone clients,
# or many opened on purpose) would otherwise be held forever. A request being answered is never
# timed: scoring may take minutes under load.
IDLE_TIMEOUT = 30.0
REQUEST_TIMEOUT = 120.0


def timed_protocol(idle_timeout: float = IDLE_TIMEOUT, request_timeout: float = REQUEST_TIMEOUT):
    """uvicorn's h11 protocol with the client-side timeouts above (uvicorn times out only idle
    keep-alive connections after a response, not a new connection or a half-sent request)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    tick = max(0.05, min(1.0, idle_timeout / 4))

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._last_byte = time.monotonic()
            self._request_start: float | None = None
            self._watch = self.loop.call_later(tick, self._check_client)

        def data_received(self, data: bytes) -> None:
            self._last_byte = time.monotonic()
            if self._request_start is None:
                self._request_start = self._last_byte
            super().data_received(data)

        def on_response_complete(self) -> None:
            self._last_byte, self._request_start = time.monotonic(), None  # the client's turn starts now
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._watch.cancel()
            super().connection_lost(exc)

        def _clients_turn(self) -> bool:
            c = self.cycle
            return c is None or c.response_complete or c.more_body

        def _check_client(self) -> None:
            if self.transport.is_closing():
                return
            now = time.monotonic()
            if not self._clients_turn():
                self._request_start = None  # received whole: the answer is ours to give, untimed
            elif now - self._last_byte > idle_timeout or (
                    self._request_start is not None and now - self._request_start > request_timeout):
                self.transport.close()  # connection_lost follows and tells the app, if one is waiting
                return
            self._watch = self.loop.call_later(tick, self._check_client)

    return TimedH11Protocol


def serve(app, host: str, port: int, exit_with_parent: bool = False, idle_timeout: float = IDLE_TIMEOUT,
          request_timeout: float = REQUEST_TIMEOUT) -> None:
    """Run `app` with uvicorn until SIGINT/SIGTERM. With `exit_with_parent` the server also stops
    when the process that started it dies (a trainer killed with SIGKILL leaves no server behind).
    Idle and half-sent connections are closed (timed_protocol)."""
    import uvicorn

    if exit_with_parent:
        parent = os.getppid()

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            log.warning("parent process %d is gone: shutting down", parent)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                http=timed_protocol(idle_timeout, request_timeout))
