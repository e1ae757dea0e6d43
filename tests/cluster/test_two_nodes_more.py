"""Two real nodes beyond `make test-cluster`'s (CI's): a SIGKILL of the second node's rank stops the job
on both hosts, and `--resume latest` continues it to its end. `make test-cluster-more` (root; outside CI's
time: two launches of 4 epochs over the veth pair); run it for a change to launch/cluster.py's failure
handling or to resuming across hosts. The nodes and helpers are tests/cluster/test_two_nodes.py's."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.cluster.test_two_nodes import _up, assert_nothing_left, finish, launch, node_pids, wait_for
from tests.distributed_runs import metrics

pytestmark = [pytest.mark.cluster_more,
              pytest.mark.skipif(os.environ.get("PACO_TEST_CLUSTER") != "1", reason="make test-cluster-more runs these"),
              pytest.mark.skipif(not _up(), reason="test cluster not up: make cluster-test-setup")]


def _rank_pid(ns: str) -> int:
    ranks = [pid for pid, cmd in node_pids(ns).items() if "launch/train.py" in cmd and "deepspeed.launcher" not in cmd
             and "pdsh" not in cmd and "bash" not in cmd.split(" ")[0]]
    assert len(ranks) == 1, node_pids(ns)
    return ranks[0]


def test_sigkill_of_the_second_nodes_rank_then_resume(tmp_path):
    proc = launch(tmp_path, "kill", "train.num_epochs=4", "checkpoint.save_freq=1", "test.eval_freq=4")
    ckpts = tmp_path / "kill" / "checkpoints"
    wait_for(ckpts / "epoch_0002", proc)
    os.kill(_rank_pid("pc-node1"), signal.SIGKILL)
    t_kill = time.monotonic()
    code = finish(proc, timeout=120)
    down = time.monotonic() - t_kill
    log = (tmp_path / "kill.log").read_text()
    print(f"SIGKILL of node 1's rank -> job down in {down:.1f}s (code {code})")
    assert code != 0, log[-4000:]  # finish() fails the test if the job is not down within its timeout
    assert "failed after" in log and "10.77.0.2" in log.split("[cluster] failed after", 1)[1].splitlines()[0]
    assert_nothing_left()
    done = max(int(p.name.split("_")[1]) for p in ckpts.glob("epoch_*"))
    assert done >= 2
    proc = launch(tmp_path, "kill", "train.num_epochs=4", "checkpoint.save_freq=1", "test.eval_freq=4",
                  extra=("--resume", "latest"))
    assert finish(proc) == 0, (tmp_path / "kill.log").read_text()[-4000:]
    epochs = [r["epoch"] for r in metrics(tmp_path / "kill") if "reward/consistency_score/mean" in r]
    assert epochs[-1] == 3 and sorted(set(epochs)) == [0, 1, 2, 3]  # continued from the checkpoint to the end
    assert (ckpts / "epoch_0004").is_dir()
    assert_nothing_left()
