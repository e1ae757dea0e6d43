"""Time of the trainer's whole GRPO advantage step of one epoch, `StatTracker.compute` of
paco_ds/grpo/advantages.py, from the gathered host arrays to host arrays.

    OMP_NUM_THREADS=1 python benchmarks/advantage_step.py [--quick] [--device cuda]

An epoch of m prompts x k images with 3 rewards (weights 0.2, 1, 1, as the t2is recipe's), for
k x m in 8 x 8, 16 x 42, 24 x 48 and 16 x 512, with two settings: the log-tame aggregation with
the global std, and the weighted sum with per-group std. The step runs its normalisation through
`kernels.grpo_advantages` with the torch backend ("torch") and, on CUDA, in Triton ("triton");
the backends alternate within each round (kernels.bench's timer), and the median is reported.
The kernel alone is `python -m kernels.bench --ops grpo_advantages`.

Prints a table and writes benchmarks/results/advantage_step_<device>.json (or under --out).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, device_slug, machine, write_report  # noqa: E402

GROUPS = ((8, 8), (16, 42), (24, 48), (16, 512))  # (images per prompt k, prompts m)
SETTINGS = (("log_tame", True), ("weighted_sum", False))  # (aggregation, global std)
WEIGHTS = {"a": 0.2, "b": 1.0, "c": 1.0}


def case(k: int, m: int, fn: str, global_std: bool, device, triton: bool) -> dict:
    """{backend: the advantage step of an epoch of m prompts x k images}, on host arrays."""
    import numpy as np

    from paco_ds.recipe.schema import AdvantageConfig, AggregationConfig
    from paco_ds.grpo.advantages import StatTracker

    n = k * m
    rng = np.random.default_rng(0)
    rewards = {key: rng.random(n) for key in WEIGHTS}
    ids = np.repeat(rng.choice(100_000, m, replace=False), k)[rng.permutation(n)]
    cfg = (AdvantageConfig(global_std=global_std), AggregationConfig(fn=fn))
    trackers = {"torch": StatTracker(*cfg, WEIGHTS, backend="torch")}
    if triton:
        trackers["triton"] = StatTracker(*cfg, WEIGHTS, backend="triton")
    return {name: (lambda t=tracker: t.compute(rewards, ids, device=device)) for name, tracker in trackers.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="16 x 42 and the log-tame setting only, 2 rounds")
    p.add_argument("--device", default=None, help="cuda where available, else cpu")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    import torch

    import kernels
    from kernels.bench.run import Timer, side_by_side

    started = machine()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    triton = device.type == "cuda" and "triton" in kernels.available_backends(device)
    groups, settings = (GROUPS[1:2], SETTINGS[:1]) if args.quick else (GROUPS, SETTINGS)
    rounds = 2 if args.quick else 3
    timer = Timer(device, min_time=0.05, min_reps=3, max_reps=200)
    t0 = time.perf_counter()
    rows = []
    for k, m in groups:
        for fn, global_std in settings:
            times = side_by_side(timer, case(k, m, fn, global_std, device, triton), rounds)
            for backend, t in times.items():
                rows.append({"group_size": k, "groups": m, "samples": k * m, "aggregation": fn,
                             "global_std": global_std, "backend": backend, "median_ms": t * 1e3,
                             "speedup_vs_torch": times["torch"] / t})
    print(f"{'k x m':<9} {'aggregation':<13} {'std':<7} {'backend':<8} {'median ms':>10} {'vs torch':>9}")
    for r in rows:
        print(f"{str(r['group_size']) + 'x' + str(r['groups']):<9} {r['aggregation']:<13} "
              f"{'global' if r['global_std'] else 'group':<7} {r['backend']:<8} {r['median_ms']:>10.3f} "
              f"{r['speedup_vs_torch']:>8.1f}x")
    info = {"device": str(device), "rewards": list(WEIGHTS), "weights": WEIGHTS, "rounds": rounds,
            "method": "StatTracker.compute from host arrays to host arrays; median per backend, the backends "
                      "alternating within each round (kernels.bench.run.side_by_side)",
            "seconds": round(time.perf_counter() - t0, 1), "results": rows}
    print(f"wrote {write_report(f'advantage_step_{device_slug(device)}', info, args.out, started)}")


if __name__ == "__main__":
    main()
