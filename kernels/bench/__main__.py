"""python -m kernels.bench: time the fused ops against eager torch and torch.compile.

For each op and shape, every backend available on this machine runs side by side (rounds
interleave the backends, so drifts of a noisy machine hit them alike), and the table gives the
median time, the achieved bandwidth (the bytes the op must move at least, divided by the median
time), that bandwidth as a percent of the copy bandwidth measured here with a large device copy,
and the speed-up over eager torch. Working sets that fit in the CPU caches can beat the copy
bandwidth (over 100%); the bandwidth-vs-size plot shows where that happens.

The backend column names what was asked for; where another backend actually runs the op
(`kernels.active_backend`: e.g. "cpp" has no kernel for the PPO loss), the row reads
"cpp->torch" and its "runs" field says so: a fallback is never reported as a fused kernel.

"grpo_advantages" times `kernels.grpo_advantages` on one epoch's rewards (3 rewards, fp64 on the
device) in torch and, on CUDA, in Triton. kernels/ imports nothing from paco_ds: the trainer's
whole advantage step around that op is timed by benchmarks/advantage_step.py.

Writes kernels/bench/results/<device>.json and <device>.png (or under --out).

The command line is parsed before anything imports torch, so `--help` and a bad argument answer at
once; the benchmark (run.py) is imported after.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kernels.bench import OPS, RESULTS


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="512 px only, batch 1 and 4, no torch.compile (~1 min)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile baseline")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="latent dtype (default bf16)")
    ap.add_argument("--device", default=None, help="cuda where available, else cpu")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for <device>.json and <device>.png")
    ap.add_argument("--aot", action="store_true", help="only print the registers, spills, shared memory and "
                    "occupancy of every Triton kernel compiled for sm_90 and sm_80 "
                    "(kernels/bench/results/aot_sm*.json, "
                    "written by `python -m kernels.aot`) and exit")
    args = ap.parse_args(argv)
    unknown = set(o for o in args.ops.split(",") if o) - set(OPS)
    if unknown:
        ap.error(f"unknown ops {sorted(unknown)} (choose from {', '.join(OPS)})")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    from kernels.bench import run

    if args.aot:
        run.print_aot_table()
        return 0
    return run.run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
