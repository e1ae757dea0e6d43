"""Which sequence-parallel degree lets a recipe train without gradient checkpointing.

ZeRO-3 partitions the weights, not one sample's activations: at 1024 px a FLUX.1 sample is 4096
image tokens plus 512 prompt tokens through 57 blocks, and its training activations alone are twice
an 80 GiB GPU. Gradient checkpointing cuts them by recomputing every block's forward in the backward;
sequence parallelism (`parallel.sequence: N`, paco_ds/models/sequence.py) cuts them by splitting the
tokens over N ranks, at the cost of the attention's all-to-alls. `sequence_advice` plans the recipe
again (the fake-CUDA pass, plan.py) with checkpointing off at N = 2, 4, ... (the degrees the world
size, the heads and the token counts allow) and names the smallest N whose plan fits, with what
each rank exchanges, beside what checkpointing costs instead: about one more transformer forward
per trained step (the forward counted at the training size).
"""
from __future__ import annotations

from paco_ds.errors import ConfigError
from paco_ds.gpu_plan.plan import GiB, SAMPLING, SCORING, TRAINING, GpuPlan, gpu_plan
from paco_ds.recipe.schema import Config


def degrees(cfg: Config, world_size: int) -> list[int]:
    """The sequence-parallel degrees above 1 this recipe can run on `world_size` ranks, smallest first."""
    from paco_ds.grpo.preflight import check_sequence_parallel

    out = []
    for n in range(2, world_size + 1):
        if world_size % n:
            continue
        try:
            check_sequence_parallel(with_sequence(cfg, n), [], [])
        except ConfigError:
            continue
        out.append(n)
    return out


def with_sequence(cfg: Config, n: int, checkpointing: bool | None = None) -> Config:
    """The recipe with parallel.sequence n (and model.gradient_checkpointing, when given)."""
    update = {"parallel": cfg.parallel.model_copy(update={"sequence": n})}
    if checkpointing is not None:
        update["model"] = cfg.model.model_copy(update={"gradient_checkpointing": checkpointing})
    return cfg.model_copy(update=update)


def worth_asking(cfg: Config, plan: GpuPlan) -> bool:
    """Whether sharding the sequence could change the verdict: the recipe runs unsharded, its family
    shards, and training is what does not fit (or fits only with checkpointing) while sampling and
    scoring fit (sharding cuts activations, not the gathered weights or encoders that fill those)."""
    from paco_ds.models import policy_class
    from paco_ds.models.sequence import family_refusal

    if cfg.parallel.sequence != 1 or family_refusal(policy_class(cfg.model.family)) is not None:
        return False
    others_fit = all(plan.total(p) <= plan.capacity for p in (SAMPLING, SCORING))
    return others_fit and (plan.gradient_checkpointing or plan.total(TRAINING) > plan.capacity)


def sequence_advice(cfg: Config, world_size: int, gpu_gib: float, plan: GpuPlan, log=None) -> str | None:
    """The smallest parallel.sequence whose plan fits without gradient checkpointing, beside the cost
    of checkpointing; None where it is not worth asking (`worth_asking`). One more plan per degree tried."""
    if not worth_asking(cfg, plan):
        return None
    per_image = plan.flops_detail["transformer_forward"] * plan.counts["trained_steps_per_sample"]
    checkpointing = (f"gradient checkpointing instead recomputes about one transformer forward per trained step "
                     f"(+{per_image / 1e12:.1f} TFLOPs per image in training, "
                     f"+{per_image / max(plan.flops[TRAINING], 1.0):.0%})")
    tried = []
    for n in degrees(cfg, world_size):
        if log is not None:
            log(f"(planning parallel.sequence={n} without gradient checkpointing)")
        sharded = gpu_plan(with_sequence(cfg, n, checkpointing=False), world_size, gpu_gib)
        tried.append(f"{n}: training {sharded.total(TRAINING) / GiB:.1f} GiB")
        if sharded.fits:
            c = sharded.counts
            return (f"parallel.sequence: {n} fits without gradient checkpointing (training "
                    f"{sharded.total(TRAINING) / GiB:.1f} GiB per rank, activations "
                    f"{sharded.memory[TRAINING]['activations'] / GiB:.1f}; each rank's all-to-alls and gathers "
                    f"{c['collective_bytes_per_micro_step'] / GiB:.2f} GiB per trained micro-step); {checkpointing}")
    if not tried:
        return "no parallel.sequence degree runs this recipe on this world size (its heads or tokens do not split)"
    return f"no parallel.sequence fits without gradient checkpointing ({', '.join(tried)}); {checkpointing}"
