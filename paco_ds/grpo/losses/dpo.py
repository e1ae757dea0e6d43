"""`train.loss: dpo`, online Diffusion-DPO (Wallace et al., arXiv 2311.12908) in flow-matching form.

Each prompt's group of k samples gives preference pairs from its own rewards; the policy is trained
to lower its velocity-matching error on the winner relative to the reference more than on the loser:

    x_t = (1 - t) x0 + t eps,  v* = eps - x0,  the same eps and t for both samples of a pair
    err(v, x0) = mean((v - v*)^2) over the latent
    L = -log sigmoid(-beta / 2 * ((err_theta(w) - err_ref(w)) - (err_theta(l) - err_ref(l))))

averaged over the micro-batch's pairs. This is the paper's Eq. 14 with the epsilon-prediction error
replaced by the velocity error, the constant T omega(lambda_t) folded into beta, and the
`-0.5 * beta` scale of the authors' code (SalesforceAIResearch/DiffusionDPO, train.py); it is also
Flow-Factory's online `dpo` trainer (X-GenGroup/Flow-Factory, src/flow_factory/trainers/dpo.py:
best-vs-worst pairs per group, shared noise and t, target noise - x0, the same inside term).

Pairing. The trainer shuffles an epoch's samples into micro-batches and the sampler spreads a
group over ranks, so a pair can only be formed from the samples of a group that one micro-batch
holds. Within a micro-batch, each group present with two or more kept samples gives one pair: its
highest-advantage sample (winner) against its lowest (loser), if their advantages differ by more
than `margin`. Best-vs-worst is Flow-Factory's rule: the strongest preference the group offers,
each sample in at most one pair (so one shared noise per pair and 2 rows per pair in a forward),
and a tie (all rewards equal) gives no pair rather than a random label. The advantages are the
group-normalised rewards, so their order within a group is the reward's. The more of a rank's
share a micro-batch holds, the more pairs: the tiny recipe's `train.batch_size` is a rank's whole
share of the epoch. Fillers (`batch.keep` False) never pair.

Reference. The base model with the adapter disabled (`policy.adapter_disabled`), as the paper's
pretrained reference: no weights of its own to keep, swap or checkpoint, so a resume is exact for
free, and it equals Flow-Factory's frozen copy of the initial weights when the LoRA starts at zero.
Two transformer forwards per micro-step (policy with grad, reference without), on the pairs' rows
only; `train.kl_beta > 0` adds mean((v_theta - v_ref)^2) from those same two forwards.

Noise levels: `fixed` the schedule's sigma_j of each step j of train.timesteps (as nft), `uniform`
K = `num_timesteps` levels t ~ U[t_min, t_max] per pair (Flow-Factory's uniform sampler). The noise
and a drawn level are seeded per pair, slot and visit, so a resumed run draws the same.
"""
from __future__ import annotations

from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from paco_ds.recipe.schema import Config, LossSection
from paco_ds.grpo.losses.base import Loss, RolloutNeeds, check_drawn_levels, refuse_sde_log_prob_keys
from paco_ds.models.base import Policy
from paco_ds.sampling.trajectory import make_generator

# The statistics averaged per pair (a micro-step holds 0 to several pairs)
PER_PAIR = ("dpo_accuracy", "dpo_inside", "dpo_err_w", "dpo_err_l", "dpo_adv_gap")


class DPOConfig(LossSection):
    """`train.dpo`; docs/losses.md maps each key to the paper."""

    beta: float = Field(2000.0, gt=0)  # preference sharpness (Flow-Factory's default; the paper's SD1.5 uses 5000)
    margin: float = Field(0.0, ge=0)  # a pair needs A_winner - A_loser > margin (advantage units)
    timestep_sampling: Literal["fixed", "uniform"] = "fixed"
    num_timesteps: int = Field(1, ge=1)  # `uniform`: K levels drawn per pair
    t_min: float = Field(0.0, ge=0, le=1)  # `uniform`: t ~ U[t_min, t_max]
    t_max: float = Field(1.0, ge=0, le=1)

    checks_own_timesteps = True  # no SDE log-prob: `check` validates train.timesteps

    @model_validator(mode="after")
    def _range(self) -> "DPOConfig":
        if self.t_min >= self.t_max:
            raise ValueError(f"train.dpo.t_min={self.t_min} must be below train.dpo.t_max={self.t_max}")
        return self

    def trained_slots(self, cfg) -> list[int] | None:
        return None if self.timestep_sampling == "fixed" else list(range(self.num_timesteps))

    def check(self, cfg) -> None:
        refuse_sde_log_prob_keys(cfg, "dpo")
        if cfg.train.batch_size < 2:
            raise ValueError(f"train.batch_size={cfg.train.batch_size}: train.loss=dpo pairs samples of a prompt "
                             "within one micro-batch; it needs at least 2 (best: a rank's share of the epoch)")
        if cfg.sample.same_latent and cfg.sample.noise_level == 0:
            raise ValueError("sample.same_latent with sample.noise_level 0: an ODE rollout from one latent per "
                             "group gives k equal images, so train.loss=dpo would find no pair")
        check_drawn_levels(cfg, "dpo", self.timestep_sampling)

def best_worst_pairs(groups: list[int], advantages: list[float], keep: list[bool],
                     margin: float = 0.0) -> list[tuple[int, int]]:
    """(winner, loser) row indices: per group with two or more kept rows, its highest advantage
    against its lowest when they differ by more than `margin`; ties go to the first row. In the
    order of each group's first row."""
    rows: dict[int, list[int]] = {}
    for i, (g, k) in enumerate(zip(groups, keep)):
        if k:
            rows.setdefault(g, []).append(i)
    pairs = []
    for members in rows.values():
        if len(members) < 2:
            continue
        w = max(members, key=lambda i: advantages[i])
        l = min(members, key=lambda i: advantages[i])
        if advantages[w] - advantages[l] > margin:
            pairs.append((w, l))
    return pairs


def dpo_loss(err_w: torch.Tensor, err_l: torch.Tensor, ref_w: torch.Tensor, ref_l: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair -log sigmoid(-beta/2 ((err_w - ref_w) - (err_l - ref_l))) and its statistics: the
    implicit accuracy (the inside term > 0: the policy prefers the winner more than the reference)."""
    inside = -0.5 * beta * ((err_w - ref_w) - (err_l - ref_l))
    per_pair = -F.logsigmoid(inside)
    return per_pair, {"dpo_accuracy": (inside.detach() > 0).float().mean(), "dpo_inside": inside.detach().mean()}


class DPO(Loss):
    name = "dpo"
    section = DPOConfig
    headline = {"dpo_accuracy": ".3f", "dpo_pairs": ".2f"}
    needs = RolloutNeeds(log_probs=False, clean_latents=True)

    def __init__(self, cfg: Config, policy: Policy):
        super().__init__(cfg, policy)
        self.dpo: DPOConfig = cfg.train.dpo
        self.slots = list(cfg.train_timesteps)  # `fixed`: the trained step indices; else slot numbers
        self.visits: dict[tuple[int, int, int], int] = {}
        self.epoch = 0

    def begin_epoch(self, epoch):
        super().begin_epoch(epoch)
        self.visits = {}

    def _draw(self, pos_w: int, pos_l: int, t: int, shape, sigmas: torch.Tensor) -> tuple[float, torch.Tensor]:
        """The pair's noise level and noise at slot t, seeded by (seed, epoch, winner, loser, slot, visit)."""
        key = (pos_w, pos_l, t)
        n = self.visits[key] = self.visits.get(key, -1) + 1
        gen = make_generator(self.cfg.seed, "dpo", self.epoch, pos_w, pos_l, t, n)
        if self.dpo.timestep_sampling == "fixed":
            level = float(sigmas[self.slots[t]])
        else:
            level = self.dpo.t_min + (self.dpo.t_max - self.dpo.t_min) * float(torch.rand((), generator=gen))
        return level, torch.randn(shape, generator=gen)

    def __call__(self, module, batch, t):
        cfg, policy = self.cfg, self.policy
        dev = policy.device
        adv = batch.advantages.float()
        pairs = best_worst_pairs(list(batch.group_ids), adv.tolist(), batch.keep.tolist(), self.dpo.margin)
        x_final = batch.x_final
        sigmas = policy.sigmas(cfg.sample.num_steps, batch.height, batch.width).float()
        # Rows: the winners then the losers, pair by pair. Without a pair the micro-step still runs
        # both forwards on one row, weight 0: ZeRO-3's collectives must match on every rank.
        rows = [w for w, _ in pairs] + [l for _, l in pairs] or [0]
        levels, eps = [], []
        for w, l in pairs or [(0, 0)]:
            level, e = self._draw(batch.positions[w], batch.positions[l], t, x_final.shape[1:], sigmas)
            levels.append(level)
            eps.append(e)
        p = len(levels)
        x0 = x_final[rows].to(dev).float()
        sig = torch.tensor(levels, dtype=torch.float32).repeat(2 if pairs else 1).to(dev)
        eps = torch.stack(eps).repeat((2 if pairs else 1,) + (1,) * (x0.dim() - 1)).to(dev)
        view = (-1,) + (1,) * (x0.dim() - 1)
        x_t = ((1 - sig.reshape(view)) * x0 + sig.reshape(view) * eps).to(x_final.dtype)
        target = eps - x0
        cond = batch.condition.select(rows).to(dev) if batch.condition is not None else None  # editing
        call = partial(policy.velocity, module, x_t, sig, batch.embeds.select(rows).to(dev), batch.height,
                       batch.width, cfg.sample.guidance_scale, condition=cond)
        # the no-grad reference forward first: it toggles the adapter, which must not happen under a live graph
        with torch.no_grad(), policy.adapter_disabled(module):
            v_ref = call()
        v = call()
        err = (v.float() - target).pow(2).flatten(1).mean(1)
        ref = (v_ref.float() - target).pow(2).flatten(1).mean(1)
        zero = {"dpo_accuracy": 0.0, "dpo_inside": 0.0, "dpo_err_w": 0.0, "dpo_err_l": 0.0, "dpo_adv_gap": 0.0}
        if pairs:
            per_pair, stats = dpo_loss(err[:p], err[p:], ref[:p], ref[p:], self.dpo.beta)
            loss = per_pair.mean()
            gap = adv[[w for w, _ in pairs]] - adv[[l for _, l in pairs]]
            stats = {k: float(x) for k, x in stats.items()}
            stats.update(dpo_err_w=float(err[:p].detach().mean()), dpo_err_l=float(err[p:].detach().mean()),
                         dpo_adv_gap=float(gap.mean()))
            # summed over the pairs: the epoch's mean over micro-steps is divided by the mean pair
            # count in epoch_metrics, so a pair-less micro-step does not pull the averages to 0
            stats.update({k: stats[k] * len(pairs) for k in PER_PAIR})
        else:
            loss = 0.0 * v.float().sum()  # no gradient, and the same backward as every other rank's
            stats = dict(zero)
        stats["policy_loss"] = float(loss.detach())
        stats["dpo_pairs"] = float(len(pairs))
        kl = 0.0
        if cfg.train.kl_beta > 0 and pairs:
            kl_t = (v.float() - v_ref.float()).pow(2).flatten(1).mean(1).mean()
            loss, kl = loss + cfg.train.kl_beta * kl_t, float(kl_t.detach())
        stats["kl"] = kl
        return loss, stats

    def epoch_metrics(self, out: dict[str, float]) -> dict[str, float]:
        pairs = out.get("train/dpo_pairs", 0.0)
        for k in PER_PAIR:  # per pair, over the epoch's pairs on every rank
            if f"train/{k}" in out:
                out[f"train/{k}"] = out[f"train/{k}"] / pairs if pairs > 0 else 0.0
        return super().epoch_metrics(out)

    def epoch_state(self):
        return {**super().epoch_state(), "visits": dict(self.visits)}  # a visit's noise depends on those before it

    def load_epoch_state(self, state):
        super().load_epoch_state(state)
        self.visits = dict(state.get("visits", {}))
