"""A ZeRO-3 stop between two optimizer steps, for real (2 processes, the deepspeed launcher): what a
mid-epoch checkpoint keeps (paco_ds/grpo/preemption.py) resumes the accumulation exactly, after the
optimizer step's first micro-step too, which DeepSpeed has not counted yet when the stop is answered."""
import pytest

from distributed_runs import rank_probe

pytestmark = pytest.mark.stop


def test_a_stop_after_any_micro_step_resumes_the_accumulation_exactly(tmp_path):
    for rows in rank_probe("accumulation_probe.py", tmp_path, "accumulation"):
        assert [r["k"] for r in rows] == [1, 2, 3]
        assert [r["saved_micro_steps"] for r in rows] == [1, 2, 3], rows  # every micro-step done is counted
        for r in rows:
            assert r["moved"], r  # the optimizer stepped after the resume
            assert r["equal"], r  # and landed on the uninterrupted run's parameters, exactly
