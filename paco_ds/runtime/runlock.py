"""One run per run directory: an OS-level lock held for the run's whole life.

`<run>/.run.lock` is locked with `fcntl.flock` by the process that owns the run (global rank 0),
and records its pid, host and start time. The kernel drops the lock when that process ends, however
it ends (exit, exception, SIGKILL), so a lock file whose lock is free is stale: the next run takes
it over and says so. A second run into a directory that is owned exits 2 naming the directory and
the owner's pid and host, before it writes anything there (not even the lock file's contents).

flock works across processes of one host and on most shared file systems (NFSv4, Lustre with
flock mounts); where it is not supported the lock is reported as unavailable rather than ignored.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from paco_ds.errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"


class RunDirBusy(UserError):
    """Another run owns this run directory."""


class RunLock:
    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self.stale: dict | None = None  # the previous owner's record, when its lock was stale

    def _read_owner(self, fd: int) -> dict:
        try:
            raw = os.pread(fd, 4096, 0).decode("utf-8", "replace")
            return json.loads(raw) if raw.strip() else {}
        except (OSError, ValueError):
            return {}

    def acquire(self) -> "RunLock":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            owner = self._read_owner(fd)
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirBusy(
                    f"run directory {self.run_dir} is in use by another run (pid {owner.get('pid', '?')} on host "
                    f"{owner.get('host', '?')}, started {owner.get('started', '?')}); use another run_name/output_dir "
                    f"or wait for that run to end") from None
            raise UserError(f"run directory {self.run_dir}: cannot lock {self.path} ({err.strerror})") from None
        previous = self._read_owner(fd)
        if previous:  # the lock was free but the file names an owner: it died without unlocking
            self.stale = previous
            log.warning("run directory %s: taking over a stale lock of pid %s on host %s (that run is gone)",
                        self.run_dir, previous.get("pid", "?"), previous.get("host", "?"))
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Unlock and clear the record (the file stays: removing it would race a new owner)."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def in_use(run_dir: str | Path) -> bool:
    """Whether a live process owns the run directory now (a launcher waiting for its ranks' end);
    the probe takes no lock it keeps and writes nothing."""
    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's lock
    return False


@contextlib.contextmanager
def owned_run_dir(run_dir: str | Path, is_main: bool) -> Iterator[RunLock | None]:
    """Collective: global rank 0 takes the run directory's lock and holds it for the block; when
    it cannot, every rank raises the same one-line error (so no rank goes on to write there)."""
    from paco_ds.runtime.distributed import all_gather_object

    lock, error = None, None
    if is_main:
        try:
            lock = RunLock(run_dir).acquire()
        except UserError as err:
            error = err
    messages = [m for m in all_gather_object(str(error) if error else None) if m]
    if messages:
        if lock is not None:
            lock.release()
        raise error if error is not None else RunDirBusy(messages[0])
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


def fit_in_run_dir(run_dir: Path, is_main: bool, make_trainer, resume, *around: contextlib.AbstractContextManager):
    """The run itself, as GRPO and SFT runs have it: while this run owns `run_dir` (its lock), with a
    full disk or a deleted run directory reported as one line naming the path, and inside `around`
    (e.g. the recipe's reward servers), build the trainer and fit it; it is closed however the fit
    ends."""
    from paco_ds.runtime.storage import writing

    with contextlib.ExitStack() as stack:
        stack.enter_context(writing(run_dir, run_dir))
        stack.enter_context(owned_run_dir(run_dir, is_main))
        for context in around:
            stack.enter_context(context)
        trainer = make_trainer()
        try:
            trainer.fit(resume)
        except BaseException as err:  # a stop, a preemption, an error: the logs say how the run ended
            trainer.close(err)
            raise
        trainer.close()
