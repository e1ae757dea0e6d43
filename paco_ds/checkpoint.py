"""Atomic checkpoints with a retention limit, shared by the GRPO and SFT trainers.

Layout under `<run>/checkpoints/`:
    epoch_0004/          DeepSpeed engine state (trainable parameters only) + our state per rank
    latest               the name of the newest complete checkpoint (replaced atomically)
    .staging-epoch_0008/ a checkpoint being written (ignored, and removed on the next save)

Every rank writes into the staging directory; after a barrier rank 0 renames it into place and
only then points `latest` at it. A kill at any moment leaves the previous checkpoint usable.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from paco_ds.distributed import barrier
from paco_ds.errors import UserError

LATEST = "latest"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, root: Path, keep_last: int, rank: int, world_size: int):
        self.root, self.keep_last, self.rank, self.world_size = Path(root), keep_last, rank, world_size
        self.is_main = rank == 0

    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
                      and (p / "meta.json").is_file())

    def save(self, engine, tag: str, state: dict, meta: dict, write_extra=None) -> Path:
        """Collective: every rank calls it. `state` is this rank's state, `meta` rank 0's summary.
        `write_extra(staging_dir)`, when given, writes more files on rank 0 before the checkpoint is
        published (e.g. an exported adapter), so they are part of the atomic checkpoint. The world
        size is recorded: ZeRO partitions and per-rank states only load into the same one."""
        meta = {**meta, "world_size": self.world_size}
        staging = self.root / f".staging-{tag}"
        if self.is_main:
            for old in self.root.glob(".staging-*"):
                shutil.rmtree(old, ignore_errors=True)
            staging.mkdir(parents=True, exist_ok=True)
        barrier()
        if engine is not None:
            engine.save_checkpoint(str(self.root), tag=staging.name, exclude_frozen_parameters=True, save_latest=False)
        torch.save({**state, "rng": rng_state()}, staging / f"trainer_state_rank{self.rank}.pt")
        barrier()
        final = self.root / tag
        if self.is_main:
            if write_extra is not None:
                write_extra(staging)
            (staging / "meta.json").write_text(json.dumps(meta, indent=2))
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            tmp = self.root / f".{LATEST}.tmp"
            tmp.write_text(tag)
            os.replace(tmp, self.root / LATEST)
            for old in self.complete()[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    def resolve(self, spec: str) -> Path:
        """'latest' or a checkpoint directory -> the directory; a clear error when there is none."""
        if spec == LATEST:
            pointer = self.root / LATEST
            if not pointer.is_file():
                raise UserError(f"--resume latest: no checkpoint in {self.root}")
            path = self.root / pointer.read_text().strip()
        else:
            path = Path(spec)
        if not (path / "meta.json").is_file():
            raise UserError(f"--resume {spec}: {path} is not a complete checkpoint (no meta.json)")
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
        state = torch.load(state_file, map_location="cpu", weights_only=False)
        set_rng_state(state.pop("rng"))
        return state, meta
