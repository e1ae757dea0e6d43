"""Atomic checkpoints with a retention limit, shared by the GRPO and SFT trainers.

Layout under `<run>/checkpoints/`:
    epoch_0004/          DeepSpeed engine state (trainable parameters only) + our state per rank
    latest               the name of the newest complete checkpoint (replaced atomically)
    .staging-epoch_0008/ a checkpoint being written (ignored, and removed on the next save)

Every rank writes into the staging directory; after a barrier rank 0 renames it into place and
only then points `latest` at it. A kill at any moment leaves the previous checkpoint usable.

A checkpoint proves itself: when it is published, meta.json records the size and SHA-256 of every
other file in it. `--resume DIR` verifies them before loading anything and names the first bad
file; `--resume latest` skips a corrupt checkpoint with a warning and takes the newest intact one.
(A checkpoint written before the manifest existed loads unverified.)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from paco_ds.runtime.distributed import barrier
from paco_ds.errors import UserError

LATEST = "latest"
META = "meta.json"

log = logging.getLogger(__name__)


class CorruptCheckpoint(UserError):
    """A checkpoint file is missing, truncated or altered since it was published."""


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_tree(path: Path, recursive: bool = True) -> None:
    """Flush `path` (a file, or a directory with everything under it) to the disk. A rename
    publishes a checkpoint atomically only if what it names is durable: without this, a power
    loss soon after a save can leave `latest` naming a checkpoint of empty files."""
    paths = [path]
    if path.is_dir() and recursive:
        paths = sorted(path.rglob("*"), key=lambda p: -len(p.parts)) + [path]  # files before their directories
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def manifest(ckpt_dir: Path) -> dict[str, dict]:
    """{relative path: {size, sha256}} of every file of a checkpoint but meta.json."""
    ckpt_dir = Path(ckpt_dir)
    return {str(p.relative_to(ckpt_dir)): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(ckpt_dir.rglob("*")) if p.is_file() and p.relative_to(ckpt_dir).as_posix() != META}


def verify(ckpt_dir: Path) -> dict:
    """The checkpoint's meta, after checking every recorded file's size and checksum (sizes first:
    a truncated file is found without reading the others). Raises CorruptCheckpoint naming the file."""
    ckpt_dir = Path(ckpt_dir)
    try:
        meta = json.loads((ckpt_dir / META).read_text())
    except (OSError, ValueError) as err:
        raise CorruptCheckpoint(f"{ckpt_dir / META}: unreadable ({err})") from None
    files = meta.get("files")
    if files is None:
        return meta
    for rel, rec in files.items():
        p = ckpt_dir / rel
        if not p.is_file():
            raise CorruptCheckpoint(f"{p}: missing from the checkpoint")
        size = p.stat().st_size
        if size != rec["size"]:
            raise CorruptCheckpoint(f"{p}: {size} bytes, {rec['size']} when the checkpoint was written (truncated?)")
    for rel, rec in files.items():
        if _sha256(ckpt_dir / rel) != rec["sha256"]:
            raise CorruptCheckpoint(f"{ckpt_dir / rel}: checksum differs from the one recorded when the checkpoint "
                                    "was written")
    return meta


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        # One state per GPU visible when saved; a resume may see more or fewer (another
        # CUDA_VISIBLE_DEVICES, a node with another GPU count): restore the devices both have.
        # A rank works on its own device, whose index is the same when the layout is.
        for device, s in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device)


class CheckpointManager:
    def __init__(self, root: Path, keep_last: int, rank: int, world_size: int):
        self.root, self.keep_last, self.rank, self.world_size = Path(root), keep_last, rank, world_size
        self.is_main = rank == 0

    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
                      and (p / "meta.json").is_file())

    def save(self, engine, tag: str, state: dict, meta: dict, write_extra=None, rng: dict | None = None) -> Path:
        """Collective: every rank calls it. `state` is this rank's state, `meta` rank 0's summary.
        `write_extra(staging_dir)`, when given, writes more files on rank 0 before the checkpoint is
        published (e.g. an exported adapter), so they are part of the atomic checkpoint. The world
        size is recorded: ZeRO partitions and per-rank states only load into the same one. `rng`:
        the RNG states to record instead of the current ones (a state captured earlier)."""
        meta = {**meta, "world_size": self.world_size}
        staging = self.root / f".staging-{tag}"
        if self.is_main:
            for old in self.root.glob(".staging-*"):
                shutil.rmtree(old, ignore_errors=True)
            staging.mkdir(parents=True, exist_ok=True)
        barrier()
        with self._writing(staging):
            if engine is not None:
                engine.save_checkpoint(str(self.root), tag=staging.name, exclude_frozen_parameters=True,
                                       save_latest=False)
            torch.save({**state, "rng": rng if rng is not None else rng_state()},
                       staging / f"trainer_state_rank{self.rank}.pt")
            fsync_tree(staging)  # this rank's files (on a shared disk, everyone's) are on the disk
        barrier()
        final = self.root / tag
        if self.is_main:
            with self._writing(staging):
                if write_extra is not None:
                    write_extra(staging)
                meta["files"] = manifest(staging)  # every rank's files are written (barrier above)
                (staging / META).write_text(json.dumps(meta, indent=2))
                fsync_tree(staging)
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            tmp = self.root / f".{LATEST}.tmp"
            tmp.write_text(tag)
            fsync_tree(tmp)
            os.replace(tmp, self.root / LATEST)
            fsync_tree(self.root, recursive=False)  # the two renames themselves
            for old in self.complete()[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    @contextlib.contextmanager
    def _writing(self, staging: Path):
        """A full disk or a deleted run directory while saving: the partial checkpoint is removed
        (its space is what the disk lacks), and the error is one line naming the path and the
        checkpoint `latest` still names, untouched."""
        from paco_ds.runtime.storage import StorageError, storage_failure

        try:
            yield
        except (OSError, RuntimeError) as err:
            failure = storage_failure(err, staging, self.root.parent)
            if failure is None:
                raise
            shutil.rmtree(staging, ignore_errors=True)
            done = self.complete()
            kept = f"; the last complete checkpoint, {done[-1]}, is intact" if done else ""
            raise StorageError(f"saving checkpoint {staging.name.removeprefix('.staging-')}: {failure}{kept}") from err

    def resolve(self, spec: str, flag: str = "--resume") -> Path:
        """'latest' or a checkpoint directory -> the verified directory; a clear error when there is
        none. 'latest' falls back over corrupt checkpoints (newest first) with a warning each."""
        if spec == LATEST:
            pointer = self.root / LATEST
            named = self.root / pointer.read_text().strip() if pointer.is_file() else None
            candidates = sorted(self.complete(), reverse=True)
            if named is not None and named in candidates:  # the pointer's first, then older ones
                candidates.remove(named)
                candidates.insert(0, named)
            if not candidates:
                raise UserError(f"{flag} latest: no checkpoint in {self.root}")
            for path in candidates:
                try:
                    verify(path)
                    return path
                except CorruptCheckpoint as err:
                    log.warning("%s latest: skipping corrupt checkpoint %s (%s)", flag, path.name, err)
            raise UserError(f"{flag} latest: every checkpoint in {self.root} is corrupt (the newest: "
                            f"{candidates[0].name}); see the warnings above")
        path = Path(spec)
        if not (path / META).is_file():
            raise UserError(f"{flag} {spec}: {path} is not a complete checkpoint (no meta.json)")
        try:
            verify(path)
        except CorruptCheckpoint as err:
            raise CorruptCheckpoint(f"{flag} {spec}: corrupt checkpoint: {err}") from None
        return path

    def load(self, engine, path: Path) -> tuple[dict, dict]:
        """Restore the engine; returns (this rank's state, meta). RNG states are restored too."""
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("world_size", self.world_size) != self.world_size:
            raise UserError(f"--resume {path}: written with world size {meta['world_size']}, "
                            f"this run has {self.world_size}")
        if engine is not None:
            load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_module_strict=False)
            if load_path is None:
                raise UserError(f"--resume: DeepSpeed could not load {path}")
        state_file = path / f"trainer_state_rank{self.rank}.pt"
        if not state_file.is_file():
            raise UserError(f"--resume: {state_file} missing (was the checkpoint written with another world size?)")
        try:
            state = torch.load(state_file, map_location="cpu", weights_only=False)
        except (ModuleNotFoundError, AttributeError) as err:  # pickled classes this version no longer has
            raise UserError(f"--resume: {state_file} holds {err.name if isinstance(err, ModuleNotFoundError) else err} "
                            "from another paco_ds version; resume from an end-of-epoch checkpoint "
                            "(a mid-epoch preemption checkpoint keeps the epoch's samples as that version's objects)"
                            ) from None
        set_rng_state(state.pop("rng"))
        return state, meta
