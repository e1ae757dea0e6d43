"""A run's files on a disk that fills up, or in a directory someone deletes: one line naming the path.

A full disk reaches Python in three shapes: an OSError with errno ENOSPC or EDQUOT (open, write,
flush), torch's C++ writer's RuntimeError (`PytorchStreamWriter failed writing file ...`,
`basic_ios::clear`) from `torch.save` and DeepSpeed's checkpoint writer, and, once the disk is
full, follow-on errors in code that only reads back what it just wrote. A deleted run directory
shows up as FileNotFoundError wherever the next write lands (a sample grid, metrics.jsonl, a
checkpoint). Neither is a bug to debug from a traceback: the user needs the path, the cause and the
state of what was already saved (checkpoints are published atomically, so `latest` always names a
complete one; paco_ds/runtime/checkpoint.py).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from paco_ds.errors import ConfigError, UserError

NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# What torch's and DeepSpeed's C++ writers say when a write() fails; the errno is lost on the way.
# torch's C++ writer opening a file in a directory that is gone (torch/serialization.py).
_PARENT_GONE = re.compile(r"Parent directory (.+) does not exist\.")
WRITER_FAILED = ("PytorchStreamWriter failed", "basic_ios::clear", "file write failed", "unexpected pos")


class StorageError(UserError):
    """The run could not write its files (disk full, directory gone). Exit 74 (EX_IOERR): not a
    mistake in the recipe, and not a crash."""

    exit_code = 74


def _causes(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _disk(path: Path) -> tuple[int, int] | None:
    """(free, total) bytes of the disk holding `path` (or its nearest existing parent)."""
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            usage = shutil.disk_usage(p)
            return usage.free, usage.total
    return None


def _free(path: Path) -> str:
    disk = _disk(path)
    return f"{disk[0] / 2**20:.1f} MiB free on its disk" if disk else "free space unknown"


def _written_file(err: BaseException, path: Path, run_dir: Path | None) -> Path:
    """The file that was being written when `err` happened. A copy names both ends, and the one in
    `filename` is the source (shutil's sendfile copy, as DeepSpeed copies its zero_to_fp32.py into
    each checkpoint, reports the package's own file there): the destination under the run
    directory is the one the user can act on."""
    if not isinstance(err, OSError):
        return path
    names = [Path(os.fsdecode(n)) for n in (err.filename2, err.filename) if n is not None and n != ""]
    root = Path(run_dir) if run_dir is not None else path
    for name in names:
        if name == root or root in name.parents:
            return name
    return names[-1] if names else path


def storage_failure(err: BaseException, path: Path, run_dir: Path | None = None) -> StorageError | None:
    """The one-line error for `err`, raised while writing `path` (a file or a directory under
    `run_dir`), or None when `err` is not a storage failure (it keeps its traceback)."""
    path = Path(path)
    for e in _causes(err):
        where = _written_file(e, path, run_dir)
        # A full disk first: the run directory may never have been made (its mkdir is what failed)
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            return StorageError(f"no space left on device writing {where} ({e.strerror}; {_free(where)})")
        if run_dir is not None and not Path(run_dir).is_dir():
            return StorageError(f"the run directory {run_dir} was deleted while the run was writing to it "
                                f"({where}); nothing more can be saved there")
        if isinstance(e, FileNotFoundError) and run_dir is not None and Path(run_dir) in where.parents:
            return StorageError(f"{where.parent} disappeared while the run was writing {where.name} into it")
        gone = _PARENT_GONE.search(str(e)) if isinstance(e, RuntimeError) else None
        if gone and run_dir is not None and Path(run_dir) in Path(gone[1]).parents:
            # torch.save into a directory removed meanwhile: in a multi-rank checkpoint, the rank
            # whose write failed first gives the partial checkpoint's space back (checkpoint.py)
            return StorageError(f"{gone[1]} disappeared while the run was writing into it (another rank's "
                                f"failed save removes it; {_free(Path(gone[1]))})")
        if isinstance(e, RuntimeError) and any(m in str(e) for m in WRITER_FAILED):
            first = str(e).strip().splitlines()[0][:200]
            disk = _disk(where)
            if disk and disk[0] < max(2**20, disk[1] // 1000):  # the writer's errno is lost: the disk tells
                return StorageError(f"no space left on device writing {where} ({first}; {_free(where)})")
            return StorageError(f"writing {where} failed ({first}; {_free(where)}): the disk is failing or "
                                "was full for a moment")
    return None


@contextlib.contextmanager
def writing(path: Path, run_dir: Path | None = None) -> Iterator[None]:
    """Around code that writes `path` (under `run_dir`): a storage failure becomes its one line.
    Meanwhile a background writer's storage failure (TensorBoard's event thread) is one warning
    line instead of a thread traceback; the run's own next write reports it as an error."""
    previous = threading.excepthook

    def hook(args):
        failure = storage_failure(args.exc_value, path, run_dir) if args.exc_value is not None else None
        if failure is None:
            return previous(args)
        print(f"warning: {args.thread.name if args.thread else 'a thread'} stopped writing: {failure}",
              file=sys.stderr, flush=True)

    threading.excepthook = hook
    try:
        yield
    except (OSError, RuntimeError) as err:
        failure = storage_failure(err, path, run_dir)
        if failure is None:
            raise
        raise failure from err
    finally:
        threading.excepthook = previous


def check_writable(path: Path, key: str = "output_dir") -> None:
    """`path` (a directory to be) can be created and written: probe the nearest existing ancestor
    (or the directory itself) with a temporary file; nothing is left behind."""
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"config key '{key}': cannot create {path}: {probe} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        why = err.strerror or errno.errorcode.get(err.errno or 0, str(err))
        raise ConfigError(f"config key '{key}': {path} is not writable ({why} in {probe})") from None
    if probe == path and not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"config key '{key}': {path} is not writable")
