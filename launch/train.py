"""PaCo-GRPO training: `deepspeed launch/train.py --config configs/flux_t2is.yaml [--set k=v ...]`."""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paco_ds.errors import UserError, exit_on_user_error, run_entry_point  # noqa: E402
from paco_ds.recipe.loader import add_recipe_arguments  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    add_recipe_arguments(p)
    p.add_argument("--resume", default=None, help="'latest' or a checkpoint directory")
    p.add_argument("--allow-changed", action="append", default=[], metavar="KEY",
                   help="with --resume: resume although KEY (e.g. train.loss) differs from the checkpoint's recipe "
                        "(repeatable); other changed settings are printed")
    p.add_argument("--dry-run", action="store_true", help="validate the recipe and data, print the epoch plan, exit")
    p.add_argument("--world-size", type=int, default=None, help="with --dry-run: plan for this many processes")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="with --dry-run: also plan device memory and FLOPs per rank on GPUs of this many GiB, "
                        "from the real code path on fake CUDA tensors (docs/gpu_plan.md)")
    p.add_argument("--export-lora", default=None, metavar="CKPT",
                   help="export the LoRA of a checkpoint ('latest' or a directory) in diffusers format and exit")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    with exit_on_user_error("train"):
        from paco_ds.grpo.plan import load_config

        if args.world_size is not None and not args.dry_run:
            raise UserError("--world-size plans a --dry-run only; a run's world size is the launcher's "
                            "(deepspeed --num_gpus N)")
        if args.gpu_memory is not None and not args.dry_run:
            raise UserError("--gpu-memory plans a --dry-run only")
        if args.world_size is not None and args.world_size < 1:
            raise UserError(f"--world-size must be >= 1 (got {args.world_size})")
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            from paco_ds.grpo.async_rollouts import check_placement, trainer_world
            from paco_ds.grpo.plan import check_recipe, describe

            world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
            check_placement(cfg, world)  # rollout.mode: async: the last rollout.samplers processes sample
            print(describe(cfg, *check_recipe(cfg, trainer_world(cfg, world))))
            if args.gpu_memory is not None:
                from paco_ds.gpu_plan import print_plan

                print_plan(cfg, world, args.gpu_memory)
            if args.resume:  # the checkpoint a run would resume, verified as the run will
                from paco_ds.runtime.checkpoint import CheckpointManager

                from paco_ds.grpo.preflight import check_resume

                path = CheckpointManager(cfg.run_dir / "checkpoints", 1, 0, world).resolve(args.resume)
                changed = check_resume(cfg, path, tuple(args.allow_changed))
                print(f"resume from: {path}" + (f" (changed settings: {changed})" if changed else ""))
            return
        from paco_ds.grpo.run import run

        if args.allow_changed and not args.resume:
            raise UserError("--allow-changed goes with --resume")
        run(cfg, resume=args.resume, export_only=args.export_lora, allow_changed=tuple(args.allow_changed))


if __name__ == "__main__":
    run_entry_point(main)  # exits without interpreter teardown (paco_ds/errors.py)
