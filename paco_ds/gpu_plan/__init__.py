"""A full-scale plan of device memory and FLOPs per rank, from the real code path on fake CUDA
tensors (`launch/train.py --config RECIPE --dry-run --world-size N --gpu-memory GiB`).

fake.py runs code on fake CUDA tensors and counts live device bytes; models.py builds the
recipes' full-size models from configs written in the repo; plan.py runs one rollout batch, the
local rewards and one trained micro-step, and accounts one rank (docs/gpu_plan.md).
"""
from __future__ import annotations

from paco_ds.errors import ConfigError


# The families whose full-size parts paco_ds/gpu_plan/models.py describes.
PLANNED_FAMILIES = ("flux", "flux_kontext", "qwen_image_edit", "sd3")


def print_plan(cfg, world_size: int, gpu_gib: float, log=print):
    """The plan for `cfg` on `world_size` ranks of `gpu_gib` GiB, printed; returns it."""
    from paco_ds.gpu_plan.plan import describe, gpu_plan

    if not gpu_gib > 0:
        raise ConfigError(f"--gpu-memory must be > 0 GiB (got {gpu_gib})")
    if cfg.model.tiny:
        raise ConfigError("model.tiny: true builds the tiny offline model; --gpu-memory plans the full-size one "
                          "(use a recipe with model.tiny: false)")
    if cfg.model.family not in PLANNED_FAMILIES:
        raise ConfigError(f"config key 'model.family': --gpu-memory plans {', '.join(PLANNED_FAMILIES)}; "
                          f"'{cfg.model.family}' has no full-size model description in paco_ds/gpu_plan/models.py yet")
    plan = gpu_plan(cfg, world_size, gpu_gib)  # a device mix on the path raises DevicePathError: a code defect
    log(describe(plan))
    return plan
