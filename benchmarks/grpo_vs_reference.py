"""paco_ds's GRPO epoch against the reference's schedule of work: same model, same batch, one run.

Both paths run one full epoch (sample -> reward -> advantage -> train, with real AdamW steps on
the same LoRA) of a reduced-depth, full-width FLUX (`paco_ds.models.tiny.flux.save_flux_folder`:
24 heads x 128, T5 width 4096, 1 double + 2 single blocks, ~0.67B parameters):

  (a) paco_ds   the library's own pieces: the trainer's `Rollouts` (prompts encoded once per sample,
                log pi_old recorded at sampling, one VAE decode), a RewardRunner with overlap (each
                batch is scored while the next one samples), `transition_log_prob` (one transformer
                forward with grad per trained step at beta = 0, on the cached text embeddings) and
                `kernels.ppo_clip_loss`.
  (b) reference PaCo-GRPO's `train_flux.py` schedule, re-created below from
                PaCo-RL/PaCo-GRPO/scripts/train_flux.py (github.com/X-GenGroup/PaCo-RL at 08caac6;
                each choice names its lines there as `:N`): sampling with an `old`
                adapter that keeps all N+1 latents, the pipeline's VAE decode whose images are
                dropped, a second decode in reward_compute with synchronous scoring after all
                sampling, and per trained step three transformer forwards (default with grad, old
                and LoRA-disabled ref without) that each re-run both text encoders.

(a) also runs with each rollout switch that leaves every trained step as it is (its x_j, x_{j+1},
sigmas and log pi_old; only the untrained steps change), each variant one more epoch per repeat:

  paco_ds+ode          sample.ode_solver=ab2, sample.ode_steps=--ode-steps: the ODE-only stretch after
                       the noise step (2..steps) in fewer transformer calls (its final image, and so its
                       reward, is the ab2 solver's, not the plain Euler sampler's);
  paco_ds+same_latent  sample.same_latent (one initial latent per group) with share_prefix off: the same
                       work as (a), the baseline of the next one (the reference's recipe and (a) draw one
                       latent per image, so the prefix has nothing to share there);
  paco_ds+prefix       sample.same_latent + sample.share_prefix: a group's steps before its first SDE step
                       (step 0 here) walked once per group; images identical to paco_ds+same_latent's.

model.compile (regional torch.compile) is not run here: its compile takes minutes per shape on CPU;
benchmarks/compile_blocks.py measures it (benchmarks/results/compile_blocks_cpu.json).

Gradient work is the same in all: one backward per trained step, the same accumulation, two
AdamW steps per epoch with gradient clipping at 1.0. The paths and variants alternate order over
the repeats; images/s = images / median epoch time. Forward counts come from hooks on the
transformer, the T5 encoder and the VAE decoder. Writes benchmarks/results/grpo_vs_reference_<cpu|cuda>.json.

    python benchmarks/grpo_vs_reference.py --repeats 2                 # CPU defaults: 128 px, 6 steps, ode_steps 2
    python benchmarks/grpo_vs_reference.py --device cuda               # 512 px, 10 steps (the paper's), ode_steps 3
    python benchmarks/grpo_vs_reference.py --quick                     # tiny model, 4 steps, seconds (the test)

With --judge both paths score with the consistency reward instead, against ONE tiny judge served once
on loopback by paco_ds's own server (paco_ds/serving/manager.py starting the hf engine on the tiny
offline Qwen2.5-VL, paco_ds/recipe/tiny_judge.py), on the T2IS prompts and criteria of
paco_ds/data/prompts/tiny_t2is_train.jsonl (2x2 grids, three criteria each). (a) scores with
paco_ds's `consistency_score` (the recipe's template 1: each of the 6 panel pairs asked once) through
its RewardRunner with overlap, as the trainer does; (b) sends its requests as PaCo-RL's
consistency_score does (`ReferenceConsistency` below: one request per criterion per panel pair, JPEG,
after all sampling, synchronously). Only paco_ds and the reference run (no rollout switches). The
report adds per path the judge's requests per image (counted at the server), its busy seconds
(measured at the server, from /stats: wall seconds in `generate` plus the CPU seconds of each request's
`prepare`), the client's request
latencies, and the judge's seconds per request. Writes grpo_vs_reference_judge_<cpu|cuda>.json.

    python benchmarks/grpo_vs_reference.py --judge --quick             # seconds (the test)
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import JUDGE, REPO, RESULTS, machine, tiny_judge, write_report  # noqa: E402  (puts the repository on sys.path)

MODEL_DIR = REPO / "runs" / "grpo_vs_reference" / "flux_reduced"  # git-ignored; written once
RECIPE = REPO / "configs" / "flux_t2is.yaml"  # (a)'s Rollouts read their sample section from the paper's recipe
RECIPE_DATA = ["data.train_file=paco_ds/data/prompts/tiny_t2is_train.jsonl",
               "data.test_file=paco_ds/data/prompts/tiny_t2is_test.jsonl"]
GUIDANCE, NOISE_LEVEL, NOISE_STEPS = 3.5, 0.7, [1]  # PaCo-RL/PaCo-GRPO/config/grpo.py, t2is
CLIP_RANGE, ADV_CLIP, BETA = 1e-4, 5.0, 0.0  # compute_ppo_loss (:157-244), config/base.py
LR, BETAS, WD, EPS, MAX_GRAD_NORM = 3e-4, (0.9, 0.999), 1e-4, 1e-8, 1.0  # AdamW (:959-978)
OPT_STEPS_PER_EPOCH = 2  # config/grpo.py: gradient_step_per_epoch = 2
REWARD = "jpeg_compressibility"  # a local reward, the same object type for both paths
COMPILE_SOURCE = "benchmarks/results/compile_blocks_cpu.json"
REWARD_BATCH_SIZE = 4  # config/grpo.py: sample.reward_batch_size = min(4 * batch_size, 8)

PROMPTS = ["a red fox in fresh snow, watercolor", "a lighthouse on a cliff at dusk, oil painting",
           "a bowl of ramen on a wooden table, photo", "a robot reading a book in a library, pixel art",
           "a sailing ship in a storm, ink drawing", "a cat asleep on a stack of books, pastel"]

SIMPLIFICATIONS = [
    "one process: no accelerate, no DeepSpeed engine, no all-gather of rewards/prompt ids (a no-op at P=1); "
    "in (a) there is no ZeRO-3 partition, so 'gather parameters once per rollout' has nothing to gather here "
    "(benchmarks/grpo_epoch.py measures it under ZeRO-3)",
    "the same LoRA (r=64, alpha=128, the reference's target modules) from paco_ds.models.lora.add_lora; (b) adds "
    "the `old` adapter with the same config, as the reference does",
    "the same kernels: (b) uses kernels.sde_step / kernels.ppo_clip_loss / kernels.kl_to_reference (the reference "
    "has plain torch math), and the same policy code (FluxPolicy.velocity/encode_prompts/decode) instead of "
    "diffusers' FluxPipeline",
    "the same dtype in both (bf16 weights on cuda, fp32 on CPU) instead of accelerate's autocast",
    "the same optimizer in both: torch AdamW, gradient clipping 1.0 applied in both (under DeepSpeed the "
    "reference's clip is probably inactive: its accelerate config sets no gradient_clipping)",
    "the same local reward (jpeg_compressibility) in both, so the consistency reward's repeated "
    "requests (one per criterion) and the sequential reward models (multi_score) do not show; a remote judge "
    "would widen the gap",
    "the same tiny text encoders (one thin CLIP and T5 layer): re-encoding costs far less here than with "
    "T5-XXL, so the cost of re-encoding in compute_log_prob is understated",
    "no EMA, no eval, no checkpoint, no W&B image logging in either path",
    "the same initial latents and noise in both (the reference uses the global RNG); paco_ds+same_latent and "
    "paco_ds+prefix draw one initial latent per group instead",
]

# --judge: the served tiny judge and the T2IS items (prompt, layout, criteria) both paths score
JUDGE_MODEL = JUDGE  # the tiny Qwen2.5-VL that _common.tiny_judge serves
JUDGE_REWARD = "consistency_score"
JUDGE_ITEMS = REPO / "paco_ds" / "data" / "prompts" / "tiny_t2is_train.jsonl"
# the tiny judge's whole vocabulary (paco_ds/recipe/tiny_judge.py): with random weights "Yes"/"No" need not be
# among the top 20 the reference asks for; the same in both paths, so each request costs the same to answer
JUDGE_TOP_LOGPROBS = 267
REF_MAX_CONCURRENT = 120  # PaCo-GRPO/paco_grpo/rewards/rewards.py:167 (max_concurrent of each call's scorer)
JUDGE_SIMPLIFICATIONS = [
    "--judge: the same tiny judge (random weights, 2 layers) answers both paths: its seconds per request are "
    "CPU seconds of a tiny model, not a 7B VLM's on a GPU; the counts of requests are the schedules' own",
    "--judge: top_logprobs 267 (the tiny vocabulary) in both instead of the reference's 20 (module constant "
    "JUDGE_TOP_LOGPROBS says why)",
    "--judge: (b) raises on a failed request instead of scoring it 0.0 after 10 attempts "
    "(consistency_scorer.py:146-168); none failed in the runs reported",
    "--judge: (b) opens its AsyncOpenAI client inside each call (rewards.py:157-160 opens it once; its "
    "connections belong to the event loop, and asyncio.run makes a new loop per call, consistency_scorer.py:56)",
    "--judge: judge and trainer share this machine's CPU cores (on the paper's placement the judge has its own GPU)",
]

# (a)'s variants: the sample.* overrides of each (on top of the benchmark's shape); {ode_steps} is --ode-steps
PACO_VARIANTS = {
    "paco_ds": [],
    "paco_ds+ode": ["sample.ode_solver=ab2", "sample.ode_steps={ode_steps}"],
    "paco_ds+same_latent": ["sample.same_latent=true", "sample.share_prefix=false"],
    "paco_ds+prefix": ["sample.same_latent=true", "sample.share_prefix=true"],
}


# ---------------------------------------------------------------------------------------------- setup
class Counters:
    """Calls of the transformer and the T5 encoder, and images through the VAE decoder, per phase."""

    def __init__(self, policy):
        self.phase = "idle"
        self.counts: dict[str, dict[str, int]] = {}
        for name, module in (("transformer_forwards", policy.transformer), ("text_encodes", policy.text_encoder_2),
                             ("vae_decodes", policy.vae.decoder)):
            module.register_forward_pre_hook(partial(self._hit, name))

    def _hit(self, name, module, args):
        slot = self.counts.setdefault(self.phase, {})
        # calls for the transformer and T5; images (the batch size) for the VAE decoder
        n = args[0].shape[0] if name == "vae_decodes" and args else 1
        slot[name] = slot.get(name, 0) + n

    @contextmanager
    def counting(self, phase: str):
        prev, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = prev

    def take(self, prefix: str) -> dict:
        out = {k: v for k, v in self.counts.items() if k.startswith(prefix)}
        for k in out:
            del self.counts[k]
        return out


class Clock:
    """Phase timer; synchronizes CUDA before every reading so queued kernels are counted."""

    def __init__(self, device):
        self.device = device
        self.t = {}

    def now(self) -> float:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def epoch_done(self, times: dict, t0: float, t3: float, c0: float, micro_steps: int) -> float:
        """Close an epoch's `times`: training from t3, the epoch from t0, this process's CPU seconds
        (all its threads) since c0, and the micro-steps trained; returns the reading."""
        t4 = self.now()
        times.update(train_s=t4 - t3, epoch_s=t4 - t0, cpu_s=time.process_time() - c0, micro_steps=micro_steps,
                     trained_steps=micro_steps)
        return t4


def load_policy(args, device):
    import torch

    from paco_ds.recipe.schema import LoraConfig, ModelConfig
    from paco_ds.models.attention import set_attention_backend
    from paco_ds.models.flux import FluxPolicy
    from paco_ds.models.lora import add_lora

    if args.quick:
        cfg = ModelConfig(tiny=True)
    else:
        from paco_ds.models.tiny.flux import save_flux_folder

        cfg = ModelConfig(path=str(save_flux_folder(args.model_dir)), max_sequence_length=args.max_sequence_length)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # :956-957 (and model.allow_tf32)
    policy = FluxPolicy.load(cfg, device)
    # r=64, alpha=128, gaussian init, and PaCo-RL's targets for FLUX (scripts/train_flux.py, its LoRA set-up)
    add_lora(policy.transformer, LoraConfig(target_modules=list(FluxPolicy.lora_targets)))
    set_attention_backend(policy.transformer, None)  # both paths: PyTorch's SDPA without cuDNN's kernel
    return policy


def add_old_adapter(transformer):
    """A second adapter `old` with the same config, holding a copy of `default` (LoRA set-up, :740-847)."""
    with warnings.catch_warnings():  # "multiple adapters in the model": intended here
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        transformer.add_adapter(copy.deepcopy(transformer.peft_config["default"]), adapter_name="old")
    transformer.set_adapter("default")  # add_adapter activates the new one
    sync_old(transformer)


def sync_old(transformer):
    """The old-policy sync (:1481-1488): old <- d * old + (1 - d) * default with d = 0 (a hard copy, decay_type 0)."""
    import torch

    params = dict(transformer.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if ".default." in name:
                params[name.replace(".default.", ".old.")].copy_(p)


def judge_items() -> list[dict]:
    """--judge's prompts with their metadata (layout, criteria): the tiny T2IS training set."""
    import json

    return [json.loads(line) for line in JUDGE_ITEMS.read_text().splitlines() if line.strip()]


def make_batch(args):
    """The epoch's samples: images / group_size prompts, each repeated group_size times, shuffled."""
    import torch

    from paco_ds.sampling.trajectory import make_generator

    n_prompts = args.images // args.group_size
    prompts = [it["prompt"] for it in judge_items()] if args.judge else PROMPTS
    order = torch.randperm(args.images, generator=make_generator(0, "order")).tolist()
    picks = [(prompts[i // args.group_size % len(prompts)] + f" #{i // args.group_size}", i // args.group_size, i)
             for i in order]
    assert len({p for p, _, _ in picks}) == n_prompts
    return picks  # (prompt, group id, position)


def generators(rep: int, positions):
    from paco_ds.sampling.trajectory import make_generator

    # the keys Rollouts uses without same_latent (seed 0, epoch = repeat): (a) and (b) start alike
    latent = [make_generator(0, "latent", rep, f"p{p}") for p in positions]
    return latent, [make_generator(0, "noise", rep, p) for p in positions]


def clip_and_step(params, opt):
    import torch

    torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
    opt.step()
    opt.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------- (a)
def paco_rollouts(policy, args, variant: str):
    """The trainer's Rollouts (paco_ds/sampling/rollouts.py) for one of (a)'s variants: the paper's recipe
    with this benchmark's shape, seed 0 (so epoch e's latents and noise are the reference's at repeat e)."""
    import kernels
    from paco_ds.grpo.losses.base import RolloutNeeds
    from paco_ds.grpo.plan import load_config
    from paco_ds.sampling.rollouts import Rollouts

    overrides = [o.format(ode_steps=args.ode_steps) for o in PACO_VARIANTS[variant]]
    cfg = load_config(RECIPE, RECIPE_DATA + [
        "seed=0", f"sample.num_steps={args.steps}", f"sample.guidance_scale={GUIDANCE}",
        f"sample.noise_level={NOISE_LEVEL}", f"sample.noise_steps={NOISE_STEPS}", f"kernels.backend={args.backend}",
        "sample.same_latent=false", "sample.share_prefix=false", *overrides])
    sde = partial(kernels.sde_step, backend=args.backend, return_mean=BETA > 0)  # the mean only for the KL term
    return Rollouts(cfg, policy, sde, needs=RolloutNeeds(log_probs=True), share_prefix=True)


def epoch_paco(ctx, rep: int, variant: str = "paco_ds") -> dict:
    """paco_ds's epoch, with the library's pieces (as paco_ds/grpo/trainer.py composes them)."""
    import numpy as np
    import torch

    import kernels
    from paco_ds.data import PromptItem
    from paco_ds.sampling.rollouts import Pick
    from paco_ds.sampling.trajectory import gather_samples, transition_log_prob

    policy, args, clock, counters, runner = ctx["policy"], ctx["args"], ctx["clock"], ctx["counters"], ctx["runner_a"]
    rollouts = ctx["rollouts"][variant]
    spec = rollouts.spec(rep)  # the guidance, noise level and SDE step the epoch samples with
    times = {}
    calls0 = rollouts.transformer_calls
    t0, c0 = clock.now(), time.process_time()
    # 1. sample: each batch's prompts encoded once, the embeddings kept for training; the VAE decodes
    # once inside sample_trajectories and the images go to the reward workers at once (overlap).
    trajs = []
    with counters.counting(f"{variant}/sample"), rollouts.module() as module:
        for b0 in range(0, len(ctx["picks"]), args.batch_size):
            picks = [Pick(PromptItem(p, metadata=ctx["metadata"](g)), g, pos)
                     for p, g, pos in ctx["picks"][b0:b0 + args.batch_size]]
            traj = rollouts.sample(module, picks, ctx["h"], ctx["w"], epoch=rep)
            runner.submit(traj.images, traj.prompts, traj.metadata)
            trajs.append(traj)
    module = policy.transformer
    t1 = clock.now()
    times["sample_s"] = t1 - t0
    # 2. rewards: what is left after sampling.
    results = runner.collect()
    t2 = clock.now()
    times["reward_wait_s"] = t2 - t1
    # 3. advantages (kernels.grpo_advantages: per-prompt GRPO, global std as in t2is, clip 5).
    groups = torch.tensor([g for t in trajs for g in t.group_ids])
    rewards = torch.as_tensor(np.stack([results[ctx["reward"]].scores]), dtype=torch.float64)
    times["rewards"] = results[ctx["reward"]].scores.tolist()  # in the order sampled
    adv = kernels.grpo_advantages(rewards, [1.0], groups, global_std=True, clip=ADV_CLIP, backend=args.backend)
    adv = adv.advantages.float()
    t3 = clock.now()
    times["advantage_s"] = t3 - t2
    # 4. train: one forward with grad per sample and trained step, against log pi_old from sampling.
    module.train()
    entries = [(t, i) for t in trajs for i in range(len(t))]
    order = torch.randperm(len(entries), generator=torch.Generator().manual_seed(rep)).tolist()
    n_steps = len(NOISE_STEPS)
    micro = len(entries) * n_steps
    per_opt = micro // OPT_STEPS_PER_EPOCH
    k = 0
    with counters.counting(f"{variant}/train"):
        for idx in order:
            batch = gather_samples([entries[idx]])
            a = adv[[idx]].to(policy.device)
            for t in range(n_steps):
                step = transition_log_prob(policy, module, batch, t, slice(None), spec=spec)
                loss, _ = kernels.ppo_clip_loss(step.log_prob, batch.log_prob[:, t].to(policy.device), a, CLIP_RANGE,
                                                ADV_CLIP, backend=args.backend)
                (loss / per_opt).backward()
                k += 1
                if k % per_opt == 0:
                    clip_and_step(ctx["params"], ctx["opt"][variant])
    clock.epoch_done(times, t0, t3, c0, micro)
    times["rollout_transformer_calls"] = rollouts.transformer_calls - calls0  # Rollouts' own count (rows x steps)
    return times


# ---------------------------------------------------------------------------------------------- (b)
def ref_compute_log_prob(policy, module, sample: dict, j: int, sde):
    """compute_log_prob (paco_grpo/diffusers_patch/flux_pipeline.py:58-148): the prompt is re-encoded
    with CLIP and T5 on every call (:94-99 there),
    although the sample stores prompt_embeds; then one transformer forward and the SDE step
    scored at the stored x_{j+1}, returning (log_prob, mean, std) (the mean for the KL term)."""
    embeds = policy.encode_prompts(sample["prompt"])  # re-encoded, as compute_log_prob does
    x = sample["all_latents"][:, j]
    sigmas = sample["sigmas"]  # the scheduler's timesteps are rebuilt from L (a few scalars)
    v = policy.velocity(module, x, sigmas[j], embeds, sample["height"], sample["width"], GUIDANCE)
    return sde(x, v, sigmas[j].item(), sigmas[j + 1].item(), NOISE_LEVEL, sigmas[1].item(),
               prev_sample=sample["all_latents"][:, j + 1])


def ref_stat_tracker(prompts: list[str], rewards, global_std: bool = True):
    """PerPromptStatTracker.compute_advantages (paco_grpo/stat_tracking.py)(type='grpo'): group by exact prompt string,
    (R - mean_p) / max(std, 1e-6) with the batch std when global_std (t2is)."""
    import numpy as np

    r = np.asarray(rewards, dtype=np.float64)
    adv = np.zeros_like(r)
    std_all = max(r.std(), 1e-6)
    for p in np.unique(prompts):
        m = np.array([q == p for q in prompts])
        adv[m] = (r[m] - r[m].mean()) / (std_all if global_std else max(r[m].std(), 1e-6))
    return adv


class ReferenceConsistency:
    """--judge's (b): PaCo-RL's consistency_score request schedule, re-created from
    PaCo-GRPO/paco_grpo/rewards/rewards.py:153-173 and rewards/consistency_scorer.py:55-182 (08caac6).

    Per call (one reward_compute chunk): a fresh scorer (rewards.py:162-169, so its cache lives for one
    call) runs all images at once (asyncio.gather, :89-95); each image walks its criteria one after the
    other (:67-84: every dimension, every non-empty criterion text, one `await` each) and for every
    criterion asks all panel pairs at once (:170-180: divide_image on the prompt's grid, combinations of
    2), each pair a chat request with both panels as JPEG data URIs (utils.py pil_image_to_base64: PIL's
    default quality 75) and the template-1 question on the prompt's theme (:111-118: the text does not
    name the criterion, but the cache key does (:132), so each criterion asks the same pairs again),
    temperature 0, max_completion_tokens 1, top logprobs (:149-157), at most 120 requests in flight
    (:148, rewards.py:167). Score: P(Yes)/(P(Yes)+P(No)) (utils.py get_yes_cond_prob_from_completion),
    averaged over pairs, then criteria, then dimensions (:79-87)."""

    def __init__(self, base_url: str, model: str, top_logprobs: int):
        self.base_url, self.model, self.top_logprobs = base_url, model, top_logprobs
        self.requests = 0  # sent (after the per-call cache)
        self.latencies: list[float] = []  # seconds from send to answer, per request

    def score(self, images, prompts, metadata) -> dict:
        import asyncio

        from paco_ds.rewards.base import RewardResult

        return {JUDGE_REWARD: RewardResult.ok(asyncio.run(self._call(images, prompts, metadata)))}

    async def _call(self, images, prompts, metadata) -> list[float]:
        import asyncio
        import re
        from itertools import combinations

        import openai

        from paco_ds.images import split_panels, split_prompt
        from paco_ds.rewards.base import image_digest
        from paco_ds.rewards.consistency import PAIR_TEMPLATE_V1, data_uri, yes_probability

        client = openai.AsyncOpenAI(api_key="dummy-key", base_url=self.base_url, max_retries=0)
        sem, cache = asyncio.Semaphore(REF_MAX_CONCURRENT), {}

        async def pair(a, b, text: str, criterion: str) -> float:
            key = (image_digest(a), image_digest(b), criterion)  # :132
            if key in cache:
                return cache[key]
            content = [{"type": "image_url", "image_url": {"url": data_uri(a, "jpeg", 75)}},
                       {"type": "image_url", "image_url": {"url": data_uri(b, "jpeg", 75)}},
                       {"type": "text", "text": text}]
            async with sem:
                t0 = time.perf_counter()
                out = await client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": content}], temperature=0.0,
                    max_completion_tokens=1, logprobs=True, top_logprobs=self.top_logprobs, timeout=60)
                self.latencies.append(time.perf_counter() - t0)
                self.requests += 1
            top = out.choices[0].logprobs.content[0].top_logprobs
            cache[key] = yes_probability([(t.token, t.logprob) for t in top])
            return cache[key]

        async def one_image(prompt: str, image, meta: dict) -> float:
            grid = re.findall(r"(\d+)\s*[x\u2a09]\s*(\d+)", prompt)  # utils.py extract_grid_info
            panels = split_panels(image, *((int(grid[0][0]), int(grid[0][1])) if grid else (1, 1)))
            text = PAIR_TEMPLATE_V1.format(theme=split_prompt(prompt)[0])  # the same words as :114-118
            dims = []
            for crits in meta["criteria"].values():
                per_criterion = []
                for criterion in [c for c in crits.values() if c]:  # one after the other (:75-77)
                    got = await asyncio.gather(*(pair(a, b, text, criterion) for a, b in combinations(panels, 2)))
                    per_criterion.append(sum(got) / len(got) if got else 0.0)
                dims.append(sum(per_criterion) / len(per_criterion) if per_criterion else 0.0)
            return sum(dims) / len(dims)

        try:
            return list(await asyncio.gather(*(one_image(p_, im, m) for p_, im, m in zip(prompts, images, metadata))))
        finally:
            await client.close()

    @staticmethod
    def requests_for(metadata: dict, pairs: int) -> int:
        """Requests per image: panel pairs x non-empty criteria (what the schedule above sends)."""
        return pairs * sum(1 for crits in metadata["criteria"].values() for c in crits.values() if c)

    def take_latencies(self) -> list[float]:
        out, self.latencies = self.latencies, []
        return out

    def close(self) -> None:
        pass


def epoch_reference(ctx, rep: int) -> dict:
    """The reference's epoch (train_flux.py:1137-1488)."""
    import numpy as np
    import torch

    import kernels
    from paco_ds.images import to_pil

    policy, args, clock, counters, runner = ctx["policy"], ctx["args"], ctx["clock"], ctx["counters"], ctx["runner_b"]
    module = policy.transformer
    # always returns the mean: compute_ppo_loss computes the KL term
    sde = partial(kernels.sde_step, backend=args.backend)
    h, w, dev = ctx["h"], ctx["w"], policy.device
    times = {}
    t0, c0 = clock.now(), time.process_time()
    # sampling (:1137-1250): eval mode, the `old` adapter (:1144), one pipeline call per batch.
    module.eval()
    module.set_adapter("old")
    samples = []
    sigmas = policy.sigmas(args.steps, h, w)
    with counters.counting("reference/sample"), torch.no_grad():
        for b0 in range(0, len(ctx["picks"]), args.batch_size):
            picks = ctx["picks"][b0:b0 + args.batch_size]
            prompts = [p for p, _, _ in picks]
            # prompt_ids from the T5 tokenizer at max_sequence_length, kept to regroup prompts later (:1154-1160)
            prompt_ids = policy.tokenizer_2(prompts, padding="max_length", max_length=policy.max_sequence_length,
                                            truncation=True, return_tensors="pt").input_ids
            lat_gens, noise_gens = generators(rep, [pos for _, _, pos in picks])
            x = policy.initial_latents(len(picks), h, w, lat_gens)
            embeds = policy.encode_prompts(prompts)  # the pipeline's encode_prompt, once per call
            all_latents = [x]  # all N+1 latents kept on the device for every sample
            for i in range(args.steps):
                v = policy.velocity(module, x, torch.full((len(picks),), sigmas[i].item()), embeds, h, w, GUIDANCE)
                level = NOISE_LEVEL if i in NOISE_STEPS else 0.0  # SDE only at the noise steps (paco_grpo/scheduler.py)
                noise = None
                if level > 0:
                    noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in noise_gens]).to(dev)
                x = sde(x, v, sigmas[i].item(), sigmas[i + 1].item(), level, sigmas[1].item(),
                        noise=noise).prev_sample.to(x.dtype)
                all_latents.append(x)
            # the pipeline decodes and post-processes to PIL; the trainer drops these images
            to_pil(policy.decode(x, h, w))
            all_latents = torch.stack(all_latents, dim=1)
            for k, (prompt, g, _) in enumerate(picks):  # one dict per image (:1229-1244)
                samples.append({"prompt": [prompt], "prompt_ids": prompt_ids[[k]], "height": h, "width": w,
                                "prompt_embeds": embeds.prompt_embeds[[k]].cpu(), "pooled": embeds.pooled[[k]].cpu(),
                                "all_latents": all_latents[[k]], "sigmas": sigmas, "metadata": ctx["metadata"](g)})
    module.set_adapter("default")  # :1250
    t1 = clock.now()
    times["sample_s"] = t1 - t0
    # reward_compute (:76-153, called at :1252) after all sampling, in chunks of reward_batch_size; each
    # chunk's last latents are decoded again and scored synchronously (submit then .result()).
    scores = []
    with counters.counting("reference/reward"), torch.no_grad():
        for r0 in range(0, len(samples), REWARD_BATCH_SIZE):
            chunk = samples[r0:r0 + REWARD_BATCH_SIZE]
            last = torch.cat([s["all_latents"][:, -1] for s in chunk])
            images = to_pil(policy.decode(last, h, w))
            res = runner.score(images, [s["prompt"][0] for s in chunk], [s["metadata"] for s in chunk])
            scores.append(res[ctx["reward"]].scores)
    t2 = clock.now()
    times["reward_wait_s"] = t2 - t1
    # gather (:1265-1273): one process. Then prompt ids decoded back to strings, per-prompt GRPO
    # advantages (:1292-1302).
    ids = torch.cat([s["prompt_ids"] for s in samples])
    prompts = policy.tokenizer_2.batch_decode(ids, skip_special_tokens=True)
    advantages = torch.as_tensor(ref_stat_tracker(prompts, np.concatenate(scores)), dtype=torch.float32)
    times["rewards"] = np.concatenate(scores).tolist()
    for s, a in zip(samples, advantages):
        s["advantages"] = a[None]
        del s["prompt_ids"]
    t3 = clock.now()
    times["advantage_s"] = t3 - t2
    # training (:1362-1479): train mode, shuffled, batch size 1; per sample and trained step, compute_ppo_loss.
    module.train()
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(rep)).tolist()
    micro = len(samples) * len(NOISE_STEPS)
    ga = micro // OPT_STEPS_PER_EPOCH  # accumulation over (sample, timestep) micro-steps (:875-882)
    k = 0
    with counters.counting("reference/train"):
        for idx in order:
            s = samples[idx]
            batch = {**s, "all_latents": torch.cat([s["all_latents"]]),  # re-batching (:1377-1398)
                     "advantages": torch.cat([s["advantages"]]).to(dev)}
            for j in NOISE_STEPS:
                # compute_ppo_loss: log pi_theta from `default` with grad (:169-176) ...
                cur = ref_compute_log_prob(policy, module, batch, j, sde)
                # ... log pi_old recomputed with the `old` adapter under no_grad (:177-185) ...
                with torch.no_grad():
                    module.set_adapter("old")
                    old = ref_compute_log_prob(policy, module, batch, j, sde)
                    module.set_adapter("default")
                    # ... and mu_ref from the base model, adapters disabled (:186-193): 3 forwards at beta = 0
                    with policy.adapter_disabled(module):
                        ref = ref_compute_log_prob(policy, module, batch, j, sde)
                policy_loss, _ = kernels.ppo_clip_loss(cur.log_prob, old.log_prob, batch["advantages"], CLIP_RANGE,
                                                       ADV_CLIP, backend=args.backend)
                kl = kernels.kl_to_reference(cur.mean, ref.mean, cur.std, backend=args.backend).mean()  # :213-214
                loss = policy_loss + BETA * kl
                (loss / ga).backward()  # accelerator.backward divides by the accumulation steps
                k += 1
                if k % ga == 0:  # sync_gradients (:1449-1455)
                    clip_and_step(ctx["params"], ctx["opt"]["reference"])
    sync_old(module)  # :1481-1488
    clock.epoch_done(times, t0, t3, c0, micro)
    return times


# ---------------------------------------------------------------------------------------------- judge
def judge_stats(url: str) -> dict:
    """The server's own counters (paco_ds/serving/hf_engine.py, GET /stats)."""
    import httpx

    return httpx.get(url.removesuffix("/v1") + "/stats", timeout=30).json()


def judge_epoch(before: dict, after: dict, client_requests: int, latencies: list[float]) -> dict:
    """One epoch's judge work: what the server counted and timed, and what the client sent and waited."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("completed", "batches", "generate_s", "prepare_cpu_s")}
    return {"server_requests": d["completed"], "client_requests": client_requests, "batches": d["batches"],
            "generate_s": d["generate_s"], "prepare_cpu_s": d["prepare_cpu_s"],
            # the server's seconds of work on this epoch's requests: the model's, and preprocessing's CPU
            "busy_s": d["generate_s"] + d["prepare_cpu_s"],
            "client_latency_sum_s": sum(latencies), "client_latency_mean_s": sum(latencies) / max(len(latencies), 1)}


def judge_summary(epochs: list[dict], images: int, expected_per_image: float) -> dict:
    """Per path: requests per image (counted; the same every repeat) and the median seconds."""
    med = {k: statistics.median(e[k] for e in epochs) for k in ("busy_s", "generate_s", "prepare_cpu_s",
                                                                 "client_latency_sum_s", "client_latency_mean_s",
                                                                 "batches")}
    requests = epochs[0]["server_requests"]
    return {"requests_per_image": requests / images, "expected_requests_per_image": expected_per_image,
            "server_requests_by_repeat": [e["server_requests"] for e in epochs],
            "client_requests_by_repeat": [e["client_requests"] for e in epochs],
            "median": med, "busy_s_per_request": med["busy_s"] / requests,
            "generate_s_per_request": med["generate_s"] / requests,
            "requests_per_batch": requests / med["batches"] if med["batches"] else None,
            "by_repeat": epochs}


# ---------------------------------------------------------------------------------------------- driver
def warm_up(ctx) -> None:
    """Untimed: build the kernels (the C++ ops on CPU; on CUDA every Triton variant both paths use:
    sampling, scoring with and without the mean, the KL and the PPO loss, forward and backward),
    touch the reward, run the transformer forward + backward once."""
    import torch

    import kernels
    from paco_ds.images import to_pil

    policy, h, w, backend = ctx["policy"], ctx["h"], ctx["w"], ctx["args"].backend
    x = policy.initial_latents(1, h, w, [torch.Generator().manual_seed(0)])
    embeds = policy.encode_prompts(["warm up"])
    policy.transformer.train()
    with torch.no_grad():
        v0 = policy.velocity(policy.transformer, x, torch.tensor([0.9]), embeds, h, w, GUIDANCE)
        x1 = kernels.sde_step(x, v0, 0.9, 0.8, NOISE_LEVEL, 0.95, noise=torch.randn_like(x), backend=backend,
                              return_mean=False).prev_sample
    v = policy.velocity(policy.transformer, x, torch.tensor([0.9]), embeds, h, w, GUIDANCE)
    adv = torch.ones(1, device=x.device)
    loss = 0
    for return_mean in (False, True):
        st = kernels.sde_step(x, v, 0.9, 0.8, NOISE_LEVEL, 0.95, prev_sample=x1, backend=backend,
                              return_mean=return_mean)
        lp, _ = kernels.ppo_clip_loss(st.log_prob, st.log_prob.detach(), adv, CLIP_RANGE, ADV_CLIP, backend=backend)
        loss = loss + lp
        if return_mean:
            loss = loss + kernels.kl_to_reference(st.mean, st.mean.detach() + 1, st.std, backend=backend).mean()
    loss.backward()
    for p in ctx["params"]:
        p.grad = None
    warm = policy.decode(x1, h, w)
    if ctx["args"].judge:  # both judges' clients and the server's first requests (not timed)
        item = judge_items()[0]
        ctx["runner_a"].score(warm, [item["prompt"]], [item])
        ctx["runner_a"].take_latencies()
        ctx["runner_b"].score(to_pil(warm), [item["prompt"]], [item])
        ctx["runner_b"].take_latencies()
    else:
        ctx["runner_b"].score(warm, ["warm up"], [{}])
    ctx["clock"].now()
    ctx["counters"].counts.clear()


def adamw_steps(opt) -> int:
    """Optimizer steps taken so far (AdamW's own per-parameter counter)."""
    state = next(iter(opt.state.values()), None)
    return int(state["step"]) if state else 0


def summarise(name: str, runs: list[dict], counts: dict, images: int, opt) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in ("sample_s", "reward_wait_s", "advantage_s", "train_s",
                                                                 "epoch_s", "cpu_s")}
    n_rep = len(runs)
    per_rep = {phase.split("/", 1)[1]: {k: v // n_rep for k, v in c.items()} for phase, c in counts.items()}
    trained = runs[0]["trained_steps"]
    train = per_rep.get("train", {})
    return {
        "path": name, "images_per_sec": images / med["epoch_s"], "median": med,
        "images_per_cpu_sec": images / med["cpu_s"],  # less sensitive than wall time to other load on the machine
        "epoch_s_by_repeat": [r["epoch_s"] for r in runs],
        "rewards_by_repeat": [r["rewards"] for r in runs],  # each image's score, in the order sampled
        "calls_per_epoch": per_rep,
        "trained_steps": trained,
        "sample_forwards_per_image": per_rep.get("sample", {}).get("transformer_forwards", 0) / images,
        "forwards_per_trained_step": train.get("transformer_forwards", 0) / trained,
        "text_encodes_per_trained_step": train.get("text_encodes", 0) / trained,
        "vae_decodes_per_image": sum(c.get("vae_decodes", 0) for c in per_rep.values()) / images,
        "optimizer_steps_per_epoch": OPT_STEPS_PER_EPOCH,
        "adamw_steps_taken": adamw_steps(opt),  # over all repeats: OPT_STEPS_PER_EPOCH x repeats
        **({"rollout_transformer_calls": runs[0]["rollout_transformer_calls"]} if "rollout_transformer_calls" in runs[0]
           else {}),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--resolution", type=int, help="image side (default: 128 on CPU, 512 on cuda, 32 with --quick)")
    p.add_argument("--images", type=int, help="images per epoch (default: 4 on CPU, 32 on cuda)")
    p.add_argument("--group-size", type=int, help="images per prompt (default: 2 on CPU, 16 on cuda)")
    p.add_argument("--steps", type=int, help="denoising steps (default: 6 on CPU, 10 on cuda, 4 with --quick); "
                   "noise step [1]")
    p.add_argument("--ode-steps", type=int,
                   help="paco_ds+ode's sample.ode_steps: the steps of the ODE-only stretch after the noise step "
                        "(default: 3 on cuda, 2 on CPU, 1 with --quick; each shorter than that stretch)")
    p.add_argument("--repeats", type=int,
                   help="epochs per path and variant, alternating order (default: 2 on CPU, 3 on cuda)")
    p.add_argument("--batch-size", type=int, default=1, help="images per rollout call (the reference's default 1)")
    p.add_argument("--max-sequence-length", type=int,
                   help="T5 tokens (default: 512 on cuda, the reference's; 128 on CPU, which keeps 128 px's "
                        "text tokens from dwarfing its 64 image tokens)")
    p.add_argument("--backend", default="auto", help="kernels backend for both paths (auto|torch|cpp|triton)")
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR, help="the reduced FLUX folder (written once)")
    p.add_argument("--quick", action="store_true", help="tiny random FLUX, 32 px, seconds (a smoke run)")
    p.add_argument("--judge", action="store_true",
                   help="score both paths with the consistency reward against one tiny judge served on loopback "
                        "(paco_ds's hf engine), each with its own request schedule; paco_ds and the reference only")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/grpo_vs_reference_<device>.json)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    # ode_steps < the tail stretch's steps - 2 (2..steps), so paco_ds+ode does walk it in fewer steps
    defaults = ({"resolution": 32, "images": 4, "group_size": 2, "steps": 4, "ode_steps": 1, "repeats": 1,
                 "max_sequence_length": 64}
                if args.quick else
                {"resolution": 512, "images": 32, "group_size": 16, "steps": 10, "ode_steps": 3, "repeats": 3,
                 "max_sequence_length": 512}
                if cuda else
                {"resolution": 128, "images": 4, "group_size": 2, "steps": 6, "ode_steps": 2, "repeats": 2,
                 "max_sequence_length": 128})
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.images % args.group_size or args.images % OPT_STEPS_PER_EPOCH:
        p.error("--images must be a multiple of --group-size and of 2 (two optimizer steps per epoch)")
    if args.steps < 3:
        p.error("--steps must be at least 3 (noise step 1 is trained)")
    if not 1 <= args.ode_steps < args.steps - 2:
        p.error(f"--ode-steps must be in [1, {args.steps - 3}]: fewer than the {args.steps - 2} steps after "
                "the noise step")
    machine_info = machine()

    import torch

    from paco_ds.recipe.schema import RewardSet
    from paco_ds.images import grid_shape
    from paco_ds.rewards.runner import RewardRunner

    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    judge_url, served = None, contextlib.ExitStack()
    if args.judge:  # before the model loads: the server's start overlaps nothing timed
        t_judge = time.perf_counter()
        # paco_ds.serving.manager starts the hf engine (the real server code path); it exits with this process
        judge_url = served.enter_context(tiny_judge(startup_timeout=300))
        print(f"judge: tiny Qwen2.5-VL served by the hf engine at {judge_url} "
              f"(started in {time.perf_counter() - t_judge:.1f}s)", flush=True)
    if not cuda:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = torch.device("cuda" if cuda else "cpu")
    t_load = time.perf_counter()
    policy = load_policy(args, device)
    add_old_adapter(policy.transformer)  # only (b) activates it
    load_s = time.perf_counter() - t_load
    params = [p_ for n, p_ in policy.transformer.named_parameters() if ".default." in n]
    variants = {"paco_ds": PACO_VARIANTS["paco_ds"]} if args.judge else PACO_VARIANTS
    items = judge_items() if args.judge else []
    reward = JUDGE_REWARD if args.judge else REWARD
    if args.judge:  # (a): the recipe's consistency_score term (template 1, PNG), on the served tiny judge
        spec = RewardSet(terms={JUDGE_REWARD: {"model": JUDGE_MODEL, "base_url": judge_url,
                                               "top_logprobs": JUDGE_TOP_LOGPROBS}})
        runner_a = RewardRunner(spec, overlap=True)  # the trainer's default batches_in_flight (8)
        runner_b = ReferenceConsistency(judge_url, JUDGE_MODEL, JUDGE_TOP_LOGPROBS)
    else:
        spec = RewardSet(terms={REWARD: {}})
        runner_a, runner_b = RewardRunner(spec, overlap=True), RewardRunner(spec, overlap=False)
    ctx = {"policy": policy, "args": args, "clock": Clock(device), "counters": Counters(policy), "params": params,
           "h": args.resolution, "w": args.resolution, "picks": make_batch(args), "reward": reward,
           "metadata": (lambda g: items[g % len(items)]) if args.judge else (lambda g: {}),
           # all: torch AdamW on the `default` adapter (:959-978); one optimizer per path, kept across repeats
           "opt": {name: torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, eps=EPS)
                   for name in [*variants, "reference"]},
           "rollouts": {name: paco_rollouts(policy, args, name) for name in variants},
           "runner_a": runner_a, "runner_b": runner_b}
    n_params = sum(p_.numel() for n, p_ in policy.transformer.named_parameters() if "lora_" not in n)
    print(f"model: {'tiny' if args.quick else args.model_dir} ({n_params / 1e9:.3f}B transformer parameters, "
          f"{policy.dtype}, loaded in {load_s:.1f}s) on {device}; {args.images} images, group {args.group_size}, "
          f"{args.resolution}px, {args.steps} steps, {policy.max_sequence_length} T5 tokens", flush=True)
    paths = {**{name: partial(epoch_paco, variant=name) for name in variants}, "reference": epoch_reference}
    runs = {name: [] for name in paths}
    judged = {name: [] for name in paths}  # --judge: each epoch's judge work
    try:
        warm_up(ctx)
        for rep in range(args.repeats):
            names = list(paths) if rep % 2 == 0 else list(reversed(paths))  # alternate: drift hits both alike
            for name in names:
                if args.judge:
                    client = runner_b if name == "reference" else runner_a.rewards[JUDGE_REWARD]
                    before, sent0 = judge_stats(judge_url), client.requests
                r = paths[name](ctx, rep)
                runs[name].append(r)
                line = ""
                if args.judge:  # every request of the epoch is answered by now (collect / synchronous scoring)
                    j = judge_epoch(before, judge_stats(judge_url), client.requests - sent0,
                                    (runner_b if name == "reference" else runner_a).take_latencies())
                    judged[name].append(j)
                    line = f", judge: {j['server_requests']} requests, busy {j['busy_s']:.2f}s"
                print(f"repeat {rep} {name:>19}: epoch {r['epoch_s']:.2f}s (sample {r['sample_s']:.2f}, reward wait "
                      f"{r['reward_wait_s']:.2f}, train {r['train_s']:.2f}{line})", flush=True)
    finally:
        ctx["runner_a"].close()
        ctx["runner_b"].close()
        served.close()  # stops the judge
    res = {name: summarise(name, runs[name], ctx["counters"].take(name + "/"), args.images, ctx["opt"][name])
           for name in paths}
    a, b = res["paco_ds"], res["reference"]
    vs_reference = {name: r["images_per_sec"] / b["images_per_sec"] for name, r in res.items() if name != "reference"}
    vs_paco = {name: r["images_per_sec"] / a["images_per_sec"] for name, r in res.items() if name in variants}
    # the prefix's own gain: against the same draw of latents without sharing (the same images)
    prefix_vs_same_latent = (res["paco_ds+prefix"]["images_per_sec"] / res["paco_ds+same_latent"]["images_per_sec"]
                             if "paco_ds+prefix" in res else None)
    speedup, speedup_cpu = vs_reference["paco_ds"], a["images_per_cpu_sec"] / b["images_per_cpu_sec"]

    head = f"{'path':>19} {'img/s':>8} {'epoch s':>8} {'CPU s':>8} {'sample s':>9} {'reward wait s':>13} " \
           f"{'train s':>8} {'sample fwd/img':>14} {'fwd/trained step':>16} {'T5 calls/trained step':>21} " \
           f"{'VAE decodes/img':>15} {'vs reference':>12} {'vs paco_ds':>10}"
    print(head)
    for name, r in res.items():
        m = r["median"]
        ratios = f"{vs_reference.get(name, 1.0):>11.3f}x {vs_paco[name]:>9.3f}x" if name in vs_paco else \
            f"{1.0:>11.3f}x {1 / vs_reference['paco_ds']:>9.3f}x"
        print(f"{name:>19} {r['images_per_sec']:>8.4f} {m['epoch_s']:>8.2f} {m['cpu_s']:>8.2f} "
              f"{m['sample_s']:>9.2f} {m['reward_wait_s']:>13.3f} {m['train_s']:>8.2f} "
              f"{r['sample_forwards_per_image']:>14.2f} {r['forwards_per_trained_step']:>16.0f} "
              f"{r['text_encodes_per_trained_step']:>21.0f} {r['vae_decodes_per_image']:>15.0f} {ratios}")
    print(f"paco_ds / reference images/s: {speedup:.3f}x (per CPU second: {speedup_cpu:.3f}x)")
    if prefix_vs_same_latent is not None:
        print(f"paco_ds+prefix / paco_ds+same_latent images/s: {prefix_vs_same_latent:.3f}x")
    judge = None
    if args.judge:
        pairs = {name: [] for name in paths}
        for prompt, g, _ in ctx["picks"]:
            rows, cols = grid_shape(prompt, ctx["metadata"](g))
            n_pairs = rows * cols * (rows * cols - 1) // 2
            pairs["paco_ds"].append(n_pairs)  # template 1: each panel pair once
            pairs["reference"].append(ReferenceConsistency.requests_for(ctx["metadata"](g), n_pairs))
        judge = {name: judge_summary(judged[name], args.images, sum(pairs[name]) / args.images) for name in paths}
        ja, jb = judge["paco_ds"], judge["reference"]
        judge["ratios_reference_over_paco_ds"] = {
            "requests_per_image": jb["requests_per_image"] / ja["requests_per_image"],
            "busy_s_per_epoch": jb["median"]["busy_s"] / ja["median"]["busy_s"],
            # what grpo_full_scale.py scales its judge FLOPs per request by
            "busy_s_per_request": jb["busy_s_per_request"] / ja["busy_s_per_request"],
            "generate_s_per_request": jb["generate_s_per_request"] / ja["generate_s_per_request"]}
        print(f"\njudge ({JUDGE_MODEL}, served once; server-side seconds from /stats: generate wall + prepare CPU)")
        print(f"{'path':>19} {'requests/img':>12} {'expected':>8} {'busy s':>8} {'busy ms/req':>11} "
              f"{'client ms/req':>13} {'req/batch':>9} {'reward wait s':>13} {'epoch s':>8} {'img/s':>8}")
        for name in paths:
            jn, r = judge[name], res[name]
            print(f"{name:>19} {jn['requests_per_image']:>12.2f} {jn['expected_requests_per_image']:>8.2f} "
                  f"{jn['median']['busy_s']:>8.3f} {1e3 * jn['busy_s_per_request']:>11.2f} "
                  f"{1e3 * jn['median']['client_latency_mean_s']:>13.2f} {jn['requests_per_batch'] or 0:>9.2f} "
                  f"{r['median']['reward_wait_s']:>13.3f} {r['median']['epoch_s']:>8.2f} {r['images_per_sec']:>8.4f}")
        rr = judge["ratios_reference_over_paco_ds"]
        print(f"reference / paco_ds: requests per image {rr['requests_per_image']:.2f}x, judge busy per epoch "
              f"{rr['busy_s_per_epoch']:.2f}x, per request {rr['busy_s_per_request']:.3f}x; "
              f"paco_ds / reference images/s {speedup:.3f}x")
    print(f"model.compile: not run here (minutes of compile per shape on CPU); measured by "
          f"benchmarks/compile_blocks.py, {COMPILE_SOURCE}")
    report = {
        "config": {"device": str(device), "dtype": str(policy.dtype).replace("torch.", ""), "quick": args.quick,
                   "model": "tiny" if args.quick else "reduced FLUX (REDUCED_FLUX_TRANSFORMER: 1 double + 2 single "
                   "blocks, 24 heads x 128, T5 width 4096)", "transformer_params": n_params,
                   "resolution": args.resolution, "images": args.images, "group_size": args.group_size,
                   "steps": args.steps, "ode_steps": args.ode_steps, "noise_steps": NOISE_STEPS,
                   "trained_steps": NOISE_STEPS,
                   "noise_level": NOISE_LEVEL, "guidance": GUIDANCE, "beta": BETA, "clip_range": CLIP_RANGE,
                   "rollout_batch_size": args.batch_size, "max_sequence_length": policy.max_sequence_length,
                   "lora": {"rank": 64, "alpha": 128}, "optimizer": "torch.optim.AdamW", "lr": LR,
                   "optimizer_steps_per_epoch": OPT_STEPS_PER_EPOCH, "reward": reward, "judge": args.judge,
                   "kernels_backend": args.backend,
                   "repeats": args.repeats, "torch_threads": torch.get_num_threads(), "load_s": load_s},
        **res,
        "variants": {name: [o.format(ode_steps=args.ode_steps) for o in overrides]
                     for name, overrides in variants.items()},  # each one's sample.* overrides
        "images_per_sec": {name: r["images_per_sec"] for name, r in res.items()},
        "speedup": speedup,  # paco_ds images/s / reference images/s
        "speedup_cpu_time": speedup_cpu,  # the same from process CPU seconds (a cross-check on a shared machine)
        "speedup_vs_reference": vs_reference,  # each (a) variant's images/s / the reference's
        "speedup_vs_paco_ds": vs_paco,  # each (a) variant's images/s / plain (a)'s
        "prefix_vs_same_latent": prefix_vs_same_latent,  # the shared prefix's own gain (same latents, same images)
        **({"judge": {"model": JUDGE_MODEL, "served_by": "paco_ds.serving.hf_engine (tiny Qwen2.5-VL, random "
                      "weights), started once by paco_ds.serving.manager on loopback",
                      "items": str(JUDGE_ITEMS.relative_to(REPO)), "top_logprobs": JUDGE_TOP_LOGPROBS,
                      "busy_s": "server-side, from the server's /stats before and after each epoch: wall seconds in "
                                "generate (the model, one batch at a time) + CPU seconds of the requests' prepare "
                                "(image decoding, chat template, processor)", **judge}} if judge else {}),
        "model_compile": {"run_here": False, "source": COMPILE_SOURCE,
                          "why": "regional torch.compile takes minutes per shape on CPU; "
                                 "benchmarks/compile_blocks.py measures it"},
        "load_average_at_end": os.getloadavg(),
        "method": "one process, one model; per repeat each path and variant runs one full epoch (sample, reward, "
                  "advantage, train with AdamW steps), order alternating; images/s = images / median epoch seconds",
        "zero3_gather": "not applicable: one process holds every parameter (no ZeRO-3 partition to gather)",
        "reference_simplifies": ([s_ for s_ in SIMPLIFICATIONS if "jpeg_compressibility" not in s_]
                                 + JUDGE_SIMPLIFICATIONS) if args.judge else SIMPLIFICATIONS,
    }
    out = args.out or RESULTS / (f"grpo_vs_reference{'_judge' if args.judge else ''}_{'cuda' if cuda else 'cpu'}"
                                 f"{'_quick' if args.quick else ''}.json")
    path = write_report(out.stem, report, out.parent, machine_info)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
