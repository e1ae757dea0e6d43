"""PPO-clip, GRPO-Guard, Flow-GRPO-Fast, DiffusionNFT, AWM, online DPO, DGPO, CPS sampling, MixGRPO-Flash and
tree rollouts on the tiny T2IS recipe, same images.

Every method runs the real trainer (deepspeed launcher, 2 ZeRO-3 CPU processes) from its tiny
recipe with one learnable reward, jpeg_compressibility, the same seeds, the same prompts per epoch,
group size and epochs, so the same number of sampled images. Per method and seed it reads the
epoch rows of metrics.jsonl: the mean training reward of each epoch's images (sampled by the
policy after the previous epochs' updates), the ODE eval reward on the test prompts before
training and after the last epoch (EMA off: with 1-2 optimizer steps an epoch and an update every
8, a short run's EMA would still be the initial weights), and the wall time per sampled image (sum of the epochs'
time/epoch: sampling + reward + training, no start-up, no eval). Prints a table, writes
benchmarks/results/loss_compare_cpu.json and the reward-vs-images curves (mean +- std over seeds)
as loss_compare_cpu.png.

    python benchmarks/loss_compare.py                      # 10 methods x 3 seeds, about 50 min on 2 cores
    python benchmarks/loss_compare.py --methods awm --merge  # one method, merged into the results file

`--merge` runs only the given methods and replaces their runs in the existing results (the other
methods' runs are kept, so every method still has the same seeds, epochs and images; settings
that differ are refused); the table and figure are rebuilt from all runs, and each part's command,
date and machine are kept under "parts".

    python benchmarks/loss_compare.py --full-scale         # each method's full-size FLUX recipe, counted

`--full-scale` trains nothing: per method it runs the GPU plan (paco_ds/gpu_plan: the real code path
of a rollout and a trained micro-step on fake CUDA tensors, FLOPs by torch.utils.flop_counter) on
the method's full-size FLUX.1-dev T2IS recipe (FULL_SCALE), 8 ranks of 80 GiB, and writes the model
FLOPs per sampled image (sampling, training), the transformer calls and forward-equivalents per
image and the memory verdict to benchmarks/results/loss_compare_full_scale.json (about 30 s each).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, RESULTS, machine, write_report  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from distributed_runs import launch_cmd, cpu_env, metrics  # noqa: E402

METHODS = {  # name -> (tiny recipe, extra --set)
    "ppo_clip": ("configs/tiny/t2is.yaml", ()),
    "grpo_guard": ("configs/tiny/t2is_guard.yaml", ()),
    "fast_window": ("configs/tiny/t2is_fast.yaml", ()),
    "nft": ("configs/tiny/t2is_nft.yaml", ()),
    "awm": ("configs/tiny/t2is_awm.yaml", ()),
    "dpo": ("configs/tiny/t2is_dpo.yaml", ()),
    "dgpo": ("configs/tiny/t2is_dgpo.yaml", ()),
    "cps": ("configs/tiny/t2is_cps.yaml", ()),
    "mixgrpo_flash": ("configs/tiny/t2is_mixgrpo_flash.yaml", ()),
    "tree": ("configs/tiny/t2is_tree.yaml", ()),
}
REWARD = "jpeg_compressibility"

# The same methods at full size: FLUX.1-dev on PaCo's T2IS recipe (512 px, 10 steps, k = 16), the
# method's own full-size recipe where there is one, else flux_t2is.yaml with the tiny recipe's
# switches. The shipped tiny prompts stand in for PaCo's files (the shapes come from the recipe).
ODE = ("sample.noise_level=0", "sample.noise_steps=[]", "sample.same_latent=false")
FULL_SCALE = {
    "ppo_clip": ("configs/flux_t2is.yaml", ()),
    "grpo_guard": ("configs/flux_t2is_guard.yaml", ()),
    "fast_window": ("configs/flux_t2is_fast.yaml", ()),
    "nft": ("configs/flux_t2is_nft.yaml", ()),
    "awm": ("configs/flux_t2is.yaml", (*ODE, "train.loss=awm")),
    "dpo": ("configs/flux_t2is.yaml", (*ODE, "train.loss=dpo", "train.batch_size=16", "train.timesteps=[1, 3]")),
    "dgpo": ("configs/flux_t2is.yaml", (*ODE, "train.loss=dgpo", "train.batch_size=16")),
    "cps": ("configs/flux_t2is.yaml", ("sample.sde_type=cps", "sample.noise_level=0.8")),
    "mixgrpo_flash": ("configs/flux_t2is_mixgrpo_flash.yaml", ()),
    "tree": ("configs/flux_t2is_tree.yaml", ()),
}
PLAN_DATA = ("data.train_file=paco_ds/data/prompts/tiny_t2is_train.jsonl",
             "data.test_file=paco_ds/data/prompts/tiny_t2is_test.jsonl", "sample.prompts_per_epoch=8")


def run_one(method: str, seed: int, args, root: Path) -> dict:
    config, extra = METHODS[method]
    run_dir = root / f"{method}_s{seed}"
    sets = (f"seed={seed}", f"train.num_epochs={args.epochs}", f"sample.group_size={args.group_size}",
            f"sample.prompts_per_epoch={args.prompts}", f"test.eval_freq={args.epochs}", "checkpoint.save_freq=0",
            "logging.num_train_images=0", "reward_servers=null", "train.ema.enabled=false", f"rewards.train.terms={{{REWARD}: {{weight: 1.0}}}}",
            f"rewards.test.terms={{{REWARD}: {{weight: 1.0}}}}", *extra)
    t0 = time.perf_counter()
    proc = subprocess.run(launch_cmd("launch/train.py", run_dir, *sets, config=REPO / config), cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{method} seed {seed} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = metrics(run_dir)
    epochs = [r for r in rows if "time/epoch" in r]
    evals = {r["epoch"]: r[f"eval/{REWARD}/mean"] for r in rows if f"eval/{REWARD}/mean" in r}
    per_epoch = args.prompts * args.group_size
    return {"method": method, "seed": seed, "images": [per_epoch * (r["epoch"] + 1) for r in epochs],
            "train_reward": [r[f"reward/{REWARD}/mean"] for r in epochs],
            "eval_before": evals.get(0), "eval_after": evals.get(args.epochs),
            "epoch_seconds": sum(r["time/epoch"] for r in epochs), "run_seconds": wall,
            "forwards_per_step": epochs[-1].get("train/forwards_per_step"),
            "sde_logprob_rows_per_rank": [r.get("train/sde_logprob_rows") for r in epochs]}


def _ms(xs):
    xs = [x for x in xs if x is not None]
    return (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (float("nan"), 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--last", type=int, default=2, help="reward after N images: mean over the last LAST epochs")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--merge", action="store_true", help="replace only these methods' runs in the existing results")
    p.add_argument("--full-scale", action="store_true", help="count each method's full-size recipe (GPU plan), no runs")
    args = p.parse_args()
    started = machine()
    if args.full_scale:
        return full_scale(args.methods, Path(args.out), started)
    out = Path(args.out)
    previous = _previous(out / "loss_compare_cpu.json", args) if args.merge else None
    ran = list(args.methods)
    runs = []
    with tempfile.TemporaryDirectory(prefix="loss_compare_") as root:
        for seed in args.seeds:  # seeds outer: a slow machine phase hits every method alike
            for m in args.methods:
                r = run_one(m, seed, args, Path(root))
                runs.append(r)
                print(f"{m:12s} seed {seed}: reward {r['train_reward'][0]:.3f} -> {r['train_reward'][-1]:.3f}, "
                      f"{r['epoch_seconds']:.0f}s", flush=True)
    n_images = args.epochs * args.prompts * args.group_size
    parts = []
    if previous is not None:
        kept = [m for m in previous["settings"]["recipes"] if m not in args.methods]
        runs = [r for r in previous["runs"] if r["method"] in kept] + runs
        parts = previous.get("parts") or [{"methods": list(previous["settings"]["recipes"]),
                                           **{k: previous[k] for k in ("command", "date", "machine")}}]
        for part in parts:
            part["methods"] = [m for m in part["methods"] if m not in args.methods]
        parts = [part for part in parts if part["methods"]]
        args.methods = kept + args.methods
    table = []
    for m in args.methods:
        rs = [r for r in runs if r["method"] == m]
        first = _ms([r["train_reward"][0] for r in rs])
        last = _ms([statistics.mean(r["train_reward"][-args.last:]) for r in rs])
        gain = _ms([statistics.mean(r["train_reward"][-args.last:]) - r["train_reward"][0] for r in rs])
        ev = _ms([r["eval_after"] - r["eval_before"] for r in rs if r["eval_after"] is not None])
        spi = _ms([r["epoch_seconds"] / n_images for r in rs])
        # gain per 1000 images and per minute of epoch time (sampling + reward + training), per seed
        gpi = _ms([1000 * (statistics.mean(r["train_reward"][-args.last:]) - r["train_reward"][0]) / n_images
                   for r in rs])
        gps = _ms([60 * (statistics.mean(r["train_reward"][-args.last:]) - r["train_reward"][0]) / r["epoch_seconds"]
                   for r in rs])
        table.append({"method": m, "seeds": len(rs), "images": n_images, "reward_first_epoch": first,
                      "reward_last_epochs": last, "gain": gain, "eval_gain": ev, "seconds_per_image": spi,
                      "gain_per_1k_images": gpi, "gain_per_minute": gps,
                      "forwards_per_trained_step": rs[0]["forwards_per_step"],
                      "sde_logprob_rows_per_rank_epoch": rs[0]["sde_logprob_rows_per_rank"][0]})
    fmt = lambda ms, d=3, sign="+": f"{ms[0]:{sign}.{d}f} +- {ms[1]:.{d}f}"
    print(f"\nreward = mean {REWARD} of an epoch's sampled images; after {n_images} images = mean of the last "
          f"{args.last} epochs; mean +- std over seeds {args.seeds}")
    print(f"{'method':12s} {'first epoch':>16s} {'after N images':>16s} {'gain':>16s} {'eval gain':>16s} "
          f"{'s/image':>14s} {'gain/1k img':>16s} {'gain/min':>16s} {'fwd/step':>8s} {'SDE lp/epoch':>12s}")
    for t in table:
        print(f"{t['method']:12s} {fmt(t['reward_first_epoch']):>16s} {fmt(t['reward_last_epochs']):>16s} "
              f"{fmt(t['gain']):>16s} {fmt(t['eval_gain']):>16s} {fmt(t['seconds_per_image'], 2, ''):>14s} "
              f"{fmt(t['gain_per_1k_images'], 2):>16s} {fmt(t['gain_per_minute'], 3):>16s} "
              f"{t['forwards_per_trained_step']:>8.1f} {t['sde_logprob_rows_per_rank_epoch']:>12.0f}")
    png = out / "loss_compare_cpu.png"
    _plot(runs, args.methods, png, n_images)
    info = {"settings": {"epochs": args.epochs, "prompts_per_epoch": args.prompts, "group_size": args.group_size,
                         "seeds": args.seeds, "reward": REWARD, "world_size": 2, "last_epochs": args.last,
                         "recipes": {m: METHODS[m][0] for m in args.methods}},
            "table": table, "runs": runs, "figure": png.name}
    if previous is not None:
        from datetime import datetime, timezone

        command = " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
        info["parts"] = parts + [{"methods": ran, "command": command, "machine": started,
                                  "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}]
    print(f"wrote {write_report('loss_compare_cpu', info, out, started)} and {png}")


def full_scale(methods: list[str], out: Path, started: dict) -> None:
    """Each method's full-size recipe planned on fake CUDA tensors: FLOPs per sampled image."""
    from paco_ds.gpu_plan.plan import SAMPLING, TRAINING, gpu_plan
    from paco_ds.grpo.plan import load_config

    rows = []
    for m in methods:
        recipe, sets = FULL_SCALE[m]
        cfg = load_config(REPO / recipe, [*PLAN_DATA, *sets])
        plan = gpu_plan(cfg, 8, 80)
        fwd = plan.flops_detail["transformer_forward"]
        sampling, training = plan.flops[SAMPLING], plan.flops[TRAINING]
        note = None
        if m == "dpo":
            # The plan's micro-step trains every row it is given; DPO trains 2 rows of a group of k
            # (its best and worst sample, each with the reference's forward and the policy's).
            training *= 2 / cfg.sample.group_size
            note = f"training counted for 2 of every {cfg.sample.group_size} samples (one pair per group)"
        rows.append({"method": m, "recipe": recipe, "sets": list(sets),
                     "transformer_calls_per_image": plan.counts["transformer_calls_per_image"],
                     "trained_steps_per_sample": plan.counts["trained_steps_per_sample"],
                     "tflops_per_image": {"sampling": sampling / 1e12, "training": training / 1e12,
                                          "total": (sampling + training) / 1e12},
                     "transformer_forward_tflops": fwd / 1e12,
                     "forward_equivalents_per_image": (sampling + training) / fwd,
                     "peak_gib": max(plan.total(p) for p in plan.memory) / 2 ** 30, "fits_8x80": plan.fits,
                     "note": note})
        r = rows[-1]
        print(f"{m:14s} calls/img {r['transformer_calls_per_image']:>4} trained steps {r['trained_steps_per_sample']:>2} "
              f"TFLOPs/img sampling {r['tflops_per_image']['sampling']:7.1f} training {r['tflops_per_image']['training']:7.1f}"
              f" total {r['tflops_per_image']['total']:7.1f} ({r['forward_equivalents_per_image']:.1f} forwards) "
              f"peak {r['peak_gib']:.1f} GiB", flush=True)
    info = {"what": "model FLOPs per sampled image at full size (FLUX.1-dev, PaCo's T2IS recipe, 8 x 80 GiB), "
                    "counted on the real code path on fake CUDA tensors (paco_ds/gpu_plan); rewards and judge "
                    "excluded (the same for every method)", "world_size": 8, "gpu_gib": 80, "methods": rows}
    print(f"wrote {write_report('loss_compare_full_scale', info, out, started)}")


def _previous(path: Path, args) -> dict:
    """The results to merge into; the same settings, or a SystemExit naming the one that differs."""
    if not path.exists():
        raise SystemExit(f"--merge: {path} does not exist (run all methods first)")
    prev = json.loads(path.read_text())
    mine = {"epochs": args.epochs, "prompts_per_epoch": args.prompts, "group_size": args.group_size,
            "seeds": args.seeds, "reward": REWARD, "world_size": 2, "last_epochs": args.last}
    for key, value in mine.items():
        if prev["settings"].get(key) != value:
            raise SystemExit(f"--merge: {path} has {key}={prev['settings'].get(key)!r}, this run {value!r}")
    return prev


def _plot(runs, methods, path: Path, n_images: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for m in methods:
        rs = [r for r in runs if r["method"] == m]
        xs = rs[0]["images"]
        ys = [statistics.mean(c) for c in zip(*(r["train_reward"] for r in rs))]
        sd = [statistics.stdev(c) if len(c) > 1 else 0.0 for c in zip(*(r["train_reward"] for r in rs))]
        ax.plot(xs, ys, marker="o", label=f"{m} ({len(rs)} seeds)")
        ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)], alpha=0.15)
    ax.set_xlabel("images sampled")
    ax.set_ylabel(f"{REWARD} (epoch mean)")
    ax.set_title(f"tiny T2IS, 2 ZeRO-3 CPU ranks, {n_images} images")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


if __name__ == "__main__":
    main()
