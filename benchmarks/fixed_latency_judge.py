"""A STAND-IN judge for benchmarks, not a judge: it answers every chat request after a fixed
latency with one response the real judge gave (recorded beforehand, read from --response), and
uses no CPU while it waits (asyncio.sleep). It models a judge on its own hardware, where a reward
costs the trainer's host nothing but the wait (benchmarks/reward_overlap.py, variant fixed).

    python benchmarks/fixed_latency_judge.py --response resp.json --model NAME --port 8000 --latency 0.5
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
import uuid

from fastapi import FastAPI, Request  # module level: the handlers' annotations are resolved from here


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--response", required=True, help="a chat.completion JSON the real judge returned")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--latency", type=float, required=True, help="seconds from request to answer")
    args = p.parse_args(argv)

    import uvicorn

    cached = json.loads(open(args.response).read())
    parent = os.getppid()
    # What overlap rests on, for tests that must not depend on seconds: how many requests were at
    # the judge at once (a trainer that waits for batch b's answers before sending batch b+1 never
    # has more than one batch's requests here).
    served = {"requests": 0, "in_flight": 0, "max_in_flight": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async def exit_with_parent():
            while os.getppid() == parent:
                await asyncio.sleep(1.0)
            os._exit(0)
        watcher = asyncio.get_running_loop().create_task(exit_with_parent())
        yield
        watcher.cancel()

    app = FastAPI(title="fixed-latency stand-in judge", lifespan=lifespan)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": args.model, "stand_in": True}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": args.model, "object": "model", "created": 0, "owned_by": "stand-in"}]}

    @app.get("/stats")
    async def stats():
        return served

    @app.post("/stats/reset")
    async def reset_stats():
        served.update(requests=0, max_in_flight=served["in_flight"])
        return served

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        await request.body()
        served["requests"] += 1
        served["in_flight"] += 1
        served["max_in_flight"] = max(served["max_in_flight"], served["in_flight"])
        try:
            await asyncio.sleep(args.latency)
        finally:
            served["in_flight"] -= 1
        return {**cached, "id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": args.model}

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
