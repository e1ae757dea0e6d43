"""The policy on its test prompts: the in-training evaluation, which `launch/evaluate.py policy`
(paco_ds/eval/policy.py) runs too.

`evaluate_test_prompts` samples every test prompt with ODE steps at the test resolution (an item's
own size wins), scores it with the test reward set (each batch while the next one samples) and
gathers the results from all ranks. Prompt i goes to data-parallel rank i % data_world (a sequence
group of parallel.sequence ranks samples it together, and its first rank scores it) and samples from
a generator seeded by (seed, "eval", i), so an image and its scores do not depend on how many
processes share the work.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
from tqdm.auto import tqdm

from paco_ds.runtime import stopping
from paco_ds.recipe.schema import Config
from paco_ds.data import PromptItem
from paco_ds.runtime.distributed import DistInfo, all_gather_object
from paco_ds.sampling.rollouts import Pick, Rollouts
from paco_ds.images import is_video, make_grid, make_video_grid, to_media
from paco_ds.rewards.runner import RewardRunner


def evaluate_test_prompts(cfg: Config, dist: DistInfo, rollouts: Rollouts, items: list[PromptItem],
                          rewards: RewardRunner, weights: contextlib.AbstractContextManager | None = None,
                          adapter: bool = True) -> tuple[dict, list]:
    """(metrics, shown): eval/<reward>/mean|std over the test prompts `items`, scored with the test
    reward set `rewards`, and the first `test.num_images` images as (prompt index, [reference] or
    [], image), on every rank. `weights`: swaps in the weights to evaluate (the trainer's EMA).
    With `adapter=False` the LoRA is off: the base model."""
    if not items:
        return {}, []
    t0 = time.perf_counter()
    mine = [(i, it) for i, it in enumerate(items) if i % dist.data_world == dist.data_rank]
    n_show = cfg.test.num_images
    scored, shown = [], []  # (prompt index, size) of each submitted sample, in submission order
    swapped = weights if weights is not None and adapter else contextlib.nullcontext()
    bar = tqdm(total=len(mine), desc="eval", unit="prompt", disable=not dist.is_main, leave=False)
    with swapped, _adapter(rollouts.policy.transformer, adapter), rollouts.module() as module:
        for start in range(0, len(mine), cfg.test.batch_size):
            # preempted: no more batches; the trainer's next check saves. Not under parallel.sequence: the
            # ranks of a group would see the request at different batches, and a forward's all-to-all
            # needs them all (the evaluation finishes first there)
            if dist.sequence == 1 and stopping.saving_requested():
                break
            chunk = mine[start:start + cfg.test.batch_size]
            for (h, w), picks in rollouts.by_size([Pick(it, i, i) for i, it in chunk], cfg.test.resolution):
                traj = rollouts.sample_test(module, picks, h, w)
                if not dist.scores:  # the group's first rank scores and shows these images
                    continue
                refs = rollouts.references(traj)
                # scored while the next batch samples, as in training; collected once below
                rewards.submit(traj.images, traj.prompts, traj.metadata, refs)
                for j, i in enumerate(p.group for p in picks):
                    scored.append((i, (h, w)))
                    if i < n_show:  # an edit is shown beside its reference(s)
                        ref = [] if not refs else list(refs[j]) if isinstance(refs[j], tuple) else [refs[j]]
                        shown.append((i, ref, to_media(traj.images[j][None])[0]))  # an image, or frames
            bar.update(len(chunk))
    bar.close()
    res = rewards.collect()
    records = [(i, {n: float(r.scores[k]) for n, r in res.items()}, size) for k, (i, size) in enumerate(scored)]
    everyone = sorted((r for rs in all_gather_object(records) for r in rs), key=lambda r: r[0])
    if not everyone:  # every rank was preempted before its first batch
        return {}, []
    metrics = {}
    for name in rewards.rewards:
        s = np.array([r[1][name] for r in everyone], dtype=np.float64)
        s = s[np.isfinite(s)]
        metrics[f"eval/{name}/mean"] = float(s.mean()) if s.size else float("nan")
        metrics[f"eval/{name}/std"] = float(s.std()) if s.size else float("nan")
    metrics["eval/height"], metrics["eval/width"] = map(float, everyone[0][2])
    metrics["time/eval"] = time.perf_counter() - t0
    images = sorted((x for xs in all_gather_object(shown) for x in xs), key=lambda x: x[0])
    return metrics, images


def eval_grid(images: list):
    """Test images in prompt order; an edit's reference(s) beside it, one row per edit (an edit with
    fewer input images than the most has blank tiles before its output). Videos: the frames of one
    animated grid."""
    from PIL import Image

    refs = max((len(ref) for _, ref, _ in images), default=0)
    outs = [out for _, _, out in images]
    if is_video(outs):  # videos: one animated grid, frame by frame
        return make_video_grid(outs)
    if not refs:
        return make_grid(outs)
    blank = Image.new("RGB", (1, 1), "white")
    tiles = [im for _, ref, out in images for im in (*ref, *[blank] * (refs - len(ref)), out)]
    return make_grid(tiles, ncols=refs + 1)


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
