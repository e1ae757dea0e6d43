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
VOLATILE = ("time/", "images_per_sec", "throughput/", "judge/latency_ms", "judge/sleep_s", "judge/wake_s")  # timings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(**extra) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    env.update(wandb_env(REPO / "build" / "wandb"))
    env.update(extra)
    return env


def wandb_env(home: Path) -> dict:
    """W&B for a run that logs to it (logging.wandb): offline whatever the recipe says, quiet, and
    W&B's own folders (settings, cache, its service's logs) under `home`, not the user's."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(home / "config"),
            "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data")}


def rank_launcher(nproc: int, port: int | None = None) -> list[str]:
    """The command that starts `nproc` ranks of a script on this machine: what `deepspeed --num_gpus N`
    runs once its runner has found the local resources, DeepSpeed's own local launcher
    (deepspeed.launcher.launch, which spawns the ranks, sets their environment and stops them all when
    one fails), without the runner's own interpreter start before it (an import of torch and
    DeepSpeed per launch, seconds each). The `deepspeed` command itself is launched by
    tests/runtime/test_distributed.py and `make demo`."""
    import base64

    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(nproc))}).encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}", "--master_addr=127.0.0.1",
            f"--master_port={port or free_port()}", "--enable_each_rank_log=None"]


def deepspeed_cli(nproc: int, port: int | None = None) -> list[str]:
    """`deepspeed --num_gpus N`, the command users run, runner and all: for what the runner itself does
    (its handling of signals, tests/grpo/test_stop.py)."""
    return [str(DEEPSPEED), "--num_gpus", str(nproc), "--master_port", str(port or free_port())]


def launch_cmd(script: str, run_dir: Path, *sets: str, nproc: int = 2, config: Path = TINY,
               extra: tuple[str, ...] = (), cli: bool = False) -> list[str]:
    """`script` on `nproc` ranks with the tiny recipe `config` in `run_dir`; `cli`: through the
    `deepspeed` command itself rather than its local launcher."""
    cmd = [*(deepspeed_cli(nproc) if cli else rank_launcher(nproc)), str(REPO / script),
           "--config", str(config), "--set", f"output_dir={run_dir.parent}", "--set", f"run_name={run_dir.name}"]
    for s in sets:
        cmd += ["--set", s]
    return cmd + list(extra)


def run_trainer(run_dir: Path, *sets: str, nproc: int = 2, script: str = "launch/train.py",
                extra: tuple[str, ...] = (), timeout: float = 600, config: Path = TINY,
                env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(launch_cmd(script, run_dir, *sets, nproc=nproc, extra=extra, config=config), cwd=REPO,
                          env=cpu_env(**(env or {})),
                          capture_output=True, text=True, timeout=timeout)
    return proc


def resume_copy(run_dir: Path, dest: Path, checkpoint: str, *sets: str, extra: tuple[str, ...] = (),
                **kwargs) -> subprocess.CompletedProcess:
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
    return run_trainer(dest, *sets, extra=("--resume", "latest", *extra), **kwargs)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def rank_probe(script: str, out: Path, name: str, nproc: int = 2, timeout: float = 300) -> list:
    """Run tests/scripts/`script` on `nproc` CPU ranks under the deepspeed launcher, writing to `out`;
    it must exit 0. Each rank's result, read from `out`/<name>_rank<r>.json."""
    cmd = [*rank_launcher(nproc), str(REPO / "tests/scripts" / script), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, tail(proc)
    return [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(nproc)]


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


# ------------------------------------------------------------------------------------ the run cache
# Sources a tiny run depends on: a cached run is reused only while these are unchanged.
RUN_SOURCES = ("paco_ds", "kernels", "launch", "configs", "csrc", "tests/scripts")


def source_digest() -> str:
    """A digest of every file a run reads from the repository (and of the interpreter)."""
    import hashlib

    h = hashlib.sha256(sys.executable.encode())
    for top in RUN_SOURCES:
        for p in sorted((REPO / top).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(REPO)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()[:16]


class Run:
    """A finished launch: its directory, return code and output."""

    def __init__(self, run_dir: Path, returncode: int, stdout: str, stderr: str):
        self.dir, self.returncode, self.stdout, self.stderr = run_dir, returncode, stdout, stderr

    def ok(self) -> "Run":
        """The run, asserting that it exited 0 (the message holds the end of its output)."""
        assert self.returncode == 0, f"{self.dir}: exit {self.returncode}\n{self.stdout[-3000:]}\n---\n{self.stderr[-3000:]}"
        return self

    def metrics(self) -> list[dict]:
        return metrics(self.dir)

    def epochs(self) -> list[dict]:
        """The metrics rows of trained epochs (evaluation-only rows left out)."""
        return [r for r in self.metrics() if "time/epoch" in r]


class RunCache:
    """Each distinct tiny configuration (script, recipe, overrides, world size) is launched once and
    every check reads that launch's outputs. Runs live under `root` (shared by the session's workers),
    each beside a `<name>.result.json` with its status and output; with `persist` (make's test targets
    set PACO_RUN_CACHE) the root is a folder named by a digest of the sources (RUN_SOURCES), so `make
    test` and `make test-runs` in one tree share a launch, and any change to the code launches it
    again. Checks must not write into a cached run's directory: a resume works on a copy
    (`resume_copy`)."""

    def __init__(self, root: Path, persist: bool = False):
        self.root = root / source_digest() if persist else root
        self.persist = persist
        self.launched: list[str] = []  # the names this session launched (the others came from disk)
        self._runs: dict[tuple, Run] = {}

    def get(self, name: str, *sets: str, script: str = "launch/train.py", nproc: int = 2, config: Path = TINY,
            timeout: float = 900) -> Run:
        """The run `name` (a directory name, unique per configuration) of `config` with `sets`. Pytest's
        workers (pytest-xdist) share the root: the first to ask launches it, holding a lock on
        `<name>.lock`, and the others wait for it and read its result."""
        import fcntl

        key = (script, nproc, str(config), sets)
        if key in self._runs:
            return self._runs[key]
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return self._get_locked(name, key, timeout)

    def _get_locked(self, name: str, key: tuple, timeout: float) -> Run:
        script, nproc, config, sets = key
        run_dir = self.root / name
        stamp = run_dir.parent / f"{name}.result.json"
        if stamp.is_file():
            saved = json.loads(stamp.read_text())
            if saved["key"] == [script, nproc, str(config), list(sets)]:
                self._runs[key] = Run(run_dir, saved["returncode"], saved["stdout"], saved["stderr"])
                return self._runs[key]
        clash = [k for k, r in self._runs.items() if r.dir == run_dir]
        assert not clash, f"run name {name!r} is used for two configurations: {clash[0]} and {key}"
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        proc = run_trainer(run_dir, *sets, nproc=nproc, script=script, timeout=timeout, config=Path(config))
        self.launched.append(name)
        run = Run(run_dir, proc.returncode, proc.stdout, proc.stderr)
        stamp.write_text(json.dumps({"key": [script, nproc, str(config), list(sets)], "returncode": proc.returncode,
                                     "stdout": proc.stdout, "stderr": proc.stderr}))
        self._runs[key] = run
        return run


# A loss or sampler recipe in 2 short epochs on jpeg compressibility alone (no judge).
SHORT_RUN = ("train.num_epochs=2", "sample.group_size=4", "test.eval_freq=0", "checkpoint.save_freq=1",
             "checkpoint.keep_last=2", "logging.num_train_images=0", "reward_servers=null",
             "rewards.train.terms={jpeg_compressibility: {weight: 1.0}}", "rewards.test=null")
# SHORT_RUN made small for 4 processes on 2 cores under parallel.sequence=2 (two groups of 2): one trained
# step of two, 32 px images (4 tokens), 16 prompt tokens, an evaluation at the start and the end
SEQUENCE_GROUPS_RUN = (*SHORT_RUN, "parallel.sequence=2", "sample.num_steps=2", "sample.noise_steps=[0]",
                       "train.resolution=32", "model.max_sequence_length=16", "sample.batch_size=2", "train.batch_size=2",
                       "test.eval_freq=2", "test.resolution=32", "test.num_steps=2", "logging.tensorboard=false")


def resumes_exactly(tmp_path: Path, config: Path, *sets: str) -> list[dict]:
    """A 2-epoch run of `config` (SHORT_RUN and `sets`), and a copy resumed from its epoch-1 checkpoint:
    their metrics are equal. Returns the full run's epoch rows."""
    full = tmp_path / "full"
    proc = run_trainer(full, *SHORT_RUN, *sets, config=config)
    assert proc.returncode == 0, tail(proc)
    resumed = resume_copy(full, tmp_path / "resumed", "epoch_0001", *SHORT_RUN, *sets, config=config)
    assert resumed.returncode == 0, tail(resumed)
    assert "resumed from" in resumed.stdout
    assert stable(metrics(tmp_path / "resumed")) == stable(metrics(full))
    rows = [r for r in metrics(full) if "time/epoch" in r]
    assert [r["epoch"] for r in rows] == [0, 1]  # SHORT_RUN's 2 epochs, each trained
    return rows


# What a family's tiny T2IS run logs every epoch (the recipe's rewards with the judge served by the run)
T2IS_FIELDS = ("reward/consistency_score/mean", "reward/subfig_clipT/mean", "reward/pickscore/mean", "train/loss",
               "train/grad_norm")


# What a video family's tiny text-to-video run logs every epoch (the judge asked about frame pairs,
# the image rewards' per-frame forms)
T2V_FIELDS = ("reward/frame_consistency/mean", "reward/subfig_clipT/mean", "reward/pickscore/mean",
              "reward/jpeg_compressibility/mean", "train/loss", "train/grad_norm")


def family_run_resumes_exactly(tmp_path: Path, config: Path, *sets: str, fields: tuple[str, ...] = T2IS_FIELDS,
                               forwards: float = 1.0) -> Path:
    """A family's tiny recipe for 2 epochs (`sets`) on 2 ZeRO-3 ranks: every epoch logs `fields`,
    finite; training's log-probs equal sampling's (ratio 1) with `forwards` transformer calls per
    trained step; the second epoch has a gradient; and a copy resumed from its epoch-1 checkpoint has
    the same metrics. Returns the full run's directory."""
    import math

    full = tmp_path / "full"
    proc = run_trainer(full, *sets, config=config)
    assert proc.returncode == 0, tail(proc)
    rows = [r for r in metrics(full) if "time/epoch" in r]
    assert [r["epoch"] for r in rows] == [0, 1]
    for r in rows:
        assert all(k in r and math.isfinite(r[k]) for k in fields), [k for k in fields if k not in r]
        assert r["train/ratio_first"] == 1.0  # log-probs at training equal those at sampling
        assert r["train/forwards_per_step"] == forwards  # beta = 0: no reference forward
    assert rows[1]["train/grad_norm"] > 0
    resumed = resume_copy(full, tmp_path / "resumed", "epoch_0001", *sets, config=config)
    assert resumed.returncode == 0, tail(resumed)
    assert "resumed from" in resumed.stdout
    assert stable(metrics(tmp_path / "resumed")) == stable(metrics(full))
    return full
