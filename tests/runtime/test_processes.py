"""paco_ds/runtime/processes.py, the one place that reads processes (psutil): a process is known by pid and
start time, a zombie has ended, and a group stop signals, waits, then kills what ignored it."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paco_ds.runtime import processes

pytestmark = pytest.mark.fast

# A group leader that ignores SIGTERM, with a child in its group.
STUBBORN = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('ready', flush=True); "
            "time.sleep(60)")


def _leader(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _identity(proc: subprocess.Popen) -> tuple[int, float]:
    """A group leader this test started and has not reaped, as stop_groups takes it: pid and start time."""
    return proc.pid, processes.start_time(proc.pid)


def test_a_process_is_known_by_pid_and_start_time_and_a_zombie_has_ended():
    # Wait for the child's own line: between fork and exec its command line is briefly empty.
    code = "print('ready', flush=True); import time; time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    started = processes.start_time(proc.pid)
    assert processes.alive(proc.pid) and processes.alive(proc.pid, started)
    assert not processes.alive(proc.pid, started - 1.0)  # the pid, reused by another process
    assert processes.parent(proc.pid) == __import__("os").getpid()
    assert processes.cmdline(proc.pid)[-1] == code
    proc.kill()
    # A zombie until reaped: alive() reaps our own child and says it has ended (once the kill lands).
    deadline = time.monotonic() + 10
    while processes.alive(proc.pid, started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes.alive(proc.pid, started)
    assert processes.start_time(proc.pid) is None and processes.parent(proc.pid) == 0


def test_a_group_stop_kills_what_ignores_the_signal_after_the_timeout():
    proc = _leader(STUBBORN)
    child, = processes.children(proc.pid)
    assert processes.group_alive(proc.pid)
    t0 = time.monotonic()
    killed = processes.stop_groups([_identity(proc)], signal.SIGTERM, timeout=0.5,
                                   running=lambda g: proc.poll() is None or g.alive())
    assert killed == [proc.pid] and 0.5 <= time.monotonic() - t0 < 5
    proc.wait(5)
    deadline = time.monotonic() + 5
    while processes.alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes.alive(child) and not processes.group_alive(proc.pid)


def test_a_group_that_obeys_is_not_killed():
    proc = _leader("import subprocess, sys, time; print('ready', flush=True); time.sleep(60)")
    assert processes.stop_groups([_identity(proc)], timeout=5, running=lambda g: proc.poll() is None) == []
    assert proc.wait(1) == -signal.SIGTERM


def test_a_step_of_the_wall_clock_does_not_change_a_process_identity(monkeypatch):
    import os

    import psutil

    me = os.getpid()
    started = processes.start_time(me)
    ticks = open(f"/proc/{me}/stat").read().rsplit(")", 1)[1].split()[19]  # the kernel's own count
    assert started == int(ticks) / os.sysconf("SC_CLK_TCK")
    # the clock jumps an hour: psutil's create_time (boot time + start) moves with it, the identity does not
    create_time = psutil.Process.create_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: create_time(self) + 3600.0)
    assert processes.start_time(me) == started and processes.alive(me, started)
    assert processes.alive(me, ticks) and not processes.alive(me, str(int(ticks) - 1))  # earlier state files


def test_descendants_by_program_name_are_waited_for_then_killed():
    """How a run stops W&B's service processes (paco_ds/runtime/metrics.py): found among this process's
    descendants by program name, a grandchild too; one that has ended is not killed, one still
    running after the wait is."""
    parent = _leader(STUBBORN)  # a python whose child, another python, sleeps
    quick = subprocess.Popen(["sleep", "0.2"])
    try:
        names = ("python", "python3", "sleep", Path(sys.executable).name)
        mine = {parent.pid, quick.pid, *processes.children(parent.pid)}  # not another test's helpers
        deadline = time.monotonic() + 30  # the grandchild's command line shows once it has exec'd
        while len(found := [p for p in processes.descendants(names) if p[0] in mine]) < 3:
            assert time.monotonic() < deadline, found
            time.sleep(0.05)
        pids = {pid for pid, _ in found}
        assert {parent.pid, quick.pid} <= pids  # and the grandchild
        quick.wait()
        left = processes.stop_processes([p for p in found if p[0] != parent.pid], timeout=1.0)
        assert quick.pid not in left and len(left) == 1  # the sleeping grandchild, killed
        while processes.alive(left[0]):  # SIGKILL lands at once; the deadline turns a miss into a failure
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        processes.stop_groups([_identity(parent)], timeout=1.0)
        parent.wait()
