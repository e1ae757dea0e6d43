"""Policies (one file per model family), LoRA, and tiny offline builders.

`model.family` names a policy here. An editing policy is one new file implementing `Policy` (with
`encode_condition` for its reference images) plus one line in POLICIES; the recipe loader checks
the name, so a family without a policy is a one-line error at load and in `--dry-run`. A policy
outside paco_ds is named by its import path, `model.family: mypackage.module:MyPolicy`.
"""
from __future__ import annotations

from paco_ds.recipe.loader import resolve

POLICIES: dict[str, str] = {
    "flux": "paco_ds.models.flux:FluxPolicy",
    "flux_kontext": "paco_ds.models.flux_kontext:KontextPolicy",
    "flux2": "paco_ds.models.flux2:Flux2Policy",
    "flux2_klein": "paco_ds.models.flux2_klein:Flux2KleinPolicy",
    "qwen_image": "paco_ds.models.qwen_image:QwenImagePolicy",
    "qwen_image_edit": "paco_ds.models.qwen_image_edit:QwenEditPolicy",
    "qwen_image_edit_plus": "paco_ds.models.qwen_image_edit_plus:QwenEditPlusPolicy",
    "sd3": "paco_ds.models.sd3:SD3Policy",
    "wan": "paco_ds.models.wan:WanPolicy",
    "wan22": "paco_ds.models.wan22:Wan22Policy",
    "wan22_ti2v": "paco_ds.models.wan:WanTI2VPolicy",
    "z_image": "paco_ds.models.z_image:ZImagePolicy",
}


def policy_class(family: str):
    """The Policy class of `model.family`: a name of POLICIES or "module:Class"."""
    return resolve(family, POLICIES, "model.family", "model family")


def with_family_defaults(model_cfg):
    """`model_cfg` with `path` and `lora.target_modules`, where the recipe left them unset (None),
    taken from the family's policy class (`default_path`, `lora_targets`)."""
    cls = policy_class(model_cfg.family)
    update = {}
    if model_cfg.path is None:
        update["path"] = cls.default_path
    if model_cfg.lora.target_modules is None:
        update["lora"] = model_cfg.lora.model_copy(update={"target_modules": list(cls.lora_targets)})
    return model_cfg.model_copy(update=update) if update else model_cfg


def build_policy(model_cfg, device, ds_config: dict | None = None, source=None):
    """Load the recipe's policy. With a ZeRO-3 `ds_config` the transformer is built partitioned;
    `source` (a models.base.ModelSource): where the modules come from, when not the recipe's
    checkpoint or tiny twin (the GPU plan's full-size model on a fake device)."""
    model_cfg = with_family_defaults(model_cfg)
    return policy_class(model_cfg.family).load(model_cfg, device, ds_config=ds_config, source=source)
