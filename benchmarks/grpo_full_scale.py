"""The paper's T2IS epoch on 8 GPUs at full scale, paco_ds against the reference, from counted FLOPs.

This is the GPU headline derived from counted FLOPs until a GPU is measured: no GPU ran it. The
FLOPs per call come from the GPU plan's fake-CUDA pass of configs/flux_t2is.yaml (FLUX.1-dev at
512 x 512, paco_ds/gpu_plan: transformer forward, forward + backward of a trained micro-step, T5-XXL
+ CLIP-L prompt encoding, the VAE decode, the CLIP-H reward models) and one judge request
(Qwen2.5-VL-7B prefill of two 256 x 256 panels and the question, paco_ds/gpu_plan/judge.py).
Each epoch is m = 42 prompts x k = 16 images = 672 images. Times are FLOPs / (MFU x peak), with
the same model FLOP utilisation for every device and phase (30, 40 and 50 %; H100 SXM dense bf16
peak 989 TFLOP/s), so the ratio depends only on the work and where it runs:

  (a) reference  PaCo-RL/PaCo-GRPO/scripts/train_flux.py at 08caac6 with its README's placement:
                 one judge GPU (vLLM) and seven trainers. Per image: 10 transformer forwards and one
                 prompt encoding to sample, a decode in the pipeline and a second one in
                 reward_compute, the local CLIP-H rewards; per trained step three transformer
                 forwards (policy with grad, old and base without) that each re-encode the prompt
                 with T5-XXL and CLIP, and the policy's backward. The judge gets 57 requests per 2x2
                 image (the criteria loop repeats the six panel pairs) after all sampling, and the
                 trainers wait for it (synchronous scoring); each of its requests costs the measured
                 ratio below times paco_ds's.
  (b) paco_ds    the same recipe: one forward with grad per trained step on the cached embeddings
                 (beta = 0, log pi_old from sampling), one decode, six requests per 2x2 image
                 (deduplicated pairs) scored while sampling continues; two placements: the judge on
                 its own GPU beside seven trainers (`cluster.judges`), and one judge per GPU
                 sharing eight trainers' devices (`cluster.colocate`: the judge's work is added to
                 the sampling phase of every GPU).

Each paco_ds placement also gets a row per rollout switch that keeps training exact, with its
sampling forwards per image counted from the recipe's own step plan (paco_ds/sampling/solver.py on
the loaded config; the reference and plain paco_ds take 10):

  + ode_steps 3      sample.ode_solver=ab2, sample.ode_steps=3: steps 0 and 1 (the noise step), then
                     2..10 in 3 steps: 5 forwards;
  + share_prefix     sample.same_latent + sample.share_prefix: a group's step before its first SDE
                     step walked once per group of k = 16: 9 + 1/16 forwards;
  + both             the two together: 4 + 1/16 forwards.

Counted and measured in the judge's share: the requests per image are counted (57: panel pairs x
non-empty criteria over the paper's T2IS training set, tests/rewards/test_consistency_reward.py; 6:
the pairs once) and so are the FLOPs of one request. The judge's time per request of the reference
against paco_ds's is MEASURED, by benchmarks/grpo_vs_reference.py --judge
(benchmarks/results/grpo_vs_reference_judge_cpu.json): both request schedules against one served
judge, the server's own seconds (generate wall + prepare CPU, from its /stats) per request it
answered. Both send two panels and the same template-1 question, so the ratio is what the rest
costs: JPEG against PNG data URIs, and how the requests arrive (24 at once per reward chunk after
sampling, against 6 per rollout batch while sampling goes on) and so batch. The reference's judge
FLOPs are scaled by it. The judge there is the tiny Qwen2.5-VL on CPU, not PaCo-Reward-7B on a GPU:
the ratio is a measured proxy, not a GPU measurement.

model.compile has no row here: regional torch.compile runs the same FLOPs faster (a higher MFU),
so counted FLOPs cannot show it; its measured CPU speed-up is in docs/benchmarks.md
(benchmarks/results/compile_blocks_cpu.json).

    python benchmarks/grpo_full_scale.py            # writes benchmarks/results/grpo_full_scale.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(REPO))

PEAK = 989e12  # H100 SXM, dense bf16 FLOP/s
IMAGES = 42 * 16  # m x k of the T2IS recipe (m = 42 stays for 7 and 8 trainers)
STEPS = 10
TRAINED = 1  # trained steps per image (noise_steps [1])
REF_REQUESTS, OUR_REQUESTS = 57, 6  # judge requests per 2x2 image (counted)
# the measured judge time per request, reference over paco_ds (benchmarks/grpo_vs_reference.py --judge)
JUDGE_MEASURED = RESULTS / "grpo_vs_reference_judge_cpu.json"
RECIPE = REPO / "configs" / "flux_t2is.yaml"
# each exact rollout switch's sample.* overrides (a row per paco_ds placement)
SWITCHES = {"": [], " + ode_steps 3": ["sample.ode_solver=ab2", "sample.ode_steps=3"],
            " + share_prefix": ["sample.same_latent=true", "sample.share_prefix=true"],
            " + both": ["sample.ode_solver=ab2", "sample.ode_steps=3", "sample.same_latent=true",
                        "sample.share_prefix=true"]}
TINY_DATA = ["data.train_file=paco_ds/data/prompts/tiny_t2is_train.jsonl",
             "data.test_file=paco_ds/data/prompts/tiny_t2is_test.jsonl", "sample.prompts_per_epoch=8"]


def counted_flops() -> dict:
    """FLOPs per call from the fake-CUDA pass (the prompts do not change the shapes: 512 x 512,
    T5 padded to 512 tokens, CLIP to 77)."""
    from paco_ds.gpu_plan.judge import judge_request_flops
    from paco_ds.gpu_plan.plan import gpu_plan
    from paco_ds.grpo.plan import load_config

    plan = gpu_plan(load_config(RECIPE, TINY_DATA), 8, 80)
    d = plan.flops_detail
    return {"transformer_forward": d["transformer_forward"], "train_micro_step": d["train_micro_step"],
            "prompt_encode": d["prompt_encode"], "vae_decode": d["vae_decode"], "reward_models": d["reward_models"],
            "judge_request": judge_request_flops(256, 256), "plan_seconds": plan.seconds}


def measured_judge(path: Path = JUDGE_MEASURED) -> dict:
    """The reference's judge seconds per request over paco_ds's, as grpo_vs_reference.py --judge
    measured them at one served judge (server-side: generate wall + prepare CPU seconds per answered
    request), with where and how it was measured."""
    path = Path(path).resolve()
    r = json.loads(path.read_text())
    j = r["judge"]
    ratios = j["ratios_reference_over_paco_ds"]
    source = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return {"source": str(source), "command": r["command"], "date": r["date"],
            "load_average_at_start": r["machine"]["load_average_at_start"],
            "load_average_at_end": r["load_average_at_end"], "cpu_model": r["machine"]["cpu_model"],
            "shape": {k: r["config"][k] for k in ("resolution", "images", "group_size", "steps", "repeats")},
            "judge_model": j["model"],
            "requests_per_image_measured": {"reference": j["reference"]["requests_per_image"],
                                            "paco_ds": j["paco_ds"]["requests_per_image"]},
            "busy_s_per_request": {"reference": j["reference"]["busy_s_per_request"],
                                   "paco_ds": j["paco_ds"]["busy_s_per_request"]},
            # what scales the reference's judge FLOPs per request
            "time_per_request_ratio": ratios["busy_s_per_request"],
            "generate_s_per_request_ratio": ratios["generate_s_per_request"]}


def sampling_forwards(overrides: list[str]) -> float:
    """Transformer forwards per sampled image under the recipe with these sample.* overrides: the
    steps of its plan (the ODE-only stretches walked in at most ode_steps), and with a shared prefix
    the steps before the first SDE step once per group of k (as paco_ds/sampling/rollouts.py counts them)."""
    from paco_ds.grpo.plan import load_config
    from paco_ds.sampling.solver import plan_for

    cfg = load_config(RECIPE, TINY_DATA + overrides)
    plan = plan_for(cfg)
    if not (cfg.sample.same_latent and cfg.sample.share_prefix):
        return float(len(plan))
    first = min(cfg.sample.noise_steps)
    prefix = sum(1 for st in plan if st.k <= first)
    return prefix / cfg.sample.group_size + sum(1 for st in plan if st.i >= first)


def schedules(f: dict, forwards: dict[str, float], judge_ratio: float = 1.0) -> dict:
    """Work per epoch (FLOPs) on the trainers by phase, and on the judge, for each schedule;
    `forwards`: sampling forwards per image for each rollout switch (SWITCHES); `judge_ratio`: the
    reference's judge time per request over paco_ds's (measured_judge), applied to its judge FLOPs."""
    fwd, micro, enc, dec, rew, req = (f[k] for k in ("transformer_forward", "train_micro_step", "prompt_encode",
                                                     "vae_decode", "reward_models", "judge_request"))
    ref_train = TRAINED * (micro + 2 * fwd + 3 * enc)  # policy fwd+bwd, old and ref forwards, 3 encodes
    ours_train = TRAINED * micro
    out = {"reference": {"trainers": 7, "judges": 1, "overlap": False, "colocated": False,
                         "sample": IMAGES * (enc + STEPS * fwd + dec), "score_local": IMAGES * (dec + rew),
                         "train": IMAGES * ref_train, "judge": IMAGES * REF_REQUESTS * req * judge_ratio}}
    for placement, trainers, judges, colocated in (("judge on its own GPU", 7, 1, False),
                                                  ("judges colocated", 8, 8, True)):
        for switch, n in forwards.items():
            out[f"paco_ds ({placement}){switch}"] = {
                "trainers": trainers, "judges": judges, "overlap": True, "colocated": colocated,
                "sampling_forwards_per_image": n, "sample": IMAGES * (enc + n * fwd + dec),
                "score_local": IMAGES * rew, "train": IMAGES * ours_train, "judge": IMAGES * OUR_REQUESTS * req}
    return out


def epoch_time(s: dict, mfu: float) -> dict:
    rate = mfu * PEAK
    trainer_sample = (s["sample"] + s["score_local"]) / s["trainers"] / rate
    judge = s["judge"] / s["judges"] / rate
    train = s["train"] / s["trainers"] / rate
    if s["colocated"]:  # the judge shares each GPU's time during sampling and scoring
        score_phase = trainer_sample + judge
        bottleneck = "every GPU (trainer and judge share it)"
    elif s["overlap"]:  # scoring runs while sampling continues: the slower of the two
        score_phase = max(trainer_sample, judge)
        bottleneck = "judge GPU" if judge > trainer_sample else "trainer GPUs"
    else:  # the reference: all sampling, then the trainers wait for the judge's answers
        score_phase = trainer_sample + judge
        bottleneck = "judge GPU" if judge > trainer_sample + train else "trainer GPUs"
    total = score_phase + train
    return {"sample_and_score_s": score_phase, "train_s": train, "judge_busy_s": judge, "epoch_s": total,
            "bottleneck": bottleneck}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS / "grpo_full_scale.json"))
    p.add_argument("--judge-measured", type=Path, default=JUDGE_MEASURED,
                   help="grpo_vs_reference.py --judge's JSON: the measured judge time per request, reference / paco_ds")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    f = counted_flops()
    judge = measured_judge(args.judge_measured)
    forwards = {switch: sampling_forwards(overrides) for switch, overrides in SWITCHES.items()}
    assert forwards[""] == STEPS, forwards  # the plain plan is the schedule's steps
    sch = schedules(f, forwards, judge["time_per_request_ratio"])
    table = {mfu: {name: epoch_time(s, mfu) for name, s in sch.items()} for mfu in (0.3, 0.4, 0.5)}
    print("GPU headline derived from counted FLOPs until a GPU is measured (no GPU ran this).")
    print(f"FLOPs per call (T): " + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in f.items() if k != "plan_seconds"))
    print(f"judge: {REF_REQUESTS} vs {OUR_REQUESTS} requests per image (counted); the reference's time per request "
          f"= {judge['time_per_request_ratio']:.3f} x paco_ds's (measured: {judge['source']}, {judge['judge_model']}, "
          f"load average {judge['load_average_at_start'][0]:.1f} -> {judge['load_average_at_end'][0]:.1f})")
    print(f"epoch: {IMAGES} images, T2IS recipe (FLUX.1-dev 512 x 512, 10 steps, 1 trained step), 8 x H100 "
          f"(dense bf16 peak {PEAK / 1e12:.0f} TFLOP/s)")
    ratios = {}
    for mfu, rows in table.items():
        ref = rows["reference"]["epoch_s"]
        print(f"\nMFU {mfu:.0%}:")
        for name, r in rows.items():
            ratio = ref / r["epoch_s"]
            ratios.setdefault(name, ratio)
            print(f"  {name:51s} epoch {r['epoch_s'] / 60:6.1f} min  (sample+score {r['sample_and_score_s']:6.0f} s, "
                  f"train {r['train_s']:5.0f} s, judge busy {r['judge_busy_s']:6.0f} s; bottleneck {r['bottleneck']})"
                  f"  reference / this = {ratio:.2f}x")
    out = {"note": "GPU headline derived from counted FLOPs until a GPU is measured; times = FLOPs / (MFU x peak)",
           "command": "python benchmarks/grpo_full_scale.py", "peak_flops": PEAK, "images_per_epoch": IMAGES,
           "denoising_steps": STEPS, "judge_requests_per_image": {"reference": REF_REQUESTS, "paco_ds": OUR_REQUESTS},
           "judge_requests_counted": "57: panel pairs x non-empty criteria, the mean over the paper's T2IS training "
                                     "set's 2x2 prompts; 6: the 2x2 grid's panel pairs once",
           # measured: the reference's judge time per request over paco_ds's; its judge FLOPs are scaled by it
           "judge_time_per_request_measured": judge,
           "flops_per_call": f, "work_flops": sch,
           "epoch": {f"{int(m * 100)}%": rows for m, rows in table.items()},
           "ratio_reference_over": {k: round(v, 3) for k, v in ratios.items()},
           "switches": {"overrides": SWITCHES, "sampling_forwards_per_image": forwards,
                        # each switch's epoch time against its placement's plain paco_ds, at each MFU
                        "gain_over_plain_paco_ds": {f"{int(m * 100)}%": {
                            name: round(rows[name.split(")")[0] + ")"]["epoch_s"] / r["epoch_s"], 4)
                            for name, r in rows.items() if name.startswith("paco_ds") and not name.endswith(")")}
                            for m, rows in table.items()}},
           "model_compile": "no counted-FLOPs row: regional torch.compile runs the same FLOPs (a higher MFU); "
                            "its measured CPU speed-up is in docs/benchmarks.md "
                            "(benchmarks/results/compile_blocks_cpu.json)",
           "seconds": round(time.perf_counter() - t0, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return out


if __name__ == "__main__":
    main()
