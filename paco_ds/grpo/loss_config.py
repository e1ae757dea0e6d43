"""The recipe sections of the built-in losses, `train.ppo`, `train.nft` and `train.awm`: each loss's
keys, and its cross-checks against the rest of the recipe, next to the loss (paco_ds/grpo/losses.py,
paco_ds/grpo/awm.py; docs/losses.md maps each key to its paper).

Part of the recipe schema: `paco_ds.config` imports this module, so it imports neither torch nor
the losses themselves. `Config` calls the active loss's `check` once the whole recipe is typed.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LossSection(BaseModel):
    # The rules of every recipe section (paco_ds.config.Section): unknown keys and non-finite floats
    # are refused, naming the key.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def check(self, cfg) -> None:
        """Raise ValueError, naming the keys, where the recipe `cfg` (a paco_ds.config.Config whose
        train.loss is this section's loss) contradicts this loss."""


def _refuse_sde_log_prob_keys(cfg, loss: str) -> None:
    if cfg.train.ppo.ratio_norm or cfg.sample.sde_window is not None:
        raise ValueError(f"train.loss={loss} trains on clean latents: train.ppo.ratio_norm and sample.sde_window "
                         "apply to SDE log-prob losses only")


class PPOConfig(LossSection):
    """`train.loss: ppo`, PPO-clip on the SDE transition log-ratio (PaCo-GRPO, Flow-GRPO)."""

    clip_range: float = Field(1e-4, gt=0)
    ratio_norm: bool = False  # GRPO-Guard (arXiv 2510.22319): RatioNorm + per-step gradient reweighting

    def check(self, cfg) -> None:
        if self.ratio_norm and cfg.sample.sde_type != "flow_grpo":
            raise ValueError("train.ppo.ratio_norm normalises Gaussian log-ratios: it needs sample.sde_type=flow_grpo")


class NFTConfig(LossSection):
    """`train.loss: nft`, DiffusionNFT (arXiv 2509.16117); docs/losses.md maps each key to its equation."""

    beta: float = Field(1.0, gt=0)  # implicit-policy strength: v+- = v_old +- beta (v_theta - v_old)
    decay_type: Literal[0, 1, 2] = 1  # old-policy soft update: 0 copy, 1 min(0.001 s, 0.5), 2 delayed
    adaptive_weight: bool = True  # x0-regression weighted by 1 / mean|x0_hat - x0| (stop-grad)

    def check(self, cfg) -> None:
        _refuse_sde_log_prob_keys(cfg, "nft")


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

    def check(self, cfg) -> None:
        _refuse_sde_log_prob_keys(cfg, "awm")
        n = cfg.sample.num_steps
        if self.timestep_sampling == "fixed":
            steps = cfg.train_timesteps
            if not steps or any(j >= n for j in steps):
                raise ValueError(f"train.timesteps {steps}: train.awm.timestep_sampling=fixed trains these step "
                                 f"indices; give at least one, each < sample.num_steps={n}")
            return
        if cfg.train.timesteps is not None:
            raise ValueError(f"train.timesteps: only with train.awm.timestep_sampling=fixed (with "
                             f"{self.timestep_sampling}, train.awm.num_timesteps levels are drawn)")
        if self.timestep_sampling.startswith("discrete"):
            end, k = int(n * self.timestep_fraction), self.num_timesteps
            room = end - 1 if self.timestep_sampling == "discrete_wo_init" else end  # strata of width >= 1
            if k > room:
                raise ValueError(f"train.awm.num_timesteps={k}: {self.timestep_sampling} draws distinct steps below "
                                 f"sample.num_steps x train.awm.timestep_fraction = {end}; at most {room}")
