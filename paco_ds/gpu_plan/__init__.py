"""A full-scale plan of device memory and FLOPs per rank, from the real code path on fake CUDA
tensors (`launch/train.py --config RECIPE --dry-run --world-size N --gpu-memory GiB`).

fake.py runs code on fake CUDA tensors and counts live device bytes; the full-size models are the
policy's own (`Policy.full_size`, paco_ds/models/full_size.py) and each local reward's
(`Reward.full_size`, rewards.py); plan.py runs one rollout batch, the local rewards and one trained
micro-step, and accounts one rank (docs/gpu_plan.md).
"""
from __future__ import annotations

from paco_ds.errors import ConfigError


def print_plan(cfg, world_size: int, gpu_gib: float, log=print):
    """The plan for `cfg` on `world_size` ranks of `gpu_gib` GiB, printed; returns it."""
    from paco_ds.gpu_plan.plan import describe, gpu_plan
    from paco_ds.models import POLICIES, policy_class

    if not gpu_gib > 0:
        raise ConfigError(f"--gpu-memory must be > 0 GiB (got {gpu_gib})")
    if cfg.model.tiny:
        raise ConfigError("model.tiny: true builds the tiny offline model; --gpu-memory plans the full-size one "
                          "(use a recipe with model.tiny: false)")
    policy = policy_class(cfg.model.family)
    if getattr(policy, "full_size", None) is None:
        planned = [name for name in POLICIES if getattr(policy_class(name), "full_size", None)]
        raise ConfigError(f"config key 'model.family': --gpu-memory plans a family whose policy describes its "
                          f"full-size model (`full_size`: {', '.join(planned)}); {policy.__name__} of "
                          f"'{cfg.model.family}' has none")
    plan = gpu_plan(cfg, world_size, gpu_gib)  # a device mix on the path raises DevicePathError: a code defect
    from paco_ds.gpu_plan.sequence import sequence_advice

    advice = sequence_advice(cfg, world_size, gpu_gib, plan, log)  # more plans where sharding could help
    if advice:
        plan.advice.append(advice)
    log(describe(plan))
    if cfg.rollout.mode == "async" and world_size > 1:  # how many of the GPUs to sample with (docs/async.md)
        from paco_ds.gpu_plan import async_split

        recipe = async_split.split(plan, cfg, world_size, min(cfg.rollout.samplers, world_size - 1))
        log(async_split.describe(async_split.split(plan, cfg, world_size), recipe))
    return plan
