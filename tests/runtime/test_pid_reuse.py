"""No signal reaches a process the run did not start. Every stop path (paco_ds/runtime/processes.py, the
cluster launcher's stops and its guard, the reward-server manager, the test lanes' pid files) is run
against the record of a process that has ended and whose pid a newcomer now holds, taken on purpose
(through ns_last_pid as root, else by cycling pids): the newcomer must still run, with the same
start time, having received no signal. Each path also stops what is really its own, so that a
path that signals nothing at all does not pass."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paco_ds.launchers import cluster; from paco_ds.runtime import processes
from paco_ds.serving import manager
from tests.distributed_runs import REPO, cpu_env

pytestmark = pytest.mark.fast

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
# The newcomer: it notes each catchable stop signal in a file and goes on (SIGKILL ends it).
SENTINEL = """
import signal, sys, time
def note(signum, frame):
    with open(sys.argv[1], "a") as f:
        f.write(f"{signum}\\n")
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, note)
print("ready", flush=True)
while True:
    time.sleep(60)
"""


class Newcomer:
    """A process that took a recorded pid after the recorded process ended."""

    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.log, self.pid = proc, log, proc.pid
        assert proc.stdout.readline().strip() == "ready"
        self.ticks = processes._start_ticks(self.pid)

    def signals(self) -> list[int]:
        return [int(s) for s in self.log.read_text().split()] if self.log.exists() else []

    def assert_untouched(self) -> None:
        time.sleep(0.1)  # a signal sent is delivered by now; its handler has written the note
        assert self.proc.poll() is None, f"the newcomer holding pid {self.pid} was killed ({self.proc.returncode})"
        assert processes._start_ticks(self.pid) == self.ticks
        assert self.signals() == [], f"the newcomer holding pid {self.pid} received signals {self.signals()}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def newcomers():
    made: list[Newcomer] = []
    yield made
    for n in made:
        n.close()


def _ended(session: bool = True) -> tuple[int, float]:
    """(pid, start time) of a process (a group leader, with `session`) that ran, ended and was reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=session)
    assert proc.stdout.readline().strip() == "ready"
    record = proc.pid, processes.start_time(proc.pid)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    return record


def _discard(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout:
        proc.stdout.close()


def _take(pid: int, tmp_path: Path, newcomers: list, session: bool = True, argv0: str = sys.executable) -> Newcomer:
    """A newcomer holding `pid`, a number whose process has ended: ns_last_pid makes it the next pid
    (root, where /proc/sys is writable); otherwise tests/runtime/pid_cycle.c cycles the pids round to it
    (a wrap of the pids: a second or two)."""
    log = tmp_path / f"signals-{pid}"
    argv = [argv0, "-c", SENTINEL, str(log)]

    def spawn() -> subprocess.Popen | None:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=session)
        if proc.pid == pid:
            return proc
        _discard(proc)  # another process on the machine took it first
        return None

    # A start time counts clock ticks (10 ms): a pid reused within the tick its first holder started in
    # could not be told apart. In a run a wrap of the pids takes minutes; here, a few ticks' wait.
    time.sleep(3 / os.sysconf("SC_CLK_TCK"))
    proc = None
    if os.getuid() == 0 and os.access(NS_LAST_PID, os.W_OK):
        for _ in range(300):
            NS_LAST_PID.write_text(str(pid - 1))
            if (proc := spawn()) is not None:
                break
    if proc is None:
        cycler = _pid_cycler(tmp_path)
        # Two wraps at most, and no more than about 30 s of children where pid_max is in the millions.
        children = min(2 * int(Path("/proc/sys/kernel/pid_max").read_text()), 400_000)
        for _ in range(5):  # another process may take the pid between the cycle and the spawn
            if subprocess.run([cycler, str(pid), str(children)]).returncode != 0:
                break
            if (proc := spawn()) is not None:
                break
    if proc is None:
        pytest.fail(f"could not give pid {pid} to a new process: ns_last_pid is not writable here and "
                    f"{children} short-lived children did not cycle the pids round to it")
    newcomers.append(Newcomer(proc, log))
    return newcomers[-1]


def _pid_cycler(tmp_path: Path) -> Path:
    """tests/runtime/pid_cycle.c built once per test process (a C compiler is part of the set-up: the
    C++ kernels need one)."""
    global _CYCLER
    if _CYCLER is None or not _CYCLER.exists():
        out = tmp_path.parent / f"pid_cycle-{os.getpid()}"
        subprocess.run(["cc", "-O2", "-o", str(out), str(Path(__file__).with_name("pid_cycle.c"))], check=True)
        _CYCLER = out
    return _CYCLER


_CYCLER: Path | None = None


@pytest.fixture(params=["pidfd-group", "pidfd", "kill"])
def mode(request, monkeypatch):
    """The three ways a checked signal is sent: a pidfd and the kernel's group signal through it
    (Linux >= 6.9), a pidfd without it (older kernels: killpg right after the check, or the recorded
    members), and no pidfd at all (kill(2) right after the check)."""
    if request.param != "pidfd-group":
        monkeypatch.setattr(processes, "_group_flag", [False])
    if request.param == "kill":
        monkeypatch.setattr(processes, "_PIDFD", False)
    return request.param


# ------------------------------------------------------------------------------------ paco_ds.runtime.processes
def test_signal_if_same_signals_its_own_process_and_spares_a_newcomer(tmp_path, newcomers, mode):
    own = subprocess.Popen(["sleep", "60"])
    started = processes.start_time(own.pid)
    assert not processes.signal_if_same(own.pid, None, signal.SIGTERM)  # no start time: not ours
    assert not processes.signal_if_same(own.pid, started - 1.0, signal.SIGTERM)
    assert processes.signal_if_same(own.pid, started, signal.SIGTERM)
    assert own.wait(5) == -signal.SIGTERM
    newcomer = _take(own.pid, tmp_path, newcomers, session=False)
    assert not processes.signal_if_same(own.pid, started, signal.SIGTERM)
    assert not processes.signal_if_same(own.pid, str(round(started * os.sysconf("SC_CLK_TCK"))), signal.SIGTERM)
    assert processes.stop_processes([(own.pid, started)], timeout=0.2) == []
    newcomer.assert_untouched()


def test_stop_groups_spares_a_newcomer_group_with_the_recorded_number(tmp_path, newcomers, mode):
    leader, started = _ended()
    newcomer = _take(leader, tmp_path, newcomers)  # it leads a group of that number, as killpg would find it
    t0 = time.monotonic()
    assert processes.stop_groups([(leader, started)], signal.SIGTERM, timeout=2.0) == []
    assert time.monotonic() - t0 < 1.5  # not taken for a group still running
    assert not processes.signal_group_if_same(leader, started, signal.SIGKILL)
    newcomer.assert_untouched()


def test_a_group_whose_leader_is_gone_is_reached_through_recorded_members_only(tmp_path, newcomers, mode):
    """The leader's group outlives it in a member: the member still gets the group's signal. Once the
    member has ended too and a newcomer holds its pid, nothing is sent."""
    leader = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE,
                              process_group=0)
    log = tmp_path / "member-signals"
    member = subprocess.Popen([sys.executable, "-c", SENTINEL, str(log)], stdout=subprocess.PIPE, text=True,
                              process_group=leader.pid)
    assert member.stdout.readline().strip() == "ready"
    with processes.Group(leader.pid, processes.start_time(leader.pid)) as group:
        group.record_members()
        assert set(group.members) == {leader.pid, member.pid}
        leader.stdin.close()  # the leader ends
        deadline = time.monotonic() + 10
        while not processes.exited(leader.pid):  # ended, not reaped: exited() leaves it its pid
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert processes.same_process(leader.pid, group.started)
        leader.wait()
        assert not group.leader_holds() and group.alive()  # its member runs on
        assert group.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not log.exists():
            assert time.monotonic() < deadline, "the member of a group whose leader is gone got no signal"
            time.sleep(0.02)
        member_started = group.members[member.pid]
        _discard(member)
        assert not group.alive()
        newcomer = _take(member.pid, tmp_path, newcomers)
        assert not group.signal(signal.SIGTERM) and not group.alive()
        assert processes.stop_groups([group], signal.SIGTERM, timeout=0.5) == []
        assert not processes.signal_if_same(member.pid, member_started, signal.SIGKILL)
    newcomer.assert_untouched()


# ------------------------------------------------------------------------------------ paco_ds.launchers.cluster
def test_the_cluster_stops_spare_a_newcomer_with_a_recorded_leader_pid(tmp_path, newcomers):
    """_stop_group (a judge's transport, the deepspeed runner's group) and _stop_trainers, with a
    record made after the leader ended (the guard's) and with a group held since the leader ran
    (the launcher's own)."""
    held_leader = subprocess.Popen(["sleep", "60"], start_new_session=True)
    held = processes.Group(held_leader.pid, processes.start_time(held_leader.pid))
    _discard(held_leader)
    leader, started = _ended()
    for pid in (leader, held.leader):
        _take(pid, tmp_path, newcomers)  # each leads a group of that number, as killpg would find it
    t0 = time.monotonic()
    with processes.Group(leader, started) as recorded:
        for group in (recorded, held):
            cluster._stop_trainers(group)
            cluster._stop_group(group, timeout=2.0)
    held.close()
    assert time.monotonic() - t0 < 4  # neither waited on a group it took for the runner's
    for newcomer in newcomers:
        newcomer.assert_untouched()


def test_the_cluster_stop_of_its_own_transport_still_stops_it(tmp_path):
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); print('ready', flush=True); time.sleep(60)"
    transport = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert transport.stdout.readline().strip() == "ready"
    group = processes.Group(transport.pid, processes.start_time(transport.pid))
    (child,) = processes.children(transport.pid)
    cluster._stop_group(group, timeout=5.0, proc=transport)
    group.close()
    assert transport.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while processes.alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes.alive(child)


def test_the_guard_spares_newcomers_and_processes_recorded_without_a_start_time(tmp_path, newcomers):
    trainers, trainers_started = _ended()
    transport, transport_started = _ended()
    reused = [_take(trainers, tmp_path, newcomers), _take(transport, tmp_path, newcomers)]
    unverifiable = _take(_ended()[0], tmp_path, newcomers)  # a state file of an earlier version: no start time
    state = tmp_path / "processes.json"
    state.write_text(json.dumps({
        "ssh_port": None, "trainers": trainers, "trainers_started": trainers_started,
        "judges": [{"host": "node-0", "log": str(tmp_path / "no-pid-yet.log"), "transport": transport,
                    "transport_started": transport_started},
                   {"host": "node-1", "log": str(tmp_path / "no-pid-yet.log"), "transport": unverifiable.pid}]}))
    # launcher 1 is not the guard's parent: it acts at once, as after the launcher's death
    guard = subprocess.run([sys.executable, "-m", "paco_ds.launchers.cluster", "--reap", str(state), "1"], cwd=REPO,
                           env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert guard.returncode == 0, guard.stderr
    assert "died without cleaning up" in guard.stderr and not state.exists()
    for newcomer in [*reused, unverifiable]:
        newcomer.assert_untouched()


def test_a_remote_judge_is_stopped_by_pid_only_while_the_pid_is_still_the_judge(tmp_path, newcomers, monkeypatch):
    """The judge's ssh command prints its pid and start time; the stop over ssh (run here through
    sh) checks both before each signal."""
    monkeypatch.setattr(cluster, "remote_argv", lambda host, cmd, ssh_port=None, use_pdsh=None: ["sh", "-c", cmd])
    log = tmp_path / "judge.log"
    with log.open("w") as fh:
        judge = subprocess.Popen(["sh", "-c", f"echo PACO_JUDGE_PID $$ {cluster._shell_start_ticks('$$')} && "
                                              "exec sleep 60"], stdout=fh)
    deadline = time.monotonic() + 10
    while cluster._remote_pid(log) is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pid, ticks = cluster._remote_pid(log)
    assert pid == judge.pid and ticks == str(processes._start_ticks(judge.pid))
    assert cluster._stop_remote_judge("node-0", pid, None, None) is None and judge.poll() is None  # unverifiable
    assert cluster._stop_remote_judge("node-0", pid, ticks, None) is None
    assert judge.wait(10) == -signal.SIGTERM
    newcomer = _take(pid, tmp_path, newcomers, session=False)
    assert cluster._stop_remote_judge("node-0", pid, ticks, None) is None
    newcomer.assert_untouched()


# ------------------------------------------------------------------------------------ the judge manager
def test_the_manager_stop_spares_a_newcomer_and_a_server_recorded_without_a_start_time(tmp_path, newcomers):
    pid, started = _ended()
    reused = _take(pid, tmp_path, newcomers)
    unverifiable = _take(_ended()[0], tmp_path, newcomers)
    (tmp_path / manager.STATE_FILE).write_text(json.dumps({"endpoints": {}, "servers": [
        {"name": "reused", "role": "engine", "url": "http://127.0.0.1:1", "pid": pid, "start_time": started},
        {"name": "old", "role": "engine", "url": "http://127.0.0.1:1", "pid": unverifiable.pid}]}))
    assert [s["alive"] for s in manager.status(tmp_path)] == [False, False]
    assert manager.stop(tmp_path, timeout=1.0) == []
    assert not (tmp_path / manager.STATE_FILE).exists()
    reused.assert_untouched()
    unverifiable.assert_untouched()


# ------------------------------------------------------------------------------------ the lanes' pid files
def _pidfile(*commands: str, check: bool = True) -> subprocess.CompletedProcess:
    script = "set -euo pipefail; source tests/pidfile.sh; " + "; ".join(commands)
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60, check=check)


def test_a_daemons_pid_file_stops_the_daemon_it_names(tmp_path):
    (tmp_path / "sshd").symlink_to("/bin/sleep")  # a process named sshd
    daemon = subprocess.Popen([str(tmp_path / "sshd"), "60"])
    pidf = tmp_path / "sshd.pid"
    pidf.write_text(f"{daemon.pid}\n")
    assert _pidfile(f"pidfile_pid {pidf} sshd").stdout.strip() == str(daemon.pid)  # from the file's time
    _pidfile(f"pidfile_note {pidf} sshd")
    assert (tmp_path / "sshd.pid.start").read_text().strip() == str(processes._start_ticks(daemon.pid))
    assert _pidfile(f"pidfile_pid {pidf} sshd").stdout.strip() == str(daemon.pid)
    assert _pidfile(f"pidfile_pid {pidf} slurmd", check=False).returncode != 0  # another daemon's name
    _pidfile(f"stop_pidfile {pidf} sshd")
    assert daemon.wait(5) == -signal.SIGTERM
    assert not pidf.exists() and not (tmp_path / "sshd.pid.start").exists()


def test_a_pid_file_whose_daemon_died_spares_the_newcomer_with_its_pid(tmp_path, newcomers):
    """netns.sh's sshd and slurm.sh's daemons: a newcomer even named like the daemon is "not
    running" (so `up` starts a fresh daemon) and `down` does not signal it."""
    (tmp_path / "sshd").symlink_to("/bin/sleep")
    daemon = subprocess.Popen([str(tmp_path / "sshd"), "60"])
    noted, unnoted = tmp_path / "noted.pid", tmp_path / "unnoted.pid"
    for pidf in (noted, unnoted):
        pidf.write_text(f"{daemon.pid}\n")
    _pidfile(f"pidfile_note {noted} sshd")
    _discard(daemon)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sshd").symlink_to(sys.executable)  # the newcomer is named sshd too
    newcomer = _take(daemon.pid, tmp_path, newcomers, argv0=str(tmp_path / "bin" / "sshd"))
    assert Path(f"/proc/{newcomer.pid}/comm").read_text().strip() == "sshd"
    old = time.time() - 60
    os.utime(unnoted, (old, old))  # written by the daemon before the newcomer started
    for pidf in (noted, unnoted):
        assert _pidfile(f"pidfile_pid {pidf} sshd", check=False).returncode != 0
        _pidfile(f"stop_pidfile {pidf} sshd")
        assert not pidf.exists()
    stranger = tmp_path / "stranger.pid"  # a live process of another name
    stranger.write_text(f"{newcomers[0].pid}\n")
    assert _pidfile(f"pidfile_pid {stranger} slurmctld", check=False).returncode != 0
    _pidfile(f"stop_pidfile {stranger} slurmctld")
    newcomer.assert_untouched()


def test_the_lanes_signal_their_daemons_only_through_the_checked_pid_files():
    for script in ("tests/cluster/netns.sh", "tests/slurm/slurm.sh"):
        text = (REPO / script).read_text()
        assert 'source "$HERE/../pidfile.sh"' in text
        assert 'kill "$(cat' not in text and "kill -0" not in text and "stop_pidfile() {" not in text, script
