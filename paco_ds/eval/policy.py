"""`launch/evaluate.py policy`: base against a trained LoRA on the recipe's test prompts, through
the in-training evaluation (`evaluate_test_prompts` in paco_ds/grpo/evaluation.py), so an image
and its scores are the ones training logged for the same prompt and seed. It builds the policy,
its rollouts and the test rewards only: no trainer, engine or optimizer.
"""
from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path

from paco_ds.grpo.evaluation import eval_grid, evaluate_test_prompts
from paco_ds.images import is_video, make_grid, make_video_grid, save_media

log = logging.getLogger(__name__)


def run_policy_eval(cfg, lora: str | None = None, checkpoint: str | None = None, out: str | None = None,
                    base: bool = True) -> dict | None:
    """Base and trained on the recipe's test prompts; a table on stdout and files in `out`."""
    from paco_ds.runtime.checkpoint import CheckpointManager
    from paco_ds.runtime.distributed import barrier, setup_distributed, shutdown_distributed
    from paco_ds.runtime.sequence import grouped
    from paco_ds.errors import ConfigError
    from paco_ds.serving.manager import started_for_run

    if not cfg.data.test_file:
        raise ConfigError("data.test_file: the recipe names no test prompts to evaluate")
    if lora is not None:
        from paco_ds.models.lora import check_lora_file

        check_lora_file(lora, "--lora")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist = grouped(setup_distributed(), cfg.parallel.sequence)  # parallel.sequence: groups sample together
    out_dir = Path(out) if out else cfg.run_dir / "eval"
    if checkpoint:  # its adapter (the EMA when the recipe keeps one), read from the checkpoint's files
        from paco_ds.grpo.export import export_from_checkpoint

        ckpt = CheckpointManager(cfg.run_dir / "checkpoints", cfg.checkpoint.keep_last, dist.rank, dist.world_size)
        path = ckpt.resolve(checkpoint, "--checkpoint")
        lora = str(out_dir / f"lora_{path.name}")
        if dist.is_main:
            export_from_checkpoint(cfg, path, Path(lora))
        barrier()
    if lora is not None:
        cfg.model.lora.path = str(lora)  # add_lora loads it, with its stored rank and alpha
    result = None
    with started_for_run(cfg.reward_servers, cfg.run_dir, dist.local_rank):
        policy, rollouts, items, rewards = _build(cfg, dist)
        try:
            columns = []
            if base:
                columns.append(("base", *evaluate_test_prompts(cfg, dist, rollouts, items, rewards, adapter=False)))
            if lora:
                columns.append(("trained", *evaluate_test_prompts(cfg, dist, rollouts, items, rewards)))
            if dist.is_main:
                result = _report(cfg, columns, out_dir, lora if checkpoint is None else checkpoint)
        finally:
            rewards.close()
    shutdown_distributed()
    return result


def _build(cfg, dist):
    """What the evaluation needs and nothing more: the policy with the LoRA (no engine, optimizer,
    loss or train rewards), its rollouts, the test prompts and the test reward set. Seeded as
    the trainer is, so a fresh LoRA starts from the same weights."""
    import random

    import numpy as np
    import torch

    from paco_ds.data import load_prompts
    from paco_ds.sampling.rollouts import Rollouts
    from paco_ds.models import build_policy, policy_class
    from paco_ds.models.attention import check_attention_backend, set_attention_backend
    from paco_ds.models.lora import add_lora
    from paco_ds.rewards.runner import RewardRunner
    from paco_ds.serving.manager import endpoints_for_run

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    from paco_ds.grpo.preflight import check_input_images, check_sequence_parallel
    from paco_ds.models.sequence import shard_sequence
    from paco_ds.runtime.sequence import sequence_mesh

    items = load_prompts(cfg.resolve_path(cfg.data.test_file), cfg.data.format, "data.test_file")
    if cfg.data.max_test_prompts:
        items = items[:cfg.data.max_test_prompts]
    check_input_images(cfg, items, "data.test_file")  # before any model loads
    check_sequence_parallel(cfg, [], items)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.model.allow_tf32
    check_attention_backend(cfg.model.attention_backend, policy_class(cfg.model.family), dist.device, cfg.model.dtype)
    policy = build_policy(cfg.model, dist.device)  # whole on each rank: inference holds no optimizer state
    add_lora(policy.transformer, cfg.model.lora)
    set_attention_backend(policy.transformer, cfg.model.attention_backend)
    mesh = sequence_mesh(dist)
    if mesh is not None:
        shard_sequence(policy, mesh)
    policy.transformer.requires_grad_(False).to(policy.dtype)  # the adapter in the model's dtype, as the engine holds it
    rewards = RewardRunner(cfg.rewards.eval, "rewards.test.terms" if cfg.rewards.test else "rewards.train.terms",
                           batches_in_flight=cfg.rewards.batches_in_flight, device=str(dist.device),
                           run_dir=cfg.run_dir, reward_endpoints=endpoints_for_run(cfg.reward_servers, cfg.run_dir))
    return policy, Rollouts(cfg, policy), items, rewards


def _report(cfg, columns: list, out_dir: Path, source) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    names = sorted({k.split("/")[1] for _, m, _ in columns for k in m if k.startswith("eval/") and k.endswith("/mean")})
    fmt = lambda v: "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"  # noqa: E731
    first = columns[0][1]
    head = (f"test prompts: {cfg.data.test_file} at "
            f"{int(first['eval/height'])}x{int(first['eval/width'])}, {cfg.test.num_steps} ODE steps"
            + (f"; trained: {source}" if source else ""))
    lines = [head, f"{'reward':<28}" + "".join(f"{c:>20}" for c, _, _ in columns) + (f"{'delta':>12}" if len(columns) == 2 else "")]
    table = {}
    for n in names:
        row = {c: (m[f"eval/{n}/mean"], m[f"eval/{n}/std"]) for c, m, _ in columns}
        table[n] = {c: {"mean": v[0], "std": v[1]} for c, v in row.items()}
        cells = "".join(f"{fmt(v[0]) + ' +- ' + fmt(v[1]):>20}" for v in row.values())
        delta = ""
        if len(columns) == 2:
            d = columns[1][1][f"eval/{n}/mean"] - columns[0][1][f"eval/{n}/mean"]
            table[n]["delta"] = d
            delta = f"{d:>+12.4f}"
        lines.append(f"{n:<28}{cells}{delta}")
    print("\n".join(lines), flush=True)
    (out_dir / "policy_eval.json").write_text(json.dumps({"source": source, "table": table, "metrics": {
        c: m for c, m, _ in columns}}, indent=2))
    with (out_dir / "policy_eval.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["reward", *[f"{c}_{s}" for c, _, _ in columns for s in ("mean", "std")]])
        for n in names:
            w.writerow([n, *[table[n][c][s] for c, _, _ in columns for s in ("mean", "std")]])
    for c, _, images in columns:
        if images:
            save_media(eval_grid(images), out_dir / c)  # a PNG, or an animated WebP of videos
    if len(columns) == 2 and columns[0][2]:
        # one row per prompt: [reference,] base, trained (videos: frame by frame)
        tiles = []
        for (_, ref, b), (_, _, t) in zip(columns[0][2], columns[1][2]):
            tiles += [*ref, b, t]
        grid = make_video_grid if is_video(tiles) else make_grid
        save_media(grid(tiles, ncols=len(columns[0][2][0][1]) + 2), out_dir / "base_vs_trained")
    print(f"results: {out_dir}/policy_eval.json, {out_dir}/policy_eval.csv; grids: {out_dir}/*.png "
          "(videos: *.webp)", flush=True)
    return {"table": table}
