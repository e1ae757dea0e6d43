"""A GRPO run from a loaded recipe (`launch/train.py`): the stop handling, the process group, the
checks before anything starts, the run directory's lock and the reward servers around the trainer;
or, with `--export-lora`, a checkpoint's adapter alone."""
from __future__ import annotations

import logging
from pathlib import Path

from paco_ds.runtime import startup, stopping
from paco_ds.runtime.checkpoint import CheckpointManager
from paco_ds.recipe.schema import Config
from paco_ds.runtime.distributed import setup_distributed, shutdown_distributed
from paco_ds.grpo.trainer import GRPOTrainer
from paco_ds.serving.manager import started_for_run


def run(cfg: Config, resume: str | Path | None = None, export_only: str | Path | None = None,
        allow_changed: tuple[str, ...] = ()) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if export_only:  # one process, from the checkpoint files: no model, no process group, no judge
        _export_only(cfg, export_only)
        return
    startup.mark("imports")
    # First: a stop (a signal, or the launcher's end) must reach a rank however far it got.
    stopping.install(cfg.checkpoint.save_on_sigterm, cfg.checkpoint.sigterm_grace_s)
    if cfg.rollout.mode == "async" and _async_sampler(cfg):  # the launch's last ranks sample, in no process group
        return
    dist = setup_distributed()
    startup.mark("process_group")
    logging.getLogger("paco_ds").setLevel(logging.INFO if dist.is_main else logging.WARNING)
    # Before anything starts or is written (paco_ds/grpo/preflight.py): the recipe and its data,
    # the checkpoint to resume (verified), then the run directory's lock, held for the whole run.
    from paco_ds.grpo.plan import check_recipe
    from paco_ds.runtime.runlock import fit_in_run_dir

    check_recipe(cfg, dist.world_size)
    check_device_choices(cfg, dist.device)
    ckpt = CheckpointManager(cfg.run_dir / "checkpoints", cfg.checkpoint.keep_last, dist.rank, dist.world_size)
    if resume:
        from paco_ds.grpo.preflight import check_resume

        resume = ckpt.resolve(resume, "--resume")
        changed = check_resume(cfg, resume, allow_changed)  # before a model, a judge or the engine exists
        if changed and dist.is_main:
            print(f"resuming {resume} with changed settings: {changed}", flush=True)
    startup.mark("checks")
    # The recipe's reward servers: started by local rank 0 of each node while the ranks build their
    # models, awaited by every rank before the rewards are built, stopped when the run ends.
    colocate = cfg.cluster is not None and cfg.cluster.colocate  # the judges must be able to sleep
    servers = started_for_run(cfg.reward_servers, cfg.run_dir, dist.local_rank, sleep_mode=colocate, background=True)
    fit_in_run_dir(cfg.run_dir, dist.is_main, lambda: GRPOTrainer(cfg, dist, servers.ready), resume, servers)
    shutdown_distributed()


def _async_sampler(cfg: Config) -> bool:
    """rollout.mode: async (paco_ds/grpo/async_rollouts.py): a sampler rank runs its sampler here (True);
    a trainer rank's world becomes the trainers' alone, whose ZeRO-3 the samplers never join."""
    import os

    from paco_ds.grpo.async_rollouts import check_placement, role_of

    role = role_of(cfg, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    check_placement(cfg, role.launch_world)
    if role.is_sampler:
        from paco_ds.grpo.sampler import run_sampler

        run_sampler(cfg, role)
        return True
    os.environ["WORLD_SIZE"] = str(role.trainers)
    return False


def check_device_choices(cfg: Config, device) -> None:
    """What only the training processes can check, knowing their device (`--dry-run` may run on a
    machine without the GPUs): that the attention backend runs there."""
    from paco_ds.models import policy_class
    from paco_ds.models.attention import check_attention_backend

    check_attention_backend(cfg.model.attention_backend, policy_class(cfg.model.family), device, cfg.model.dtype)


def _export_only(cfg: Config, spec: str | Path) -> None:
    """`--export-lora`: on global rank 0 only (any world size, or plain python), the verified
    checkpoint's adapter into <run>/lora, holding the run directory's lock while it writes."""
    import os

    from paco_ds.grpo.export import export_from_checkpoint
    from paco_ds.runtime.runlock import RunLock

    if int(os.environ.get("RANK", "0")) != 0:
        return
    ckpt = CheckpointManager(cfg.run_dir / "checkpoints", cfg.checkpoint.keep_last, 0, 1)
    path = ckpt.resolve(str(spec), "--export-lora")
    with RunLock(cfg.run_dir):
        export_from_checkpoint(cfg, path, cfg.run_dir / "lora")
