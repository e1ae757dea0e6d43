"""Load on a reward server: C concurrent clients, each sending N consistency-style requests.

Every request is what consistency_score sends: two panel images as PNG data URIs and the v1
prompt, temperature 0, one token, top-20 logprobs. Without --url the benchmark starts the tiny
Qwen2.5-VL on the built-in hf engine itself. Prints req/s and latency percentiles, and writes
benchmarks/results/serve_load.json (or under --out).

    python benchmarks/serve_load.py --clients 8 --requests 50
    python benchmarks/serve_load.py --url http://127.0.0.1:8000/v1 --model PaCo-Reward-7B
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from _common import JUDGE, RESULTS, machine, tiny_judge, write_report  # puts the repository on sys.path
from paco_ds.rewards.consistency import PAIR_TEMPLATE_V1, data_uri
from paco_ds.recipe.servers import API_KEY_ENV


def _requests(n: int, size: int, seed: int) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    text = PAIR_TEMPLATE_V1.format(theme="A 2x2 grid of a lighthouse keeper in a yellow raincoat.")
    out = []
    for _ in range(n):
        ims = [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(2)]
        out.append([*({"type": "image_url", "image_url": {"url": data_uri(im)}} for im in ims),
                    {"type": "text", "text": text}])
    return out


async def _load(url: str, model: str, contents: list[list[dict]], clients: int, per_client: int,
                top_logprobs: int) -> tuple[list[float], list[str], float]:
    import openai

    latencies: list[float] = []
    errors: list[str] = []

    async def client(c: int) -> None:
        async with openai.AsyncOpenAI(base_url=url, api_key=os.environ.get(API_KEY_ENV) or "none", max_retries=0,
                                      timeout=120) as api:
            for i in range(per_client):
                t0 = time.perf_counter()
                try:
                    resp = await api.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": contents[c * per_client + i]}],
                        temperature=0.0, max_completion_tokens=1, logprobs=True, top_logprobs=top_logprobs)
                    if not resp.choices[0].logprobs.content[0].top_logprobs:
                        raise ValueError("no top logprobs in the response")
                except Exception as err:  # noqa: BLE001 - every failure is counted and reported
                    errors.append(f"{type(err).__name__}: {err}")
                    continue
                latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return latencies, errors, time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=50, help="requests per client")
    p.add_argument("--url", help="an OpenAI base URL to load (default: start the tiny hf engine)")
    p.add_argument("--model", default=JUDGE)
    p.add_argument("--image-size", type=int, default=256, help="panel side in pixels")
    p.add_argument("--top-logprobs", type=int, default=20)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    machine_info = machine()

    contents = _requests(args.clients * args.requests, args.image_size, seed=0)
    with (contextlib.nullcontext(args.url) if args.url else tiny_judge()) as url:
        warm = _requests(2, args.image_size, seed=1)
        asyncio.run(_load(url, args.model, warm, 1, 2, args.top_logprobs))
        before = _server_stats(url) if not args.url else {}
        latencies, errors, wall = asyncio.run(_load(url, args.model, contents, args.clients, args.requests,
                                                    args.top_logprobs))
        server = {k: v - before.get(k, 0) for k, v in _server_stats(url).items() if k != "max_batch"} if before else {}
    ms = sorted(x * 1000 for x in latencies)
    pct = lambda q: ms[min(len(ms) - 1, int(round(q / 100 * (len(ms) - 1))))] if ms else float("nan")
    result = {"clients": args.clients, "requests_per_client": args.requests, "image_size": args.image_size,
              "engine": "hf (tiny Qwen2.5-VL)" if not args.url else args.url, "requests": len(contents),
              "ok": len(latencies), "errors": len(errors), "error_examples": errors[:3], "wall_s": wall,
              "req_per_s": len(latencies) / wall, "latency_ms": {"p50": pct(50), "p90": pct(90), "p99": pct(99),
                                                                 "mean": statistics.fmean(ms) if ms else None},
              "server": server}
    print(f"{'clients':>8} {'requests':>9} {'errors':>7} {'req/s':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}"
          f" {'mean batch':>10}")
    batch = server.get("batched_requests", 0) / max(1, server.get("batches", 0)) if server else float("nan")
    print(f"{args.clients:>8} {len(contents):>9} {len(errors):>7} {result['req_per_s']:>8.1f} {pct(50):>8.1f} "
          f"{pct(90):>8.1f} {pct(99):>8.1f} {batch:>10.2f}")
    path = write_report("serve_load", {"result": result}, args.out, machine_info)
    print(f"wrote {path}")
    return 1 if errors else 0


def _server_stats(url: str) -> dict:
    """The hf engine's request and batch counters (the run's share is the difference)."""
    import httpx

    token = os.environ.get(API_KEY_ENV)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.get(url.removesuffix("/v1") + "/stats", headers=headers, timeout=10).json()


if __name__ == "__main__":
    sys.exit(main())
