"""Colocated rollouts against rollout.mode: async on the tiny recipe, side by side in one run (CPU).

Each setting is the real trainer under the deepspeed launcher with the same number of processes
(--nproc, 2 by default: on a 2-core machine each process has a core), the tiny recipe's rewards and its
judge (the tiny Qwen2.5-VL on the hf engine, started by the run, on the same cores):
  colocated                  every rank samples, then every rank trains (ZeRO-3 over all of them);
  async k=1, async k=2       one sampler process, the others train; rollout.max_staleness 1 and 2;
  async k=1 after sampling   as async k=1, but the sampler hands an epoch's batches to the rewards
                             once it has sampled them all (rollout.scoring: after_sampling) instead of
                             as each finishes (streamed): the judge's comparison.
For each seed the settings run in turn (a drifting machine hits them alike). Per run, over the epochs
after the first (which holds the sampler's start-up): images per second (images / summed epoch time),
the time the trainers waited per epoch (colocated: for the judge's last answers after sampling,
time/reward_wait; async: for rollouts, async/trainer_wait_s) and the sampler's waits for an adapter
version; and the reward curve (reward/combined/mean per epoch). Across seeds: mean and spread (sample
standard deviation). Writes benchmarks/results/async_rollouts_cpu.json (command, machine, commit, load).

    python benchmarks/async_rollouts.py --epochs 6 --seeds 1 2 3
    python benchmarks/async_rollouts.py --epochs 6 --seeds 3 --add-to benchmarks/results/async_rollouts_cpu.json

The report is written after every run, so a benchmark stopped part-way keeps what it measured, and
--add-to continues it (its earlier commands and machines are kept in "earlier").
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
from _common import REPO, RESULTS, git_state, machine, write_report  # noqa: E402

ASYNC = ["rollout.mode=async", "rollout.samplers=1"]
SETTINGS = {
    "colocated": [],
    "async k=1": ASYNC + ["rollout.max_staleness=1"],
    "async k=2": ASYNC + ["rollout.max_staleness=2"],
    "async k=1 after sampling": ASYNC + ["rollout.max_staleness=1", "rollout.scoring=after_sampling"],
}


def run(out: Path, name: str, sets: list[str], seed: int, epochs: int, nproc: int, port: int) -> dict:
    run_name = f"{name.replace(' ', '_').replace('=', '')}_s{seed}"
    sets = [f"output_dir={out}", f"run_name={run_name}", f"seed={seed}", f"train.num_epochs={epochs}",
            "test.eval_freq=0", "checkpoint.save_freq=0", "logging.num_train_images=0", "logging.tensorboard=false",
            *sets]
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(port),
           str(REPO / "launch/train.py"), "--config", str(REPO / "configs/tiny/t2is.yaml")]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    load, t0 = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} (seed {seed}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(l) for l in (out / run_name / "metrics.jsonl").read_text().splitlines() if l.strip()]
    rows = [r for r in rows if "time/epoch" in r]
    steady = rows[1:]  # epoch 0 holds the sampler's start-up (and the first calls' warm-up everywhere)
    images = sum(r["images_per_sec"] * r["time/epoch"] for r in steady)
    wait = "async/trainer_wait_s" if "async/trainer_wait_s" in rows[0] else "time/reward_wait"
    return {"setting": name, "seed": seed, "wall_s": time.perf_counter() - t0, "load_before": load,
            "load_after": os.getloadavg()[0], "images_per_sec": images / sum(r["time/epoch"] for r in steady),
            "trainer_wait_s_per_epoch": statistics.mean(r[wait] for r in steady),
            "sampler_wait_s_per_epoch": statistics.mean(r.get("async/sampler_wait_s", 0.0) for r in steady),
            "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in steady),
            "reward": [r["reward/combined/mean"] for r in rows], "epoch_s": [r["time/epoch"] for r in rows]}


def spread(values: list[float]) -> dict:
    # one seed has no spread: None, not 0
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values), "values": values}


def summary(runs: list[dict]) -> dict:
    out = {}
    for name in dict.fromkeys(r["setting"] for r in runs):
        mine = [r for r in runs if r["setting"] == name]
        curves = list(zip(*[r["reward"] for r in mine]))
        out[name] = {k: spread([r[k] for r in mine]) for k in
                     ("images_per_sec", "trainer_wait_s_per_epoch", "sampler_wait_s_per_epoch", "staleness_mean")}
        out[name]["reward_curve"] = [spread(list(epoch)) for epoch in curves]
        out[name]["reward_gain"] = spread([r["reward"][-1] - r["reward"][0] for r in mine])
    return out


def _pm(v: dict, width: int, digits: int) -> str:
    std = "-" if v["std"] is None else f"{v['std']:.{digits}f}"
    return f"{v['mean']:>{width}.{digits}f} ± {std:<{digits + 2}}"


def table(s: dict) -> str:
    head = (f"{'setting':<26} {'images/s':>14} {'trainer wait s/epoch':>21} {'sampler wait s/epoch':>21} "
            f"{'staleness':>9} {'reward first -> last (gain)':>34}")
    lines = [head]
    for name, v in s.items():
        curve, gain = v["reward_curve"], v["reward_gain"]
        gain_std = "-" if gain["std"] is None else f"{gain['std']:.3f}"
        lines.append(f"{name:<26} {_pm(v['images_per_sec'], 7, 3)}{_pm(v['trainer_wait_s_per_epoch'], 13, 2)}"
                     f"{_pm(v['sampler_wait_s_per_epoch'], 13, 2)}{v['staleness_mean']['mean']:>9.2f}   "
                     f"{curve[0]['mean']:.3f} -> {curve[-1]['mean']:.3f} ({gain['mean']:+.3f} ± {gain_std}, "
                     f"{gain['n']} seed(s))")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--nproc", type=int, default=2, help="processes per setting (async: one of them samples)")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--add-to", type=Path, help="an earlier report of this benchmark (the same --epochs and --nproc): "
                   "its runs are kept and this command's added, e.g. more seeds after a benchmark stopped part-way")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    started, source = machine(), git_state(REPO)
    runs, earlier = [], []
    if args.add_to:
        before = json.loads(args.add_to.read_text())
        if (before["epochs"], before["nproc"]) != (args.epochs, args.nproc):
            raise SystemExit(f"--add-to {args.add_to}: its runs have --epochs {before['epochs']} --nproc "
                             f"{before['nproc']}, not {args.epochs} and {args.nproc}")
        runs = before["runs"]
        earlier = before.get("earlier", []) + [{k: before[k] for k in ("command", "date", "machine", "source")}]
    settings = {**(before["settings"] if args.add_to else {}), **{n: SETTINGS[n] for n in args.settings}}

    def report() -> Path:
        # written after every run, so a long benchmark stopped part-way keeps what it measured
        return write_report("async_rollouts_cpu", {"source": source, "epochs": args.epochs, "nproc": args.nproc,
                                                   "settings": settings, "earlier": earlier, "summary": summary(runs),
                                                   "runs": runs, "load_average_at_end": os.getloadavg()},
                            args.out, started)

    port = 29900
    with tempfile.TemporaryDirectory(prefix="paco_async_bench_") as tmp:
        for seed in args.seeds:
            for name in args.settings:
                port += 1
                runs.append(run(Path(tmp), name, SETTINGS[name], seed, args.epochs, args.nproc, port))
                print(f"{name} seed {seed}: {runs[-1]['images_per_sec']:.3f} images/s, load "
                      f"{runs[-1]['load_before']:.1f} -> {runs[-1]['load_after']:.1f}", flush=True)
                path = report()
    print(table(summary(runs)))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
