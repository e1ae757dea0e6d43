"""What a colocated judge gives back when it sleeps, and what a sleep/wake cycle costs, on CPU.

The judge is the built-in hf engine serving a random-weight Qwen2.5-VL (the tiny recipe's
architecture widened to --hidden/--layers: the tiny judge itself holds 0.24 MiB of weights, too
little to see in an RSS; this one holds hundreds of MiB, like a small real judge). Level 1 on a
CPU writes the weights to a file in the temp dir (a disk here) and frees them; wake reads them
back. For each of --cycles cycles: the judge's RSS awake (after a scored request), the sleep's
seconds, its RSS asleep, the wake's seconds, and whether the scores after the wake are identical.
Writes benchmarks/results/judge_sleep.json (or under --out).

    python benchmarks/judge_sleep.py --cycles 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, machine, write_report  # puts the repository on sys.path

MODEL = "paco-reward-wide"
REQUEST = {"model": MODEL, "max_tokens": 1, "logprobs": True, "top_logprobs": 20,
           "messages": [{"role": "user", "content": "Do the two images show the same subject? Answer Yes or No."}]}


def rss_mib(pid: int) -> float:
    return next(int(l.split()[1]) for l in Path(f"/proc/{pid}/status").read_text().splitlines()
                if l.startswith("VmRSS:")) / 1024


def wide_judge(path: Path, hidden: int, layers: int) -> int:
    """The tiny Qwen2.5-VL with a wider, deeper text model, saved as a checkpoint; returns its bytes."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from paco_ds.models.tiny.qwen_vl import tiny_qwen2_5_vl

    tiny, processor = tiny_qwen2_5_vl()
    cfg = tiny.config
    cfg.text_config.hidden_size, cfg.text_config.intermediate_size = hidden, 4 * hidden
    cfg.text_config.num_hidden_layers, cfg.text_config.layer_types = layers, ["full_attention"] * layers
    cfg.text_config.num_attention_heads = cfg.text_config.num_key_value_heads = hidden // 16  # head_dim 16, as mrope
    cfg.vision_config.out_hidden_size = hidden
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    machine_info = machine()

    import httpx

    from paco_ds.serving import manager
    from paco_ds.recipe.servers import ServersConfig
    from paco_ds.serving.sleep import JudgeSleep

    rows = []
    with tempfile.TemporaryDirectory(prefix="paco_wide_judge_") as tmp:
        weights = wide_judge(Path(tmp) / "ckpt", args.hidden, args.layers)
        cfg = ServersConfig(engine="hf", models=[{"name": MODEL, "path": str(Path(tmp) / "ckpt")}], port=0,
                            max_logprobs=267, startup_timeout=300, dtype="fp32")
        state = manager.start(cfg, Path(tmp) / "state", exit_with_parent=True)
        try:
            (server,) = state["servers"]
            url, pid = server["url"], server["pid"]
            judge = JudgeSleep([url])

            def score() -> dict:
                r = httpx.post(f"{url}/v1/chat/completions", json=REQUEST, timeout=300)
                r.raise_for_status()
                return r.json()["choices"][0]["logprobs"]

            reference = score()
            for c in range(args.cycles):
                awake = rss_mib(pid)
                t0 = time.perf_counter()
                judge.sleep()
                sleep_s = time.perf_counter() - t0
                asleep = rss_mib(pid)
                refused = httpx.post(f"{url}/v1/chat/completions", json=REQUEST, timeout=60).status_code
                t0 = time.perf_counter()
                judge.wake()
                wake_s = time.perf_counter() - t0
                woke = rss_mib(pid)
                same = score() == reference
                rows.append({"cycle": c, "rss_awake_mib": awake, "sleep_s": sleep_s, "rss_asleep_mib": asleep,
                             "status_while_asleep": refused, "wake_s": wake_s, "rss_after_wake_mib": woke,
                             "identical_scores_after_wake": same})
        finally:
            manager.stop(Path(tmp) / "state")

    print(f"judge: random-weight Qwen2.5-VL, text hidden {args.hidden} x {args.layers} layers, "
          f"{weights / 2**20:.0f} MiB of fp32 weights; hf engine on CPU, sleep level 1 (weights to a file)")
    print(f"{'cycle':>5} {'RSS awake MiB':>14} {'sleep s':>8} {'RSS asleep MiB':>15} {'wake s':>7} {'same scores':>12}")
    for r in rows:
        print(f"{r['cycle']:>5} {r['rss_awake_mib']:>14.0f} {r['sleep_s']:>8.2f} {r['rss_asleep_mib']:>15.0f} "
              f"{r['wake_s']:>7.2f} {str(r['identical_scores_after_wake']):>12}")
    med = {k: statistics.median(r[k] for r in rows) for k in ("rss_awake_mib", "rss_asleep_mib", "sleep_s", "wake_s")}
    freed = med["rss_awake_mib"] - med["rss_asleep_mib"]
    print(f"median: {freed:.0f} MiB freed of {weights / 2**20:.0f} MiB of weights; a cycle costs "
          f"{med['sleep_s'] + med['wake_s']:.2f}s (sleep {med['sleep_s']:.2f}s + wake {med['wake_s']:.2f}s)")
    ok = all(r["identical_scores_after_wake"] and r["status_while_asleep"] == 503 for r in rows) \
        and freed > 0.9 * weights / 2**20
    path = write_report("judge_sleep", {
        "settings": {"cycles": args.cycles, "hidden": args.hidden, "layers": args.layers, "dtype": "float32",
                     "weights_mib": weights / 2**20, "level": 1,
                     "judge": "random-weight Qwen2.5-VL (tiny architecture widened), hf engine, CPU"},
        "median": med, "freed_mib": freed, "cycle_s": med["sleep_s"] + med["wake_s"], "met": ok, "cycles": rows},
        args.out, machine_info)
    print(f"wrote {path}" + ("" if ok else "  (NOT MET: RSS did not drop by 90% of the weights, or scores differ)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
