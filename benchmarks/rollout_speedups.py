"""What the rollout switches buy: a group's shared prefix (`sample.share_prefix`, with
`sample.same_latent`) and fewer solver steps in the ODE-only stretches (`sample.ode_steps`,
`sample.ode_solver`), side by side with the plain sampler.

1. Sampling (always): the trainer's own rollout code (paco_ds/sampling/rollouts.py) on PaCo-GRPO's T2IS
   shape (10 steps, the SDE at step 1, one image per rollout batch, groups of k) with the
   reduced-depth, full-width FLUX of benchmarks/grpo_vs_reference.py at 128 px, each switch and
   the plain sampler alternating over the repeats. images/s, transformer calls per image, and how
   far the images move from the plain sampler's (uint8 levels).
2. Training (`--curves`): the tiny T2IS recipe with 8 steps, the SDE and training at steps 0-2
   (a stretch of 3 trained steps for a learning signal within CPU minutes, then the ODE tail
   [3, 8)), 2 ranks, the JPEG reward, 3 seeds: the plain Euler sampler against the tail in 2 AB2
   steps; images/s and the reward of every epoch.

    python benchmarks/rollout_speedups.py --repeats 2          # 1. on CPU, minutes
    python benchmarks/rollout_speedups.py --quick --curves     # tiny model, plus 2.
    python benchmarks/rollout_speedups.py --batches 1 2 4 8    # only sample.batch_size, side by side
Writes benchmarks/results/rollout_speedups_<cpu|cuda>.json (rollout_batches_<cpu|cuda>.json).
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
from _common import REPO, RESULTS, machine, write_report  # noqa: E402  (puts the repository on sys.path)

TINY_DATA = ["data.train_file=paco_ds/data/prompts/tiny_t2is_train.jsonl",
             "data.test_file=paco_ds/data/prompts/tiny_t2is_test.jsonl"]
# name -> recipe settings; every variant samples one latent per group, so their images compare
VARIANTS = {
    "plain": ["sample.share_prefix=false"],
    "share_prefix": ["sample.share_prefix=true"],
    "ode_steps=3 ab2": ["sample.share_prefix=false", "sample.ode_solver=ab2", "sample.ode_steps=3"],
    "both": ["sample.share_prefix=true", "sample.ode_solver=ab2", "sample.ode_steps=3"],
}
PROMPTS = ["a red fox in fresh snow, watercolor", "a lighthouse on a cliff at dusk, oil painting",
           "a bowl of ramen on a wooden table, photo", "a robot reading a book in a library, pixel art"]


def sampling(args) -> dict:
    import torch

    from grpo_vs_reference import load_policy
    from paco_ds.data import PromptItem
    from paco_ds.grpo.losses.base import RolloutNeeds
    from paco_ds.grpo.plan import load_config
    from paco_ds.sampling.rollouts import Pick, Rollouts

    device = torch.device(args.device)
    policy = load_policy(args, device)
    size = args.size
    common = TINY_DATA + [f"sample.num_steps={args.steps}", "sample.noise_steps=[1]", "sample.same_latent=true",
                          f"sample.group_size={args.group_size}"]
    cfgs = {name: load_config(REPO / "configs" / "flux_t2is.yaml", common + sets) for name, sets in VARIANTS.items()}
    items = [PromptItem(p) for p in PROMPTS]
    groups = args.images // args.group_size
    picks = [Pick(items[g % len(items)], g, g * args.group_size + j) for g in range(groups)
             for j in range(args.group_size)]
    times = {name: [] for name in VARIANTS}
    calls, images = {}, {}
    for rep in range(args.repeats):
        names = list(VARIANTS)
        names = names[rep % len(names):] + names[:rep % len(names)]  # each variant goes first once in a while
        for name in names:
            cfg = cfgs[name]
            ro = Rollouts(cfg, policy, needs=RolloutNeeds(log_probs=True), share_prefix=True)
            out = []
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for p in picks:  # sample.batch_size 1: one image per rollout batch, as the paper's recipe
                out.append(ro.sample(policy.transformer, [p], size, size, epoch=rep).images)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
            calls[name] = ro.transformer_calls / len(picks)
            images[name] = torch.cat(out)
            print(f"  rep {rep} {name:16s} {times[name][-1]:7.2f} s", flush=True)
    base = statistics.median(times["plain"])
    rows = {}
    for name in VARIANTS:
        t = statistics.median(times[name])
        diff = (images[name].float() - images["plain"].float()).abs()
        rows[name] = {"seconds": times[name], "images_per_s": len(picks) / t, "speed_vs_plain": base / t,
                      "transformer_calls_per_image": calls[name], "image_diff_mean": float(diff.mean()),
                      "image_diff_max": float(diff.max())}
    print(f"\n{len(picks)} images ({groups} groups of {args.group_size}), {args.steps} steps, SDE at step 1, "
          f"{size} px, {'tiny model' if args.quick else 'reduced-depth full-width FLUX'}, {args.repeats} repeats")
    print(f"{'variant':18s} {'images/s':>9s} {'vs plain':>9s} {'calls/img':>10s} {'|d| mean':>9s} {'|d| max':>8s}")
    for name, r in rows.items():
        print(f"{name:18s} {r['images_per_s']:9.3f} {r['speed_vs_plain']:8.2f}x {r['transformer_calls_per_image']:10.2f} "
              f"{r['image_diff_mean']:9.2f} {r['image_diff_max']:8.0f}")
    return {"images": len(picks), "group_size": args.group_size, "steps": args.steps, "size": size, "rows": rows}


def rollout_batches(args) -> dict:
    """`sample.batch_size`: the same images sampled in rollout batches of each size (the plain
    sampler), the sizes alternating over the repeats; images/s against one image per batch."""
    import torch

    from grpo_vs_reference import load_policy
    from paco_ds.data import PromptItem
    from paco_ds.grpo.losses.base import RolloutNeeds
    from paco_ds.grpo.plan import load_config
    from paco_ds.sampling.rollouts import Pick, Rollouts

    device = torch.device(args.device)
    policy = load_policy(args, device)
    cfg = load_config(REPO / "configs" / "flux_t2is.yaml", TINY_DATA + [
        f"sample.num_steps={args.steps}", "sample.noise_steps=[1]", "sample.share_prefix=false"])
    ro = Rollouts(cfg, policy, needs=RolloutNeeds(log_probs=True))
    picks = [Pick(PromptItem(PROMPTS[i % len(PROMPTS)]), i, i) for i in range(args.images)]
    sizes = args.batches
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for rep in range(args.repeats):
        for b in sizes[rep % len(sizes):] + sizes[:rep % len(sizes)]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(0, len(picks), b):
                ro.sample(policy.transformer, picks[i:i + b], args.size, args.size, epoch=rep)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[b].append(time.perf_counter() - t0)
            print(f"  rep {rep} batch {b:2d} {times[b][-1]:7.2f} s", flush=True)
    base = statistics.median(times[sizes[0]])
    rows = {str(b): {"seconds": times[b], "images_per_s": len(picks) / statistics.median(times[b]),
                     "speed_vs_first": base / statistics.median(times[b])} for b in sizes}
    print(f"\nrollout batches: {len(picks)} images, {args.steps} steps, {args.size} px, "
          f"{'tiny model' if args.quick else 'reduced-depth full-width FLUX'}, {torch.get_num_threads()} threads, "
          f"{args.repeats} repeats")
    print(f"{'sample.batch_size':>17s} {'images/s':>9s} {f'vs {sizes[0]}':>8s}")
    for b, r in rows.items():
        print(f"{b:>17s} {r['images_per_s']:9.3f} {r['speed_vs_first']:7.2f}x")
    return {"images": len(picks), "steps": args.steps, "size": args.size, "threads": torch.get_num_threads(),
            "rows": rows}


def curves(args) -> dict:
    """Tiny-recipe training runs: the plain sampler and the ODE switch, 3 seeds each."""
    deepspeed = Path(sys.executable).parent / "deepspeed"
    sets = ["reward_servers=null", "rewards.train.terms={jpeg_compressibility: {weight: 1.0}}", "rewards.test=null",
            "sample.num_steps=8", "sample.noise_steps=[0, 1, 2]", "sample.same_latent=false", f"train.num_epochs={args.epochs}",
            "test.eval_freq=0", "checkpoint.save_freq=0", "logging.num_train_images=0"]
    variants = {"euler (plain)": [], "ode_steps=2 ab2": ["sample.ode_solver=ab2", "sample.ode_steps=2"]}
    out = {}
    with tempfile.TemporaryDirectory(prefix="rollout_speedups_") as tmp:
        for seed in args.seeds:
            for name, extra in variants.items():  # alternate the variants within each seed
                run = Path(tmp) / f"{name.split()[0]}_{seed}"
                cmd = [str(deepspeed), "--num_gpus", "2", "--master_port", str(29600 + seed), str(REPO / "launch/train.py"),
                       "--config", str(REPO / "configs/tiny/t2is.yaml"), "--set", f"output_dir={tmp}",
                       "--set", f"run_name={run.name}", "--set", f"seed={seed}"]
                for s in sets + extra:
                    cmd += ["--set", s]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
                if proc.returncode != 0:
                    raise SystemExit(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}")
                rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
                rows = [r for r in rows if "time/epoch" in r]
                out.setdefault(name, {})[seed] = {
                    "reward": [r["reward/jpeg_compressibility/mean"] for r in rows],
                    "images_per_sec": [r["images_per_sec"] for r in rows],
                    "time_sample_s": [r["time/sample"] for r in rows],
                    "transformer_calls": rows[0]["sample/transformer_calls"], "wall_s": time.perf_counter() - t0}
                print(f"  {name:16s} seed {seed}: reward {out[name][seed]['reward'][0]:.3f} -> "
                      f"{out[name][seed]['reward'][-1]:.3f}, sampling {statistics.median(out[name][seed]['time_sample_s']):.2f} s/epoch",
                      flush=True)
    print(f"\n{'variant':18s} {'calls/epoch':>11s} {'sample s/epoch':>15s} {'images/s':>9s} {'first':>7s} {'last':>7s} "
          f"{'last 3 mean':>11s}")
    summary = {}
    for name, seeds in out.items():
        s = {"transformer_calls": seeds[args.seeds[0]]["transformer_calls"],
             "sample_s": statistics.median(t for r in seeds.values() for t in r["time_sample_s"][1:]),
             "images_per_s": statistics.median(t for r in seeds.values() for t in r["images_per_sec"][1:]),
             "reward_first": statistics.mean(r["reward"][0] for r in seeds.values()),
             "reward_last": statistics.mean(r["reward"][-1] for r in seeds.values()),
             "reward_last3": statistics.mean(x for r in seeds.values() for x in r["reward"][-3:])}
        summary[name] = s
        print(f"{name:18s} {s['transformer_calls']:11.0f} {s['sample_s']:15.2f} {s['images_per_s']:9.2f} "
              f"{s['reward_first']:7.3f} {s['reward_last']:7.3f} {s['reward_last3']:11.3f}")
    return {"epochs": args.epochs, "seeds": args.seeds, "runs": out, "summary": summary}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="the tiny model instead of the reduced-depth, full-width FLUX")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-sequence-length", type=int, default=64)
    p.add_argument("--model-dir", default=str(REPO / "runs" / "grpo_vs_reference" / "flux_reduced"))
    p.add_argument("--curves", action="store_true", help="also the tiny recipe's training runs (3 seeds)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=None, metavar="B",
                   help="only the rollout batch sizes (sample.batch_size) side by side, e.g. 1 2 4 8")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    info = machine()
    if args.batches:
        report = {"rollout_batches": rollout_batches(args), "load_average_at_end": os.getloadavg()}
        path = write_report(f"rollout_batches_{args.device}", report, Path(args.out), info)
        print(f"\nwrote {path}")
        return report
    report = {"sampling": sampling(args)}
    if args.curves:
        report["curves"] = curves(args)
    report["load_average_at_end"] = os.getloadavg()
    path = write_report(f"rollout_speedups_{args.device}", report, Path(args.out), info)
    print(f"\nwrote {path}")
    return report


if __name__ == "__main__":
    main()
