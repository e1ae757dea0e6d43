"""Shared fixtures. Everything runs on CPU with tiny models built offline."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
sys.path.insert(0, str(REPO))

TINY = REPO / "configs" / "tiny" / "t2is.yaml"


def shared_file(*parts: str) -> Path:
    """A data file of the reference (its T2IS prompt metadata, PickScore test prompts) from a copy
    beside the repository (SHARED_DATA); the test is skipped when it is absent."""
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} not present")
    return p


def run_cli(*args: str, timeout: float = 120, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run a command with the project on PYTHONPATH; returns the completed process."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """A user's mistake: exit code 2 and exactly one line on stderr, no traceback; returns the line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


# Triton on CPU needs TRITON_INTERPRET=1 before `import triton`, and earlier tests may import it
# (deepspeed does): a kernel test module re-runs itself in a subprocess with the variable set.
TRITON_DEVICE = "cuda" if __import__("torch").cuda.is_available() else "cpu"
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
triton_kernel_test = pytest.mark.skipif(TRITON_DEVICE == "cpu" and not TRITON_INTERPRETED,
                                        reason="runs in the TRITON_INTERPRET=1 subprocess of test_in_the_interpreter")
in_parent_on_cpu = pytest.mark.skipif(TRITON_DEVICE != "cpu" or TRITON_INTERPRETED,
                                      reason="the kernels run in this process")


def run_in_triton_interpreter(test_file: str, min_passed: int) -> None:
    """Run `test_file` under TRITON_INTERPRET=1 and check that its kernel tests ran and passed."""
    out = run_cli("-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, timeout=600,
                  env={"TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    passed = re.search(r"(\d+) passed", out.stdout.strip().splitlines()[-1])
    assert passed and int(passed.group(1)) >= min_passed, out.stdout[-2000:]  # every kernel test ran


@pytest.fixture(scope="session")
def tiny_cfg():
    from paco_ds.grpo.plan import load_config

    return load_config(TINY)


@pytest.fixture(scope="session")
def tiny_policy(tiny_cfg):
    """A tiny FLUX policy with a LoRA whose B matrices are non-zero (so the adapter matters)."""
    import torch

    from paco_ds.models.flux import FluxPolicy
    from paco_ds.models.lora import add_lora

    policy = FluxPolicy.load(tiny_cfg.model, torch.device("cpu"))
    add_lora(policy.transformer, tiny_cfg.model.lora)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return policy
