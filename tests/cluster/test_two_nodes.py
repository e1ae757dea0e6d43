"""Two real nodes on one machine: network namespaces pc-node0 (10.77.0.1) and pc-node1 (10.77.0.2)
joined by a veth pair, each with its own sshd (tests/cluster/netns.sh, `make cluster-test-setup`).
launch/cluster.py runs on node 0, as it would on a cluster's first host; pdsh/ssh reach both nodes,
gloo talks over the veth pair. After every run, no process but each node's sshd may remain."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed_runs import REPO, TINY, cpu_env, free_port, metrics

NODES = {"pc-node0": "10.77.0.1", "pc-node1": "10.77.0.2"}
SSHD_PIDS = Path("/run/paco-cluster")


def _up() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return all(n in ns for n in NODES) and all((SSHD_PIDS / f"sshd-{i}.pid").is_file() for i in range(2))


# Minutes of runs: only `make test-cluster` (which sets PACO_TEST_CLUSTER=1) runs them, not `make test`.
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(os.environ.get("PACO_TEST_CLUSTER") != "1", reason="make test-cluster runs these"),
              pytest.mark.skipif(not _up(), reason="test cluster not up: make cluster-test-setup")]


def node_pids(ns: str, daemons: frozenset[int] = frozenset()) -> dict[int, str]:
    """Every process in a node's network namespace but its sshd listener (and `daemons`, the pids of
    other services the namespace runs, e.g. Slurm's), with its command line."""
    sshd = {int((SSHD_PIDS / f"sshd-{i}.pid").read_text()) for i in range(2)}
    out = {}
    for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
        pid = int(p)
        if pid in sshd or pid in daemons:
            continue
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return out


def assert_nothing_left(within: float = 15, daemons: frozenset[int] = frozenset()) -> float:
    """No process of the run on either node within `within` seconds; returns how long it took."""
    t0 = time.monotonic()
    while time.monotonic() < t0 + within and any(node_pids(n, daemons) for n in NODES):
        time.sleep(0.5)
    assert {n: node_pids(n, daemons) for n in NODES} == {n: {} for n in NODES}
    return time.monotonic() - t0


def hostfile(tmp_path: Path) -> Path:
    p = tmp_path / "hostfile"
    p.write_text("# two test nodes, one trainer rank each\n10.77.0.1 slots=1\n10.77.0.2 slots=1\n")
    return p


def launch(tmp_path: Path, run: str, *sets: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = ["ip", "netns", "exec", "pc-node0", sys.executable, str(REPO / "launch" / "cluster.py"),
           "--hostfile", str(hostfile(tmp_path)), "--config", str(TINY), "--master-port", str(free_port()),
           "--set", f"output_dir={tmp_path}", "--set", f"run_name={run}", *[a for s in sets for a in ("--set", s)],
           *extra]
    log = (tmp_path / f"{run}.log").open("a")
    return subprocess.Popen(cmd, cwd=REPO, env=cpu_env(GLOO_SOCKET_IFNAME="pceth"), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 400) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
        raise


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout}s"
        time.sleep(0.3)


SHORT = ("train.num_epochs=2", "checkpoint.save_freq=1", "test.eval_freq=2")


def test_two_nodes_one_judge_that_dies_once_and_is_restarted(tmp_path):
    """One run: rank 0 asks the judge on its own node, rank 1 reaches it over the veth pair; after the
    epoch-1 checkpoint the judge is killed, restarted once by the launcher, and the run finishes."""
    proc = launch(tmp_path, "one", "train.num_epochs=3", "checkpoint.save_freq=1", "test.eval_freq=3",
                  "rewards.train.on_failure=mask")
    wait_for(tmp_path / "one" / "checkpoints" / "epoch_0001", proc)
    judge = [pid for pid, cmd in node_pids("pc-node0").items()  # not the pdsh/ssh that carry its command line
             if cmd.startswith(f"{sys.executable} -m paco_ds.serving.hf_engine")]
    assert len(judge) == 1
    os.kill(judge[0], signal.SIGKILL)
    code = finish(proc)
    log = (tmp_path / "one.log").read_text()
    assert code == 0, log[-4000:]
    assert "--include 10.77.0.1:0@10.77.0.2:0" in log and "dist_world_size=2" in log
    assert "[routing] rank 0: 'paco-reward-tiny' -> http://10.77.0.1:8000/v1 (this host; model list in" in log
    assert "[routing] rank 1: 'paco-reward-tiny' -> http://10.77.0.1:8000/v1 (another host; model list in" in log
    print("\n".join(line for line in log.splitlines() if "[routing]" in line))
    rows = metrics(tmp_path / "one")
    scored = [r for r in rows if "reward/consistency_score/mean" in r]
    assert [r["epoch"] for r in scored] == [0, 1, 2]
    # epoch 0, before the kill: every sample scored, and the route's cost as the judge answered
    first = next(r for r in rows if r["epoch"] == 0 and "time/epoch" in r)
    assert 0 <= first["reward/consistency_score/mean"] <= 1 and first["reward/masked"] == 0
    assert 0 < first["judge/latency_ms_p50"] <= first["judge/latency_ms_p90"]
    assert "host '10.77.0.1': judge on port 8000 died" in log and "restarting (1/1)" in log
    judges = json.loads((tmp_path / "one" / "cluster" / "judges.json").read_text())
    assert judges["judge@10.77.0.1:8000"]["completed"] > 0 and judges["judge@10.77.0.1:8000"]["restarts"] == 1
    print(f"judge restart: {judges['judge@10.77.0.1:8000']['history']}")
    assert "stopped everything on 10.77.0.1, 10.77.0.2" in log
    assert_nothing_left()


def test_two_nodes_colocated(tmp_path):
    proc = launch(tmp_path, "colo", *SHORT, "cluster.colocate=true")
    code = finish(proc)
    log = (tmp_path / "colo.log").read_text()
    assert code == 0, log[-4000:]
    assert "--include 10.77.0.1:0@10.77.0.2:0" in log  # colocated: the judges take no slot
    assert "[routing] rank 1: 'paco-reward-tiny' -> http://10.77.0.2:8000/v1 (this host; model list in" in log
    judges = json.loads((tmp_path / "colo" / "cluster" / "judges.json").read_text())
    assert sorted(judges) == ["judge@10.77.0.1:8000", "judge@10.77.0.2:8000"]
    assert all(j["completed"] > 0 for j in judges.values())
    rows = metrics(tmp_path / "colo")
    assert [r["epoch"] for r in rows if "reward/consistency_score/mean" in r] == [0, 1]
    # each epoch puts the judges to sleep for training; they are woken from the second epoch on
    epochs = [r for r in rows if "judge/sleeps" in r]
    assert [(r["epoch"], r["judge/sleeps"], r["judge/wakes"]) for r in epochs] == [(0, 1.0, 0.0), (1, 1.0, 1.0)]
    assert_nothing_left()


def test_sigkill_of_the_launcher_stops_every_host(tmp_path):
    """SIGKILL gives launch/cluster.py no time to clean up, and the judges, the deepspeed runner
    and their ssh sessions run in sessions of their own: the guard it started stops them all."""
    proc = launch(tmp_path, "orphan", "train.num_epochs=50", "checkpoint.save_freq=1", "test.eval_freq=0")
    wait_for(tmp_path / "orphan" / "checkpoints" / "epoch_0001", proc)
    assert node_pids("pc-node1"), "no rank on node 1"
    os.kill(proc.pid, signal.SIGKILL)  # the launcher alone, as the OOM killer would
    proc.wait()
    t_kill = time.monotonic()
    deadline = t_kill + 30
    while any(node_pids(n) for n in NODES) and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"SIGKILL of launch/cluster.py -> nothing left on either node after {time.monotonic() - t_kill:.1f}s")
    assert {n: node_pids(n) for n in NODES} == {n: {} for n in NODES}
    assert "died without cleaning up: stopping everything it started" in (tmp_path / "orphan.log").read_text()
