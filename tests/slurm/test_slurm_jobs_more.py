"""A Slurm job beyond `make test-slurm`'s (CI's): the time limit's warning (SIGUSR1 to the batch shell) saves
every rank and the launcher requeues the job itself; its next start is cancelled and nothing of it is left
30 s after `scancel`. `make test-slurm-more` (root; outside CI's time: a job of about 100 s); run it for a
change to launch/slurm.py's signals, the requeue, or the template's `--signal`. The cluster and helpers are
tests/slurm/test_slurm_jobs.py's."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.cluster.test_two_nodes import assert_nothing_left, node_pids
from tests.slurm.test_slurm_jobs import _up, daemons, finished, running_ranks, slurm, submit, wait_until

pytestmark = [pytest.mark.slurm_more,
              pytest.mark.skipif(os.environ.get("PACO_TEST_SLURM") != "1", reason="make test-slurm-more runs these"),
              pytest.mark.skipif(not _up(), reason="test Slurm cluster not up: make slurm-test-setup")]


def test_the_time_limit_warning_requeues_then_scancel_leaves_nothing_within_30s(tmp_path):
    """SIGUSR1 to the batch shell, as `--signal=B:USR1@N` sends it before the time limit: every rank
    saves, the launcher requeues the job itself. Its next start is cancelled: nothing of it may be
    left on either node 30 s after `scancel`."""
    job_id = submit(tmp_path, "cancelled", "train.num_epochs=20")
    run, out = tmp_path / "cancelled", tmp_path / "cancelled.out"
    try:
        wait_until(lambda: (run / "checkpoints" / "epoch_0000").is_dir(), "checkpoint epoch_0000", job_id)
        assert all(running_ranks().values()), running_ranks()
        slurm("scancel", "--signal=USR1", "--batch", job_id)
        # Training again (the resumed trainer clears the preemption marker): a stop before the first
        # safe point would wait for it, up to checkpoint.sigterm_grace_s.
        wait_until(lambda: ", restart 1:" in out.read_text() and not (run / "PREEMPTED").exists(),
                   "the requeued job training again", job_id)
        assert all(running_ranks().values()), running_ranks()
        first = out.read_text().split(", restart 1:", 1)[0]
        assert "[cluster] SIGUSR1 to the launcher: asked every rank to stop" in first
        assert "[cluster] preempted (" in first and f"requeueing job {job_id} (scontrol requeue)" in first
        judges = [p for p, cmd in node_pids("pc-node0", daemons()).items() if " -m paco_ds.serving.hf_engine " in cmd]
        assert judges
        slurm("scancel", job_id)
        took = assert_nothing_left(within=30, daemons=daemons())
        print(f"scancel -> nothing of the job left on either node after {took:.1f}s")
        state = finished(job_id, timeout=60)
    finally:
        subprocess.run(["nsenter", "--net=/var/run/netns/pc-node0", "scancel", job_id], capture_output=True)
    second = out.read_text().split(", restart 1:", 1)[1]
    assert (state["JobState"], state["Restarts"]) == ("CANCELLED", "1"), second[-4000:]
    assert "[cluster] SIGTERM to the launcher" in second and "requeueing" not in second  # cancelled stays cancelled
