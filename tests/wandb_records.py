"""What an offline W&B run wrote, read back from its transaction log (`run-<id>.wandb`) with wandb's
own record type (`wandb.proto.wandb_internal_pb2.Record`), and the W&B processes a test left behind.

The installed wandb (0.31) ships no reader of that file in Python (wandb-core, its Go service, reads
it for `wandb sync`): the log is LevelDB's log format (32 KiB blocks of records, each a 7-byte header
of checksum, length and type FULL/FIRST/MIDDLE/LAST; W&B's checksum is the CRC-32 of the type byte and
the data) after W&B's 7-byte file header ":W&B", 0xBEE1, 0.
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

from paco_ds.runtime.metrics import WANDB_SERVICES

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: Path) -> list[bytes]:
    """The records of a .wandb file, each checked against its stored checksum."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), f"{path}: not a W&B log"
    out, pending, pos = [], None, HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # the zero-filled rest of the last block
            break
        chunk = data[pos + HEADER:pos + HEADER + length]
        assert crc == zlib.crc32(bytes([kind]) + chunk), f"{path}@{pos}: bad checksum"
        pos += HEADER + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind in (MIDDLE, LAST):
            assert pending is not None, f"{path}@{pos}: a record continued without its start"
            pending += chunk
            if kind == LAST:
                out.append(pending)
                pending = None
        else:
            raise AssertionError(f"{path}@{pos}: record type {kind}")
    return out


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    out = []
    for raw in raw_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        out.append(record)
    return out


def offline_runs(wandb_root: Path) -> list[Path]:
    """The .wandb files under `<dir>/wandb/`, oldest segment first (a resume writes a new one)."""
    return sorted(Path(wandb_root).glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)


def run_record(path: Path):
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")


def history(path: Path) -> dict[int, dict]:
    """{step: {key: value}} of the history rows, W&B's own `_step`, `_runtime` and `_timestamp` left
    out; a media value (an image) is the dict of its fields ({"_type": "image-file", "path": ...})."""
    rows: dict[int, dict] = {}
    for r in records(path):
        if r.WhichOneof("record_type") != "history":
            continue
        row = rows.setdefault(r.history.step.num, {})
        for item in r.history.item:
            path = [item.key] if item.key else list(item.nested_key)  # wandb 0.31 writes nested_key only
            value = json.loads(item.value_json)
            if len(path) > 1:
                row.setdefault(path[0], {})["/".join(path[1:])] = value
            elif not path[0].startswith("_"):
                row[path[0]] = value
    return rows


def numbers(row: dict) -> dict:
    """What TensorBoard and W&B get of a metrics.jsonl row: its numbers (None is a non-finite value)."""
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def split_images(rows: dict[int, dict]) -> tuple[dict[int, dict], dict[int, dict]]:
    """History rows as ({step: scalars}, {step: {key: image fields}}), steps without one left out."""
    scalars = {s: {k: v for k, v in r.items() if not isinstance(v, dict)} for s, r in rows.items()}
    images = {s: {k: v for k, v in r.items() if isinstance(v, dict)} for s, r in rows.items()}
    return {s: r for s, r in scalars.items() if r}, {s: r for s, r in images.items() if r}


def exit_code(path: Path) -> int | None:
    """The exit code the run was finished with, None when it was never finished."""
    return next((r.exit.exit_code for r in records(path) if r.WhichOneof("record_type") == "exit"), None)


def was_marked_preempting(path: Path) -> bool:
    return any(r.WhichOneof("record_type") == "preempting" for r in records(path))


def wandb_processes(marker: tuple[str, str] | None = None) -> list:
    """W&B's service processes (wandb-core and its system monitor) still alive; with `marker`
    (name, value), only those whose environment has it (a test's own, inherited from the run)."""
    import psutil

    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            program = (p.info["cmdline"] or [p.info["name"]])[0]
            if not any(name in program for name in WANDB_SERVICES):
                continue
            if marker is None or p.environ().get(marker[0]) == marker[1]:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found
