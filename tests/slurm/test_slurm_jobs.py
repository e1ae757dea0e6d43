"""A real two-node Slurm cluster on one machine (tests/slurm/slurm.sh, `make slurm-test-setup`):
slurmctld and one slurmd per network namespace of tests/cluster (pc-node0 = 10.77.0.1, pc-node1 =
10.77.0.2). Every job is the sbatch template configs/slurm/flux_t2is.sbatch itself, given the tiny
recipe, one rank per node (`--ntasks-per-node=1`, no GPUs) and gloo over the veth pair; the judge
runs on the first node. One uninterrupted job is the reference the requeued one must match."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.cluster.test_two_nodes import NODES, assert_nothing_left, node_pids
from tests.distributed_runs import REPO, TINY, cpu_env, metrics, stable

SLURM_RUN = Path("/run/paco-slurm")
TEMPLATE = REPO / "configs" / "slurm" / "flux_t2is.sbatch"
# Short runs; the ranks' preemption grace (and the launcher's 10 s after it) fits the test cluster's
# KillWait (40 s, tests/slurm/slurm.sh).
SETS = ("train.num_epochs=2", "checkpoint.save_freq=1", "test.eval_freq=0", "checkpoint.sigterm_grace_s=25",
        "sample.group_size=4", "logging.num_train_images=0")


def _up() -> bool:
    if os.geteuid() != 0 or shutil.which("sbatch") is None or not (SLURM_RUN / "slurmctld.pid").is_file():
        return False
    return psutil.pid_exists(int((SLURM_RUN / "slurmctld.pid").read_text()))


# Minutes of runs: only `make test-slurm` (which sets PACO_TEST_SLURM=1) runs them.
pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(os.environ.get("PACO_TEST_SLURM") != "1", reason="make test-slurm runs these"),
              pytest.mark.skipif(not _up(), reason="test Slurm cluster not up: make slurm-test-setup")]


def slurm(*argv: str) -> str:
    """A Slurm command, from node 0's namespace (where slurmctld listens)."""
    r = subprocess.run(["nsenter", "--net=/var/run/netns/pc-node0", *argv], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, f"{' '.join(argv)}: {r.stderr}"
    return r.stdout


def daemons() -> frozenset[int]:
    """slurmctld (with its slurmscriptd) and both slurmd: services of the nodes, not of a job."""
    pids = {int(p.read_text()) for p in SLURM_RUN.glob("*.pid")}
    return frozenset(pids | {c.pid for p in pids if psutil.pid_exists(p) for c in psutil.Process(p).children()
                             if "slurmstepd" not in " ".join(c.cmdline())})


def submit(out: Path, name: str, *sets: str) -> str:
    """The template, as a user submits it, with the tiny recipe and this machine's resources."""
    argv = ["sbatch", "--parsable", f"--job-name={name}", "--gpus-per-node=0", "--cpus-per-task=1", "--time=15",
            f"--output={out}/%x.out", str(TEMPLATE), "--config", str(TINY), "--set", f"output_dir={out}",
            *[a for s in (*SETS, *sets) for a in ("--set", s)]]
    r = subprocess.run(["nsenter", "--net=/var/run/netns/pc-node0", *argv], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env=cpu_env(GLOO_SOCKET_IFNAME="pceth"))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def job(job_id: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", slurm("scontrol", "show", "job", "-o", job_id)))


def wait_until(cond, what: str, job_id: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"no {what} after {timeout}s: {job(job_id)}"
        time.sleep(0.5)


def finished(job_id: str, timeout: float = 420) -> dict[str, str]:
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
    wait_until(lambda: job(job_id)["JobState"] in ended, "end of the job", job_id, timeout)
    return job(job_id)


def running_ranks() -> dict[str, list[int]]:
    return {n: [p for p, cmd in node_pids(n, daemons()).items() if "launch/train.py --local_rank" in cmd]
            for n in NODES}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted job: the first test's subject, the requeue test's reference."""
    out = tmp_path_factory.mktemp("slurm")
    job_id = submit(out, "reference")
    try:
        state = finished(job_id)
    finally:
        subprocess.run(["nsenter", "--net=/var/run/netns/pc-node0", "scancel", job_id], capture_output=True)
    return out, state, (out / "reference.out").read_text()


def test_a_two_node_job_trains_the_tiny_recipe(reference):
    out, state, log = reference
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "0"), log[-4000:]
    assert "[slurm] job " in log and "pc-node0 slots=1, pc-node1 slots=1" in log and "SLURM_NTASKS_PER_NODE" in log
    assert "--include pc-node0:0@pc-node1:0" in log and "dist_world_size=2" in log
    assert "[routing] rank 1: 'paco-reward-tiny' -> http://10.77.0.1:8000/v1 (another host" in log
    assert "[cluster] done in" in log and "stopped everything on pc-node0, pc-node1" in log
    rows = metrics(out / "reference")
    assert [r["epoch"] for r in rows if "reward/consistency_score/mean" in r] == [0, 1]
    assert_nothing_left(daemons=daemons())


def test_scontrol_requeue_saves_comes_back_and_matches_the_uninterrupted_run(reference, tmp_path):
    job_id = submit(tmp_path, "requeued")
    run = tmp_path / "requeued"
    try:
        wait_until(lambda: (run / "checkpoints" / "epoch_0001").is_dir(), "checkpoint epoch_0001", job_id)
        assert all(running_ranks().values()), running_ranks()
        slurm("scontrol", "requeue", job_id)  # Slurm SIGTERMs the job, then queues it again
        state = finished(job_id)
    finally:
        subprocess.run(["nsenter", "--net=/var/run/netns/pc-node0", "scancel", job_id], capture_output=True)
    log = (tmp_path / "requeued.out").read_text()  # both starts, appended (--open-mode=append)
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-4000:]
    first, second = log.split(", restart 1:", 1)
    assert "DUE TO JOB REQUEUE" in first and "[cluster] SIGTERM to the launcher: asked every rank to stop" in first
    assert "[cluster] preempted (" in first  # every rank saved: the run directory's marker says so
    assert "requeueing" not in first  # Slurm requeued it; the launcher only requeues after the time-limit warning
    assert second.split("\n", 1)[0].endswith("resuming from its latest checkpoint")
    assert "--resume latest" in second and "resumed from " in second and "[cluster] done in" in second
    assert stable(metrics(run)) == stable(metrics(reference[0] / "reference"))
    assert not (run / "PREEMPTED").exists()  # training again cleared it
    assert_nothing_left(daemons=daemons())
