"""launch/cluster.py without a cluster: hostfile parsing, judge placement and --dry-run.
The real two-node runs are in tests/cluster/ (make test-cluster)."""
import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from paco_ds.launchers.cluster import parse_hostfile, place
from paco_ds.recipe.schema import ClusterConfig
from paco_ds.errors import ConfigError
from paco_ds.serving.routing import choose, is_local, parse
from tests.conftest import run_cli
from tests.distributed_runs import REPO, TINY, cpu_env

pytestmark = pytest.mark.fast

TWO_BY_EIGHT = "# two GPU nodes\nnode-0 slots=8   # judge on GPU 0\n\nnode-1 slots=8\n"


def hostfile(tmp_path, text):
    p = tmp_path / "hostfile"
    p.write_text(text)
    return p


def test_hostfile_comments_and_order(tmp_path):
    assert list(parse_hostfile(hostfile(tmp_path, TWO_BY_EIGHT)).items()) == [("node-0", 8), ("node-1", 8)]


@pytest.mark.parametrize("text,where,what", [
    ("a slots=1\n# x\na slots=2\n", ":3:", "listed twice (first at line 1)"),
    ("a slots=1\nb slot=2\n", ":2:", "expected 'HOST slots=N'"),
    ("a slots=0\n", ":1:", "at least 1"),
    ("# nothing\n", "", "no hosts"),
])
def test_hostfile_errors_name_the_line(tmp_path, text, where, what):
    with pytest.raises(ConfigError) as e:
        parse_hostfile(hostfile(tmp_path, text))
    assert f"hostfile{where}" in str(e.value) and what in str(e.value)


def test_placement_judge_on_gpu0_of_node0():
    p = place({"node-0": 8, "node-1": 8}, ClusterConfig(judges=[{"host": "node-0", "gpus": [0]}]))
    assert p.world_size == 15  # 16 GPUs, one serves the judge
    assert p.include == "node-0:1,2,3,4,5,6,7@node-1:0,1,2,3,4,5,6,7"
    assert [(j.host, j.gpus, j.port) for j in p.judges] == [("node-0", [0], 8000)]
    assert p.master_host == "node-0"


def test_placement_every_node_and_colocate():
    hosts = {"node-0": 8, "node-1": 8}
    every = place(hosts, ClusterConfig(every_node={"gpus": [0, 1]}))
    assert every.world_size == 12 and every.include.startswith("node-0:2,3,4,5,6,7@node-1:2,")
    colo = place(hosts, ClusterConfig(colocate=True))
    assert colo.world_size == 16 and [j.host for j in colo.judges] == ["node-0", "node-1"]
    two = place(hosts, ClusterConfig(judges=[{"host": "node-0", "gpus": [0]}, {"host": "node-0", "gpus": [1]}]))
    assert [j.port for j in two.judges] == [8000, 8001] and two.world_size == 14


@pytest.mark.parametrize("judges,msg", [
    ([{"host": "node-9", "gpus": [0]}], "cluster.judges[0].host: 'node-9' is not in"),
    ([{"host": "node-0", "gpus": [2]}], "cluster.judges[0].gpus: [2] not on 'node-0'"),
    ([{"host": "node-0", "gpus": [0]}, {"host": "node-0", "gpus": [0, 1]}], "cluster.judges[1].gpus: [0] of 'node-0' already"),
    ([{"host": "node-0", "gpus": [0, 1]}], "no trainer rank is left"),
])
def test_placement_errors(judges, msg):
    with pytest.raises(ConfigError, match=None) as e:
        place({"node-0": 2}, ClusterConfig(judges=judges))
    assert msg in str(e.value)


def test_one_placement_only():
    with pytest.raises(ValueError, match="give one of judges, every_node, colocate"):
        ClusterConfig(colocate=True, every_node={"gpus": [0]})


def test_routing_prefers_this_host_then_any_healthy():
    assert parse("m=http://10.0.0.1:8000/v1+http://127.0.0.1:9/v1,n=http://x:1/v1") == {
        "m": ["http://10.0.0.1:8000/v1", "http://127.0.0.1:9/v1"], "n": ["http://x:1/v1"]}
    assert is_local("http://127.0.0.1:1/v1") and not is_local("http://192.0.2.1:1/v1")
    # Nothing answers: the nearest is returned, so its errors name it.
    assert choose(["http://192.0.2.1:1/v1", "http://127.0.0.1:9/v1"], "m") == ("http://127.0.0.1:9/v1", None)


def _cli(*args, extra_env=None):
    return subprocess.run([sys.executable, str(REPO / "launch" / "cluster.py"), *args], cwd=REPO,
                          env={**cpu_env(), **(extra_env or {})},
                          capture_output=True, text=True, timeout=120)


def test_dry_run_prints_every_command(tmp_path):
    hf = hostfile(tmp_path, "node-0 slots=4\nnode-1 slots=4\n")
    r = _cli("--hostfile", str(hf), "--config", str(TINY), "--dry-run",
             "--set", "cluster.judges=[{host: node-0, gpus: [0]}]", "--set", "sample.prompts_per_epoch=3")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "world size 7: --include node-0:1,2,3@node-1:0,1,2,3" in out
    assert "[node-0] pdsh -S -R ssh -w node-0" in out or "[node-0] ssh -o BatchMode=yes node-0" in out
    assert "CUDA_VISIBLE_DEVICES=0" in out and "PACO_REWARD_ENDPOINTS=paco-reward-tiny=http://node-0:8000/v1" in out
    assert "--hostfile" in out and "--master_addr node-0" in out
    # m=3 prompts x k=8 samples over 7 ranks: m*k must divide by 7, so m rounds up to 7
    assert "prompts per epoch m        7 (asked 3)" in out


def test_dry_run_checks_m_for_the_world_size(tmp_path):
    # 2 x 8 GPUs with the judge on GPU 0 of node 0: 15 ranks; m rounds to 15 > the tiny set's 8 prompts
    r = _cli("--hostfile", str(hostfile(tmp_path, TWO_BY_EIGHT)), "--config", str(TINY), "--dry-run",
             "--set", "cluster.judges=[{host: node-0, gpus: [0]}]")
    assert r.returncode == 2 and "sample.prompts_per_epoch=15 (rounded for world size 15" in r.stderr
    r = _cli("--hostfile", str(hostfile(tmp_path, TWO_BY_EIGHT)), "--config", str(TINY), "--dry-run",
             "--set", "cluster.colocate=true")
    assert r.returncode == 0 and "world size 16" in r.stdout and "(colocated with the judges)" in r.stdout


def test_dry_run_places_the_samplers_of_an_async_run_on_the_last_ranks(tmp_path):
    # 2 x 4 slots, the judge on node-0's GPU 0: 7 ranks, the last 3 sample (node-1's slots 1-3), 4 train
    r = run_cli("launch/cluster.py", "--hostfile", str(hostfile(tmp_path, "node-0 slots=4\nnode-1 slots=4\n")),
                "--config", str(TINY), "--dry-run", "--set", "cluster.judges=[{host: node-0, gpus: [0]}]",
                "--set", "rollout.mode=async", "--set", "rollout.samplers=3")  # in this process
    assert r.returncode == 0, r.stderr[-2000:]
    assert "samplers      the last 3 rank(s), on node-1:1,2,3; the other 4 train" in r.stdout
    assert "world size                 4" in r.stdout  # the epoch plan is the trainers'


def test_dry_run_bad_hostfile_is_one_line(tmp_path):
    r = _cli("--hostfile", str(hostfile(tmp_path, "a slots=1\na slots=1\n")), "--config", str(TINY), "--dry-run")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "hostfile:2: host 'a' is listed twice" in r.stderr
    r = _cli("--hostfile", str(hostfile(tmp_path, "a slots=1\n")), "--config", str(TINY), "--dry-run",
             "--set", "cluster.judges=[{host: b}]")
    assert r.returncode == 2 and "cluster.judges[0].host: 'b' is not in" in r.stderr and "Traceback" not in r.stderr


def test_a_run_without_a_token_makes_its_own_and_the_plan_hides_it(tmp_path):
    """Judges listen on the hosts' addresses, where /sleep and /wake_up need a token: a colocated
    run must not depend on the user exporting one, and a dry run must not print it."""
    from paco_ds.launchers.cluster import ensure_token

    env: dict[str, str] = {}
    ensure_token("PACO_REWARD_API_KEY", env)
    made = env["PACO_REWARD_API_KEY"]
    assert len(made) >= 32
    ensure_token("PACO_REWARD_API_KEY", env)
    assert env["PACO_REWARD_API_KEY"] == made  # a given token is kept
    other: dict[str, str] = {}
    ensure_token("PACO_REWARD_API_KEY", other)
    assert other["PACO_REWARD_API_KEY"] != made  # one per run

    hf = hostfile(tmp_path, "node-0 slots=2\nnode-1 slots=2\n")
    r = _cli("--hostfile", str(hf), "--config", str(TINY), "--dry-run", "--set", "cluster.colocate=true",
             extra_env={"PACO_REWARD_API_KEY": "s3cret-given-token"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PACO_REWARD_API_KEY=<token>" in r.stdout and "s3cret-given-token" not in r.stdout
    assert r.stdout.count("PACO_REWARD_API_KEY=<token>") == 3  # two judges' lines and the ranks' env file


GUARDED_LAUNCHER = """
import json, os, subprocess, sys, time
from pathlib import Path
from paco_ds.runtime.processes import start_time
state = Path(sys.argv[1])
trainers = subprocess.Popen(["sleep", "600"], start_new_session=True)
transport = subprocess.Popen(["sleep", "600"], start_new_session=True)
state.write_text(json.dumps({"ssh_port": None, "trainers": trainers.pid, "trainers_started": start_time(trainers.pid),
                             "judges": [{"host": "node-0", "log": str(state.parent / "no-pid-yet.log"),
                                         "transport": transport.pid, "transport_started": start_time(transport.pid)}]}))
guard = subprocess.Popen([sys.executable, "-m", "paco_ds.launchers.cluster", "--reap", str(state), str(os.getpid())],
                         start_new_session=True)
print(trainers.pid, transport.pid, guard.pid, flush=True)
time.sleep(600)
"""


def test_the_guard_stops_what_a_killed_launcher_started(tmp_path):
    """SIGKILL leaves the launcher no time to clean up, and what it started runs in sessions of its
    own: the guard it leaves behind stops them (launch/cluster.py starts one per run)."""
    state = tmp_path / "processes.json"
    launcher = subprocess.Popen([sys.executable, "-c", GUARDED_LAUNCHER, str(state)], cwd=REPO, env=cpu_env(),
                                stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in launcher.stdout.readline().split()]
    *started, guard = pids

    def alive(pid):
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    assert all(alive(p) for p in pids)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in started), "the guard left the launcher's processes running"
    while alive(guard) and time.monotonic() < deadline + 30:  # it may still be checking the groups are gone
        time.sleep(0.2)
    assert not alive(guard)
    assert not state.exists()  # its work done, it leaves nothing to redo
    for p in started + [guard]:  # tidy: nothing here reaps the orphans' zombies but init
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


def test_the_guard_leaves_when_the_launcher_cleaned_up(tmp_path):
    state = tmp_path / "processes.json"
    state.write_text('{"ssh_port": null, "trainers": null, "judges": []}')
    guard = subprocess.Popen([sys.executable, "-m", "paco_ds.launchers.cluster", "--reap", str(state), str(os.getpid())],
                             cwd=REPO, env=cpu_env(), stderr=subprocess.PIPE, text=True)
    state.unlink()  # what close() does when everything is stopped
    assert guard.wait(timeout=60) == 0
    assert "died without cleaning up" not in guard.stderr.read()
