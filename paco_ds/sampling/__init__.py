"""Sampling the policy. A rollout walks down the package, each module using only those below it:

  rollouts.py    `Rollouts`: the module sampling runs through, prompts grouped by size, one batch
  window.py      the SDE steps of a batch (fixed noise steps or a Flow-GRPO-Fast window)
  trajectory.py  the rollout loop with log-probs, `Trajectory` and the training batch made from it
  spec.py        what the loop takes: the epoch's `SamplingSpec` (from the recipe) and a `RolloutBatch`
  solver.py      the ODE stretches between SDE steps (Euler or AB2, fewer steps)
"""
