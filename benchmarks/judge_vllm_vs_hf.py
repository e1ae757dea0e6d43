"""vLLM's CPU build against the built-in hf engine, serving the same tiny judge (same weights).

Per engine: start-up (command to a served model list), one consistency-style 2-image request at 64
and at 256 px (the median of 3 after one warm-up), 20 concurrent such requests at 64 px (wall time),
and the resident memory of the server's whole process tree (vLLM runs an API server and an engine
process). Engines are started interleaved (vllm, hf, vllm, hf, ...) because the machine is shared.
Both run float32 on CPU with the settings of the vLLM test lane (tests/vllm_lane/conftest.py).
Prints a table and writes benchmarks/results/judge_vllm_vs_hf.json.

    make vllm-setup
    PACO_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python benchmarks/judge_vllm_vs_hf.py --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from _common import JUDGE, RESULTS, machine, write_report  # puts the repository on sys.path
from paco_ds.rewards.consistency import PAIR_TEMPLATE_V1, data_uri
from paco_ds.serving import manager
from paco_ds.recipe.servers import ServersConfig
from paco_ds.recipe.tiny_judge import TINY_JUDGE_VOCAB_SIZE

ENGINES = ("vllm", "hf")


def tree_rss_mib(pid: int) -> float:
    """Resident memory of `pid` and all its descendants (from /proc), MiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(l.split()[1]) for l in status.splitlines() if l.startswith("VmRSS:"))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue  # gone, or a kernel thread without memory
    return total / 1024


def config(engine: str, judge_dir: Path, vllm_python: str) -> ServersConfig:
    kw = ({"vllm_python": vllm_python, "max_model_len": 2048, "extra_args": ["--mm-processor-cache-gb", "0"]}
          if engine == "vllm" else {"dtype": "fp32"})
    return ServersConfig(engine=engine, device="cpu", models=[{"name": JUDGE, "path": str(judge_dir)}], port=0,
                         max_logprobs=TINY_JUDGE_VOCAB_SIZE, startup_timeout=1200, **kw)


def body(size: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    ims = [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(2)]
    text = PAIR_TEMPLATE_V1.format(theme="A 2x2 grid of a lighthouse keeper in a yellow raincoat.")
    return {"model": JUDGE, "max_tokens": 1, "logprobs": True, "top_logprobs": 20, "temperature": 0,
            "messages": [{"role": "user", "content": [
                *({"type": "image_url", "image_url": {"url": data_uri(im)}} for im in ims),
                {"type": "text", "text": text}]}]}


async def timed(client, url: str, payload: dict) -> float:
    t0 = time.perf_counter()
    r = await client.post(f"{url}/chat/completions", json=payload)
    r.raise_for_status()
    return time.perf_counter() - t0


async def measure(url: str, concurrent: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        out = {}
        for size in (64, 256):
            await timed(client, url, body(size, seed=0))  # warm-up
            out[f"one_{size}px_s"] = statistics.median([await timed(client, url, body(size, seed=s))
                                                        for s in (1, 2, 3)])
        t0 = time.perf_counter()
        await asyncio.gather(*(timed(client, url, body(64, seed=100 + i)) for i in range(concurrent)))
        out[f"concurrent_{concurrent}_s"] = time.perf_counter() - t0
        return out


def one(engine: str, judge_dir: Path, vllm_python: str, concurrent: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"paco_bench_{engine}_") as state_dir:
        t0 = time.perf_counter()
        state = manager.start(config(engine, judge_dir, vllm_python), state_dir, exit_with_parent=True)
        try:
            row = {"startup_s": time.perf_counter() - t0}
            row.update(asyncio.run(measure(state["endpoints"][JUDGE], concurrent)))
            row["rss_mib"] = tree_rss_mib(state["servers"][0]["pid"])
            return row
        finally:
            manager.stop(state_dir)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved starts of each engine")
    ap.add_argument("--concurrent", type=int, default=20)
    ap.add_argument("--vllm-python", default=os.environ.get("PACO_VLLM_PYTHON", ".venv-vllm/bin/python"))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if not os.access(args.vllm_python, os.X_OK):
        print(f"--vllm-python {args.vllm_python} is not an interpreter with vLLM (make vllm-setup)", file=sys.stderr)
        return 2
    info = machine()
    from paco_ds.models.tiny.qwen_vl import save_tiny_qwen2_5_vl

    runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
    with tempfile.TemporaryDirectory(prefix="paco_tiny_judge_") as tmp:
        judge_dir = save_tiny_qwen2_5_vl(Path(tmp) / "judge")
        for r in range(args.rounds):
            for engine in ENGINES:
                runs[engine].append(one(engine, judge_dir, args.vllm_python, args.concurrent))
                print(f"round {r} {engine}: {runs[engine][-1]}", flush=True)
    keys = list(runs["hf"][0])
    median = {e: {k: statistics.median(row[k] for row in rows) for k in keys} for e, rows in runs.items()}
    ratio = {k: median["vllm"][k] / median["hf"][k] for k in keys}
    print(f"\n{'median of ' + str(args.rounds):<22} {'vLLM (CPU build)':>17} {'hf engine':>10} {'vLLM / hf':>10}")
    for k in keys:
        print(f"{k:<22} {median['vllm'][k]:>17.3f} {median['hf'][k]:>10.3f} {ratio[k]:>10.2f}")
    path = write_report("judge_vllm_vs_hf", {"rounds": args.rounds, "concurrent": args.concurrent, "runs": runs,
                                             "median": median, "vllm_over_hf": ratio}, args.out, info)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
