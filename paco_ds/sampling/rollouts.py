"""Sampling the policy, for training and for evaluation: the module sampling runs through, one
rollout batch, an editing batch's condition, the grouping of prompts by image size, and the
reference images rewards compare edits against.

The trainer (paco_ds/grpo/trainer.py) samples its epochs with it; the evaluation
(paco_ds/grpo/evaluation.py) samples the test prompts with it, also outside a training run
(`launch/evaluate.py policy`, with no engine and no optimizer). Each gives it only what it needs:
the evaluation no optimizer, loss or trained steps.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable, Iterator, NamedTuple, Sequence

import torch

import kernels
from paco_ds.recipe.schema import Config
from paco_ds.data import PromptItem, read_references
from paco_ds.runtime.engine import gathered_for_phase
from paco_ds.images import to_pil
from paco_ds.models.base import Condition, Policy
from paco_ds.models.compile import compiled_while_gathered
from paco_ds.sampling.trajectory import Trajectory, make_generator, ode_prefix, sample_trajectories
from paco_ds.sampling.solver import plan_for
from paco_ds.sampling.tree import TreeCache, sample_tree
from paco_ds.sampling.window import rollout_steps, window_start

class Pick(NamedTuple):
    """One sample to draw: its prompt, its GRPO group (the prompt's index; the seed of an
    evaluation image), its position in the epoch (the seed of its noise) and its index among its
    group's samples (its leaf, under tree rollouts)."""

    item: PromptItem
    group: int
    position: int
    member: int = 0


class Rollouts:
    """`module`: what sampling calls (the DeepSpeed engine in training; default the transformer);
    `gather_once`: a ZeRO-3 transformer's parameters are gathered once for a whole sampling phase
    (deepspeed.rollout_gather=once) instead of per denoising step; `sde`: the SDE step (the loss's,
    so that log pi_old and training's log-prob come from the same kernel); `train_timesteps` and
    `needs` (the loss's RolloutNeeds): what a training rollout keeps."""

    def __init__(self, cfg: Config, policy: Policy, sde: Callable | None = None, *, module: torch.nn.Module | None = None,
                 gather_once: bool = False, train_timesteps: Sequence[int] = (), needs=None, share_prefix: bool = False):
        self.cfg, self.policy = cfg, policy
        self.sde = sde if sde is not None else partial(kernels.sde_step, backend=cfg.kernels.backend)
        self._module = module
        self.gather_once = gather_once
        self.train_timesteps = list(train_timesteps)
        self.needs = needs
        self.plan, self._plan_epoch = plan_for(cfg), None  # a sliding SDE window re-plans each epoch (sample)
        # sample.share_prefix with same_latent: per prompt group of the epoch, its latents up to its first SDE step
        self.share_prefix = share_prefix and cfg.sample.same_latent
        self._prefixes: dict[tuple, dict[int, torch.Tensor]] = {}
        self._prefix_epoch = None
        self._tree = TreeCache()  # sample.tree: the epoch's nodes on this rank
        self.transformer_calls = 0  # rows x steps sampled so far (the plan and the shared prefixes make it smaller)

    @contextlib.contextmanager
    def module(self) -> Iterator[torch.nn.Module]:
        """The transformer for a sampling phase, in eval mode."""
        transformer = self.policy.transformer
        was_training = transformer.training
        transformer.eval()
        try:
            if self.gather_once:  # ZeRO-3: whole parameters, no DeepSpeed hooks, the compiled blocks if any
                with gathered_for_phase(transformer), compiled_while_gathered(transformer):
                    yield transformer
            else:
                yield self._module if self._module is not None else transformer
        finally:
            transformer.train(was_training)

    def by_size(self, picks: list[Pick], resolution: int) -> list[tuple[tuple[int, int], list[Pick]]]:
        """Split (item, group id, position) picks into runs of the same image size, keeping order.
        An item's own height/width win; an edit's size keeps its reference's aspect ratio (the last
        input image's, for several: as diffusers' QwenImageEditPlusPipeline sizes its output)."""
        groups: dict[tuple[int, int], list] = {}
        for p in picks:
            item = p.item
            if item.height or item.width or item.image is None:
                size = item.size(resolution)
            else:
                size = self.policy.target_size(*read_references(item)[-1].shape[1:], resolution)
            groups.setdefault(size, []).append(p)
        return list(groups.items())

    def condition(self, items: list[PromptItem], h: int, w: int) -> Condition | None:
        """An editing batch's reference images, encoded once for the whole rollout and training: one
        tensor per sample, or a tuple of them for a multi-image edit."""
        if items[0].image is None:
            return None
        per_item = [read_references(it) for it in items]
        return self.policy.encode_condition([refs[0] if len(refs) == 1 else tuple(refs) for refs in per_item], h, w)

    def sample(self, module, picks: list[Pick], h: int, w: int, epoch: int) -> Trajectory:
        """One training rollout batch: the recipe's noise steps (or SDE window), log pi_old of the
        trained steps and what the loss needs; latents and noise keyed by (seed, epoch, position)."""
        cfg, seed = self.cfg, self.cfg.seed
        win = cfg.sample.sde_window
        if win is not None and win.schedule == "sliding" and self._plan_epoch != epoch:
            # every rollout of the epoch has its window at one place: the ODE stretches are around it
            self.plan, self._plan_epoch = plan_for(cfg, window_start(cfg, epoch)), epoch
        prompts = [p.item.prompt for p in picks]
        condition = self.condition([p.item for p in picks], h, w)
        embeds = self.policy.encode_prompts(prompts, condition)
        if cfg.sample.tree is not None:
            traj, calls = sample_tree(self.policy, module, picks, embeds, h, w, cfg=cfg, epoch=epoch, sde_fn=self.sde,
                                      nodes=self._tree.for_epoch(epoch), condition=condition,
                                      keep_mean=self.needs.mean_old, keep_final=self.needs.clean_latents)
            self.transformer_calls += calls
            return traj
        latent_keys = [(p.group if cfg.sample.same_latent else f"p{p.position}") for p in picks]
        x0 = self.policy.initial_latents(len(picks), h, w,
                                         [make_generator(seed, "latent", epoch, k) for k in latent_keys])
        noise_steps, train_steps = rollout_steps(cfg, epoch, [p.group for p in picks], self.train_timesteps)
        start = 0
        if self.share_prefix:
            x0, start = self._shared_prefix(module, picks, h, w, epoch, x0, embeds, condition, noise_steps)
        self.transformer_calls += len(picks) * sum(1 for st in self.plan if st.i >= start)
        return sample_trajectories(
            self.policy, module, prompts, embeds, h, w, condition=condition,
            num_steps=cfg.sample.num_steps, guidance=cfg.sample.guidance_scale, noise_level=cfg.sample.noise_level,
            noise_steps=noise_steps, train_steps=train_steps if self.needs.log_probs else [],
            generators=[make_generator(seed, "noise", epoch, p.position) for p in picks], initial_latents=x0,
            sde_type=cfg.sample.sde_type, sde_fn=self.sde, keep_final=self.needs.clean_latents,
            keep_mean=self.needs.mean_old, metadata=[p.item.metadata for p in picks],
            positions=[p.position for p in picks], group_ids=[p.group for p in picks], plan=self.plan, start=start)

    def _shared_prefix(self, module, picks: list[Pick], h: int, w: int, epoch: int, x0: torch.Tensor, embeds,
                       condition, noise_steps) -> tuple[torch.Tensor, int]:
        """(the batch's latents at schedule index `start`, start): with one initial latent per group,
        a group's samples are equal until its first SDE step, so those steps run once per group (for
        the first of its samples this rank samples) and every later sample of the group starts from
        the stored latents. `start` is the batch's earliest first SDE step (every step before it is an
        ODE step for the whole batch)."""
        cfg = self.cfg
        if self._prefix_epoch != epoch:
            self._prefixes, self._prefix_epoch = {}, epoch
        n = cfg.sample.num_steps
        per_sample = bool(noise_steps) and isinstance(noise_steps[0], (list, tuple))
        first = [min(noise_steps[r] if per_sample else noise_steps, default=n) if cfg.sample.noise_level > 0 else n
                 for r in range(len(picks))]
        start = min(first)
        if start == 0:
            return x0, 0
        keys = [(p.group, h, w) for p in picks]
        todo = {}  # group key -> the batch row that walks its prefix
        for r, key in enumerate(keys):
            if key not in self._prefixes:
                todo.setdefault(key, r)
        if todo:
            rows = list(todo.values())
            walked = ode_prefix(self.policy, module, x0[rows], embeds.select(rows), h, w, num_steps=n, plan=self.plan,
                                ends=[first[r] for r in rows], guidance=cfg.sample.guidance_scale, sde_fn=self.sde,
                                sde_type=cfg.sample.sde_type,
                                condition=condition.select(rows) if condition is not None else None)
            self._prefixes.update(zip(todo, walked))
            self.transformer_calls += len(rows) * sum(1 for st in self.plan if st.k <= max(first[r] for r in rows))
        return torch.stack([self._prefixes[key][start] for key in keys]).to(x0.device, x0.dtype), start

    def sample_test(self, module, picks: list[Pick], h: int, w: int) -> Trajectory:
        """One evaluation batch: ODE steps (test.num_steps), noise from a generator per prompt
        index (the pick's group id), so an image does not depend on the rank that samples it."""
        cfg = self.cfg
        prompts = [p.item.prompt for p in picks]
        condition = self.condition([p.item for p in picks], h, w)
        return sample_trajectories(
            self.policy, module, prompts, self.policy.encode_prompts(prompts, condition), h, w,
            num_steps=cfg.test.num_steps, guidance=cfg.sample.guidance_scale, noise_level=0.0, noise_steps=[],
            train_steps=[], generators=[make_generator(cfg.seed, "eval", p.group) for p in picks], sde_fn=self.sde,
            condition=condition, metadata=[p.item.metadata for p in picks],
            positions=[p.position for p in picks], group_ids=[p.group for p in picks])

    @staticmethod
    def references(traj: Trajectory):
        """The original reference images of an editing batch as PIL images, a tuple of them for a
        multi-image edit (None for text-to-image)."""
        if traj.condition is None:
            return None
        return [tuple(to_pil(i[None])[0] for i in im) if isinstance(im, tuple) else to_pil(im[None])[0]
                for im in traj.condition.images]
