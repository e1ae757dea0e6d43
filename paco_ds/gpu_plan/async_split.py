"""How many GPUs of a launch to give to sampling under `rollout.mode: async` (docs/async.md), from the
plan's counted FLOPs per image (GpuPlan.flops) and memory.

A sampler runs, per image, the rollout (prompt encoding, every transformer call of the step plan, the
decode) and the local reward models; a trainer runs the recipe's trained micro-steps and, for a
stale sample, one forward per trained step for log pi_prox (decoupled PPO, paco_ds/grpo/async_rollouts.py):
counted here for every image, as in steady state with max_staleness >= 1 nearly every sample is stale.
Time is FLOPs / (MFU x peak) with the same MFU on both sides, so the split depends only on the ratio
of the two sides' FLOPs; the seconds printed take MFU = 40 % of an H100's dense bf16 peak, the middle
of the 30-50 % the full-scale epoch model assumes (benchmarks/grpo_full_scale.py). A sampler's
batched rollout forwards may reach a higher MFU than a trainer's micro-steps (or a lower one with
small batches): only a GPU measures that. The judge, the evaluation and the file traffic are not in
the FLOPs (the traffic is printed beside them).
"""
from __future__ import annotations

from dataclasses import dataclass

from paco_ds.gpu_plan.plan import GiB, SAMPLING, SCORING, TRAINING, GpuPlan

MFU = 0.40
PEAK = 989e12  # H100 SXM dense bf16 FLOP/s
# The trainers' state, 1/world each under ZeRO (the categories GpuPlan.memory names), by the stage that shards it.
SHARDED = {"base params (ZeRO-3 shards)": 3, "LoRA params": 3, "grads": 2, "optimizer state": 1, "EMA": 3}


@dataclass(frozen=True)
class Side:
    gpus: int
    flops_per_image: float
    seconds_per_image: float  # the side's time per image of the launch, its GPUs working in parallel
    busy: float  # the fraction of the launch's pace it works (1: it sets the pace, the other side waits)


@dataclass(frozen=True)
class AsyncSplit:
    gpus: int
    samplers: Side
    trainers: Side
    colocated_seconds_per_image: float  # the same GPUs, every one sampling then training (no proximal forward)
    sampler_gib: float  # per sampler: the whole model, the encoders, VAE and reward models, the rollout's activations
    trainer_gib: float  # per trainer: its ZeRO state over the trainers alone, the larger of training and the proximal pass
    adapter_gb: float  # one push of the adapter (trainer rank 0 writes it after every optimizer step)
    rollout_mb_per_image: float  # what a sampler writes per image for the trainers

    @property
    def seconds_per_image(self) -> float:
        return max(self.samplers.seconds_per_image, self.trainers.seconds_per_image)


def _sides(gpus: int, samplers: int, sample: float, train: float) -> tuple[Side, Side]:
    rate = MFU * PEAK
    ts, tt = sample / samplers / rate, train / (gpus - samplers) / rate
    pace = max(ts, tt)
    return (Side(samplers, sample, ts, ts / pace), Side(gpus - samplers, train, tt, tt / pace))


def split(plan: GpuPlan, cfg, gpus: int, samplers: int | None = None) -> AsyncSplit:
    """`gpus` GPUs with `samplers` of them sampling (None: the count at which neither side waits the
    longest, i.e. the launch's pace max(sampling, training time per image) is smallest)."""
    from paco_ds.runtime.engine import recipe_zero_stage

    if gpus < 2:
        raise ValueError(f"rollout.mode: async needs a sampler and a trainer: {gpus} GPU(s)")
    sample = plan.flops[SAMPLING] + plan.flops[SCORING]
    proximal = len(cfg.train_timesteps) * plan.flops_detail["transformer_forward"]
    train = plan.flops[TRAINING] + proximal
    if samplers is None:
        samplers = min(range(1, gpus), key=lambda m: max(sample / m, train / (gpus - m)))
    sampler_side, trainer_side = _sides(gpus, samplers, sample, train)
    colocated = (sample + plan.flops[TRAINING]) / gpus / (MFU * PEAK)
    return AsyncSplit(gpus, sampler_side, trainer_side, colocated, _sampler_bytes(plan) / GiB,
                      _trainer_bytes(plan, recipe_zero_stage(cfg), gpus - samplers) / GiB,
                      plan.params["lora"] * _element_size(plan) / 1e9, plan.rollout_bytes / 1e6)


def _element_size(plan: GpuPlan) -> int:
    import torch

    return torch.finfo(getattr(torch, plan.dtype)).bits // 8


def _sampler_bytes(plan: GpuPlan) -> int:
    """A sampler holds the whole transformer with its adapter (no shards, gradients or optimizer), the
    frozen encoders, VAE and reward models, and sampling's and scoring's activations (scoring's column
    holds both when rewards overlap sampling)."""
    s, r = plan.memory[SAMPLING], plan.memory[SCORING]
    frozen = sum(s.get(k, 0) for k in ("text encoders", "VAE", "reward models", "CUDA context"))
    return plan.params["transformer"] * _element_size(plan) + frozen + max(s["activations"], r["activations"])


def _trainer_bytes(plan: GpuPlan, stage: int, trainers: int) -> int:
    """A trainer's columns with its ZeRO state sharded over the trainers alone (the plan's is over all its
    ranks), without the text encoders (a trainer encodes no training prompt); the proximal pass holds the
    gathered transformer as sampling does, with no rollout activations."""
    scale = plan.world_size / trainers

    def rescaled(column: dict) -> int:
        return sum(v * scale if stage >= SHARDED.get(k, 99) else v for k, v in column.items()
                   if k not in ("text encoders", "activations"))

    train = rescaled(plan.memory[TRAINING]) + plan.memory[TRAINING]["activations"]
    proximal = rescaled(plan.memory[SAMPLING])
    return int(max(train, proximal))


def describe(s: AsyncSplit, recipe: AsyncSplit | None = None) -> str:
    """The balanced split `s`, and the recipe's own rollout.samplers (`recipe`) when it differs."""
    lines = [f"rollout.mode async on {s.gpus} GPUs (time = FLOPs / ({MFU:.0%} MFU x {PEAK / 1e12:.0f} TFLOP/s), the "
             "same on both sides; the split whose slower side is fastest):",
             f"  samplers {s.samplers.gpus}: {s.samplers.flops_per_image / 1e12:.1f} TFLOPs per image (the rollout and "
             f"the local rewards), {s.samplers.busy:.0%} busy",
             f"  trainers {s.trainers.gpus}: {s.trainers.flops_per_image / 1e12:.1f} TFLOPs per image (the trained steps "
             f"and one proximal forward per trained step), {s.trainers.busy:.0%} busy",
             f"  {1 / s.seconds_per_image:.2f} images/s; colocated on the same GPUs "
             f"{1 / s.colocated_seconds_per_image:.2f} images/s (neither counts waits for the judge or stragglers)",
             f"  memory per sampler {s.sampler_gib:.1f} GiB (the whole model), per trainer {s.trainer_gib:.1f} GiB; "
             f"files: {s.adapter_gb:.2f} GB per adapter push, {s.rollout_mb_per_image:.1f} MB of rollout per image"]
    if recipe is not None and recipe.samplers.gpus != s.samplers.gpus:
        lines.append(f"  the recipe's rollout.samplers: {recipe.samplers.gpus}: {1 / recipe.seconds_per_image:.2f} "
                     f"images/s, samplers {recipe.samplers.busy:.0%} and trainers {recipe.trainers.busy:.0%} busy; "
                     f"set rollout.samplers: {s.samplers.gpus}")
    return "\n".join(lines)
