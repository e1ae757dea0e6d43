"""How a training rank stops: on a signal, or when its launcher is gone.

DeepSpeed's `deepspeed` runner forwards SIGTERM/SIGINT to its ranks only for multi-node (pdsh)
launches; on one node it simply dies, and its per-node launcher (`deepspeed.launcher.launch`)
and the ranks under it would train on, unseen. So every rank watches its launchers itself: the
parent, and above it the `deepspeed` runner and `launch/cluster.py` when they are there. A
launcher that ends, however it ends (SIGTERM, SIGINT, SIGKILL), is a stop request, as is a
SIGTERM or SIGINT to the rank.

What a stop request does:
- by default, the rank stops at once: SystemExit in the main thread, so the run's `finally`
  blocks stop the judges it started and release the run directory. A rank stuck past
  `HARD_STOP_S` (a collective whose peer is gone, a long kernel) stops its judges itself and
  exits. Checkpoints are published atomically, so `latest` names the last complete one.
- with `checkpoint.save_on_sigterm` (preemption: SIGTERM, a grace period, SIGKILL), a SIGTERM or
  the launcher's end only raises a flag: the trainer polls it at its safe points (each micro-step,
  each rollout batch), the ranks agree, save a checkpoint together and exit with PREEMPTED_EXIT.
  Past `checkpoint.sigterm_grace_s` the rank stops as above, without the checkpoint. SIGINT
  (Ctrl-C) still stops at once.

A multi-node launcher (paco_ds/launchers/cluster.py) asks every rank on every host to stop by writing the
file named in PACO_STOP_FILE (in the shared run directory): a rank that sees it acts as on a
SIGTERM. A file needs no process ids, no ssh and no live transport: under a scheduler the ssh
sessions that carry the ranks may be signalled together with the launcher.
"""
from __future__ import annotations

import _thread
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from paco_ds.runtime import processes
from paco_ds.errors import UserError

log = logging.getLogger(__name__)

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: stopped after saving; `--resume latest` continues
STOP_FILE_ENV = "PACO_STOP_FILE"  # a launcher's stop request to ranks on every host: the file's existence
HARD_STOP_S = 20.0  # an immediate stop that has not ended by then is forced (judges first)
POLL_S = 0.25


class Preempted(UserError):
    """The run stopped on request after saving a checkpoint to resume from."""

    exit_code = PREEMPTED_EXIT


# <run dir>/PREEMPTED: written (rank 0) once every rank has saved after a stop request, removed when a
# run of that directory starts training again. A launcher or a scheduler script decides on requeueing
# from it, not from the status the DeepSpeed launcher returns (143 after a SIGTERM, whatever the ranks did).
PREEMPTED_MARKER = "PREEMPTED"


def mark_preempted(run_dir: Path, checkpoint: Path, reason: str) -> None:
    import json
    import os

    marker = Path(run_dir) / PREEMPTED_MARKER
    tmp = marker.with_name(f".{PREEMPTED_MARKER}.tmp")
    tmp.write_text(json.dumps({"checkpoint": str(checkpoint), "reason": reason, "time": time.time()}) + "\n")
    os.replace(tmp, marker)


def clear_preempted(run_dir: Path) -> None:
    (Path(run_dir) / PREEMPTED_MARKER).unlink(missing_ok=True)


def preempted_since(run_dir: Path, since: float) -> dict | None:
    """The marker's record when a preemption checkpoint was saved at or after `since` (time.time()), else None."""
    import json

    try:
        record = json.loads((Path(run_dir) / PREEMPTED_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("time", 0) >= since else None


def _is_runner(argv: list[str]) -> bool:
    return any(a.endswith("/deepspeed") or a == "deepspeed" or a == "deepspeed.launcher.runner" for a in argv[:3])


def _is_cluster(argv: list[str]) -> bool:
    return any(a.endswith(("launch/cluster.py", "launch/slurm.py")) for a in argv[:3])


def launcher_chain(pid: int | None = None) -> list[tuple[int, float]]:
    """The processes whose end stops this rank, nearest first, as (pid, start time): the
    parent (deepspeed's per-node launcher, torchrun, ...), then the `deepspeed` runner above
    deepspeed's launcher, then `launch/cluster.py` above the runner. Empty for a rank started
    by hand (its parent is a shell that outlives it)."""
    pid = os.getpid() if pid is None else pid
    chain: list[int] = []
    parent = processes.parent(pid)
    if parent <= 1:
        return []
    argv = processes.cmdline(parent)
    if "deepspeed.launcher.launch" in argv or any("torch.distributed.run" in a or a.endswith("/torchrun")
                                                 for a in argv[:3]):
        chain.append(parent)
        if "deepspeed.launcher.launch" in argv:
            runner = processes.parent(parent)
            if runner > 1 and _is_runner(processes.cmdline(runner)):
                chain.append(runner)
                above = processes.parent(runner)
                if above > 1 and _is_cluster(processes.cmdline(above)):
                    chain.append(above)
    return [(p, started) for p in chain if (started := processes.start_time(p)) is not None]


class _OutputThatMayClose:
    """A rank's stdout or stderr that may lose its reader: under a multi-node launcher it is the pipe
    of an ssh session, which a scheduler's SIGTERM to the job ends while the rank is still saving.
    A write to it after that is dropped, where it would raise BrokenPipeError mid-save."""

    def __init__(self, stream):
        self._stream, self._lost = stream, False

    def write(self, text):
        if not self._lost:
            try:
                return self._stream.write(text)
            except (BrokenPipeError, ConnectionResetError):
                self._lost = True
        return len(text)

    def flush(self):
        if not self._lost:
            try:
                self._stream.flush()
            except (BrokenPipeError, ConnectionResetError):
                self._lost = True

    def __getattr__(self, name):  # fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def keep_running_without_output() -> None:
    """Make this rank's sys.stdout and sys.stderr survive the end of their reader (idempotent)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _OutputThatMayClose):
            setattr(sys, name, _OutputThatMayClose(stream))


class StopControl:
    """This rank's stop handling; one per process (`install`)."""

    def __init__(self, save_first: bool = False, grace_s: float = 25.0, hard_stop_s: float = HARD_STOP_S):
        self.save_first, self.grace_s, self.hard_stop_s = save_first, grace_s, hard_stop_s
        self.reason: str | None = None
        self.preempt = False  # a request the trainer should answer with a checkpoint
        self._since: float | None = None
        self._deadline: float | None = None
        self._exit_code = 143
        self._cleanups: list[Callable[[], object]] = []
        self._lock = threading.Lock()
        self._watched: list[tuple[int, float]] = []
        self._previous: dict[int, object] = {}
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._stop_file = os.environ.get(STOP_FILE_ENV) or None

    # -------------------------------------------------------------------------------- set-up
    def install(self) -> "StopControl":
        if self._stop_file is not None:  # a rank of a multi-node launch: its output is an ssh session's
            keep_running_without_output()
        self._watched = launcher_chain()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._thread = threading.Thread(target=self._watch, name="paco-stop-watch", daemon=True)
        self._thread.start()
        return self

    def uninstall(self) -> None:
        self._done.set()
        for sig, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)

    def add_cleanup(self, fn: Callable[[], object]) -> None:
        """Run `fn` (e.g. stop this rank's judges) before a forced exit."""
        self._cleanups.append(fn)

    def remove_cleanup(self, fn: Callable[[], object]) -> None:
        with contextlib.suppress(ValueError):
            self._cleanups.remove(fn)

    # -------------------------------------------------------------------------------- requests
    @property
    def has_launcher(self) -> bool:
        """Whether a launcher above this rank stops it when another rank fails."""
        return bool(self._watched)

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def _request(self, reason: str, preempt: bool, exit_code: int) -> bool:
        """Record the first request; True when this call made it."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason, self.preempt, self._exit_code = reason, preempt, exit_code
            self._since = time.monotonic()
            self._deadline = self._since + (self.grace_s if preempt else self.hard_stop_s)
        what = (f"saving a checkpoint first (grace {self.grace_s:g}s, checkpoint.sigterm_grace_s)" if preempt
                else "stopping now")
        print(f"[rank {os.environ.get('RANK', '0')}] stop requested: {reason}; {what}", file=sys.stderr, flush=True)
        return True

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        preempt = self.save_first and signum == signal.SIGTERM
        first = self._request(name, preempt, 128 + signum)
        if preempt:
            return  # the trainer saves at its next safe point
        if first or not self.preempt:
            raise SystemExit(128 + signum)
        # a SIGINT during a preemption save: stop now
        self._deadline = time.monotonic()

    def request_stop(self, reason: str) -> None:
        """A stop asked on behalf of another process of the run (an async run's sampler): as a SIGTERM."""
        self._stop_as_sigterm(reason)

    def _launcher_gone(self, pid: int) -> None:
        self._stop_as_sigterm(f"the launcher (pid {pid}) ended")

    def _stop_as_sigterm(self, reason: str) -> None:
        if self._request(reason, self.save_first, 143) and not self.save_first:
            _thread.interrupt_main(signal.SIGTERM)  # SystemExit in the main thread, as a SIGTERM would

    def _stop_file_request(self) -> str | None:
        """The launcher's reason, when it asked every rank to stop (PACO_STOP_FILE exists)."""
        if self._stop_file is None:
            return None
        try:
            return Path(self._stop_file).read_text().strip() or "stop requested"
        except FileNotFoundError:
            return None
        except OSError as err:  # there but unreadable: still a request
            return f"stop requested ({err.strerror})"

    # -------------------------------------------------------------------------------- watcher
    def _watch(self) -> None:
        while not self._done.wait(POLL_S):
            if self.reason is None:
                for pid, start in self._watched:
                    if not processes.alive(pid, start):
                        self._launcher_gone(pid)
                        break
            if self.reason is None and (asked := self._stop_file_request()) is not None:
                self._stop_as_sigterm(f"the launcher asked every rank: {asked}")
            if self._deadline is not None and time.monotonic() > self._deadline:
                self._force_exit()

    def _force_exit(self) -> None:
        """The stop did not finish in time (a rank blocked in a collective or a kernel): stop the
        judges this rank started and exit without running anything else."""
        print(f"[rank {os.environ.get('RANK', '0')}] stop: not finished "
              f"{time.monotonic() - (self._since or 0):.0f}s after the request ({self.reason}); exiting now",
              file=sys.stderr, flush=True)
        for fn in list(self._cleanups):
            with contextlib.suppress(Exception):
                fn()
        sys.stderr.flush()
        os._exit(self._exit_code)


_current: StopControl | None = None


def install(save_first: bool = False, grace_s: float = 25.0) -> StopControl:
    global _current
    if _current is not None:
        _current.uninstall()
    _current = StopControl(save_first, grace_s).install()
    return _current


def current() -> StopControl | None:
    return _current


def saving_requested() -> bool:
    """Whether this rank was asked to save and stop (checkpoint.save_on_sigterm). Loops whose
    length differs between ranks (the evaluation) end early on it; the next collective check
    saves on every rank together."""
    control = current()
    return control is not None and control.requested and control.preempt


def uninstall() -> None:
    global _current
    if _current is not None:
        _current.uninstall()
        _current = None
