"""Multi-node GRPO from a DeepSpeed hostfile: judges placed and started over ssh, trainers on the
remaining slots, everything stopped on every host at the end.

    python launch/cluster.py --hostfile hostfile --config configs/flux_t2is.yaml [--set k=v ...] [--dry-run]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paco_ds.errors import exit_on_user_error  # noqa: E402
from paco_ds.recipe.loader import add_recipe_arguments  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hostfile", required=True, help="DeepSpeed hostfile: 'HOST slots=N' lines")
    add_recipe_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="validate, print every command for every host, exit")
    p.add_argument("--resume", default=None, help="'latest' or a checkpoint directory")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="with --dry-run: also plan device memory and FLOPs per trainer rank on GPUs of this many GiB")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    with exit_on_user_error("cluster"):
        from paco_ds.launchers.cluster import main as run

        code = run(args.hostfile, args.config, args.overrides, args.dry_run, args.resume, args.master_port,
                   gpu_memory=args.gpu_memory)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
