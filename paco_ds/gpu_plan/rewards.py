"""The recipe's local reward models at full size on fake CUDA, run through their own `score`.

Each reward class describes itself at full size (`Reward.full_size`: its models on the meta device
and the dtypes it keeps them in; None where it keeps no model on the device). Remote rewards (the
judge) run in their own server; the plan counts the colocated judge's memory from `reward_servers`
and its FLOPs in benchmarks/grpo_full_scale.py.
"""
from __future__ import annotations

import torch

from paco_ds.recipe.schema import Config
from paco_ds.gpu_plan.fake import FakeCuda, to_fake_cuda
from paco_ds.models.full_size import count


def local_rewards(cfg: Config, mode: FakeCuda):
    """(name, reward) of every training reward with a model on the device, its models fake CUDA
    tensors tagged "reward models"; their parameters are summed in `mode.reward_params`."""
    from paco_ds.rewards.registry import reward_class

    device = torch.device("cuda", 0)
    for name, term in cfg.rewards.train.terms.items():
        full = reward_class(name, "rewards.train.terms").full_size(device, **term.kwargs)
        if full is None:
            continue  # remote judges, rewards without a model (jpeg_compressibility, ocr's CPU runtime)
        for model, dtype in full.models:
            to_fake_cuda(mode, model, dtype)
            model.eval().requires_grad_(False)
            mode.track_module(model, "reward models")
            mode.reward_params = getattr(mode, "reward_params", 0) + count(model)
        yield name, full.reward
