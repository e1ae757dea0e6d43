"""A loss defined in tests/ only, with a switch of its own, for the GPU plan to count with no line of
paco_ds/gpu_plan/ knowing it (tests/plan/test_more_plans.py): REINFORCE on the trained step's
log-prob, plus `train.extra_forwards.forwards` more transformer forwards without grad per micro-step
(what a reference or old-policy forward costs)."""
from __future__ import annotations

from functools import partial

import torch
from pydantic import Field

from paco_ds.grpo.losses.base import Loss
from paco_ds.recipe.schema import LossSection
from paco_ds.sampling.spec import SamplingSpec
from paco_ds.sampling.trajectory import transition_log_prob


class ExtraForwardsConfig(LossSection):
    forwards: int = Field(0, ge=0)  # the switch: extra no-grad transformer forwards per micro-step


class ExtraForwards(Loss):
    name = "extra_forwards"
    section = ExtraForwardsConfig

    def __init__(self, cfg, policy):
        super().__init__(cfg, policy)
        self.log_prob = partial(transition_log_prob, policy, spec=SamplingSpec.training(cfg, self.sde, self.needs))

    def __call__(self, module, batch, t):
        step = self.log_prob(module, batch, t, slice(None))
        dev = step.log_prob.device
        with torch.no_grad():
            for _ in range(self.cfg.train.extra_forwards.forwards):
                self.log_prob(module, batch, t, slice(None))
        ratio = torch.exp(step.log_prob.float() - batch.log_prob[:, t].to(dev).float())
        return -(batch.advantages.to(dev).float() * ratio).mean(), {"kl": 0.0}
