"""`launch/train.py --export-lora CKPT`: the adapter of a GRPO checkpoint, from its files alone.

No model is built, no process group, no judge: the trainable (LoRA) weights are gathered from the
ZeRO checkpoint files with DeepSpeed's own reader (any stage, any world size it was written with),
and when the recipe keeps an EMA, its shards (one per rank in trainer_state_rank*.pt; under ZeRO-3
each rank holds the r-th slice of every flattened parameter) are put back together in the
optimizer's parameter order and replace them, as the trainer's own export does. The result is
written in diffusers' format with the adapter's peft config (rank, alpha, targets) as metadata.
`export_adapter` is the trainer's own: the live adapter (its EMA swapped in) after the last epoch.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path

import torch

from paco_ds.recipe.schema import Config
from paco_ds.errors import UserError

ADAPTER = "default"
log = logging.getLogger(__name__)


def _zero_stage(ckpt: Path) -> int:
    for f in sorted(ckpt.glob("*mp_rank_00_model_states.pt")):
        sd = torch.load(f, map_location="cpu", weights_only=False)
        return int((sd.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))
    raise UserError(f"--export-lora {ckpt}: no DeepSpeed model states (mp_rank_00_model_states.pt) in it")


def trained_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """name -> fp32 tensor of every trained parameter, in the optimizer's order."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name, exclude_frozen_parameters=True)
    return {k: v for k, v in sd.items() if "lora_" in k}


def ema_weights(ckpt: Path, shapes: dict[str, torch.Size], stage: int) -> dict[str, torch.Tensor] | None:
    """The EMA of each trained parameter, rebuilt from every rank's shard; None without an EMA."""
    files = sorted(ckpt.glob("trainer_state_rank*.pt"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
    states = [torch.load(f, map_location="cpu", weights_only=False).get("ema") for f in files]
    if not states or states[0] is None:
        return None
    names = list(shapes)
    world = len(states)
    if any(len(s["shadow"]) != len(names) for s in states):
        raise UserError(f"--export-lora {ckpt}: the EMA state does not match the checkpoint's {len(names)} "
                        "trained parameters")
    out = {}
    for i, name in enumerate(names):
        numel = math.prod(shapes[name])
        if stage == 3:
            flat = torch.cat([s["shadow"][i].reshape(-1) for s in states])[:numel]
        else:
            flat = states[0]["shadow"][i].reshape(-1)
        if flat.numel() != numel:
            raise UserError(f"--export-lora {ckpt}: EMA shard sizes of '{name}' do not add up ({flat.numel()} of "
                            f"{numel} over {world} ranks)")
        out[name] = flat.reshape(shapes[name]).clone()
    return out


def export_adapter(policy, trainable: list[torch.nn.Parameter], ema, zero3: bool, out_dir: Path,
                   is_main: bool) -> Path | None:
    """A training run's (EMA when enabled) adapter in diffusers' format, by rank 0; collective under
    ZeRO-3 (the adapter is gathered)."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    from paco_ds.runtime.distributed import barrier
    from paco_ds.models.lora import adapter_config, export_family_lora, lora_state_dict

    with ema.swapped_in() if ema is not None else contextlib.nullcontext(), \
            GatheredParameters(trainable, enabled=zero3):
        sd = lora_state_dict(policy.transformer) if is_main else None
    if is_main:
        path = export_family_lora(type(policy), sd, out_dir, adapter_config(policy.transformer))
        log.info("LoRA exported to %s", path)
    barrier()
    return out_dir if is_main else None


def export_from_checkpoint(cfg: Config, ckpt: Path, out_dir: Path) -> Path:
    from paco_ds.models import policy_class, with_family_defaults
    from paco_ds.models.lora import export_family_lora, peft_config

    meta = json.loads((ckpt / "meta.json").read_text())
    stage = _zero_stage(ckpt)
    weights = trained_state(ckpt)
    if not weights:
        raise UserError(f"--export-lora {ckpt}: the checkpoint holds no LoRA weights")
    ema = ema_weights(ckpt, {k: v.shape for k, v in weights.items()}, stage) if cfg.train.ema.enabled else None
    if ema is not None:
        weights = ema
    dtype = weights[next(iter(weights))].dtype
    sd = {k.replace(f".{ADAPTER}.", "."): v.to(dtype).contiguous() for k, v in weights.items()}
    path = export_family_lora(policy_class(cfg.model.family), sd, out_dir,
                              peft_config(with_family_defaults(cfg.model).lora, list(weights)))
    print(f"LoRA: {out_dir} (from {ckpt.name}, epoch {meta.get('epoch')}, written by {meta.get('world_size')} "
          f"ranks{', EMA' if ema is not None else ''})", flush=True)
    return path
