"""`train.loss: dgpo`, Direct Group Preference Optimization (Luo et al., arXiv 2510.08425).

DGPO trains on deterministic (ODE) rollouts: no SDE log-probability, no policy gradient. A group's
samples are compared with the reference through their denoising (flow-matching) errors, and the
group as a whole is the preference unit. For sample i of group g, noised at sigma with the group's
noise eps (x_t = (1 - sigma) x0_i + sigma eps, target eps - x0_i):

    dsm_i = mean((v_theta(x_t) - (eps - x0_i))^2),   ref_i the same error of the reference
    z_g   = sum over i in g of A_i * beta * (dsm_i - ref_i) / k        (k: sample.group_size)
    L     = -log sigmoid(-z_g)

With normalised advantages (sum_g A_i = 0) the positive-advantage samples are the group's preferred
set and the negative ones its rejected set, and -z_g is the paper's group-level Bradley-Terry
margin. Its gradient is sigmoid(z_g) * beta / k * sum_i A_i grad dsm_i; as the authors' code
(Luo-Yihong/DGPO, scripts/train_sd3_dgpo.py, `compute_group_dgpo_loss_allreduce`) and Flow-Factory's
trainer (X-GenGroup/Flow-Factory, src/flow_factory/trainers/dgpo.py), the loss is written as the
surrogate with that gradient up to the constant beta / k:

    L = mean over the micro-batch's rows of  stopgrad(sigmoid(z_g(i))) * A_i * dsm_i

Where the group's members are. z_g needs every member's error at the same step. The members of a
group that a micro-step holds on any rank are summed together: each rank's (group, term) rows are
all-gathered (one small collective per micro-step), as the authors all-reduce their per-group sums.
The tiny recipe's micro-batch is a rank's whole share of the epoch, so every group is complete; with
smaller micro-batches a group split over micro-steps is summed per part, and `dgpo_group_coverage`
(the mean fraction of k present) says how much of each group a sum saw.

Noise and levels. The noise is one eps per group and micro-step, seeded by (seed, epoch, group, slot,
micro-step): a group's members share it on every rank (the authors broadcast it), and a resumed run
draws the same. Levels, the same for the whole micro-batch: `fixed` the schedule's sigma_j of each
step j of train.timesteps; `truncated` the authors' sampler, `num_timesteps` distinct steps drawn per
epoch from the first `trunc_steps` + 1 steps of the schedule (the high-noise end; their `trunc_steps`
with `num_train_timesteps`).

Reference: the base model, adapter disabled (the authors' default `use_ema_ref: False`), so there
are no weights of its own to keep. Two transformer forwards per micro-step; `train.kl_beta > 0` adds
mean((v_theta - v_ref)^2) from the same two. Advantages are clamped to +-`adv_clip_max` first (the
authors' `adv_clip_max`, 5).

The old policy (the authors' `ema_ref`), kept when `clip_dsm` or `sample_with_old_after` asks for it:
an fp32 copy of this rank's adapter shards, blended after every optimizer step n as
old <- d old + (1 - d) theta with d = min(0.3, 0.001 (n - 1)) (the authors' decay at that step).
- `clip_dsm`: a third forward, the old policy's, without gradient; with ratio = exp(dsm_old - dsm),
  a row whose ratio left [1 - clip_range, 1 + clip_range] on its advantage's side (above for A > 0,
  below otherwise) contributes its dsm without gradient (PPO-style, as the authors' `clip_dsm`).
- `sample_with_old_after` (their `switch_ema_ref`): after that many optimizer steps the rollouts sample
  with the old policy.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field

from paco_ds.recipe.schema import Config, LossSection
from paco_ds.grpo.losses.base import Loss, OldPolicy, RolloutNeeds, check_drawn_levels, refuse_sde_log_prob_keys
from paco_ds.models.base import Policy
from paco_ds.sampling.trajectory import make_generator


class DGPOConfig(LossSection):
    """`train.dgpo`; docs/losses.md maps each key to the paper and the authors' config."""

    beta: float = Field(100.0, gt=0)  # the authors' beta_dpo (GenEval and OCR 100, PickScore 10)
    adv_clip_max: float = Field(5.0, gt=0)  # A -> clamp(A, -adv_clip_max, adv_clip_max)
    timestep_sampling: Literal["fixed", "truncated"] = "truncated"  # the authors' sampler (their default)
    num_timesteps: int = Field(4, ge=1)  # `truncated`: steps drawn per epoch (num_train_timesteps)
    trunc_steps: int = Field(6, ge=0)  # `truncated`: drawn from steps 0..trunc_steps
    clip_dsm: bool = False  # PPO-style clip of dsm against the EMA old policy (the authors' clip_dsm)
    clip_range: float = Field(5e-2, gt=0)  # the authors' clip_range (jpeg 5e-2; GenEval and OCR 1e-2)
    sample_with_old_after: int | None = Field(None, ge=0)  # the authors' switch_ema_ref (200 or 500)

    checks_own_timesteps = True  # no SDE log-prob: `check` validates train.timesteps

    def trained_slots(self, cfg) -> list[int] | None:
        return None if self.timestep_sampling == "fixed" else list(range(self.num_timesteps))

    def check(self, cfg) -> None:
        refuse_sde_log_prob_keys(cfg, "dgpo")
        if cfg.sample.same_latent and cfg.sample.noise_level == 0:
            raise ValueError("sample.same_latent with sample.noise_level 0: an ODE rollout from one latent per "
                             "group gives k equal images, so train.loss=dgpo would see no preference")
        check_drawn_levels(cfg, "dgpo", self.timestep_sampling)
        if self.timestep_sampling == "truncated":
            n = cfg.sample.num_steps
            if self.trunc_steps >= n:
                raise ValueError(f"train.dgpo.trunc_steps={self.trunc_steps} must be < sample.num_steps={n}")
            if self.num_timesteps > self.trunc_steps + 1:
                raise ValueError(f"train.dgpo.num_timesteps={self.num_timesteps}: `truncated` draws distinct steps "
                                 f"from 0..train.dgpo.trunc_steps={self.trunc_steps}; at most {self.trunc_steps + 1}")


def preference_terms(dsm: torch.Tensor, ref: torch.Tensor, advantages: torch.Tensor, beta: float,
                     k: int) -> torch.Tensor:
    """Each row's share of its group's z_g: A_i beta (dsm_i - ref_i) / k, without gradient."""
    return advantages * beta * (dsm.detach() - ref) / k


def old_policy_decay(global_step: int) -> float:
    """The old policy's blend after optimizer step `global_step` (1-based): the authors' min(0.3, 0.001 s)
    with s their step count before it (Luo-Yihong/DGPO, scripts/train_sd3_dgpo.py, `ema_ref.step`)."""
    return min(0.3, 0.001 * (global_step - 1))


def clip_dsm(dsm: torch.Tensor, old_dsm: torch.Tensor, advantages: torch.Tensor,
             clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dsm with the gradient cut where the ratio exp(old_dsm - dsm) left the clip range on the side of
    the row's advantage, which rows were cut): the authors' `clip_dsm`."""
    ratio = torch.exp(old_dsm - dsm.detach())
    cut = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    return torch.where(cut, dsm.detach(), dsm), cut


def dgpo_loss(dsm: torch.Tensor, advantages: torch.Tensor, groups: list[int], all_groups: list[int],
              all_terms: torch.Tensor, live: torch.Tensor | None = None):
    """The micro-batch's surrogate loss and each row's (weight, z_g). `dsm` carries the gradient;
    z_g sums `all_terms` over the rows of `all_groups` (every rank's rows of this micro-step, this
    rank's included) that belong to the row's group; `live` 0 for rows that add nothing (fillers).
    The group ids are host lists: the bookkeeping needs no data-dependent device op."""
    live = torch.ones_like(advantages) if live is None else live
    slot = {g: i for i, g in enumerate(dict.fromkeys([*groups, *all_groups]))}
    dev = all_terms.device
    z = torch.zeros(len(slot), dtype=all_terms.dtype, device=dev)
    z.scatter_add_(0, torch.tensor([slot[g] for g in all_groups], dtype=torch.long, device=dev), all_terms)
    z_rows = z[torch.tensor([slot[g] for g in groups], dtype=torch.long, device=dev)]
    weight = torch.sigmoid(z_rows).detach()
    return (weight * advantages * dsm * live).sum() / len(dsm), weight, z_rows


class DGPO(Loss):
    name = "dgpo"
    section = DGPOConfig
    headline = {"dgpo_weight": ".3f", "dgpo_group_coverage": ".2f"}
    needs = RolloutNeeds(log_probs=False, clean_latents=True)
    gathers_across_ranks = True  # every rank's (group, term) rows of a micro-step (_gather)

    def __init__(self, cfg: Config, policy: Policy):
        super().__init__(cfg, policy)
        self.dgpo: DGPOConfig = cfg.train.dgpo
        self.slots = list(cfg.train_timesteps)  # `fixed`: the trained step indices; else slot numbers
        self.micro_steps: dict[int, int] = {}  # per slot, the micro-steps so far this epoch (as every rank)
        self.epoch = 0
        self.old: OldPolicy | None = None
        self.global_step = 0

    def setup(self, params):
        if self.dgpo.clip_dsm or self.dgpo.sample_with_old_after is not None:
            self.old = OldPolicy(params, "train.dgpo.clip_dsm / sample_with_old_after")

    def after_optimizer_step(self, global_step):
        self.global_step = global_step
        if self.old is not None:
            self.old.blend(old_policy_decay(global_step))

    def sampling(self):
        after = self.dgpo.sample_with_old_after
        if self.old is not None and after is not None and self.global_step > after:
            return self.old.swapped_in()
        return contextlib.nullcontext()

    def begin_epoch(self, epoch):
        super().begin_epoch(epoch)
        self.micro_steps = {}

    def step_of_slot(self, t: int) -> int:
        """The schedule step slot `t` trains this epoch."""
        if self.dgpo.timestep_sampling == "fixed":
            return self.slots[t]
        gen = make_generator(self.cfg.seed, "dgpo-steps", self.epoch)
        order = torch.randperm(self.dgpo.trunc_steps + 1, generator=gen).tolist()
        return order[t]

    def _gather(self, groups: list[int], terms: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Every rank's (group, term) rows of this micro-step: each rank sends train.batch_size rows,
        its own padded with group -1 (one all_gather of a fixed size, as ZeRO-3's lockstep needs)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return groups, terms
        pad = self.cfg.train.batch_size
        if len(groups) > pad:
            raise RuntimeError(f"train.loss=dgpo: a micro-batch of {len(groups)} rows, above train.batch_size={pad}")
        mine = torch.zeros(pad, 2, dtype=torch.float64)
        mine[:, 0] = -1
        mine[:len(groups), 0] = torch.tensor(groups, dtype=torch.float64)
        mine[:len(groups), 1] = terms.detach().double().cpu()
        mine = mine.to(self.policy.device)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(out, mine)
        rows = torch.cat(out).cpu()
        rows = rows[rows[:, 0] >= 0]
        return [int(g) for g in rows[:, 0].tolist()], rows[:, 1].to(terms.dtype).to(terms.device)

    def __call__(self, module, batch, t):
        cfg, d, policy = self.cfg, self.dgpo, self.policy
        dev = policy.device
        n = self.micro_steps[t] = self.micro_steps.get(t, -1) + 1
        sigma = float(policy.sigmas(cfg.sample.num_steps, batch.height, batch.width).float()[self.step_of_slot(t)])
        x0 = batch.x_final.to(dev).float()
        noise = {}  # one eps per group: every rank draws the same for a group at this micro-step
        for g in batch.group_ids:
            if g not in noise:
                noise[g] = torch.randn(x0.shape[1:], generator=make_generator(cfg.seed, "dgpo", self.epoch, g, t, n))
        eps = torch.stack([noise[g] for g in batch.group_ids]).to(dev)
        x_t = ((1 - sigma) * x0 + sigma * eps).to(batch.x_final.dtype)
        target = eps - x0
        sig = torch.full((len(x0),), sigma, dtype=torch.float32, device=dev)
        cond = batch.condition.to(dev) if batch.condition is not None else None  # editing
        call = partial(policy.velocity, module, x_t, sig, batch.embeds.to(dev), batch.height, batch.width,
                       cfg.sample.guidance_scale, condition=cond)
        # the no-grad reference forward first: it toggles the adapter, which must not happen under a live graph
        with torch.no_grad(), policy.adapter_disabled(module):
            v_ref = call()
        v_old = None
        if d.clip_dsm:
            with torch.no_grad(), self.old.swapped_in():
                v_old = call()
        v = call()
        dsm = (v.float() - target).pow(2).flatten(1).mean(1)
        ref = (v_ref.float() - target).pow(2).flatten(1).mean(1)
        adv = batch.advantages.to(dev).float().clamp(-d.adv_clip_max, d.adv_clip_max)
        clipped = None
        if v_old is not None:
            dsm, clipped = clip_dsm(dsm, (v_old.float() - target).pow(2).flatten(1).mean(1), adv, d.clip_range)
        live = batch.keep.to(dev).float()  # fillers (padding for matched ZeRO-3 collectives) add nothing
        groups = list(batch.group_ids)
        terms = preference_terms(dsm, ref, adv, d.beta, cfg.sample.group_size)
        kept = [i for i, k in enumerate(batch.keep.tolist()) if k]
        all_groups, all_terms = self._gather([groups[i] for i in kept], terms[kept])
        loss, weight, z = dgpo_loss(dsm, adv, groups, all_groups, all_terms, live)
        members = Counter(all_groups)
        mean = lambda x: float((x.detach() * live).sum()) / len(kept) if kept else 0.0
        stats = {"policy_loss": float(loss.detach()), "dgpo_weight": mean(weight), "dgpo_z": mean(z),
                 "dgpo_dsm": mean(dsm), "dgpo_ref_dsm": mean(ref), "dgpo_sigma": sigma,
                 "dgpo_group_coverage": sum(members.values()) / (len(members) * cfg.sample.group_size)
                 if members else 0.0}
        if clipped is not None:
            stats["dgpo_clipfrac"] = mean(clipped.float())
        kl = 0.0
        if cfg.train.kl_beta > 0:
            kl_t = ((v.float() - v_ref.float()).pow(2).flatten(1).mean(1) * live).sum() / len(batch)
            loss, kl = loss + cfg.train.kl_beta * kl_t, float(kl_t.detach())
        stats["kl"] = kl
        return loss, stats

    def epoch_state(self):
        return {**super().epoch_state(), "micro_steps": dict(self.micro_steps)}  # they seed the noise

    def state_dict(self):
        if self.old is None:
            return {}
        return {"old": [s.cpu() for s in self.old.shadow], "global_step": self.global_step}

    def load_state_dict(self, state):
        if self.old is not None:
            self.old.load_copies(state["old"], "the DGPO old policy")
            self.global_step = state["global_step"]

    def load_epoch_state(self, state):
        super().load_epoch_state(state)
        self.micro_steps = dict(state.get("micro_steps", {}))
