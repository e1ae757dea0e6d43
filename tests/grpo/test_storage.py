"""A full disk or a deleted run directory is one line naming the path, and what was saved stays.

The errors are real: /dev/full answers every write with ENOSPC, and a 256 KiB tmpfs mounted in a
private mount namespace (`unshare -m`) is a disk that fills up. The real-process runs (2 ZeRO-3
ranks writing into a full disk, a run directory deleted mid-run) are in tests/grpo/test_stop.py.
"""
import errno
import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO
from paco_ds.runtime.storage import StorageError, storage_failure, writing

pytestmark = pytest.mark.fast


def _raised(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the error under test
        return err
    raise AssertionError("no error")


def test_a_write_to_a_full_device_names_the_file(tmp_path):
    """write() errors carry no file name: the path the caller was writing is the one named."""
    err = _raised(lambda: open("/dev/full", "w").write("x" * 100_000))  # a real ENOSPC from the kernel
    failure = storage_failure(err, tmp_path / "metrics.jsonl", tmp_path)
    assert isinstance(failure, StorageError) and failure.exit_code == 74
    assert f"no space left on device writing {tmp_path / 'metrics.jsonl'} (No space left" in str(failure)


def test_torch_writer_failure_is_a_storage_error(tmp_path):
    """torch.save's C++ writer loses the errno: its message is what is left to recognise."""
    err = _raised(lambda: torch.save(torch.zeros(1 << 20), "/dev/full"))
    assert isinstance(err, RuntimeError)
    failure = storage_failure(err, tmp_path / "trainer_state_rank0.pt", tmp_path)
    assert failure is not None and "trainer_state_rank0.pt failed" in str(failure)


def test_a_deleted_run_directory_is_named(tmp_path):
    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    shutil.rmtree(run)
    err = _raised(lambda: (run / "samples" / "epoch_0001.png").write_bytes(b"png"))
    failure = storage_failure(err, run, run)
    assert failure is not None and f"the run directory {run} was deleted" in str(failure)
    assert "epoch_0001.png" in str(failure)


def test_a_full_disk_is_not_taken_for_a_deleted_run_directory(tmp_path):
    """The run directory's own mkdir can be what the full disk refused: it never existed."""
    run = tmp_path / "run"
    err = OSError(errno.ENOSPC, "No space left on device", str(run))
    failure = storage_failure(err, run, run)
    assert failure is not None and f"no space left on device writing {run}" in str(failure)
    assert "deleted" not in str(failure)


def test_other_errors_keep_their_traceback(tmp_path):
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with writing(tmp_path, tmp_path):
            raise RuntimeError("shape mismatch")
    with pytest.raises(FileNotFoundError):  # a missing input elsewhere is not the run directory's loss
        with writing(tmp_path, tmp_path):
            open(tmp_path.parent / "no-such-input.json")


SAVE_INTO_A_FULL_DISK = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from paco_ds.runtime.checkpoint import CheckpointManager, verify
    from paco_ds.errors import UserError
    root = Path(sys.argv[1]) / "checkpoints"
    ckpt = CheckpointManager(root, keep_last=3, rank=0, world_size=1)
    ckpt.save(None, "epoch_0000", {"w": torch.zeros(8)}, {"epoch": 0})
    try:
        ckpt.save(None, "epoch_0001", {"w": torch.zeros(1 << 18)}, {"epoch": 1})  # 1 MiB: does not fit
        out = {"error": None}
    except UserError as err:
        out = {"error": str(err), "code": err.exit_code}
    out["latest"] = (root / "latest").read_text()
    out["left"] = sorted(p.name for p in root.iterdir())
    out["verified"] = bool(verify(root / "epoch_0000"))
    print(json.dumps(out))
""")


def _in_a_full_disk(tmp_path, script: str, size: str = "256k") -> subprocess.CompletedProcess:
    """Run `script` with its first argument a fresh tmpfs of `size`, private to it."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    for prefix in (["unshare", "-m"], ["unshare", "-r", "-m"]):  # as root; else in a user namespace
        r = subprocess.run([*prefix, "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs "$1" && shift && exec "$@"',
                            "sh", str(disk), sys.executable, "-c", script, str(disk)],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        if "mount" not in r.stderr and "unshare" not in r.stderr:
            return r
    pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[-200:]}")


def test_a_checkpoint_that_does_not_fit_leaves_the_last_one_intact(tmp_path):
    r = _in_a_full_disk(tmp_path, SAVE_INTO_A_FULL_DISK)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["code"] == 74
    assert out["error"].startswith("saving checkpoint epoch_0001: no space left on device writing ")
    assert "the last complete checkpoint" in out["error"] and out["error"].endswith("epoch_0000, is intact")
    assert out["latest"] == "epoch_0000" and out["verified"]
    assert out["left"] == ["epoch_0000", "latest"]  # the partial checkpoint's space is given back


COPY_INTO_A_FULL_DISK = textwrap.dedent("""
    import json, shutil, sys, tempfile
    from pathlib import Path
    from paco_ds.runtime.storage import storage_failure
    src = Path(tempfile.mkdtemp()) / "zero_to_fp32.py"  # outside the disk, like DeepSpeed's own copy
    src.write_bytes(b"#" * (1 << 20))
    run = Path(sys.argv[1]) / "run"
    (run / "checkpoint").mkdir(parents=True)
    try:
        shutil.copyfile(src, run / "checkpoint" / "zero_to_fp32.py")  # as DeepSpeed copies its script
        print(json.dumps({"error": None}))
    except OSError as err:
        print(json.dumps({"error": str(storage_failure(err, run, run)), "src": str(src),
                          "names": [str(err.filename), str(err.filename2)]}))
""")


def test_a_copy_into_a_full_disk_names_the_destination_in_the_run_not_the_source(tmp_path):
    r = _in_a_full_disk(tmp_path, COPY_INTO_A_FULL_DISK)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"] is not None and out["error"].startswith("no space left on device writing "), out
    assert str(tmp_path / "disk" / "run" / "checkpoint" / "zero_to_fp32.py") in out["error"], out
    assert out["src"] not in out["error"]


def test_a_checkpoint_directory_removed_under_a_rank_is_named(tmp_path):
    """In a 2-rank save, the rank whose write failed first removes the partial checkpoint; the
    other rank's torch.save then finds its directory gone: one line, not a traceback."""
    staging = tmp_path / "run" / "checkpoints" / ".staging-step_0000012"
    staging.parent.mkdir(parents=True)
    (tmp_path / "other").mkdir()
    err = _raised(lambda: torch.save({"w": torch.zeros(2)}, staging / "mp_rank_01_model_states.pt"))
    assert isinstance(err, RuntimeError) and "does not exist" in str(err)
    failure = storage_failure(err, tmp_path / "run", tmp_path / "run")
    assert failure is not None and failure.exit_code == 74
    assert str(failure).startswith(f"{staging} disappeared while the run was writing into it")
    assert storage_failure(err, tmp_path / "other", tmp_path / "other") is None  # not this run's directory


def test_a_checkpoint_is_on_the_disk_before_the_renames_publish_it(tmp_path, monkeypatch):
    """Every file of the checkpoint, its directory and the new `latest` are fsync'd before the
    rename that makes each visible, and the checkpoints directory after both renames."""
    import os

    from paco_ds.runtime.checkpoint import CheckpointManager

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), real_replace(a, b))[1])
    root = tmp_path / "checkpoints"
    CheckpointManager(root, keep_last=2, rank=0, world_size=1).save(None, "epoch_0001", {"w": torch.zeros(4)},
                                                                    {"epoch": 1})
    staging = str(root / ".staging-epoch_0001")
    publish = events.index(("replace", staging, str(root / "epoch_0001")))
    synced = {e[1] for e in events[:publish] if e[0] == "fsync"}
    assert {f"{staging}/trainer_state_rank0.pt", f"{staging}/meta.json", staging} <= synced
    point = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(root / "latest"))
    assert ("fsync", str(root / ".latest.tmp")) in events[publish:point]
    assert ("fsync", str(root)) in events[point:]
    assert (root / "latest").read_text() == "epoch_0001"
