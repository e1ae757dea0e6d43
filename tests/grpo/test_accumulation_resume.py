"""A ZeRO-3 stop between two optimizer steps, for real (2 processes, the deepspeed launcher): what a
mid-epoch checkpoint keeps (paco_ds/grpo/preemption.py) resumes the accumulation exactly, after the
optimizer step's first micro-step too, which DeepSpeed has not counted yet when the stop is answered."""
import json
import subprocess

import pytest

from distributed_runs import DEEPSPEED, REPO, cpu_env, free_port

pytestmark = pytest.mark.stop


def test_a_stop_after_any_micro_step_resumes_the_accumulation_exactly(tmp_path):
    cmd = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_port()),
           str(REPO / "tests/scripts/accumulation_probe.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in range(2):
        rows = json.loads((tmp_path / f"accumulation_rank{rank}.json").read_text())
        assert [r["k"] for r in rows] == [1, 2, 3]
        assert [r["saved_micro_steps"] for r in rows] == [1, 2, 3], rows  # every micro-step done is counted
        for r in rows:
            assert r["moved"], r  # the optimizer stepped after the resume
            assert r["equal"], r  # and landed on the uninterrupted run's parameters, exactly
