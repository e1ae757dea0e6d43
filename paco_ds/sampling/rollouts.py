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
from dataclasses import replace
from functools import partial
from typing import Callable, Iterator, NamedTuple

import torch

import kernels
from paco_ds.recipe.schema import Config
from paco_ds.data import PromptItem, read_references
from paco_ds.runtime.engine import gathered_for_phase
from paco_ds.images import to_pil
from paco_ds.models.base import Condition, Policy
from paco_ds.models.compile import compiled_while_gathered
from paco_ds.sampling.prompt_cache import PromptCache
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import Trajectory, make_generator, ode_prefix, sample_trajectories
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
    so that log pi_old and training's log-prob come from the same kernel); `needs` (the loss's
    RolloutNeeds): what a training rollout keeps; `share_prefix`: ranks may run different numbers
    of forwards, so a group's prefix is walked once per rank where the recipe asks for it
    (sample.share_prefix with sample.same_latent). Each epoch samples with one SamplingSpec, built
    from the recipe at its first batch (`spec`); the trained steps are the recipe's
    (Config.train_timesteps) or its SDE window's."""

    def __init__(self, cfg: Config, policy: Policy, sde: Callable | None = None, *, module: torch.nn.Module | None = None,
                 gather_once: bool = False, needs=None, share_prefix: bool = False):
        self.cfg, self.policy = cfg, policy
        self.sde = sde if sde is not None else partial(kernels.sde_step, backend=cfg.kernels.backend)
        self._module = module
        self.gather_once = gather_once
        self.needs = needs
        self._spec: tuple[int, SamplingSpec] | None = None  # (epoch, its spec)
        # per prompt group of the epoch, its latents up to its first SDE step
        self.share_prefix = share_prefix and cfg.sample.share_prefix and cfg.sample.same_latent
        self._prefixes: dict[tuple, dict[int, torch.Tensor]] = {}
        self._prefix_epoch = None
        # sample.tree: the epoch's nodes on this rank
        self._tree = TreeCache(cfg.seed, cfg.sample.tree.branches) if cfg.sample.tree is not None else None
        self.transformer_calls = 0  # rows x steps sampled so far (the plan and the shared prefixes make it smaller)
        # each prompt's embeddings and encoded reference images, kept across epochs (prompt_cache.py)
        self.prompts = PromptCache(cfg.sample.prompt_cache_gib * 2 ** 30)

    def spec(self, epoch: int) -> SamplingSpec:
        """The epoch's training SamplingSpec: the recipe's, with the loss's SDE step and needs; a
        sliding SDE window's plan has its ODE stretches around where the window is this epoch."""
        if self._spec is None or self._spec[0] != epoch:
            win = self.cfg.sample.sde_window
            at = window_start(self.cfg, epoch) if win is not None and win.schedule == "sliding" else None
            self._spec = epoch, SamplingSpec.training(self.cfg, self.sde, self.needs, window_at=at)
        return self._spec[1]

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

    def encoded(self, picks: list[Pick], h: int, w: int, split: str) -> tuple:
        """(embeddings, condition) of the picks' prompts at h x w, from the prompt cache where an
        earlier batch encoded them; the text encoders come back to the device only to encode."""
        def encode(rows: list[int]):
            self.policy.park_text_encoders(False)
            items = [picks[r].item for r in rows]
            condition = self.condition(items, h, w)
            return self.policy.encode_prompts([it.prompt for it in items], condition), condition

        return self.prompts.encoded([(split, p.group, h, w) for p in picks], encode)

    def sample(self, module, picks: list[Pick], h: int, w: int, epoch: int) -> Trajectory:
        """One training rollout batch: the recipe's noise steps (or SDE window), log pi_old of the
        trained steps and what the loss needs; latents and noise keyed by (seed, epoch, position)."""
        cfg, seed = self.cfg, self.cfg.seed
        spec = self.spec(epoch)
        prompts = [p.item.prompt for p in picks]
        embeds, condition = self.encoded(picks, h, w, "train")
        batch = RolloutBatch(prompts=prompts, embeds=embeds, height=h, width=w,
                             condition=condition, metadata=[p.item.metadata for p in picks],
                             positions=[p.position for p in picks], group_ids=[p.group for p in picks])
        if self._tree is not None:
            traj, calls = sample_tree(self.policy, module, spec, batch, [p.member for p in picks], self._tree, epoch)
            self.transformer_calls += calls
            return traj
        latent_keys = [(p.group if cfg.sample.same_latent else f"p{p.position}") for p in picks]
        x0 = self.policy.initial_latents(len(picks), h, w,
                                         [make_generator(seed, "latent", epoch, k) for k in latent_keys])
        noise_steps, train_steps = rollout_steps(cfg, spec, epoch, batch.group_ids)
        batch = replace(batch, generators=[make_generator(seed, "noise", epoch, p.position) for p in picks],
                        initial_latents=x0, noise_steps=noise_steps, train_steps=train_steps)
        if self.share_prefix:
            batch = self._shared_prefix(module, spec, batch, epoch)
        self.transformer_calls += len(picks) * sum(1 for st in spec.plan if st.i >= batch.start)
        return sample_trajectories(self.policy, module, spec, batch)

    def _shared_prefix(self, module, spec: SamplingSpec, batch: RolloutBatch, epoch: int) -> RolloutBatch:
        """The batch with its latents at schedule index `start`, from there: with one initial latent
        per group, a group's samples are equal until its first SDE step, so those steps run once per
        group (for the first of its samples this rank samples) and every later sample of the group
        starts from the stored latents. `start` is the batch's earliest first SDE step (every step
        before it is an ODE step for the whole batch)."""
        if self._prefix_epoch != epoch:
            self._prefixes, self._prefix_epoch = {}, epoch
        n, noise_steps = spec.num_steps, batch.noise_steps
        per_sample = batch.per_sample_steps
        first = [min(noise_steps[r] if per_sample else noise_steps, default=n) if spec.noise_level > 0 else n
                 for r in range(len(batch))]
        start = min(first)
        if start == 0:
            return batch
        keys = [(g, batch.height, batch.width) for g in batch.group_ids]
        todo = {}  # group key -> the batch row that walks its prefix
        for r, key in enumerate(keys):
            if key not in self._prefixes:
                todo.setdefault(key, r)
        if todo:
            rows = list(todo.values())
            walked = ode_prefix(self.policy, module, spec, batch.select(rows), [first[r] for r in rows])
            self._prefixes.update(zip(todo, walked))
            self.transformer_calls += len(rows) * sum(1 for st in spec.plan if st.k <= max(first[r] for r in rows))
        x0 = batch.initial_latents
        x_start = torch.stack([self._prefixes[key][start] for key in keys]).to(x0.device, x0.dtype)
        return replace(batch, initial_latents=x_start, start=start)

    def sample_test(self, module, picks: list[Pick], h: int, w: int) -> Trajectory:
        """One evaluation batch: ODE steps (test.num_steps), noise from a generator per prompt
        index (the pick's group id), so an image does not depend on the rank that samples it."""
        cfg = self.cfg
        prompts = [p.item.prompt for p in picks]
        embeds, condition = self.encoded(picks, h, w, "test")
        batch = RolloutBatch(prompts=prompts, embeds=embeds, height=h, width=w,
                             condition=condition, metadata=[p.item.metadata for p in picks],
                             positions=[p.position for p in picks], group_ids=[p.group for p in picks],
                             generators=[make_generator(cfg.seed, "eval", p.group) for p in picks])
        return sample_trajectories(self.policy, module, SamplingSpec.evaluation(cfg, self.sde), batch)

    @staticmethod
    def references(traj: Trajectory):
        """The original reference images of an editing batch as PIL images, a tuple of them for a
        multi-image edit (None for text-to-image)."""
        if traj.condition is None:
            return None
        return [tuple(to_pil(i[None])[0] for i in im) if isinstance(im, tuple) else to_pil(im[None])[0]
                for im in traj.condition.images]
