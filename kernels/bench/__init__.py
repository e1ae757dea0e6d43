"""Microbenchmarks of the fused ops: `python -m kernels.bench [--quick]` (see __main__.py; the
benchmark itself is run.py).

Results of the runs committed with the project are in kernels/bench/results/<device>.json and .png.
"""
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SDE_OPS = ("sde_fwd", "sde_fwd_bwd", "sde_sample", "kl_fwd_bwd")
OPS = SDE_OPS + ("grpo_advantages", "ppo_fwd_bwd")
