"""The processes paco_ds watches and stops, read through psutil (as DeepSpeed's own launcher does):
a process is recognised by its pid and its start time (a pid can be reused; the kernel's count of
ticks since boot, which no clock step moves), a zombie counts as
ended, and a stop is one signal, a wait, then SIGKILL for what is left. What to watch and when to
stop it is the caller's policy (the judge manager, the ranks' stop control, the cluster launcher).

Every signal to a pid or a process group recorded earlier goes through `signal_if_same` or a
`Group`: the identity (pid and start time; for a group, its leader's) is checked right before the
signal, and on Linux the signal goes through a pidfd opened before that check, so it reaches the
process that was checked or nothing. A record without a start time cannot be checked and is never
signalled. A group whose leader is gone is signalled through its leader's pidfd where the kernel
can (Linux 6.9's PIDFD_SIGNAL_PROCESS_GROUP: that very group, never a newcomer's with the same
number), else only through the members recorded (pid and start time) while the leader was known.
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from typing import Callable, Iterable, Union

import psutil

Started = Union[float, str, None]  # start_time's value; a string: the raw ticks earlier state files hold

_PIDFD = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")
PIDFD_SIGNAL_PROCESS_GROUP = 4  # linux/pidfd.h (Linux >= 6.9): the signal goes to the pidfd's process group
_group_flag = [True]  # whether this kernel takes PIDFD_SIGNAL_PROCESS_GROUP (learnt at first use)


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, process group, start ticks) of `pid` in one read of /proc/<pid>/stat (so the three
    belong to one process), None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:  # not Linux
        try:
            p = psutil.Process(pid)
            return p.ppid(), os.getpgid(pid), round(p.create_time() * os.sysconf("SC_CLK_TCK"))
        except (psutil.Error, OSError):
            return None
    fields = stat[stat.rindex(b")") + 2:].split()  # after the command name, which may hold spaces
    return int(fields[1]), int(fields[2]), int(fields[19])


def _start_ticks(pid: int) -> int | None:
    """The kernel's start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat), None
    if there is no such process. Read directly: psutil's create_time adds the boot time, which it
    re-reads on every call from /proc/stat's btime, a wall-clock value that moves with clock steps
    and jitters by a second, so two reads of one process's start could differ."""
    stat = _stat(pid)
    return None if stat is None else stat[2]


def _seconds(ticks: int) -> float:
    return ticks / os.sysconf("SC_CLK_TCK")


def start_time(pid: int) -> float | None:
    """When the process started, as an identity (a pid can be reused): seconds since boot, None if
    there is no such process."""
    ticks = _start_ticks(pid)
    return None if ticks is None else _seconds(ticks)


def _matches(ticks: int | None, started: Started) -> bool:
    if ticks is None or started is None:
        return False
    if isinstance(started, str):
        return str(ticks) == started
    return _seconds(ticks) == started


def same_process(pid: int, started: Started) -> bool:
    """Whether `pid` is still the process that started at `started` (a zombie too: it still holds its
    pid). A record without a start time cannot be checked: False, it is not ours to touch."""
    return pid > 0 and started is not None and _matches(_start_ticks(pid), started)


def alive(pid: int, started: Started = None) -> bool:
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
    return _matches(_start_ticks(pid), started)


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of `pid`; -1 where pidfds are not available (an old kernel or Python, a sandbox that
    refuses the call); None if there is no such process."""
    if not _PIDFD:
        return -1
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except OSError as err:
        if err.errno == errno.EINVAL:  # a thread's id, not a process's
            return None
        return -1


def signal_if_same(pid: int, started: Started, sig: int) -> bool:
    """Send `sig` to `pid` only if it is still the process that started at `started`; whether it was
    sent. The pidfd is opened first and the start time read after it, so the signal reaches the
    process that was checked or nobody; without pidfds, the check comes right before kill(2)."""
    if pid <= 0 or started is None:
        return False
    fd = _open_pidfd(pid)
    if fd is None:
        return False
    try:
        if not same_process(pid, started):
            return False
        if fd >= 0:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd >= 0:
            os.close(fd)


def _group_signal(fd: int, sig: int) -> bool | None:
    """`sig` to the process group of the pidfd's process (whose id is that process's own struct pid,
    so never another group that took the number): True if sent, False if the group has no process
    left, None where the kernel cannot (before Linux 6.9)."""
    if fd < 0 or not _group_flag[0]:
        return None
    try:
        signal.pidfd_send_signal(fd, sig, None, PIDFD_SIGNAL_PROCESS_GROUP)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    except OSError as err:
        if err.errno == errno.EINVAL:
            _group_flag[0] = False
            return None
        raise


def exited(pid: int) -> bool:
    """Whether this process's child `pid` has ended, without reaping it: it keeps its pid (a zombie)
    until waited for, so its identity still holds. True for a pid that is not (or no longer) our child."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


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


def children_of(pid: int, started: Started) -> dict[int, float]:
    """The direct children of the process `pid` that started at `started`, as pid -> start time,
    each read together with its parent pid; {} unless that process still holds its pid before and
    after the read (so they are its children, not a newcomer's)."""
    if not same_process(pid, started):
        return {}
    kids = {}
    for c in children(pid):
        stat = _stat(c)
        if stat is not None and stat[0] == pid:
            kids[c] = _seconds(stat[2])
    return kids if same_process(pid, started) else {}


def _group_members(leader: int) -> dict[int, float]:
    """The processes whose process group is `leader`, as pid -> start time."""
    out = {}
    for pid in psutil.pids():
        stat = _stat(pid)
        if stat is not None and stat[1] == leader:
            out[pid] = _seconds(stat[2])
    return out


def group_alive(leader: int) -> bool:
    """Whether any process of the group `leader` leads still runs (zombies do not: a dead launcher's
    orphans are reaped by whoever adopted them, when it gets to it). By number: `Group.alive` is the
    check that a newcomer's group with the same number does not fool."""
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == leader and proc.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


class Group:
    """A process group, known by its leader's identity (pid and start time) and by the members
    (pid -> start time) seen while the leader was verified. The leader's pidfd is opened when the
    group is made and kept until `close()`. A group whose leader cannot be verified (no start time,
    or the pid now belongs to another process) is reached only through its recorded members."""

    def __init__(self, leader: int, started: Started, members: dict[int, float] | None = None):
        self.leader, self.started = leader, started
        self.members: dict[int, float] = dict(members or {})
        self._fd = -1
        if leader > 1 and started is not None:
            fd = _open_pidfd(leader)
            if fd is not None and fd >= 0:
                if same_process(leader, started):
                    self._fd = fd
                else:
                    os.close(fd)

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def leader_holds(self) -> bool:
        """Whether the leader is still the recorded process (running or a zombie), so that the
        group's number is its own."""
        if self.leader <= 1 or self.started is None:
            return False
        if self._fd >= 0:
            try:
                signal.pidfd_send_signal(self._fd, 0)
                return True
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
        return same_process(self.leader, self.started)

    def record_members(self) -> None:
        """Note the group's members now, while its leader holds its number (they are then ours)."""
        if self.leader_holds():
            found = _group_members(self.leader)
            if self.leader_holds():
                for pid, started in found.items():
                    self.members.setdefault(pid, started)

    def signal(self, sig: int) -> bool:
        """`sig` to the group, checked as the class says; whether anything was signalled."""
        self.record_members()
        sent = _group_signal(self._fd, sig)
        if sent is not None:
            return sent
        if self.leader_holds():  # the check, then the signal at once
            try:
                os.killpg(self.leader, sig)
                return True
            except (ProcessLookupError, PermissionError):
                pass
        return any([signal_if_same(pid, started, sig) for pid, started in self.members.items()])

    def alive(self) -> bool:
        """Whether any process of the group still runs (zombies do not)."""
        if self.leader_holds() or _group_signal(self._fd, 0):  # the number is still this group's
            return group_alive(self.leader)
        return any(alive(pid, started) for pid, started in self.members.items())


def signal_group_if_same(leader: int, started: Started, sig: int) -> bool:
    """`sig` to the process group that the process `leader`, started at `started`, leads; nothing if
    that pid now belongs to another process. Whether anything was signalled."""
    with Group(leader, started) as group:
        return group.signal(sig)


def stop_groups(groups: Iterable[Group | tuple[int, Started]], sig: int = signal.SIGTERM, timeout: float = 10.0,
                running: Callable[[Group], bool] | None = None) -> list[int]:
    """Send `sig` to each process group (a `Group`, or a leader's (pid, start time)), wait up to
    `timeout` s while any is `running` (default: `Group.alive`), then SIGKILL the groups still
    running; returns their leaders' pids. Each signal checks the group's identity first."""
    made = [g for g in groups]
    groups = [g if isinstance(g, Group) else Group(*g) for g in made]
    running = running or Group.alive
    try:
        for group in groups:
            group.signal(sig)
        deadline = time.monotonic() + timeout
        while any(running(g) for g in groups) and time.monotonic() < deadline:
            time.sleep(0.1)
        killed = [g for g in groups if running(g)]
        for group in killed:
            group.signal(signal.SIGKILL)
        return [g.leader for g in killed]
    finally:
        for given, group in zip(made, groups):
            if given is not group:
                group.close()


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
    while any(alive(*p) for p in procs if p[1] is not None) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid, started in procs if started is not None and alive(pid, started)]
    for pid, started in procs:
        if pid in left:
            signal_if_same(pid, started, signal.SIGKILL)
    return left
