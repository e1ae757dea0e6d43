"""A loss that lives outside paco_ds, to show that a loss is one file: its recipe section
(`train.reinforce`, with its own keys and cross-check) and the loss itself, named in a recipe by
import path (`train.loss: tests.grpo.reinforce_loss:Reinforce`; tests/grpo/reinforce.yaml).

REINFORCE with an importance ratio on the SDE transition log-prob of the trained step:
loss = -scale * mean(A * exp(log pi - log pi_old)), A clipped to +-advantage.clip. Its gradient at
the sampling weights is the policy gradient; unlike PPO-clip nothing bounds the ratio.
"""
from __future__ import annotations

from functools import partial

import torch
from pydantic import Field

from paco_ds.recipe.schema import LossSection
from paco_ds.grpo.losses.base import Loss
from paco_ds.sampling.spec import SamplingSpec
from paco_ds.sampling.trajectory import transition_log_prob


class ReinforceConfig(LossSection):
    scale: float = Field(1.0, gt=0)  # multiplies the loss (and so its gradient)

    def check(self, cfg) -> None:
        if cfg.sample.noise_level <= 0:
            raise ValueError("train.loss=reinforce needs SDE steps with a log-prob: sample.noise_level > 0")


class Reinforce(Loss):
    name = "reinforce"
    section = ReinforceConfig
    headline = {"ratio": ".6f"}
    first_of_epoch = ("ratio",)

    def __init__(self, cfg, policy):
        super().__init__(cfg, policy)
        self.log_prob = partial(transition_log_prob, policy, spec=SamplingSpec.training(cfg, self.sde, self.needs))

    def __call__(self, module, batch, t):
        step = self.log_prob(module, batch, t, slice(None))
        dev = step.log_prob.device
        clip = self.cfg.advantage.clip
        adv = batch.advantages.to(dev).float().clamp(-clip, clip)
        ratio = torch.exp(step.log_prob.float() - batch.log_prob[:, t].to(dev).float())
        loss = -self.cfg.train.reinforce.scale * (adv * ratio).mean()
        return loss, {"ratio": float(ratio.detach().mean()), "kl": 0.0}
