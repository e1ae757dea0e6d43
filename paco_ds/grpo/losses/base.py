"""What every policy loss is: the `Loss` interface the trainer drives, what it asks of a rollout
(`RolloutNeeds`), and the pieces several losses share (the old policy's weights, the refusal of
SDE log-prob keys by a loss that trains on clean latents).

A loss declares what it needs from a rollout, so the rollout keeps only that, and computes one
micro-step's loss from a training batch whose advantages travel on it. The trainer's micro-step
stays the same for every loss: loss -> finite check -> backward -> step. A few hooks (`setup`,
`sampling`, `begin_epoch`, `end_epoch`, `epoch_metrics`, state) let a loss keep weights of its own
(DiffusionNFT's old policy) without the trainer knowing which loss runs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn

import kernels
from paco_ds.recipe.schema import Config, LossSection
from paco_ds.grpo.ema import ShadowWeights
from paco_ds.models.base import Policy
from paco_ds.sampling.trajectory import Trajectory


@dataclass(frozen=True)
class RolloutNeeds:
    log_probs: bool  # log pi_old of the trained SDE steps, and x_j / x_{j+1} / sigmas
    clean_latents: bool = False  # the final (clean) latents of each sample
    mean_old: bool = False  # the SDE transition mean at sampling of each trained step


class Loss:
    # The loss's name (train.loss for a built-in one) and the recipe section of its own keys,
    # train.<name>, declared in its file (None: it takes none).
    name = ""
    section: type[LossSection] | None = None
    needs = RolloutNeeds(log_probs=True)
    return_mean = False  # the SDE step also returns its fp32 transition mean
    # What the trainer reports of this loss's statistics, so that it knows none of them itself:
    # `headline` the ones on the epoch line (name -> format), `first_of_epoch` the ones whose value
    # at the epoch's first micro-step is also logged, as train/<name>_first.
    headline: dict[str, str] = {}
    first_of_epoch: tuple[str, ...] = ()
    # Whether a micro-step gathers rows from every rank (DGPO's group statistics): under
    # parallel.sequence the ranks of a group hold the same samples, which such a gather would count
    # once per rank, so preflight refuses the pair.
    gathers_across_ranks = False

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

    def after_optimizer_step(self, global_step: int) -> None:
        """After each optimizer step; `global_step` counts it (e.g. DGPO's EMA old policy)."""

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



class OldPolicy(ShadowWeights):
    """The old (data-collection) adapter as fp32 copies of this rank's shards of the trainable
    parameters, swapped in for the rollout and the old velocity."""

    def __init__(self, params: list[nn.Parameter], what: str = "train.loss=nft"):
        persistent = [tuple(p.ds_shape) for p in params if getattr(p, "ds_persist", False)]
        if persistent:  # ZeRO-3 keeps these gathered: swapping the shard would not reach the forward
            raise ValueError(f"{what}: {len(persistent)} trainable parameters (e.g. {persistent[0]}) are below "
                             "zero_optimization.stage3_param_persistence_threshold; lower it below the LoRA sizes")
        super().__init__(params)



def refuse_sde_log_prob_keys(cfg: Config, loss: str) -> None:
    """For a loss that trains on clean latents: the keys that shape SDE log-prob training are an error."""
    if getattr(getattr(cfg.train, "ppo", None), "ratio_norm", False) or cfg.sample.sde_window is not None:
        raise ValueError(f"train.loss={loss} trains on clean latents: train.ppo.ratio_norm and sample.sde_window "
                         "apply to SDE log-prob losses only")


def check_drawn_levels(cfg: Config, loss: str, timestep_sampling: str) -> None:
    """For a loss that trains on noise levels of its own choosing (`train.<loss>.timestep_sampling`):
    `fixed` trains the schedule's sigmas at train.timesteps (at least one, each < sample.num_steps);
    any other sampling draws `train.<loss>.num_timesteps` levels, so train.timesteps is not its."""
    n = cfg.sample.num_steps
    if timestep_sampling == "fixed":
        steps = cfg.train_timesteps
        if not steps or any(j >= n for j in steps):
            raise ValueError(f"train.timesteps {steps}: train.{loss}.timestep_sampling=fixed trains these step "
                             f"indices; give at least one, each < sample.num_steps={n}")
    elif cfg.train.timesteps is not None:
        raise ValueError(f"train.timesteps: only with train.{loss}.timestep_sampling=fixed (with "
                         f"{timestep_sampling}, train.{loss}.num_timesteps levels are drawn)")
