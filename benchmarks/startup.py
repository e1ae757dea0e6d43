"""How long a run takes outside its epochs: a one-epoch tiny run on 2 CPU ranks, as a user starts it.

    python benchmarks/startup.py --repeats 3          # writes benchmarks/results/startup_cpu.json

    python benchmarks/startup.py --tree /path/to/other/checkout --repeats 3   # this tree against another

Each repeat runs `deepspeed --num_gpus 2 launch/train.py --config configs/tiny/t2is.yaml` with
train.num_epochs=1 (the tiny recipe's judge server, its evaluation and checkpoint at epoch 0 and its
final checkpoint, LoRA export and report included), after one warm-up run that builds what a first
run builds once per machine (the C++ ops). Per repeat: the wall time of the command, the epoch's
time/epoch, and the time outside the epochs (wall minus epoch); and where rank 0's start-up went, from
its time/startup/* milestones (seconds since the rank's process started). With `--tree`, each repeat
runs both checkouts in turns (ABBA), so the two are measured under the same load. The table gives
the median and the spread; the JSON holds every repeat, the command, machine, load and commit.
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

DEEPSPEED = Path(sys.executable).parent / "deepspeed"
SETS = ("train.num_epochs=1",)


def one_run(out: Path, port: int, tree: Path = REPO) -> dict:
    cmd = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(port), "launch/train.py", "--config",
           "configs/tiny/t2is.yaml", "--set", f"output_dir={out.parent}", "--set", f"run_name={out.name}",
           *[a for s in SETS for a in ("--set", s)]]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"startup: the run failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    epoch = next(r for r in rows if "time/epoch" in r)
    startup = {k.removeprefix("time/startup/"): v for k, v in epoch.items() if k.startswith("time/startup/")}
    return {"wall_s": wall, "epoch_s": epoch["time/epoch"], "eval_s": epoch.get("time/eval", 0.0),
            "outside_epochs_s": wall - epoch["time/epoch"], "rank0_startup_s": startup,
            "command": " ".join(cmd)}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(runs: list[dict]) -> dict:
    summary = {k: spread([r[k] for r in runs]) for k in ("wall_s", "epoch_s", "outside_epochs_s", "eval_s")}
    milestones = list(dict.fromkeys(m for r in runs for m in r["rank0_startup_s"]))
    summary["rank0_startup_s"] = {m: spread([r["rank0_startup_s"].get(m, float("nan")) for r in runs])
                                  for m in milestones}
    return summary


def print_summary(name: str, summary: dict) -> None:
    print(f"\n{name:34s} {'median':>8s} {'min':>8s} {'max':>8s}")
    for k in ("wall_s", "epoch_s", "eval_s", "outside_epochs_s"):
        s = summary[k]
        print(f"{k:34s} {s['median']:8.1f} {s['min']:8.1f} {s['max']:8.1f}")
    if summary["rank0_startup_s"]:
        print("rank 0 reached, seconds after its process started:")
    for m, s in summary["rank0_startup_s"].items():
        print(f"  {m:32s} {s['median']:8.1f} {s['min']:8.1f} {s['max']:8.1f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tree", type=Path, default=None, help="another checkout, measured in turns with this one")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default="startup_cpu")
    args = p.parse_args(argv)
    info = machine()
    trees = {"this tree": REPO, **({"other tree": args.tree.resolve()} if args.tree else {})}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="paco_startup_") as tmp:
        from paco_ds.serving.manager import free_port

        for name, tree in trees.items():  # what a first run builds once per checkout (the C++ ops)
            one_run(Path(tmp) / f"warmup_{len(runs[name])}_{name.replace(' ', '_')}", free_port(), tree)
        for i in range(args.repeats):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for name in order:
                r = one_run(Path(tmp) / f"{name.replace(' ', '_')}_{i}", free_port(), trees[name])
                runs[name].append(r)
                print(f"{name} repeat {i + 1}: wall {r['wall_s']:.1f} s, epoch {r['epoch_s']:.1f} s, outside the "
                      f"epochs {r['outside_epochs_s']:.1f} s", flush=True)
    report = {"settings": SETS, "trees": {name: {"path": str(tree), "repeats": runs[name],
                                                 "summary": summarise(runs[name])} for name, tree in trees.items()}}
    for name in trees:
        print_summary(name, report["trees"][name]["summary"])
    if args.tree:
        a, b = (report["trees"][n]["summary"]["outside_epochs_s"]["median"] for n in trees)
        report["outside_epochs_ratio"] = a / b
        print(f"\noutside the epochs, this tree / the other: {a / b:.2f}")
    path = write_report(args.name, report, args.out, info)
    print(f"\nwrote {path}; load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
