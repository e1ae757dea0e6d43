"""Phase times of a GRPO epoch on the tiny recipe (2 ZeRO-3 processes on CPU, or your GPUs).

Runs the real trainer (the deepspeed launcher) for a few epochs per setting and reports the
median over epochs after the first (warm-up) of: sampling, waiting for rewards after sampling,
training, and images per second. Settings: two train resolutions, and, under ZeRO-3, the rollout
with parameters gathered once for the whole phase versus gathered per denoising step.

    python benchmarks/grpo_epoch.py [--epochs 4] [--nproc 2] [--resolutions 64 128]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, RESULTS, machine, write_report  # noqa: E402

FIELDS = ("time/sample", "time/reward_wait", "time/train", "time/epoch", "images_per_sec")


def run_setting(out: Path, resolution: int, gather: str, epochs: int, nproc: int, port: int) -> dict:
    deepspeed = Path(sys.executable).parent / "deepspeed"
    sets = [f"output_dir={out}", f"run_name=r{resolution}_{gather}", f"train.resolution={resolution}",
            f"train.num_epochs={epochs}", "test.eval_freq=0", "checkpoint.save_freq=0", "logging.num_train_images=0",
            f"deepspeed.rollout_gather={gather}"]
    cmd = [str(deepspeed), "--num_gpus", str(nproc), "--master_port", str(port), str(REPO / "launch/train.py"),
           "--config", str(REPO / "configs/tiny/t2is.yaml")] + [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    if not _has_cuda():
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"run failed ({resolution}px, {gather}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(l) for l in (out / f"r{resolution}_{gather}" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/epoch" in r][1:]  # epoch 0 warms up (kernel build, caches)
    res = {k: statistics.median(r[k] for r in rows) for k in FIELDS}
    res.update(resolution=resolution, rollout_gather=gather, epochs_measured=len(rows),
               micro_steps_per_rank=rows[0]["train/micro_steps"] if rows else None, wall_s=time.perf_counter() - t0)
    return res


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--resolutions", type=int, nargs="+", default=[64, 128])
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    started = machine()
    info = {"runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        port = 29800
        for res in args.resolutions:
            for gather in ("once", "per_step"):
                port += 1
                info["runs"].append(run_setting(Path(tmp), res, gather, args.epochs, args.nproc, port))
    head = f"{'train px':>8} {'rollout gather':>14} {'sample s':>9} {'reward wait s':>13} {'train s':>8} {'epoch s':>8} {'img/s':>6}"
    print(head)
    for r in info["runs"]:
        print(f"{r['resolution']:>8} {r['rollout_gather']:>14} {r['time/sample']:>9.3f} {r['time/reward_wait']:>13.3f} "
              f"{r['time/train']:>8.3f} {r['time/epoch']:>8.3f} {r['images_per_sec']:>6.2f}")
    by = {(r["resolution"], r["rollout_gather"]): r for r in info["runs"]}
    for res in args.resolutions:
        once, per = by[(res, "once")], by[(res, "per_step")]
        ratio = per["time/sample"] / once["time/sample"]
        info.setdefault("sample_time_per_step_over_once", {})[str(res)] = ratio
        print(f"{res} px: per-step gathering takes {ratio:.2f}x the sampling time of gather-once")
    name = "grpo_epoch_" + ("gpu" if _has_cuda() else "cpu")
    print(f"wrote {write_report(name, info, Path(args.out), started)}")


if __name__ == "__main__":
    main()
