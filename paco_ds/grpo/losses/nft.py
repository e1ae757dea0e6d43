"""`train.loss: nft` (DiffusionNFT, arXiv 2509.16117): flow matching on the forward process of the
clean final latents; positive / negative implicit policies from the current and the old velocity,
weighted by the optimality probability r from the advantage. No SDE log-prob anywhere (the rollout
is an ODE unless the recipe says otherwise); two forwards per trained sample and step (old without
grad, current with grad), a third (adapter disabled) only when `train.kl_beta > 0`.
docs/losses.md maps each key of `train.nft` to its equation.
"""
from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from pydantic import Field

from paco_ds.recipe.schema import Config, LossSection
from paco_ds.grpo.losses.base import Loss, OldPolicy, RolloutNeeds, refuse_sde_log_prob_keys
from paco_ds.models.base import Policy
from paco_ds.sampling.trajectory import make_generator


class NFTConfig(LossSection):
    """`train.nft`."""

    beta: float = Field(1.0, gt=0)  # implicit-policy strength: v+- = v_old +- beta (v_theta - v_old)
    decay_type: Literal[0, 1, 2] = 1  # old-policy soft update: 0 copy, 1 min(0.001 s, 0.5), 2 delayed
    adaptive_weight: bool = True  # x0-regression weighted by 1 / mean|x0_hat - x0| (stop-grad)

    def check(self, cfg) -> None:
        refuse_sde_log_prob_keys(cfg, "nft")


def old_policy_decay(step: int, decay_type: int) -> float:
    """DiffusionNFT's soft update theta_old <- d theta_old + (1 - d) theta after an epoch (d by the
    optimizer steps so far): 0 a hard copy; 1 min(0.001 s, 0.5); 2 none before step 75, then
    min(0.0075 (s - 75), 0.999)."""
    if decay_type == 0:
        return 0.0
    if decay_type == 1:
        return min(0.001 * step, 0.5)
    return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)


def optimality_weight(advantages: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """r = 1/2 + 1/2 clip(A / Z, -1, 1), Z = adv_clip: the probability the sample is 'optimal'."""
    return (advantages.float().clamp(-adv_clip, adv_clip) / adv_clip / 2 + 0.5).clamp(0, 1)


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor,
             eps: torch.Tensor, r: torch.Tensor, beta: float, adaptive: bool = True) -> tuple[torch.Tensor, dict]:
    """Per-sample DiffusionNFT policy loss r L(v+) + (1 - r) L(v-), divided by beta.

    v+ = (1 - beta) v_old + beta v_theta, v- = (1 + beta) v_old - beta v_theta (implicit positive
    and negative policies). Adaptive: L(v) = mean((x0_hat - x0)^2) / sg(mean|x0_hat - x0|) with
    x0_hat = x_t - sigma v (floored at 1e-5); otherwise the flow-matching mse(v, eps - x0)."""
    v_theta, v_old = v_theta.float(), v_old.float()
    view = (-1,) + (1,) * (x0.dim() - 1)
    sig = sigma.float().reshape(view)
    v_pos = (1 - beta) * v_old + beta * v_theta
    v_neg = (1 + beta) * v_old - beta * v_theta

    def term(v):
        if not adaptive:
            return (v - (eps.float() - x0.float())).pow(2).flatten(1).mean(1)
        err = x_t.float() - sig * v - x0.float()
        w = err.detach().abs().flatten(1).mean(1).clamp_min(1e-5)
        return err.pow(2).flatten(1).mean(1) / w

    pos, neg = term(v_pos), term(v_neg)
    per_sample = (r * pos + (1 - r) * neg) / beta
    return per_sample, {"nft_pos": pos.detach().mean(), "nft_neg": neg.detach().mean(), "nft_r": r.mean()}


class NFT(Loss):
    name = "nft"
    section = NFTConfig
    needs = RolloutNeeds(log_probs=False, clean_latents=True)

    def __init__(self, cfg: Config, policy: Policy):
        super().__init__(cfg, policy)
        self.old: OldPolicy | None = None
        self.steps = list(cfg.train_timesteps)  # the schedule's sigma_j are the trained noise levels
        self.visits: dict[tuple[int, int], int] = {}
        self.epoch = 0

    def setup(self, params):
        self.old = OldPolicy(params)

    def sampling(self):
        return self.old.swapped_in()  # DiffusionNFT collects data with the old policy

    def begin_epoch(self, epoch):
        super().begin_epoch(epoch)
        self.visits = {}

    def end_epoch(self, global_step):
        self.decay = old_policy_decay(global_step, self.cfg.train.nft.decay_type)
        self.old.blend(self.decay)

    def __call__(self, module, batch, t):
        cfg, nft, policy = self.cfg, self.cfg.train.nft, self.policy
        dev, j = policy.device, self.steps[t]
        sigma = policy.sigmas(cfg.sample.num_steps, batch.height, batch.width)[j].float()
        x0 = batch.x_final.to(dev).float()
        eps = []
        for pos in batch.positions:  # fresh noise per sample, step and visit; seeded, so resumes agree
            n = self.visits[(pos, j)] = self.visits.get((pos, j), -1) + 1
            eps.append(torch.randn(x0.shape[1:], generator=make_generator(cfg.seed, "nft", self.epoch, pos, j, n)))
        eps = torch.stack(eps).to(dev)
        x_t = ((1 - sigma) * x0 + sigma * eps).to(batch.x_final.dtype)
        sig = sigma.expand(len(batch)).clone()
        embeds = batch.embeds.to(dev)
        cond = batch.condition.to(dev) if batch.condition is not None else None
        call = partial(policy.velocity, module, x_t, sig, embeds, batch.height, batch.width, cfg.sample.guidance_scale,
                       condition=cond)
        with torch.no_grad(), self.old.swapped_in():
            v_old = call()
        v_theta = call()
        r = optimality_weight(batch.advantages.to(dev), cfg.advantage.clip)
        per_sample, stats = nft_loss(v_theta, v_old, x_t, x0, sig.to(dev), eps, r, nft.beta, nft.adaptive_weight)
        live = batch.keep.to(dev).float()  # fillers (padding for matched ZeRO-3 collectives): no gradient
        loss = cfg.advantage.clip * (per_sample * live).sum() / len(batch)
        stats = {k: float(v) for k, v in stats.items()}
        stats["policy_loss"] = float(loss.detach())
        kl = 0.0
        if cfg.train.kl_beta > 0:
            with torch.no_grad(), policy.adapter_disabled(module):
                v_ref = call()
            kl_t = (v_theta.float() - v_ref.float()).pow(2).flatten(1).mean(1).mul(live).sum() / len(batch)
            loss, kl = loss + cfg.train.kl_beta * kl_t, float(kl_t)
        stats["kl"] = kl
        return loss, stats

    def epoch_metrics(self, out):
        out = super().epoch_metrics(out)
        out["train/nft_old_decay"] = float(getattr(self, "decay", 0.0))
        return out

    def epoch_state(self):
        return {**super().epoch_state(), "visits": dict(self.visits)}  # a visit's noise depends on those before it

    def load_epoch_state(self, state):
        super().load_epoch_state(state)
        self.visits = dict(state.get("visits", {}))

    def state_dict(self):
        return {"old": [s.cpu() for s in self.old.shadow]}

    def load_state_dict(self, state):
        if "old" not in state:  # the trainer names what a checkpoint lacks before loading it
            raise KeyError("the NFT loss state has no 'old' policy")
        self.old.load_copies(state["old"], "the NFT old policy")

