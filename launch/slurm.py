"""Multi-node GRPO inside a Slurm allocation: the job's nodes and their GPUs (or, on CPU nodes, its
tasks per node) become the hosts, then the judges and trainers are placed and run as
launch/cluster.py runs a hostfile. Run by an sbatch script (configs/slurm/flux_t2is.sbatch); a
requeued job resumes from the run directory's latest checkpoint by itself.

    python launch/slurm.py --config configs/flux_t2is.yaml [--set k=v ...] [--slots-per-node N] [--dry-run]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paco_ds.errors import exit_on_user_error  # noqa: E402
from paco_ds.recipe.loader import add_recipe_arguments  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_arguments(p)
    p.add_argument("--slots-per-node", type=int, default=None, metavar="N",
                   help="trainer slots per node (default: the job's GPUs per node, else SLURM_NTASKS_PER_NODE)")
    p.add_argument("--dry-run", action="store_true", help="validate, print every command for every host, exit")
    p.add_argument("--master-port", type=int, default=29500)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    with exit_on_user_error("slurm"):
        from paco_ds.launchers.slurm import main as run

        code = run(args.config, args.overrides, args.slots_per_node, args.dry_run, args.master_port)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
