"""The processes paco_ds watches and stops, read through psutil (as DeepSpeed's own launcher does):
a process is recognised by its pid and its start time (a pid can be reused; the kernel's count of
ticks since boot, which no clock step moves), a zombie counts as
ended, and a stop is one signal, a wait, then SIGKILL for what is left. What to watch and when to
stop it is the caller's policy (the judge manager, the ranks' stop control, the cluster launcher).
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Callable, Iterable

import psutil


def _start_ticks(pid: int) -> int | None:
    """The kernel's start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat), None
    if there is no such process. Read directly: psutil's create_time adds the boot time, which it
    re-reads on every call from /proc/stat's btime, a wall-clock value that moves with clock steps
    and jitters by a second, so two reads of one process's start could differ."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:  # not Linux
        try:
            return round(psutil.Process(pid).create_time() * os.sysconf("SC_CLK_TCK"))
        except psutil.Error:
            return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])  # after the command name, which may hold spaces


def start_time(pid: int) -> float | None:
    """When the process started, as an identity (a pid can be reused): seconds since boot, None if
    there is no such process."""
    ticks = _start_ticks(pid)
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


def alive(pid: int, started: float | str | None = None) -> bool:
    """Whether `pid` runs (not a zombie) and, given `started` (start_time's value; a string: the raw
    ticks that state files of earlier versions hold), is the process that started then."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child and has exited
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.Error:
        return False
    if started is None:
        return True
    if isinstance(started, str):
        return str(_start_ticks(pid)) == started
    return start_time(pid) == started


def parent(pid: int) -> int:
    """The parent's pid (0 when the process is gone)."""
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return 0


def cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def children(pid: int) -> list[int]:
    """The direct children's pids."""
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def group_alive(leader: int) -> bool:
    """Whether any process of the group `leader` leads still runs (zombies do not: a dead launcher's
    orphans are reaped by whoever adopted them, when it gets to it)."""
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == leader and proc.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


def signal_group(leader: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, sig)


def stop_groups(leaders: Iterable[int], sig: int = signal.SIGTERM, timeout: float = 10.0,
                running: Callable[[int], bool] = group_alive) -> list[int]:
    """Send `sig` to each process group, wait up to `timeout` s while any is `running`, then SIGKILL
    the groups still running; returns those it had to kill."""
    leaders = list(leaders)
    for leader in leaders:
        signal_group(leader, sig)
    deadline = time.monotonic() + timeout
    while any(running(g) for g in leaders) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = [g for g in leaders if running(g)]
    for leader in killed:
        signal_group(leader, signal.SIGKILL)
    return killed


def descendants(names: tuple[str, ...]) -> list[tuple[int, float | None]]:
    """This process's descendants whose program (the first word of the command line, its file name)
    is one of `names`, as (pid, start time)."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error, IndexError):
            if os.path.basename(proc.cmdline()[0]) in names:
                out.append((proc.pid, start_time(proc.pid)))
    return out


def stop_processes(procs: Iterable[tuple[int, float | None]], timeout: float) -> list[int]:
    """Wait up to `timeout` s for each (pid, start time) to end, then SIGKILL the ones still
    running; returns their pids."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while any(alive(*p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid, started in procs if alive(pid, started)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return left
