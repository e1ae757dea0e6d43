"""`train.loss: awm`, Advantage Weighted Matching (arXiv 2509.25050).

The pretraining loss, flow matching, on the policy's own clean samples, weighted by the sample's
advantage: noise the final latent x0 at t (x_t = (1 - t) x0 + t eps) and regress the velocity on
eps - x0, pulling high-reward samples in and pushing low-reward ones out. The paper shows DDPO /
Flow-GRPO's per-step Gaussian log-prob is the same matching loss with a noisy target (x_{t-1}
instead of x0), hence its higher variance; AWM keeps the clean target.

As in the authors' code (scxue/advantage_weighted_matching, scripts/train_sd3_awm.py) and
Flow-Factory's trainer (X-GenGroup/Flow-Factory, src/flow_factory/trainers/awm.py):
- the weighted matching error is read as a log-likelihood, log p = -w(t, mse);
- with `clip_range`, the loss is PPO-clip on exp(log p - log p_old), log p_old from the weights that
  sampled: with one optimizer step per epoch (the authors' recipes) it is the current value (ratio
  exactly 1, 1 forward); with more, a forward without grad with the sampling weights swapped in
  (2 forwards); without `clip_range`, -A log p (1 forward);
- K noise levels per sample, drawn per stratum; fresh eps for each; advantages clipped to
  +-advantage.clip and rescaled to +-advantage_max;
- optional velocity-space KL terms: to the base model (`train.kl_beta`, adapter disabled) and to a
  slow EMA anchor of the policy (`ema_beta`), each one more forward without grad.
The rollout keeps only the clean final latents (`RolloutNeeds(log_probs=False, clean_latents=True)`).
"""
from __future__ import annotations

import math
from functools import partial
from statistics import NormalDist
from typing import Literal

import torch
from pydantic import Field

import kernels
from paco_ds.recipe.schema import Config, LossSection
from paco_ds.grpo.losses.base import Loss, OldPolicy, RolloutNeeds, check_drawn_levels, refuse_sde_log_prob_keys
from paco_ds.models.base import Policy
from paco_ds.sampling.trajectory import make_generator

class AWMConfig(LossSection):
    """`train.loss: awm`, Advantage Weighted Matching (arXiv 2509.25050); docs/losses.md maps each key to the paper and
    to the authors' code (scxue/advantage_weighted_matching, scripts/train_sd3_awm.py)."""

    # The noise levels t trained per sample: `fixed` the schedule's sigma_j of train.timesteps (as
    # nft); `discrete` one step per stratum of [0, sample.num_steps * timestep_fraction), its sigma
    # (`discrete_wo_init` strata of [1, ...), `discrete_with_init` step 0 plus those); `logit_normal`
    # / `uniform` a stratified continuous t under time_shift.
    timestep_sampling: Literal["fixed", "discrete", "discrete_wo_init", "discrete_with_init", "logit_normal",
                               "uniform"] = "discrete"
    num_timesteps: int = Field(6, ge=1)  # K levels per sample (with `fixed`: train.timesteps lists them)
    timestep_fraction: float = Field(0.9, gt=0, le=1)
    time_shift: float = Field(3.0, gt=0)  # continuous samplings only
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "ghuber"  # log p = -w(t, mse)
    ghuber_power: float = Field(0.25, gt=0)
    clip_range: float | None = Field(1.0, gt=0)  # PPO clip of exp(log p - log p_old); null: -A log p
    advantage_max: float = Field(1.0, gt=0)  # A -> clip(A, +-advantage.clip) * advantage_max / advantage.clip
    ema_beta: float = Field(0.0, ge=0)  # weight of mean((v - v_anchor)^2), the anchor a slow EMA of the policy
    ema_decay: float = Field(0.3, ge=0, lt=1)
    ema_decay_type: Literal["linear", "constant"] = "linear"  # linear: min(ema_decay, 0.001 x optimizer steps)

    checks_own_timesteps = True  # no SDE log-prob: `check` validates train.timesteps

    def trained_slots(self, cfg) -> list[int] | None:
        # the K slots of a micro-batch, each drawing its level per visit; `fixed` trains train.timesteps
        return None if self.timestep_sampling == "fixed" else list(range(self.num_timesteps))

    def check(self, cfg) -> None:
        refuse_sde_log_prob_keys(cfg, "awm")
        check_drawn_levels(cfg, "awm", self.timestep_sampling)
        n = cfg.sample.num_steps
        if self.timestep_sampling == "fixed":
            return
        if self.timestep_sampling.startswith("discrete"):
            end, k = int(n * self.timestep_fraction), self.num_timesteps
            room = end - 1 if self.timestep_sampling == "discrete_wo_init" else end  # strata of width >= 1
            if k > room:
                raise ValueError(f"train.awm.num_timesteps={k}: {self.timestep_sampling} draws distinct steps below "
                                 f"sample.num_steps x train.awm.timestep_fraction = {end}; at most {room}")


_EPS = 1e-10  # inside the (generalised) Huber root, as the authors' code; its root is subtracted so w(0) = 0


def matching_log_prob(v: torch.Tensor, target: torch.Tensor, t: torch.Tensor, weighting: str,
                      power: float = 0.25) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p [B] fp32, mse [B] fp64): the per-sample mean squared velocity error, weighted by the
    noise level t as the authors' `compute_log_prob_awm`, in fp64:
    uniform -mse; t -t mse; t2 -t^2 mse; huber -t (sqrt(mse + e) - sqrt(e));
    ghuber -t ((mse + e)^p - e^p) / p, e = 1e-10."""
    mse = (v.double() - target.double()).pow(2).flatten(1).mean(1)
    t = t.double().reshape(-1)
    if weighting == "uniform":
        lp = -mse
    elif weighting == "t":
        lp = -mse * t
    elif weighting == "t2":
        lp = -mse * t * t
    elif weighting == "huber":
        lp = -((mse + _EPS).sqrt() - math.sqrt(_EPS)) * t
    elif weighting == "ghuber":
        lp = -((mse + _EPS).pow(power) - _EPS ** power) * t / power
    else:
        raise ValueError(f"train.awm.weighting: unknown {weighting!r}")
    return lp.float(), mse


def scaled_advantages(advantages: torch.Tensor, adv_clip: float, advantage_max: float) -> torch.Tensor:
    """clip(A, -Z, Z) * advantage_max / Z (the authors' `adv_clip_max` and `advantage_max`)."""
    return advantages.float().clamp(-adv_clip, adv_clip) * (advantage_max / adv_clip)


def stratum_step(kind: str, slot: int, k: int, u: float, num_steps: int, fraction: float) -> int:
    """The step index that slot `slot` of `k` trains for a uniform draw u in [0, 1): the slot's
    stratum of [start, floor(num_steps * fraction)) split in k (start 1 for `discrete_wo_init`;
    `discrete_with_init` always trains step 0 in slot 0 and splits [1, end) over the rest)."""
    end = int(num_steps * fraction)
    start = 0 if kind == "discrete" else 1
    if kind == "discrete_with_init":
        if slot == 0:
            return 0
        slot, k = slot - 1, k - 1
    lo = int(start + slot * (end - start) / k)
    hi = int(start + (slot + 1) * (end - start) / k)
    return lo + int(u * (hi - lo))


def shifted(t: float, shift: float) -> float:
    """The SD3 time shift s t / (1 + (s - 1) t)."""
    return shift * t / (1 + (shift - 1) * t)


def continuous_time(kind: str, slot: int, k: int, u: float, shift: float) -> float:
    """A stratified continuous t for slot `slot` of `k`, p = (slot + u) / k: `logit_normal`
    sigmoid(Phi^-1(p)), shifted, at least 0.01; `uniform` 0.2 + 0.8 p, shifted (the authors'
    `time_type` samplers)."""
    p = (slot + u) / k
    if kind == "logit_normal":
        z = NormalDist().inv_cdf(min(max(p, 1e-7), 1 - 1e-7))
        return max(shifted(1 / (1 + math.exp(-z)), shift), 0.01)
    if kind == "uniform":
        return shifted(0.2 + 0.8 * p, shift)
    raise ValueError(f"train.awm.timestep_sampling: {kind!r} is not continuous")


def anchor_decay(step: int, decay: float, kind: str) -> float:
    """The EMA anchor's update anchor <- d anchor + (1 - d) theta after an epoch: `linear`
    d = min(decay, 0.001 s) with s optimizer steps so far (the authors' kl_ema_decay_type), `constant` d."""
    return min(decay, 0.001 * step) if kind == "linear" else decay


class AWM(Loss):
    name = "awm"
    section = AWMConfig
    headline = {"ratio": ".6f", "clipfrac": ".3f"}  # present when the policy loss is PPO-clipped
    first_of_epoch = ("ratio",)
    needs = RolloutNeeds(log_probs=False, clean_latents=True)

    def __init__(self, cfg: Config, policy: Policy):
        super().__init__(cfg, policy)
        self.awm: AWMConfig = cfg.train.awm
        self.slots = list(cfg.train_timesteps)  # `fixed`: the trained step indices; else slot numbers
        # Sampling weights for log p_old: needed only when an optimizer step can come before a micro-step.
        self.keep_old = self.awm.clip_range is not None and \
            cfg.train.optimizer_steps_per_epoch * cfg.train.num_inner_epochs > 1
        self.old: OldPolicy | None = None
        self.anchor: OldPolicy | None = None
        self.visits: dict[tuple[int, int], int] = {}
        self.epoch, self.decay = 0, 0.0

    def setup(self, params):
        if self.keep_old:
            self.old = OldPolicy(params, "train.loss=awm")
        if self.awm.ema_beta > 0:
            self.anchor = OldPolicy(params, "train.loss=awm")

    def begin_epoch(self, epoch):
        super().begin_epoch(epoch)
        self.visits = {}
        if self.old is not None:
            self.old.blend(0.0)  # the weights that sampled this epoch

    def end_epoch(self, global_step):
        if self.anchor is not None:
            self.decay = anchor_decay(global_step, self.awm.ema_decay, self.awm.ema_decay_type)
            self.anchor.blend(self.decay)

    def noise_level(self, slot: int, u: float, sigmas: torch.Tensor) -> float:
        a, n = self.awm, self.cfg.sample.num_steps
        if a.timestep_sampling == "fixed":
            return float(sigmas[self.slots[slot]])
        if a.timestep_sampling.startswith("discrete"):
            return float(sigmas[stratum_step(a.timestep_sampling, slot, len(self.slots), u, n, a.timestep_fraction)])
        return continuous_time(a.timestep_sampling, slot, len(self.slots), u, a.time_shift)

    def __call__(self, module, batch, t):
        cfg, a, policy = self.cfg, self.awm, self.policy
        dev = policy.device
        sigmas = policy.sigmas(cfg.sample.num_steps, batch.height, batch.width).float()
        x0 = batch.x_final.to(dev).float()
        levels, eps = [], []
        for pos in batch.positions:  # per sample, slot and visit; seeded, so a resumed run draws the same
            n = self.visits[(pos, t)] = self.visits.get((pos, t), -1) + 1
            gen = make_generator(cfg.seed, "awm", self.epoch, pos, t, n)
            levels.append(self.noise_level(t, float(torch.rand((), generator=gen)), sigmas))
            eps.append(torch.randn(x0.shape[1:], generator=gen))
        sig = torch.tensor(levels, dtype=torch.float32, device=dev)
        eps = torch.stack(eps).to(dev)
        view = (-1,) + (1,) * (x0.dim() - 1)
        x_t = ((1 - sig.reshape(view)) * x0 + sig.reshape(view) * eps).to(batch.x_final.dtype)
        target = eps - x0
        cond = batch.condition.to(dev) if batch.condition is not None else None
        call = partial(policy.velocity, module, x_t, sig, batch.embeds.to(dev), batch.height, batch.width,
                       cfg.sample.guidance_scale, condition=cond)
        log_p = partial(matching_log_prob, target=target, t=sig, weighting=a.weighting, power=a.ghuber_power)

        # The no-grad forwards run before the one with grad: they swap other weights into the
        # parameters (restored after), which must not happen under a live graph. With several
        # optimizer steps per epoch the old forward runs in every micro-step (before the first
        # step it equals the current value), so every micro-step runs the same forwards.
        old = None
        if self.old is not None:
            with torch.no_grad(), self.old.swapped_in():
                old = log_p(call())[0]
        v_anchor = None
        if self.anchor is not None:
            with torch.no_grad(), self.anchor.swapped_in():
                v_anchor = call()
        v = call()
        lp, mse = log_p(v)
        adv = scaled_advantages(batch.advantages.to(dev), cfg.advantage.clip, a.advantage_max)
        if a.clip_range is None:
            loss = -(adv * lp).mean()
            stats = {"policy_loss": loss.detach()}
        else:
            # One optimizer step per epoch: the weights are those that sampled until the last
            # micro-step, so the current value is log p_old (ratio exactly 1), as the authors' code.
            old = lp.detach() if old is None else old
            loss, stats = kernels.ppo_clip_loss(lp, old, adv, a.clip_range, math.inf, backend=cfg.kernels.backend)
        stats = {k: float(x) for k, x in stats.items()}
        stats.update(awm_mse=float(mse.detach().mean()), awm_log_p=float(lp.detach().mean()), awm_t=float(sig.mean()))
        live = batch.keep.to(dev).float()  # fillers (padding for matched ZeRO-3 collectives): no gradient
        msd = lambda ref: (v.float() - ref.float()).pow(2).flatten(1).mean(1).mul(live).sum() / len(batch)
        kl = ema_kl = 0.0
        if v_anchor is not None:
            ema_kl_t = msd(v_anchor)
            loss, ema_kl = loss + a.ema_beta * ema_kl_t, float(ema_kl_t)
        if cfg.train.kl_beta > 0:
            with torch.no_grad(), policy.adapter_disabled(module):
                v_ref = call()
            kl_t = msd(v_ref)
            loss, kl = loss + cfg.train.kl_beta * kl_t, float(kl_t)
        stats["kl"], stats["ema_kl"] = kl, ema_kl
        return loss, stats

    def epoch_metrics(self, out):
        out = super().epoch_metrics(out)
        if self.anchor is not None:
            out["train/awm_anchor_decay"] = float(self.decay)
        return out

    def epoch_state(self):
        # the visit counts seed the noise; the old policy is the weights that sampled this epoch,
        # which begin_epoch cannot take again once an optimizer step has moved them
        return {**super().epoch_state(), "visits": dict(self.visits),
                "old": [s.cpu() for s in self.old.shadow] if self.old is not None else None}

    def load_epoch_state(self, state):
        super().load_epoch_state(state)
        self.visits = dict(state.get("visits", {}))
        if self.old is not None and state.get("old") is not None:
            self.old.load_copies(state["old"], "the AWM old policy")

    def state_dict(self):
        return {"anchor": [s.cpu() for s in self.anchor.shadow]} if self.anchor is not None else {}

    def load_state_dict(self, state):
        if self.anchor is None:
            return
        if "anchor" not in state:  # the trainer names what a checkpoint lacks before loading it
            raise KeyError("the AWM loss state has no 'anchor'")
        self.anchor.load_copies(state["anchor"], "the AWM anchor")

