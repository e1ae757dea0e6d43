"""What the serving benchmarks share: the machine description, a tiny judge server, the output."""
from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(REPO))

JUDGE = "paco-reward-tiny"


def device_slug(device) -> str:
    """'cpu', or the GPU's name as a file-name stem (e.g. nvidia-h100-80gb-hbm3), as kernels.bench names its results."""
    from kernels.bench.run import device_slug as slug

    return slug(device)


def machine() -> dict:
    import torch

    cpu = "unknown"
    with contextlib.suppress(OSError):
        cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                    if l.startswith("model name")), cpu)
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cores": os.cpu_count(), "cpu_model": cpu, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available()
            else None, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "load_average_at_start": os.getloadavg()}


@contextlib.contextmanager
def tiny_judge(**overrides) -> Iterator[str]:
    """The tiny Qwen2.5-VL on the built-in hf engine, on a free port; yields its base URL."""
    from paco_ds.serving import manager
    from paco_ds.recipe.servers import ServersConfig

    cfg = ServersConfig(engine="hf", models=[{"name": JUDGE, "tiny": True}], port=0, max_logprobs=267,
                        **overrides)
    with tempfile.TemporaryDirectory(prefix="paco_judge_") as state_dir:
        state = manager.start(cfg, state_dir, exit_with_parent=True)
        try:
            yield state["endpoints"][JUDGE]
        finally:
            manager.stop(state_dir)


def git_state(root: Path) -> dict:
    """The checkout's commit and whether its tree was clean (the paths that were not)."""
    import subprocess

    def git(*a):
        r = subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True)
        # rstrip: porcelain's first line starts with a space (" M path") that strip() would eat with the path's 1st letter
        return r.stdout.rstrip() if r.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    status = git("status", "--porcelain")
    dirty = [line[3:] for line in (status or "").splitlines()]
    return {"root": str(root), "commit": head, "clean": head is not None and status == "", "dirty_paths": dirty}


def write_report(name: str, report: dict, out: Path, machine_info: dict) -> Path:
    """`machine_info`: `machine()` taken when the benchmark started (the load average matters). The
    report records the commit it ran and whether the tree was clean (kernels/bench/source.py)."""
    from kernels.bench.source import source_state

    out.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": name, "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info,
              "source": source_state(), **report}
    path = out / f"{name}.json"
    path.write_text(json.dumps(report, indent=1))
    return path
