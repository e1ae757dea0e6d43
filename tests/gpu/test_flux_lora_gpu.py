"""The reduced full-width FLUX with LoRA in bf16 on the GPU: sampling, a training step through the Triton
kernels, and sampling again, in a process of its own with CUDA_LAUNCH_BLOCKING=1 (flux_lora_probe.py).
The first H100 run of the lane hit an illegal memory access in this sequence (compile and reference stages)
and a bf16 GRPO run whose every optimizer step was skipped; on failure this test's message names the stage
and the op."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

PROBE = Path(__file__).resolve().parent / "flux_lora_probe.py"


def test_reduced_flux_lora_samples_and_trains_cleanly_in_bf16():
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    proc = subprocess.run([sys.executable, str(PROBE), "--device", "cuda", "--backend", "triton"], env=env,
                          capture_output=True, text=True, timeout=600)
    done = [l for l in proc.stdout.splitlines() if l.startswith("ok ")]
    assert proc.returncode == 0 and "probe passed" in proc.stdout, (
        f"stages passed: {done}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    assert len(done) == 8
