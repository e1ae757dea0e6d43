"""DeepSpeed engine construction shared by the GRPO and SFT trainers.

The engine config comes from a JSON file (configs/deepspeed/*.json) plus recipe overrides; batch
sizes, accumulation, gradient clipping and precision are always filled in from the recipe and the
real world size, so a file never disagrees with the run. The optimizer is torch's AdamW over the
trainable (LoRA) parameters only: DeepSpeed's fused Adam would be JIT-compiled on first use.
"""
from __future__ import annotations

import contextlib
import copy
import json
import sys
import types
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from paco_ds.errors import ConfigError


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def load_ds_config(path: Path, where: str = "deepspeed.config") -> dict:
    if not path.is_file():
        raise ConfigError(f"config key '{where}': DeepSpeed config not found: {path}")
    try:
        conf = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
    return {k: v for k, v in conf.items() if not k.startswith("_")}


def build_ds_config(base: dict, *, micro_batch: int, grad_accum: int, world_size: int, grad_clip: float,
                    bf16: bool, zero_stage: int | None = None, overrides: dict | None = None) -> dict:
    conf = _merge(base, overrides or {})
    conf["train_micro_batch_size_per_gpu"] = micro_batch
    conf["gradient_accumulation_steps"] = grad_accum
    conf["train_batch_size"] = micro_batch * grad_accum * world_size
    conf["gradient_clipping"] = grad_clip  # set explicitly: the reference's clipping never reached DeepSpeed
    conf["bf16"] = {"enabled": bf16}
    conf.pop("fp16", None)
    if zero_stage is not None:
        conf.setdefault("zero_optimization", {})["stage"] = zero_stage
    return conf


def zero_stage(conf: dict) -> int:
    return int(conf.get("zero_optimization", {}).get("stage", 0))


def create_engine(model: torch.nn.Module, params: Iterable[torch.nn.Parameter], ds_config: dict, *, lr: float,
                  betas: tuple[float, float], eps: float, weight_decay: float, lr_scheduler=None):
    """deepspeed.initialize with a torch AdamW over `params`; returns the engine."""
    import deepspeed

    _muon_stand_in()
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters")
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, lr_scheduler=lr_scheduler)
    return engine


def _muon_stand_in() -> None:
    """DeepSpeed's ZeRO optimizers import its Muon modules only to ask whether the optimizer is Muon
    (stage 3 when it is built; stages 1 and 2 on each gradient reduction, calling muon_update only for
    a Muon optimizer). Importing them applies torch.compile to Muon's kernels, which loads Inductor:
    2.2 s of every rank's start-up (python -X importtime). The optimizer here is always torch's AdamW,
    so stand-ins answer the question instead, unless the real modules are loaded already."""
    def not_loaded(*args, **kwargs):
        raise RuntimeError("DeepSpeed's Muon is not loaded (paco_ds.runtime.engine): paco_ds trains with AdamW")

    package = "deepspeed.runtime.zero.muon"
    for module, attrs in (("muon_optimizer", {"MuonWithAuxAdam": type("MuonWithAuxAdam", (), {})}),
                          ("original_muon", {"muon_update": not_loaded, "adam_update": not_loaded})):
        name = f"{package}.{module}"
        if name not in sys.modules:
            stand_in = types.ModuleType(name, "paco_ds.runtime.engine's stand-in: the optimizer is never Muon")
            stand_in.__dict__.update(attrs)
            sys.modules[name] = stand_in


def partition_report(module: torch.nn.Module) -> list[dict[str, Any]]:
    """Per parameter: full and local element counts (ZeRO-3 keeps a shard in `ds_tensor`)."""
    rows = []
    for name, p in module.named_parameters():
        full = int(getattr(p, "ds_numel", p.numel()))
        local = int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else p.numel()
        rows.append({"name": name, "full": full, "local": local, "trainable": p.requires_grad})
    return rows


# A sentinel "active sub-module" id. ZeRO-3 releases a parameter after a forward unless some module
# that uses it is still marked active; this id keeps every parameter marked for a whole phase.
_PINNED = -7


@contextlib.contextmanager
def gathered_for_phase(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Gather a ZeRO-3 module's parameters once and keep them gathered until the block ends; within
    it the module runs as a plain torch module, without DeepSpeed's forward hooks.

    Sampling runs the transformer many times (every denoising step of every batch): without this,
    ZeRO-3 all-gathers and frees the whole model around each forward. `GatheredParameters` alone
    is not enough, because the engine's hooks release a parameter after each forward that used it
    unless it is listed in `ds_active_sub_modules` (DeepSpeed's private per-parameter set, read by
    its release path); the pin adds a sentinel there for the phase. tests/models/test_zero3_pin.py fails
    if a DeepSpeed upgrade changes that behaviour.

    With every parameter whole, DeepSpeed's per-module hooks have nothing left to do (fetch, release,
    trace for prefetching, mark backward boundaries for a phase without grad), so they are lifted
    for the phase: a forward costs no Python per sub-module, the prefetch trace records training
    forwards only, and a compiled block traces plain torch (models/compile.py).
    """
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    params = list(module.parameters())
    with GatheredParameters(params):
        for p in params:
            p.ds_active_sub_modules.add(_PINNED)
        try:
            with without_deepspeed_hooks(module):
                yield module
        finally:
            for p in params:
                p.ds_active_sub_modules.discard(_PINNED)


def _from_deepspeed(hook) -> bool:
    return (getattr(hook, "__module__", None) or "").startswith("deepspeed.")


@contextlib.contextmanager
def without_deepspeed_hooks(module: torch.nn.Module) -> Iterator[int]:
    """Take the forward (pre-)hooks DeepSpeed registered (its ZeRO-3 fetch/release/backward-marking
    hooks and the engine's prologue/epilogue) off `module` and its sub-modules for the block; yields
    how many. They go back in their order, so the hook handles DeepSpeed keeps stay valid."""
    lifted = []
    for m in module.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            if any(_from_deepspeed(h) for h in hooks.values()):
                lifted.append((hooks, list(hooks.items())))
                for key in [k for k, h in hooks.items() if _from_deepspeed(h)]:
                    del hooks[key]
    try:
        yield sum(len(saved) - len(hooks) for hooks, saved in lifted)
    finally:
        for hooks, saved in lifted:
            added = [(k, h) for k, h in hooks.items() if k not in dict(saved)]  # registered during the block
            hooks.clear()
            hooks.update(saved + added)


def recipe_zero_stage(cfg) -> int:
    """The ZeRO stage a run of this recipe uses: deepspeed.zero_stage, else its overrides', else the
    DeepSpeed config file's (as build_ds_config merges them)."""
    if cfg.deepspeed.zero_stage is not None:
        return cfg.deepspeed.zero_stage
    stage = cfg.deepspeed.overrides.get("zero_optimization", {}).get("stage")
    if stage is None:
        stage = load_ds_config(cfg.resolve_path(cfg.deepspeed.config)).get("zero_optimization", {}).get("stage", 0)
    return int(stage)


def run_zero_stage(cfg, world_size: int) -> int:
    """The ZeRO stage a run uses on `world_size` processes: the recipe's, except ZeRO-3 on one process,
    which partitions nothing there and only adds its per-module hooks (measured: the training phase
    8% slower than ZeRO-2 on the same epoch, docs/benchmarks.md); one process runs stage 2 instead, unless
    deepspeed.engine_compile asks for ZeRO-3's own compile. Stage 2, not 0: its optimizer skips a step
    whose gradient norm is not finite, as ZeRO-3's does, where stage 0 would write NaN into the adapter."""
    stage = recipe_zero_stage(cfg)
    if stage == 3 and world_size == 1 and not cfg.deepspeed.engine_compile:
        return 2
    return stage


def gathers_per_step(cfg) -> bool:
    """Whether a run of this recipe gathers its ZeRO-3 transformer in every sampling forward
    (deepspeed.rollout_gather: per_step), a collective in each forward: ranks must then run the same
    forwards (no shared group prefix, no tree rollouts) and compiled blocks cannot run gathered.
    Under ZeRO-3 otherwise, sampling gathers the parameters once per phase (`gathered_for_phase`)."""
    return recipe_zero_stage(cfg) == 3 and cfg.deepspeed.rollout_gather == "per_step"
