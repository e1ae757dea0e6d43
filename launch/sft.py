"""PaCo-Reward SFT.

    deepspeed launch/sft.py --config configs/paco_reward_sft.yaml [--set k=v ...] [--resume latest]
    python launch/sft.py export --config configs/paco_reward_sft.yaml [--checkpoint latest|DIR] [--out DIR]

`export` merges a trained LoRA adapter (from a checkpoint of the recipe's run, or --adapter DIR)
into the base model and writes a directory the reward server loads (default <run>/merged).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paco_ds.errors import UserError, exit_on_user_error, run_entry_point  # noqa: E402
from paco_ds.recipe.loader import add_recipe_arguments  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", choices=["train", "export"], default="train")
    add_recipe_arguments(p)
    p.add_argument("--resume", default=None, help="train: 'latest' or a checkpoint directory")
    p.add_argument("--checkpoint", default=None, help="export: 'latest' (default) or a checkpoint directory")
    p.add_argument("--adapter", default=None, help="export: a peft adapter directory (instead of a checkpoint)")
    p.add_argument("--out", default=None, help="export: output directory (default <run>/merged)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    with exit_on_user_error("sft"):
        from paco_ds.sft.config import load_sft_config

        cfg = load_sft_config(args.config, args.overrides)
        if args.command == "train":
            if args.checkpoint or args.adapter or args.out:
                raise UserError("--checkpoint, --adapter and --out belong to 'export'")
            from paco_ds.sft.trainer import run

            run(cfg, resume=args.resume)
            return
        if args.resume:
            raise UserError("--resume belongs to training, not 'export'")
        from paco_ds.sft.export import merge_adapter, resolve_adapter

        out = Path(args.out) if args.out else cfg.run_dir / "merged"
        merge_adapter(cfg, resolve_adapter(cfg, args.checkpoint, args.adapter), out)
        print(f"merged model: {out}", flush=True)


if __name__ == "__main__":
    run_entry_point(main)  # exits without interpreter teardown (paco_ds/errors.py)
