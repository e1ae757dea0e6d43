"""launch/slurm.py without a Slurm cluster: the slots an allocation gives, the one-line error outside
one, the resume and requeue decisions, and the stop file every rank watches. The real jobs are in
tests/slurm/test_slurm_jobs.py (make test-slurm)."""
import os
import sys
import time

import pytest

from paco_ds.launchers import cluster, slurm; from paco_ds.runtime import stopping
from paco_ds.errors import ConfigError, UserError
from tests.conftest import one_line_error, run_cli
from tests.distributed_runs import TINY

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("env,given,expected", [
    ({"SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "1"}, None, (8, "SLURM_GPUS_ON_NODE")),
    ({"SLURM_JOB_GPUS": "0,1,2,3", "SLURM_NTASKS_PER_NODE": "1"}, None, (4, "SLURM_JOB_GPUS")),
    ({"SLURM_GPUS_PER_NODE": "0", "SLURM_NTASKS_PER_NODE": "2"}, None, (2, "SLURM_NTASKS_PER_NODE")),
    ({"SLURM_GPUS_ON_NODE": "8"}, 3, (3, "--slots-per-node")),
])
def test_slots_per_node_gpus_first_then_tasks(env, given, expected):
    assert slurm.slots_per_node(env, given) == expected


def test_no_slots_and_no_allocation_are_errors():
    with pytest.raises(ConfigError, match="--gpus-per-node.*--ntasks-per-node.*--slots-per-node"):
        slurm.slots_per_node({"SLURM_CPUS_ON_NODE": "64"})
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST is not set"):
        slurm.allocation({"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "1"})


def test_outside_an_allocation_one_line_and_exit_2():
    env = {k: "" for k in os.environ if k.startswith("SLURM_")}
    line = one_line_error(run_cli("launch/slurm.py", "--config", str(TINY), env=env))
    assert line == ("slurm: error: SLURM_JOB_ID is not set: run launch/slurm.py inside an allocation (an sbatch "
                    "script, see configs/slurm/)")


class Launched:
    """cluster.run and scontrol, as slurm.main calls them, recorded."""

    def __init__(self, monkeypatch, outcome):
        self.calls, self.scontrol = [], []
        monkeypatch.setattr(cluster, "run", lambda cfg, hosts, hostfile, *a: self.calls.append(
            (hosts, hostfile.read_text(), a[3])) or outcome)
        monkeypatch.setattr(slurm, "expand_nodelist", lambda nodelist: ["gpu-a", "gpu-b"])
        monkeypatch.setattr(slurm, "_scontrol", lambda *args: self.scontrol.append(args) or "")


ENV = {"SLURM_JOB_ID": "41", "SLURM_JOB_NAME": "t2is", "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_GPUS_ON_NODE": "8"}


@pytest.mark.parametrize("outcome,requeued", [
    (cluster.Outcome(75, "SIGUSR1"), True),    # the time limit's warning: the ranks saved, come back
    (cluster.Outcome(75, "SIGTERM"), False),   # scancel / scontrol requeue / preemption: Slurm decides
    (cluster.Outcome(1, "SIGUSR1"), False),    # no save (no marker): nothing to resume from
    (cluster.Outcome(0, None), False),
])
def test_requeue_only_after_the_time_limit_warning_saved(monkeypatch, tmp_path, outcome, requeued):
    launched = Launched(monkeypatch, outcome)
    code = slurm.main(str(TINY), [f"output_dir={tmp_path}", "run_name=t2is"], environ=ENV, log=lambda m: None)
    assert code == outcome.code
    (hosts, hostfile, resume), = launched.calls
    assert hosts == {"gpu-a": 8, "gpu-b": 8} and "gpu-a slots=8\ngpu-b slots=8\n" in hostfile
    assert resume is None  # no checkpoint yet: a fresh start
    assert launched.scontrol == ([("requeue", "41")] if requeued else [])


def test_a_run_directory_with_a_latest_checkpoint_resumes(monkeypatch, tmp_path):
    (tmp_path / "t2is" / "checkpoints").mkdir(parents=True)
    (tmp_path / "t2is" / "checkpoints" / "latest").write_text("epoch_0003\n")
    launched = Launched(monkeypatch, cluster.Outcome(0))
    lines = []
    slurm.main(str(TINY), [f"output_dir={tmp_path}", "run_name=t2is"], environ={**ENV, "SLURM_RESTART_COUNT": "2"},
               log=lines.append)
    assert launched.calls[0][2] == "latest"
    assert lines[0].startswith("[slurm] job 41 (t2is), restart 2: SLURM_JOB_NODELIST=gpu-[a-b], 8 slot(s) per node "
                               "from SLURM_GPUS_ON_NODE") and lines[0].endswith("resuming from its latest checkpoint")


def test_the_stop_file_asks_a_rank_to_save_as_a_sigterm_would(monkeypatch, tmp_path):
    stop = tmp_path / "STOP"
    monkeypatch.setenv(stopping.STOP_FILE_ENV, str(stop))
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # install() wraps them; put them back afterwards
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    control = stopping.StopControl(save_first=True).install()
    try:
        time.sleep(3 * stopping.POLL_S)  # the watcher polls with the file absent: no request
        assert not control.requested
        # written whole, as the cluster launcher writes it (a temporary file renamed): a watcher that
        # polled between write_text's create and its write would read an empty request
        stop.with_suffix(".tmp").write_text("SIGUSR1 to the launcher\n")
        os.replace(stop.with_suffix(".tmp"), stop)
        deadline = time.monotonic() + 10
        while not control.requested and time.monotonic() < deadline:
            time.sleep(0.05)
        assert control.preempt and control.reason == "the launcher asked every rank: SIGUSR1 to the launcher"
    finally:
        control.uninstall()


def test_a_ranks_output_outlives_its_reader():
    """A rank's stdout is an ssh session's pipe: after its reader is gone a write is dropped, not raised."""
    read, write = os.pipe()
    stream = os.fdopen(write, "w", buffering=1)
    wrapped = stopping._OutputThatMayClose(stream)
    wrapped.write("before\n")
    assert os.read(read, 100) == b"before\n"
    os.close(read)
    assert wrapped.write("after the reader left\n") == len("after the reader left\n")
    wrapped.flush()
    assert wrapped.fileno() == write
    with pytest.raises(BrokenPipeError):  # what the rank would have met without it
        stream.write("x\n")
