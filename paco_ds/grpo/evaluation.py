"""The policy on its test prompts: the in-training evaluation, which `launch/evaluate.py policy`
(paco_ds/eval/policy.py) runs too.

`evaluate_test_prompts` samples every test prompt with ODE steps at the test resolution (an item's
own size wins), scores it with the test reward set (each batch while the next one samples) and
gathers the results from all ranks. Prompt i goes to rank i % world_size and samples from a
generator seeded by (seed, "eval", i), so an image and its scores do not depend on how many
processes share the work.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np

from paco_ds.distributed import all_gather_object
from paco_ds.images import make_grid, to_pil
from paco_ds.sampling.rollout import make_generator, sample_trajectories


def evaluate_test_prompts(trainer, adapter: bool = True) -> tuple[dict, list]:
    """(metrics, shown): eval/<reward>/mean|std over the test prompts, and the first
    `test.num_images` images as (prompt index, [reference] or [], image), on every rank.
    With `adapter=False` the LoRA is off: the base model."""
    cfg, dist = trainer.cfg, trainer.dist
    if not trainer.test_items:
        return {}, []
    t0 = time.perf_counter()
    mine = [(i, it) for i, it in enumerate(trainer.test_items) if i % dist.world_size == dist.rank]
    n_show = cfg.test.num_images
    scored, shown = [], []  # (prompt index, size) of each submitted sample, in submission order
    ema = trainer.ema.swapped_in() if trainer.ema is not None and adapter else contextlib.nullcontext()
    with ema, _adapter(trainer.policy.transformer, adapter), trainer.rollout_module() as module:
        for start in range(0, len(mine), cfg.test.batch_size):
            chunk = mine[start:start + cfg.test.batch_size]
            for (h, w), picks in trainer._by_size([(it, i, i) for i, it in chunk], cfg.test.resolution):
                prompts = [it.prompt for it, _, _ in picks]
                gens = [make_generator(cfg.seed, "eval", i) for _, i, _ in picks]  # by prompt, not by rank
                condition = trainer._condition([it for it, _, _ in picks], h, w)
                embeds = trainer.policy.encode_prompts(prompts, condition)
                traj = sample_trajectories(trainer.policy, module, prompts, embeds, h, w, num_steps=cfg.test.num_steps,
                                           guidance=cfg.sample.guidance_scale, noise_level=0.0, noise_steps=[],
                                           train_steps=[], generators=gens, sde_fn=trainer.sde, condition=condition)
                refs = [to_pil(im[None])[0] for im in traj.condition.images] if traj.condition is not None else None
                # scored while the next batch samples, as in training; collected once below
                trainer.eval_rewards.submit(traj.images, prompts, [it.metadata for it, _, _ in picks], refs)
                for j, (_, i, _) in enumerate(picks):
                    scored.append((i, (h, w)))
                    if i < n_show:  # an edit is shown beside its reference
                        shown.append((i, [refs[j]] if refs else [], to_pil(traj.images[j][None])[0]))
    res = trainer.eval_rewards.collect()
    records = [(i, {n: float(r.scores[k]) for n, r in res.items()}, size) for k, (i, size) in enumerate(scored)]
    everyone = sorted((r for rs in all_gather_object(records) for r in rs), key=lambda r: r[0])
    metrics = {}
    for name in trainer.eval_rewards.rewards:
        s = np.array([r[1][name] for r in everyone], dtype=np.float64)
        s = s[np.isfinite(s)]
        metrics[f"eval/{name}/mean"] = float(s.mean()) if s.size else float("nan")
        metrics[f"eval/{name}/std"] = float(s.std()) if s.size else float("nan")
    metrics["eval/height"], metrics["eval/width"] = map(float, everyone[0][2])
    metrics["time/eval"] = time.perf_counter() - t0
    images = sorted((x for xs in all_gather_object(shown) for x in xs), key=lambda x: x[0])
    return metrics, images


def eval_grid(images: list):
    """Test images in prompt order; an edit's reference beside it."""
    pairs = any(ref for _, ref, _ in images)
    tiles = [im for _, ref, out in images for im in (*ref, out)]
    return make_grid(tiles, ncols=2 if pairs else None)


@contextlib.contextmanager
def _adapter(transformer, on: bool):
    if on:
        yield
        return
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()
