"""Helpers to run the trainer for real: the deepspeed launcher, 2 processes, ZeRO-3 over gloo."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny" / "t2is.yaml"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"

# Volatile metrics (wall-clock) that legitimately differ between two identical runs.
VOLATILE = ("time/", "images_per_sec", "judge/latency_ms", "judge/sleep_s", "judge/wake_s")  # timings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(**extra) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    env.update(extra)
    return env


def launch_cmd(script: str, run_dir: Path, *sets: str, nproc: int = 2, config: Path = TINY,
               extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [str(DEEPSPEED), "--num_gpus", str(nproc), "--master_port", str(free_port()), str(REPO / script),
           "--config", str(config), "--set", f"output_dir={run_dir.parent}", "--set", f"run_name={run_dir.name}"]
    for s in sets:
        cmd += ["--set", s]
    return cmd + list(extra)


def run_trainer(run_dir: Path, *sets: str, nproc: int = 2, script: str = "launch/train.py",
                extra: tuple[str, ...] = (), timeout: float = 600, config: Path = TINY) -> subprocess.CompletedProcess:
    proc = subprocess.run(launch_cmd(script, run_dir, *sets, nproc=nproc, extra=extra, config=config), cwd=REPO,
                          env=cpu_env(),
                          capture_output=True, text=True, timeout=timeout)
    return proc


def resume_copy(run_dir: Path, dest: Path, checkpoint: str, *sets: str, **kwargs) -> subprocess.CompletedProcess:
    """A finished run resumed from one of its own checkpoints in a copy of its directory: the later
    checkpoints are removed and `latest` names `checkpoint`, as if the run had stopped there.
    The resumed copy's metrics must then equal the run's (one launch instead of a cut run and its
    resume)."""
    import shutil

    shutil.copytree(run_dir, dest, symlinks=True)
    ckpts = dest / "checkpoints"
    assert (ckpts / checkpoint / "meta.json").is_file(), f"{run_dir} kept no checkpoint {checkpoint}"
    for later in ckpts.iterdir():
        if later.is_dir() and later.name > checkpoint:
            shutil.rmtree(later)
    (ckpts / "latest").write_text(checkpoint)
    return run_trainer(dest, *sets, extra=("--resume", "latest"), **kwargs)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def tail(proc: subprocess.CompletedProcess, n: int = 3000) -> str:
    return (proc.stdout[-n:] + "\n---\n" + proc.stderr[-n:])


def finish(proc: subprocess.Popen, timeout: float) -> int:
    """`proc`'s exit code; past `timeout` its whole session is killed and the test fails."""
    import pytest

    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the run did not stop within {timeout}s")
