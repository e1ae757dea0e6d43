"""The rollout loop: ODE steps everywhere except the configured noise steps, which use the SDE.

It keeps only what training needs (the reference keeps all N+1 latents and re-encodes the prompt
in every training forward, PaCo-RL/PaCo-GRPO/scripts/train_flux.py): for each trained step j, x_j and
x_{j+1}, the sigmas, the cached text embeddings, and log pi_old recorded at sampling time. The
VAE decodes once, at the end. Noise comes from one generator per sample keyed by
(seed, epoch, position), so a sample does not depend on the world size or the batch it is in.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
import torch
from torch import nn

from paco_ds.models.base import Condition, Policy, TextEmbeds
from paco_ds.sampling.solver import Step, multistep_velocity
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec


def make_generator(*keys) -> torch.Generator:
    """A CPU generator seeded from a hash of the keys (e.g. seed, epoch, position)."""
    digest = hashlib.sha256(":".join(map(str, keys)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


@dataclass(frozen=True, kw_only=True)
class Trajectory:
    """A batch of same-size samples after rollout (tensors on CPU), complete when the sampler
    returns it. Every field holds one row or item per sample, except those marked `shared`:
    `gather_samples` stacks samples by these fields, so a new per-sample field is one line here."""

    prompts: list[str]
    metadata: list[dict]
    positions: list[int]  # global positions in the epoch plan
    group_ids: list[int]  # the prompt group (GRPO normalises within it)
    height: int = field(metadata={"shared": True})
    width: int = field(metadata={"shared": True})
    embeds: TextEmbeds
    images: torch.Tensor  # uint8 [B, 3, H, W]
    condition: Condition | None = None  # editing: the reference images and their latents
    steps: torch.Tensor | None = None  # [B, T] int64: the trained step indices j of each sample
    x_t: torch.Tensor | None = None  # [B, T, L, C]  x_j
    x_next: torch.Tensor | None = None  # [B, T, L, C]  x_{j+1}
    sigma: torch.Tensor | None = None  # [B, T]
    sigma_next: torch.Tensor | None = None  # [B, T]
    sigma_max: torch.Tensor | None = None  # [B]  sigma_1, the reference's guard for sigma == 1
    log_prob: torch.Tensor | None = None  # [B, T] fp32, log pi_old
    mean_old: torch.Tensor | None = None  # [B, T, L, C] fp32 transition mean at sampling (GRPO-Guard's bias)
    x_final: torch.Tensor | None = None  # [B, L, C] the clean latents (losses on the forward process)
    # [B, T] decoupled PPO's pi_prox / pi_behaviour, truncated, when log_prob holds log pi_prox instead of
    # the sampler's log-probs (a stale sample of rollout.mode: async, paco_ds/grpo/async_rollouts.py)
    behaviour_weight: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass(frozen=True, kw_only=True)
class TrainingBatch(Trajectory):
    """Samples stacked for one training micro-step, with each one's advantage (`training_batch`)."""

    advantages: torch.Tensor  # [B] fp32; [B, T] under tree rollouts: one per trained step (`step_advantages`)
    keep: torch.Tensor  # [B] bool: trained (False: the epoch drops it, or a zero-advantage filler)


@torch.no_grad()
def sample_trajectories(policy: Policy, module: nn.Module, spec: SamplingSpec, batch: RolloutBatch) -> Trajectory:
    """Run the sampler for one batch as `spec` says; with noise_level 0 and no train steps this is
    pure ODE (eval). The batch's `noise_steps` are its SDE steps, its `train_steps` those whose
    transitions and log-probs it keeps. The walk starts at the batch's `start` (a group's shared
    prefix already walked, see paco_ds/sampling/rollouts.py); each SDE step's noise is the sample's
    generator's next draw, or `noise_fn(r, i)` (a tree leaf's unshared path)."""
    b, height, width = len(batch), batch.height, batch.width
    num_steps, noise_level, sde_fn, sde_type = spec.num_steps, spec.noise_level, spec.sde_fn, spec.sde_type
    generators, noise_fn, train_steps = batch.generators, batch.noise_fn, batch.train_steps
    sigmas = policy.sigmas(num_steps, height, width)
    x = batch.initial_latents if batch.initial_latents is not None else \
        policy.initial_latents(b, height, width, generators)
    latent_dtype = x.dtype
    embeds_dev = batch.embeds.to(policy.device)
    cond_dev = batch.condition.to(policy.device) if batch.condition is not None else None
    per_sample = batch.per_sample_steps
    noisy = [set(n) for n in batch.noise_steps] if per_sample else [set(batch.noise_steps)] * b
    trained = [list(t) for t in train_steps] if per_sample and train_steps else [list(train_steps)] * b
    kept: list[list[tuple]] = [[] for _ in range(b)]  # per sample: (x_j, x_{j+1}, log pi, mean) of its trained steps
    plan = [st for st in spec.plan if st.i >= batch.start]
    if plan and plan[0].multistep:
        raise ValueError(f"a rollout cannot start at index {batch.start}, inside a multistep ODE stretch")
    single = {st.i for st in plan if st.k == st.i + 1}
    off_plan = sorted(set().union(*map(set, trained), *(noisy if noise_level > 0 else [])) - single)
    if off_plan:
        raise ValueError(f"steps {off_plan} are SDE or trained steps inside an ODE stretch walked in fewer steps")
    walk = OdeWalk(sigmas)

    def draw(r: int, i: int) -> torch.Tensor:
        return noise_fn(r, i) if noise_fn is not None else torch.randn(x.shape[1:], generator=generators[r])

    for st in plan:
        i = st.i
        s, s_next = sigmas[i].item(), sigmas[st.k].item()
        v = walk.velocity(st, policy.velocity(module, x, torch.full((b,), s), embeds_dev, height, width, spec.guidance,
                                              condition=cond_dev))
        rows = [r for r in range(b) if i in noisy[r]] if noise_level > 0 else []
        if len(rows) in (0, b):  # the whole batch takes the same kind of step
            level = noise_level if rows else 0.0
            noise = None
            if level > 0:
                noise = torch.stack([draw(r, i) for r in range(b)]).to(x.device)
            step = sde_fn(x, v, s, s_next, level, sigmas[1].item(), noise=noise, sde_type=sde_type)
            x_next = step.prev_sample.to(latent_dtype)
            lp = step.log_prob.float().cpu() if level > 0 else None
            mean = step.mean if level > 0 else None
            at = {r: r for r in range(b)}
        else:  # an ODE step for all, the SDE step for the samples whose window has step i
            ode = sde_fn(x, v, s, s_next, 0.0, sigmas[1].item(), sde_type=sde_type)
            noise = torch.stack([draw(r, i) for r in rows]).to(x.device)
            step = sde_fn(x[rows], v[rows], s, s_next, noise_level, sigmas[1].item(), noise=noise, sde_type=sde_type)
            x_next = ode.prev_sample.to(latent_dtype).clone()
            x_next[rows] = step.prev_sample.to(latent_dtype)
            lp, mean = step.log_prob.float().cpu(), step.mean
            at = {r: k for k, r in enumerate(rows)}
        for r in range(b):
            if i in trained[r]:
                if lp is None or r not in at:
                    raise ValueError(f"trained step {i} is not an SDE step for sample {r}")
                kept[r].append((x[r].cpu(), x_next[r].cpu(), lp[at[r]],
                                mean[at[r]].float().cpu() if spec.keep_mean else None))
        x = x_next
    images = policy.decode(x, height, width)
    positions = list(range(b)) if batch.positions is None else list(batch.positions)
    kept_steps = {}
    if train_steps:
        kept_steps = dict(
            steps=torch.tensor(trained, dtype=torch.int64).reshape(b, -1),
            x_t=torch.stack([torch.stack([k[0] for k in ks]) for ks in kept]),
            x_next=torch.stack([torch.stack([k[1] for k in ks]) for ks in kept]),
            log_prob=torch.stack([torch.stack([k[2] for k in ks]) for ks in kept]),
            mean_old=torch.stack([torch.stack([k[3] for k in ks]) for ks in kept]) if spec.keep_mean else None,
            sigma=torch.stack([sigmas[ts] for ts in trained]),
            sigma_next=torch.stack([sigmas[[j + 1 for j in ts]] for ts in trained]),
            sigma_max=sigmas[1].expand(b).clone())
    return Trajectory(prompts=list(batch.prompts),
                      metadata=list(batch.metadata) if batch.metadata is not None else [{} for _ in range(b)],
                      positions=positions,
                      group_ids=list(batch.group_ids) if batch.group_ids is not None else list(positions),
                      height=height, width=width, embeds=batch.embeds.to("cpu"), images=images,
                      condition=batch.condition.to("cpu") if batch.condition is not None else None,
                      x_final=x.cpu() if spec.keep_final else None, **kept_steps)


class OdeWalk:
    """The velocity each step of a plan takes: the model's, or for a multistep (ab2) step the
    Adams-Bashforth combination with the previous step's."""

    def __init__(self, sigmas: torch.Tensor):
        self.sigmas, self.prev = sigmas, None  # prev: (v, h) of the last step

    def velocity(self, st: Step, v: torch.Tensor) -> torch.Tensor:
        h = self.sigmas[st.k].item() - self.sigmas[st.i].item()
        out = multistep_velocity(v, *self.prev, h) if st.multistep else v
        self.prev = (v, h)
        return out


@torch.no_grad()
def ode_prefix(policy: Policy, module: nn.Module, spec: SamplingSpec, batch: RolloutBatch,
               ends: list[int]) -> list[dict[int, torch.Tensor]]:
    """The ODE steps of the spec's plan from the batch's initial latents (at index 0) for each sample r
    up to schedule index ends[r]: per sample, its latent (on CPU) at each index the plan reaches on
    the way, ends[r] included."""
    sigmas = policy.sigmas(spec.num_steps, batch.height, batch.width)
    embeds_dev = batch.embeds.to(policy.device)
    cond_dev = batch.condition.to(policy.device) if batch.condition is not None else None
    x = batch.initial_latents
    out = [{0: x[r].cpu()} for r in range(len(ends))]
    walk = OdeWalk(sigmas)
    for st in spec.plan:
        if st.k > max(ends):
            break
        v = walk.velocity(st, policy.velocity(module, x, torch.full((x.shape[0],), sigmas[st.i].item()), embeds_dev,
                                              batch.height, batch.width, spec.guidance, condition=cond_dev))
        x = spec.sde_fn(x, v, sigmas[st.i].item(), sigmas[st.k].item(), 0.0, sigmas[1].item(),
                        sde_type=spec.sde_type).prev_sample.to(x.dtype)
        for r, end in enumerate(ends):
            if st.k <= end:
                out[r][st.k] = x[r].cpu()
    return out


def transition_log_prob(policy: Policy, module: nn.Module, traj: Trajectory, t: int, idx, *, spec: SamplingSpec):
    """Recompute log pi(x_{j+1} | x_j) for trained step index t of samples `idx` through `module`,
    with the guidance and SDE of `spec` (those the trajectory was sampled with).

    Returns the SDEStep (log_prob, mean, std); with grad if the caller enables it.
    """
    x, velocity, step_args = _transition(policy, module, traj, t, idx, spec)
    return spec.sde_fn(x, velocity(), *step_args, prev_sample=traj.x_next[idx, t].to(policy.device),
                       sde_type=spec.sde_type)


def transition_log_prob_kl(policy: Policy, module: nn.Module, traj: Trajectory, t: int, idx, *, spec: SamplingSpec,
                           sde_kl_fn: Callable):
    """`transition_log_prob` and the KL surrogate to the reference policy (`module` with its adapter
    disabled) at the same x_j: (SDEStep without its mean, kl [B]). The reference's velocity runs
    without grad; `sde_kl_fn` (kernels.sde_step_kl) scores both in one pass, keeping neither mean."""
    x, velocity, step_args = _transition(policy, module, traj, t, idx, spec)
    v = velocity()
    with torch.no_grad(), policy.adapter_disabled(module):
        v_ref = velocity()
    return sde_kl_fn(x, v, v_ref, *step_args, prev_sample=traj.x_next[idx, t].to(policy.device),
                     sde_type=spec.sde_type)


def _transition(policy: Policy, module: nn.Module, traj: Trajectory, t: int, idx, spec: SamplingSpec):
    """x_j of trained step index t, the velocity call at it, and the SDE step's (sigma, sigma_next,
    noise level, sigma_max)."""
    dev = policy.device
    x = traj.x_t[idx, t].to(dev)
    cond = traj.condition.select(idx).to(dev) if traj.condition is not None else None
    embeds = traj.embeds.select(idx).to(dev)

    def velocity():
        return policy.velocity(module, x, traj.sigma[idx, t], embeds, traj.height, traj.width, spec.guidance,
                               condition=cond)

    return x, velocity, (traj.sigma[idx, t].to(dev), traj.sigma_next[idx, t].to(dev), spec.noise_level,
                         traj.sigma_max[idx].to(dev))


def gather_samples(entries: list[tuple[Trajectory, int]]) -> Trajectory:
    """Stack single samples (possibly from different rollout batches) into one batch of the same
    class, field by field. All samples must share the image size: a training micro-batch is one
    transformer call."""
    first = entries[0][0]
    if any((t.height, t.width) != (first.height, first.width) for t, _ in entries):
        raise ValueError("a training micro-batch mixes image sizes; use train.batch_size 1 for mixed-size data")
    return type(first)(**{f.name: _gather([getattr(t, f.name) for t, _ in entries], [i for _, i in entries])
                          if not f.metadata.get("shared") else getattr(first, f.name) for f in fields(first)})


def _gather(values: list, rows: list[int]):
    """Row `rows[k]` of `values[k]` for each k, stacked as the field's type stacks."""
    if values[0] is None:
        return None
    if isinstance(values[0], torch.Tensor):
        return torch.cat([v[[i]] for v, i in zip(values, rows)])
    if isinstance(values[0], list):
        return [v[i] for v, i in zip(values, rows)]
    return type(values[0]).cat([v.select([i]) for v, i in zip(values, rows)])  # TextEmbeds, Condition


def training_batch(entries: list[tuple[Trajectory, int]], advantages: torch.Tensor, keep: torch.Tensor) -> TrainingBatch:
    """The batch one training micro-step runs on: these samples stacked, with their advantages
    and whether each is trained."""
    batch = gather_samples(entries)
    return TrainingBatch(**{f.name: getattr(batch, f.name) for f in fields(batch)},
                         advantages=torch.as_tensor(advantages, dtype=torch.float32),
                         keep=torch.as_tensor(keep, dtype=torch.bool))


def step_advantages(batch: TrainingBatch, t: int) -> torch.Tensor:
    """[B]: the advantages of the batch's t-th trained step (the sample's own, or under tree rollouts
    its step's node's)."""
    return batch.advantages[:, t] if batch.advantages.dim() == 2 else batch.advantages
