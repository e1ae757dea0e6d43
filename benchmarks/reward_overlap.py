"""How much of the remote reward's time the trainer hides behind sampling.

One epoch as the trainer runs it: rollout batches of the tiny FLUX policy (the tiny T2IS
recipe's model, sizes and prompts), each handed to a RewardRunner scoring consistency_score on
a real hf-engine server. Three variants, interleaved over the repeats so that a drifting
machine hits them alike:
  none     sampling only (no reward),
  inline   each batch is scored before the next one samples (rewards.overlap: false),
  overlap  each batch is submitted at once and collected after sampling (rewards.overlap: true).
reward time R = inline - none; exposed = overlap - none; hidden fraction = 1 - exposed / R.
Two judges (--judges):
  cpu      the real tiny judge on the hf engine, on the same cores as the sampler (they compete),
  fixed    a STAND-IN (benchmarks/fixed_latency_judge.py): every request answered after --latency
           seconds with one recorded response of the real judge, no CPU used while it waits; a
           judge on its own hardware. The last batch's reward is always exposed, so at most
           1 - 1/N is hidden with N batches. --fixed-batches 42 by default: what one rank
           samples per epoch in the flagship recipe on 2 x 8 GPUs (m=42 prompts x k=16 images
           / 16 ranks, batch 1). Target: >= 90% hidden.
The runner keeps up to rewards.batches_in_flight (8) batches at a remote judge at once, so a
judge slower per batch than the sampler (here 0.5 s per batch against about 0.1 s of sampling)
still keeps pace; only the last batches' answers and the client's own CPU work stay exposed.
Writes benchmarks/results/reward_overlap.json (or under --out) with both.

    python benchmarks/reward_overlap.py --batches 8 --repeats 3
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import JUDGE, RESULTS, machine, tiny_judge, write_report  # puts the repository on sys.path

TINY_RECIPE = Path(__file__).resolve().parents[1] / "configs" / "tiny" / "t2is.yaml"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=8, help="rollout batches per epoch")
    p.add_argument("--batch-size", type=int, default=1, help="images per rollout batch")
    p.add_argument("--resolution", type=int, default=512, help="grid side (2x2 panels of half that), as in training")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads for sampling (the server gets its own)")
    p.add_argument("--num-steps", type=int, default=None, help="denoising steps per rollout (default: the recipe's)")
    p.add_argument("--judges", default="cpu,fixed", help="which judges: cpu (the real one), fixed (the stand-in)")
    p.add_argument("--latency", type=float, default=0.5, help="the stand-in's seconds per request")
    p.add_argument("--fixed-batches", type=int, default=42,
                   help="batches per epoch with the stand-in (the last batch's reward is always exposed: 1/N)")
    p.add_argument("--target", type=float, default=0.9,
                   help="hidden fraction the fixed-latency variant must reach (exit 1 below it)")
    p.add_argument("--batches-in-flight", type=int, default=8, help="rewards.batches_in_flight")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # for the server process
    machine_info = machine()

    import torch

    from paco_ds.recipe.schema import RewardSet
    from paco_ds.grpo.plan import load_config
    from paco_ds.data import load_prompts
    from paco_ds.models.flux import FluxPolicy
    from paco_ds.rewards.runner import RewardRunner
    from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
    from paco_ds.sampling.trajectory import make_generator, sample_trajectories

    torch.set_num_threads(args.threads)
    cfg = load_config(TINY_RECIPE)
    num_steps = args.num_steps or cfg.sample.num_steps
    noise_steps = [s for s in cfg.sample.noise_steps if s < num_steps]
    policy = FluxPolicy.load(cfg.model, torch.device("cpu"))
    items = load_prompts(cfg.resolve_path(cfg.data.train_file), cfg.data.format, "data.train_file")
    h = w = args.resolution
    spec = SamplingSpec(num_steps=num_steps, guidance=cfg.sample.guidance_scale, noise_level=cfg.sample.noise_level)

    def rollout(rep: int, b: int):
        picks = [items[(b * args.batch_size + i) % len(items)] for i in range(args.batch_size)]
        prompts = [it.prompt for it in picks]
        gens = [make_generator(cfg.seed, "bench", rep, b, i) for i in range(args.batch_size)]
        traj = sample_trajectories(policy, policy.transformer, spec, RolloutBatch(
            prompts=prompts, embeds=policy.encode_prompts(prompts), height=h, width=w, generators=gens,
            noise_steps=noise_steps, train_steps=[t for t in cfg.train_timesteps if t < num_steps]))
        return traj.images, prompts, [it.metadata for it in picks]

    def measure(url: str, batches: int, judge_stats: str | None = None) -> dict[str, list[dict]]:
        """`judge_stats`: the stand-in's /stats URL, read per epoch (requests at the judge at once)."""
        import httpx

        spec = RewardSet(terms={"consistency_score": {"model": JUDGE, "base_url": url, "top_logprobs": 267}})

        def epoch(variant: str, rep: int) -> dict:
            runner = RewardRunner(spec, overlap=variant == "overlap",
                                  batches_in_flight=args.batches_in_flight) if variant != "none" else None
            if judge_stats and runner is not None:
                httpx.post(f"{judge_stats}/reset", timeout=10).raise_for_status()
            t0 = time.perf_counter()
            for b in range(batches):
                batch = rollout(rep, b)
                if runner is not None:
                    runner.submit(*batch)
            t_sample = time.perf_counter() - t0
            out = {"sample_s": t_sample}
            if runner is not None:
                # Batches already scored when sampling ended: all of them in line; with overlap the
                # last one at least is still at the judge (submit returned at once).
                out["scored_when_sampling_ended"] = sum(all(f.done() for f in futures.values())
                                                        for _, futures in runner.pending)
                res = runner.collect()["consistency_score"]
                out.update(busy_s=runner.busy_seconds, valid=int(res.valid.sum()),
                           requests=runner.rewards["consistency_score"].requests)
                if judge_stats:
                    out["judge_max_in_flight"] = httpx.get(judge_stats, timeout=10).json()["max_in_flight"]
                runner.close()
            out["epoch_s"] = time.perf_counter() - t0
            return out

        epoch("overlap", -1)  # warm-up: first-call costs of the policy, the processor and the server
        runs: dict[str, list[dict]] = {"none": [], "inline": [], "overlap": []}
        for rep in range(args.repeats):
            for variant in runs:
                runs[variant].append(epoch(variant, rep))
        return runs

    def summary(runs: dict, batches: int) -> dict:
        med = {v: statistics.median(r["epoch_s"] for r in rs) for v, rs in runs.items()}
        reward_s, exposed_s = med["inline"] - med["none"], med["overlap"] - med["none"]
        hidden = 1 - exposed_s / reward_s if reward_s > 0 else float("nan")
        valid = min(r["valid"] for v in ("inline", "overlap") for r in runs[v])
        return {"batches": batches, "images_per_epoch": batches * args.batch_size,
                "requests_per_epoch": runs["overlap"][0]["requests"], "median_epoch_s": med, "reward_s": reward_s,
                "exposed_s": exposed_s, "hidden_fraction": hidden, "valid_scores": valid, "runs": runs}

    results = {}
    with tiny_judge() as url:
        if "cpu" in args.judges:
            results["cpu"] = summary(measure(url, args.batches), args.batches)
        # One response of the real judge to a request of the reward's shape (two panels of a real
        # rollout, top 267 logprobs): what the fixed-latency stand-in answers to every request.
        recorded = record_response(url, rollout(0, 0)[0])
    if "fixed" in args.judges:
        with fixed_latency_judge(recorded, args.latency) as url:
            stats = url.removesuffix("/v1") + "/stats"
            results["fixed"] = summary(measure(url, args.fixed_batches, stats), args.fixed_batches)
            results["fixed"]["latency_s"] = args.latency

    labels = {"cpu": "the real tiny judge (hf engine) on the same 2 cores as the sampler",
              "fixed": f"a STAND-IN judge: fixed {args.latency:g}s latency per request, no CPU while it waits, "
                       "answering with one recorded response of the real judge"}
    ok = True
    for name, r in results.items():
        print(f"\n[{name}] {labels[name]}")
        print(f"epoch of {r['batches']} batches x {args.batch_size} images at {h}x{w}, median of {args.repeats}:")
        print(f"{'variant':>8} {'epoch s':>8} {'reward busy s':>14}")
        for v, rs in r["runs"].items():
            busy = statistics.median(x.get("busy_s", 0.0) for x in rs)
            print(f"{v:>8} {r['median_epoch_s'][v]:>8.2f} {busy:>14.2f}")
        print(f"reward time {r['reward_s']:.2f}s, exposed with overlap {r['exposed_s']:.2f}s: "
              f"hidden fraction {r['hidden_fraction']:.2f}")
        ok &= r["valid_scores"] == r["images_per_epoch"]
        r["judge"] = labels[name]
    hidden = results.get("fixed", {}).get("hidden_fraction")
    met = hidden is None or hidden >= args.target
    if hidden is not None:
        print(f"fixed-latency judge: {hidden:.0%} of the reward time hidden behind sampling "
              f"(target {args.target:.0%}: {'met' if met else 'NOT MET'})")
    path = write_report("reward_overlap", {
        "settings": {"batch_size": args.batch_size, "resolution": args.resolution, "num_steps": num_steps,
                     "repeats": args.repeats, "sampling_threads": args.threads,
                     "batches_in_flight": args.batches_in_flight},
        "variants": results, "fixed_latency_target": args.target, "fixed_latency_target_met": met}, args.out, machine_info)
    print(f"wrote {path}")
    return 0 if ok and met else 1


def record_response(url: str, images) -> dict:
    import base64
    import io

    import httpx

    from paco_ds.images import to_pil

    grid = to_pil(images[:1])[0]
    w, h = grid.size
    panels = [grid.crop((0, 0, w // 2, h // 2)), grid.crop((w // 2, 0, w, h // 2))]
    content = []
    for im in panels:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        content.append({"type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}})
    content.append({"type": "text", "text": "Do the two images show the same subject? Answer Yes or No."})
    r = httpx.post(f"{url}/chat/completions", timeout=120, json={
        "model": JUDGE, "messages": [{"role": "user", "content": content}], "max_tokens": 1, "logprobs": True,
        "top_logprobs": 267})
    r.raise_for_status()
    return r.json()


@contextlib.contextmanager
def fixed_latency_judge(response: dict, latency: float):
    """benchmarks/fixed_latency_judge.py on a free port; yields its base URL."""
    import httpx

    from paco_ds.serving.manager import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="paco_standin_") as tmp:
        path = Path(tmp) / "response.json"
        path.write_text(json.dumps(response))
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fixed_latency_judge.py")),
                                 "--response", str(path), "--model", JUDGE, "--port", str(port),
                                 "--latency", str(latency)], stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the fixed-latency stand-in judge did not start")
                time.sleep(0.2)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
