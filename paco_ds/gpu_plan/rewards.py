"""The recipe's local reward models at full size on fake CUDA, run through their own `score`.

Remote rewards (the judge) run in their own server; the plan counts the colocated judge's memory
from `reward_servers` and its FLOPs in benchmarks/grpo_full_scale.py.
"""
from __future__ import annotations

import torch

from paco_ds.config import Config
from paco_ds.gpu_plan import models as M
from paco_ds.gpu_plan.fake import FakeCuda, to_fake_cuda


def reward_dtype(device: torch.device) -> torch.dtype:
    """The dtype the reward classes keep their models in on `device` (their own rule)."""
    from paco_ds.rewards.base import model_dtype

    return model_dtype(device)


def local_rewards(cfg: Config, mode: FakeCuda):
    device = torch.device("cuda", 0)
    dtype = reward_dtype(device)
    for name, term in cfg.rewards.train.terms.items():
        if name == "subfig_clipT":
            from paco_ds.rewards.base import LRUCache
            from paco_ds.rewards.subfig_clipT import SubfigClipT

            model, preprocess, tokenizer = M.open_clip_h()
            r = object.__new__(SubfigClipT)
            r.model, r.preprocess, r.tokenizer = model, preprocess, tokenizer
            r.device, r.dtype, r.batch_size, r.cache = device, dtype, 32, LRUCache(4096)
        elif name == "pickscore":
            from paco_ds.rewards.pickscore import PickScore

            model, processor = M.pickscore_clip()
            r = object.__new__(PickScore)
            r.model, r.processor, r.device, r.dtype, r.batch_size = model, processor, device, dtype, 16
        else:
            continue  # remote judges, or rewards without a model (jpeg_compressibility)
        to_fake_cuda(mode, model, dtype)
        model.eval().requires_grad_(False)
        mode.track_module(model, "reward models")
        mode.reward_params = getattr(mode, "reward_params", 0) + M.count(model)
        yield name, r
