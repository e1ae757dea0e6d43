"""Runs over several nodes: `cluster` (a hostfile: judges placed or colocated, the trainers on the
remaining slots, and the guard that stops them all) and `slurm` (the same inside an sbatch job, with
requeue on preemption). The top floor: they plan with the GRPO recipe and start the entry points
(`launch/cluster.py`, `launch/slurm.py`)."""
