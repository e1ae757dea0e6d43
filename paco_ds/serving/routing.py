"""Which judge a rank asks, in a multi-node run: the one on its own host first, then the first
other one that answers its model list.

`launch/cluster.py` hands every rank the judges' URLs in PACO_REWARD_ENDPOINTS
(`model=url+url,model2=url`). A URL is "on this host" when its address can be bound here, which
holds for a node's own addresses whatever its hostname says (network namespaces included).
"""
from __future__ import annotations

import os
import socket
import sys
import time
from urllib.parse import urlsplit

import httpx

ENDPOINTS_ENV = "PACO_REWARD_ENDPOINTS"


def parse(value: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in filter(None, (v.strip() for v in value.split(","))):
        model, _, urls = item.partition("=")
        out[model] = [u for u in urls.split("+") if u]
    return out


def is_local(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        addr = socket.gethostbyname(host)
        with socket.socket() as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def _answers(url: str, model: str, token: str | None) -> float | None:
    """Seconds the judge took to list its models (a round trip over this route), None when it
    does not answer or does not serve `model`."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        t0 = time.perf_counter()
        r = httpx.get(f"{url}/models", headers=headers, timeout=5.0)
        elapsed = time.perf_counter() - t0
        ok = r.status_code == 200 and model in {m.get("id") for m in r.json().get("data", [])}
        return elapsed if ok else None
    except (httpx.HTTPError, ValueError):
        return None


def choose(urls: list[str], model: str, token: str | None = None) -> tuple[str, float | None]:
    """Nearest first, then any healthy: (url, the round trip of its model list in seconds). With
    none healthy, (the nearest, None): its errors then name it."""
    ordered = sorted(urls, key=lambda u: not is_local(u))  # stable: the launcher's order among equals
    for url in ordered:
        rtt = _answers(url, model, token)
        if rtt is not None:
            return url, rtt
    return ordered[0], None


def endpoints_from_env(environ=os.environ, api_key_env: str = "PACO_REWARD_API_KEY") -> dict[str, str] | None:
    """Served model -> the base URL this rank uses, or None when the launcher gave no judges."""
    value = environ.get(ENDPOINTS_ENV, "").strip()
    if not value:
        return None
    token = environ.get(api_key_env)
    chosen = {model: choose(urls, model, token) for model, urls in parse(value).items() if urls}
    for model, (url, rtt) in chosen.items():  # one line per rank: which judge, on which host, how far
        where = "this host" if is_local(url) else "another host"
        reach = f"model list in {rtt * 1000:.1f} ms" if rtt is not None else "not answering yet"
        print(f"[routing] rank {environ.get('RANK', '?')}: '{model}' -> {url} ({where}; {reach})",
              file=sys.stderr, flush=True)
    return {model: url for model, (url, _) in chosen.items()}
