"""One OpenAI endpoint in front of several judge servers, routed by the request's `model` field.

`POST /v1/...` goes to the backend serving that model (400 when the field is missing, 404 for a
model nobody serves, 502 when the backend is unreachable, 504 when it times out); `GET /v1/models`
merges the backends' lists; `GET /health` is 200 only when every backend is healthy. The gateway
checks the bearer token, body size and image count itself, so a bad request never reaches a GPU.
Unlike the reference gateway it gets its routes from the process that starts it (no second copy
of the servers file to fall out of step, as in PaCo-RL/PaCo-GRPO/vllm_server/gateway_fastapi.py).

    python -m paco_ds.serving.gateway --port 8000 --backend PaCo-Reward-7B=http://127.0.0.1:18001
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
from collections import Counter

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from paco_ds.errors import ConfigError, exit_on_user_error
from paco_ds.recipe.servers import API_KEY_ENV
from paco_ds.serving.protocol import (DEFAULT_MAX_IMAGE_PIXELS, ApiError, check_image_count, check_image_pixels,
                                     install_common, read_json, serve)

log = logging.getLogger(__name__)


def create_app(routes: dict[str, str], *, max_images: int = 2, max_body_mb: float = 64,
               max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
               api_key_env: str | None = API_KEY_ENV, timeout: float = 300.0, connect_timeout: float = 10.0):
    """`routes`: served model name -> backend base URL (scheme, host and port, without /v1)."""
    routes = {name: url.rstrip("/") for name, url in routes.items()}
    backends = sorted(set(routes.values()))
    max_body = int(max_body_mb * 2 ** 20)
    state: dict = {}
    stats: Counter = Counter()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=connect_timeout), limits=limits) as client:
            state["client"] = client
            yield

    app = FastAPI(title="paco_ds reward gateway", lifespan=lifespan)
    install_common(app, api_key_env, open_paths=("/health", "/"))

    def _auth(request: Request) -> dict[str, str]:
        return {"authorization": request.headers["authorization"]} if "authorization" in request.headers else {}

    async def _get(url: str, request: Request) -> httpx.Response:
        try:
            return await state["client"].get(url, headers=_auth(request))
        except httpx.TimeoutException:
            raise ApiError(504, f"backend {url} timed out") from None
        except httpx.TransportError as err:
            raise ApiError(502, f"backend {url} is unreachable ({type(err).__name__})") from None

    @app.get("/")
    async def info():
        return {"routes": routes}

    @app.get("/health")
    async def health(request: Request):
        async def one(url):
            try:
                r = await state["client"].get(f"{url}/health", timeout=5.0)
                return "ok" if r.status_code == 200 else f"HTTP {r.status_code}"
            except httpx.HTTPError as err:
                return type(err).__name__
        status = dict(zip(backends, await asyncio.gather(*(one(u) for u in backends))))
        ok = all(s == "ok" for s in status.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "backends": status}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        data = []
        for r in await asyncio.gather(*(_get(f"{u}/v1/models", request) for u in backends)):
            if r.status_code != 200:
                raise ApiError(502, f"backend {r.request.url} answered HTTP {r.status_code}")
            data += r.json().get("data", [])
        return {"object": "list", "data": data}

    @app.get("/stats")
    async def get_stats():
        return dict(stats)

    @app.post("/v1/{path:path}")
    async def forward(path: str, request: Request):
        body = await read_json(request, max_body)
        check_image_count(body, max_images)
        check_image_pixels(body, max_image_pixels)  # vLLM behind it would decode the image whole
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "the request has no 'model' field")
        if model not in routes:
            raise ApiError(404, f"model '{model}' is not served by this gateway; served: {', '.join(sorted(routes))}")
        url = f"{routes[model]}/v1/{path}"
        headers = {"content-type": "application/json", **_auth(request)}
        try:
            r = await state["client"].post(url, content=json.dumps(body).encode(), headers=headers)
        except httpx.TimeoutException:
            stats[f"{model}/timeouts"] += 1
            raise ApiError(504, f"backend {routes[model]} for model '{model}' timed out") from None
        except httpx.TransportError as err:
            stats[f"{model}/unreachable"] += 1
            raise ApiError(502, f"backend {routes[model]} for model '{model}' is unreachable "
                                f"({type(err).__name__})") from None
        stats[f"{model}/requests"] += 1
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    return app


def parse_routes(items: list[str]) -> dict[str, str]:
    routes = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ConfigError(f"--backend {item!r}: expected NAME=http://host:port")
        routes[name] = url
    return routes


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Route OpenAI chat requests to reward servers by model name.")
    p.add_argument("--backend", action="append", required=True, metavar="NAME=URL",
                   help="a served model name and its server's base URL (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-images", type=int, default=2)
    p.add_argument("--max-body-mb", type=float, default=64)
    p.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for a backend's answer")
    p.add_argument("--api-key-env", default=API_KEY_ENV, help="environment variable holding the bearer token")
    p.add_argument("--exit-with-parent", action="store_true", help="stop when the starting process dies")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with exit_on_user_error("gateway"):
        routes = parse_routes(args.backend)
    app = create_app(routes, max_images=args.max_images, max_body_mb=args.max_body_mb,
                     max_image_pixels=args.max_image_pixels, api_key_env=args.api_key_env,
                     timeout=args.timeout)
    log.info("gateway on http://%s:%d/v1 for %s", args.host, args.port, ", ".join(sorted(routes)))
    serve(app, args.host, args.port, exit_with_parent=args.exit_with_parent)


if __name__ == "__main__":
    main()
