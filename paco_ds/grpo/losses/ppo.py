"""`train.loss: ppo` (PaCo-GRPO, Flow-GRPO): PPO-clip on the SDE transition log-probs of the noised
steps, against log pi_old recorded at sampling; one forward with grad per sample and step, plus a
forward with the adapter disabled for the KL to the base model only when `train.kl_beta > 0`. The
log-prob and that KL are scored in one fused pass (kernels.sde_step_kl) that keeps neither
transition mean; GRPO-Guard, which needs the mean, scores them apart.

With `train.ppo.ratio_norm` (GRPO-Guard, arXiv 2510.22319): the log-ratio gets its bias back and is
scaled by the transition std (RatioNorm), the step's term is divided by its dt (gradient
reweighting); the rollout also keeps the sampling transition mean mu_old (no extra forward).
"""
from __future__ import annotations

import math
from functools import partial
from typing import ClassVar

import torch
from pydantic import Field

import kernels
from paco_ds.recipe.schema import Config, LossSection
from paco_ds.grpo.losses.base import Loss, RolloutNeeds
from paco_ds.models.base import Policy
from paco_ds.sampling.spec import SamplingSpec
from paco_ds.sampling.trajectory import step_advantages, transition_log_prob, transition_log_prob_kl


class PPOConfig(LossSection):
    """`train.ppo`: PPO-clip on the SDE transition log-ratio."""

    takes_step_advantages: ClassVar[bool] = True  # each trained step's own (tree rollouts, sample.tree)

    clip_range: float = Field(1e-4, gt=0)
    ratio_norm: bool = False  # GRPO-Guard (arXiv 2510.22319): RatioNorm + per-step gradient reweighting

    def check(self, cfg) -> None:
        if self.ratio_norm and cfg.sample.sde_type != "flow_grpo":
            raise ValueError("train.ppo.ratio_norm normalises Gaussian log-ratios: it needs sample.sde_type=flow_grpo")


def ratio_norm(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, mean_old: torch.Tensor,
               std_dev: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's RatioNorm of per-element-mean Gaussian log-probs: with x' = mu_old + s*eps,
    log r = -mean((mu - mu_old)^2) / (2 s^2) + mean((mu - mu_old) * eps) / s; the first term is a
    bias below 0 that grows as s shrinks (low-noise steps). Adding it back and multiplying by s
    leaves mean((mu - mu_old) * eps), whose scale no longer depends on the step:
    log r~ = (log pi - log pi_old + mean((mu - mu_old)^2) / (2 s^2)) * s, s = std_t * sqrt(dt)."""
    s = std_dev.float()
    bias = (mean.float() - mean_old.float()).pow(2).flatten(1).mean(1) / (2 * s ** 2)
    return (log_prob.float() - old_log_prob.float() + bias) * s


def _moments(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.detach().double()
    return {f"{prefix}_mean": float(x.mean()), f"{prefix}_sq": float(x.pow(2).mean())}


class PPOClip(Loss):
    name = "ppo"
    section = PPOConfig
    headline = {"ratio": ".6f", "clipfrac": ".3f"}
    first_of_epoch = ("ratio",)  # 1 before the first update of the epoch: a check that old == current

    def __init__(self, cfg: Config, policy: Policy):
        self.guard = cfg.train.ppo.ratio_norm
        # The fp32 transition mean is only needed for GRPO-Guard's bias (and then for its KL term):
        # without the guard, the KL term is scored with the log-prob in one pass from the velocities.
        self.return_mean = self.guard
        self.fused_kl = cfg.train.kl_beta > 0 and not self.guard
        self.needs = RolloutNeeds(log_probs=True, mean_old=self.guard)
        super().__init__(cfg, policy)
        spec = SamplingSpec.training(cfg, self.sde, self.needs)
        self.log_prob = partial(transition_log_prob, policy, spec=spec)
        self.log_prob_kl = partial(transition_log_prob_kl, policy, spec=spec, sde_kl_fn=self._sde_kl)

    def _sde_kl(self, x, v, v_ref, *args, **kwargs):
        self.sde_logprob_rows += x.shape[0]
        return kernels.sde_step_kl(x, v, v_ref, *args, backend=self.cfg.kernels.backend, **kwargs)

    def __call__(self, module, batch, t):
        cfg = self.cfg
        if self.fused_kl:
            step, kl_t = self.log_prob_kl(module, batch, t, slice(None))
        else:
            step, kl_t = self.log_prob(module, batch, t, slice(None)), None
        dev = step.log_prob.device
        old = batch.log_prob[:, t].to(dev)
        if not self.guard:
            adv, adv_clip = step_advantages(batch, t).to(dev), cfg.advantage.clip
            if batch.behaviour_weight is not None:
                # Decoupled PPO (rollout.mode: async): `old` is log pi_prox, and each term is weighted by
                # pi_prox / pi_behaviour; folded into the clipped advantages, exact as the weight is > 0
                adv = adv.float().clamp(-adv_clip, adv_clip) * batch.behaviour_weight[:, t].to(dev)
                adv_clip = math.inf
            loss, stats = kernels.ppo_clip_loss(step.log_prob, old, adv, cfg.train.ppo.clip_range, adv_clip,
                                                backend=cfg.kernels.backend)
        else:
            dt = (batch.sigma[:, t] - batch.sigma_next[:, t]).to(dev).float()
            z = ratio_norm(step.log_prob, old, step.mean, batch.mean_old[:, t].to(dev), step.std * dt.sqrt())
            # Gradient reweighting: the step's PPO term / dt; folded into the (already clipped)
            # advantages, which is exact since dt > 0 and the max of the PPO term is linear in A.
            adv = step_advantages(batch, t).to(dev).float().clamp(-cfg.advantage.clip, cfg.advantage.clip) / dt
            loss, stats = kernels.ppo_clip_loss(z, torch.zeros_like(z), adv, cfg.train.ppo.clip_range, math.inf,
                                                backend=cfg.kernels.backend)
            # every sample's t-th trained step is the same step j unless windows are drawn per group
            label = f"guard/step{int(batch.steps[0, t])}" if cfg.sample.sde_window is None or \
                cfg.sample.sde_window.per == "epoch" else f"guard/window{t}"
            stats = dict(stats, **_moments(f"{label}/logratio_raw", step.log_prob.detach() - old),
                         **_moments(f"{label}/logratio_norm", z))
        stats = {k: float(v) for k, v in stats.items()}
        kl = 0.0
        if cfg.train.kl_beta > 0:
            if kl_t is None:  # GRPO-Guard: the reference's transition mean, then the KL of the two means
                with torch.no_grad(), self.policy.adapter_disabled(module):
                    ref = self.log_prob(module, batch, t, slice(None))
                kl_t = kernels.kl_to_reference(step.mean, ref.mean, step.std, backend=cfg.kernels.backend)
            kl_t = kl_t.mean()
            loss, kl = loss + cfg.train.kl_beta * kl_t, float(kl_t.detach())
        stats["kl"] = kl
        return loss, stats

    def epoch_metrics(self, out):
        out = super().epoch_metrics(out)
        for key in [k for k in out if k.endswith("_sq")]:  # second moments -> spreads (std over the epoch)
            mean = out[key[:-3] + "_mean"]
            out[key[:-3] + "_std"] = math.sqrt(max(out.pop(key) - mean * mean, 0.0))
        return out


