"""Policy losses, selected by `train.loss`.

A loss declares what it needs from a rollout (`RolloutNeeds`), so the rollout keeps only that,
and computes one micro-step's loss from a training batch whose advantages travel on it. The
trainer's micro-step stays the same for every loss: loss -> finite check -> backward -> step.
A few hooks (`setup`, `sampling`, `begin_epoch`, `end_epoch`, `epoch_metrics`, state) let a loss
keep weights of its own (DiffusionNFT's old policy) without the trainer knowing which loss runs.

- `ppo` (PaCo-GRPO, Flow-GRPO): PPO-clip on the SDE transition log-probs of the noised steps,
  against log pi_old recorded at sampling; one forward with grad per sample and step, plus a
  forward with the adapter disabled for the KL to the base model only when `train.kl_beta > 0`.
  With `train.ppo.ratio_norm` (GRPO-Guard, arXiv 2510.22319): the log-ratio gets its bias back and
  is scaled by the transition std (RatioNorm), the step's term is divided by its dt (gradient
  reweighting); the rollout also keeps the sampling transition mean mu_old (no extra forward).
- `nft` (DiffusionNFT, arXiv 2509.16117): flow matching on the forward process of the clean
  final latents; positive / negative implicit policies from the current and the old velocity,
  weighted by the optimality probability r from the advantage. No SDE log-prob anywhere (the
  rollout is an ODE unless the recipe says otherwise); two forwards per trained sample and step
  (old without grad, current with grad), a third (adapter disabled) only when `train.kl_beta > 0`.
- `awm` (Advantage Weighted Matching, arXiv 2509.25050), in paco_ds/grpo/awm.py: flow matching on
  the clean final latents at K drawn noise levels, its error weighted by the advantage.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn

import kernels
from paco_ds.config import Config
from paco_ds.grpo.ema import ShadowWeights
from paco_ds.models.base import Policy
from paco_ds.recipe import resolve
from paco_ds.sampling.rollout import Trajectory, make_generator, transition_log_prob


@dataclass(frozen=True)
class RolloutNeeds:
    log_probs: bool  # log pi_old of the trained SDE steps, and x_j / x_{j+1} / sigmas
    clean_latents: bool = False  # the final (clean) latents of each sample
    mean_old: bool = False  # the SDE transition mean at sampling of each trained step


class Loss:
    name = ""
    needs = RolloutNeeds(log_probs=True)
    return_mean = False  # the SDE step also returns its fp32 transition mean
    # What the trainer reports of this loss's statistics, so that it knows none of them itself:
    # `headline` the ones on the epoch line (name -> format), `first_of_epoch` the ones whose value
    # at the epoch's first micro-step is also logged, as train/<name>_first.
    headline: dict[str, str] = {}
    first_of_epoch: tuple[str, ...] = ()

    def __init__(self, cfg: Config, policy: Policy):
        self.cfg, self.policy = cfg, policy
        # The SDE step of rollouts and training: one function, so log pi_old and the log-prob
        # recomputed in training come from the same kernel (bitwise equal before an update).
        self.sde = self._counted(partial(kernels.sde_step, backend=cfg.kernels.backend, return_mean=self.return_mean))
        self.sde_logprob_rows = 0  # SDE transitions (samples x steps) given a log-prob since the last report

    def _counted(self, fn: Callable) -> Callable:
        def step(x, v, sigma, sigma_next, noise_level, *args, **kwargs):
            if noise_level > 0:
                self.sde_logprob_rows += x.shape[0]
            return fn(x, v, sigma, sigma_next, noise_level, *args, **kwargs)
        return step

    def __call__(self, module: nn.Module, batch: Trajectory, t: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of trained step index `t` for a micro-batch (its advantages are on `batch`),
        computed through `module` (the engine), and its statistics for the epoch's metrics."""
        raise NotImplementedError

    # hooks, no-ops unless a loss needs them
    def setup(self, params: list[nn.Parameter]) -> None:
        """The trainable parameters, once the engine holds them (partitioned under ZeRO-3)."""

    def sampling(self) -> contextlib.AbstractContextManager:
        """The weights rollouts sample with (default: the current ones)."""
        return contextlib.nullcontext()

    def begin_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def end_epoch(self, global_step: int) -> None:
        """After the epoch's optimizer steps."""

    def epoch_metrics(self, out: dict[str, float]) -> dict[str, float]:
        """The epoch's rank-averaged `train/` metrics, completed; resets the per-epoch counters."""
        out["train/sde_logprob_rows"] = float(self.sde_logprob_rows)
        self.sde_logprob_rows = 0
        return out

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def epoch_state(self) -> dict:
        """What the loss has counted so far in this epoch, for a mid-epoch checkpoint: resumed after
        `begin_epoch`, the rest of the epoch computes what it would have without the stop."""
        return {"sde_logprob_rows": self.sde_logprob_rows}

    def load_epoch_state(self, state: dict) -> None:
        self.sde_logprob_rows = state.get("sde_logprob_rows", 0)


# ------------------------------------------------------------------------------------ GRPO-Guard
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
    headline = {"ratio": ".6f", "clipfrac": ".3f"}
    first_of_epoch = ("ratio",)  # 1 before the first update of the epoch: a check that old == current

    def __init__(self, cfg: Config, policy: Policy):
        self.guard = cfg.train.ppo.ratio_norm
        # The fp32 transition mean is only needed for the KL term and GRPO-Guard's bias.
        self.return_mean = cfg.train.kl_beta > 0 or self.guard
        self.needs = RolloutNeeds(log_probs=True, mean_old=self.guard)
        super().__init__(cfg, policy)
        self.log_prob = partial(transition_log_prob, policy, guidance=cfg.sample.guidance_scale,
                                noise_level=cfg.sample.noise_level, sde_type=cfg.sample.sde_type, sde_fn=self.sde)

    def __call__(self, module, batch, t):
        cfg = self.cfg
        step = self.log_prob(module, batch, t, slice(None))
        dev = step.log_prob.device
        old = batch.log_prob[:, t].to(dev)
        if not self.guard:
            loss, stats = kernels.ppo_clip_loss(step.log_prob, old, batch.advantages.to(dev), cfg.train.ppo.clip_range,
                                                cfg.advantage.clip, backend=cfg.kernels.backend)
        else:
            dt = (batch.sigma[:, t] - batch.sigma_next[:, t]).to(dev).float()
            z = ratio_norm(step.log_prob, old, step.mean, batch.mean_old[:, t].to(dev), step.std * dt.sqrt())
            # Gradient reweighting: the step's PPO term / dt; folded into the (already clipped)
            # advantages, which is exact since dt > 0 and the max of the PPO term is linear in A.
            adv = batch.advantages.to(dev).float().clamp(-cfg.advantage.clip, cfg.advantage.clip) / dt
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
            with torch.no_grad(), self.policy.adapter_disabled(module):
                ref = self.log_prob(module, batch, t, slice(None))
            kl_t = kernels.kl_to_reference(step.mean, ref.mean, step.std, backend=cfg.kernels.backend).mean()
            loss, kl = loss + cfg.train.kl_beta * kl_t, float(kl_t)
        stats["kl"] = kl
        return loss, stats

    def epoch_metrics(self, out):
        out = super().epoch_metrics(out)
        for key in [k for k in out if k.endswith("_sq")]:  # second moments -> spreads (std over the epoch)
            mean = out[key[:-3] + "_mean"]
            out[key[:-3] + "_std"] = math.sqrt(max(out.pop(key) - mean * mean, 0.0))
        return out


# ------------------------------------------------------------------------------------ DiffusionNFT
def old_policy_decay(step: int, decay_type: int) -> float:
    """DiffusionNFT's soft update theta_old <- d theta_old + (1 - d) theta after an epoch (d by the
    optimizer steps so far): 0 a hard copy; 1 min(0.001 s, 0.5); 2 none before step 75, then
    min(0.0075 (s - 75), 0.999)."""
    if decay_type == 0:
        return 0.0
    if decay_type == 1:
        return min(0.001 * step, 0.5)
    return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)


class OldPolicy(ShadowWeights):
    """The old (data-collection) adapter as fp32 copies of this rank's shards of the trainable
    parameters, swapped in for the rollout and the old velocity."""

    def __init__(self, params: list[nn.Parameter], what: str = "train.loss=nft"):
        persistent = [tuple(p.ds_shape) for p in params if getattr(p, "ds_persist", False)]
        if persistent:  # ZeRO-3 keeps these gathered: swapping the shard would not reach the forward
            raise ValueError(f"{what}: {len(persistent)} trainable parameters (e.g. {persistent[0]}) are below "
                             "zero_optimization.stage3_param_persistence_threshold; lower it below the LoRA sizes")
        super().__init__(params)


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


# train.loss -> "module:Class", imported when the loss is built: AWM lives in its own file, built on the
# classes above, so this table names it instead of importing it (that would be an import cycle).
LOSSES: dict[str, str] = {
    PPOClip.name: "paco_ds.grpo.losses:PPOClip",
    NFT.name: "paco_ds.grpo.losses:NFT",
    "awm": "paco_ds.grpo.awm:AWM",
}


def loss_class(name: str) -> type[Loss]:
    """The Loss class of `train.loss`: a name of LOSSES or "module:Class" (a loss outside paco_ds)."""
    return resolve(name, LOSSES, "train.loss", "loss")


def build_loss(cfg: Config, policy: Policy) -> Loss:
    return loss_class(cfg.train.loss)(cfg, policy)
