"""`python benchmarks/advantage_step.py --quick` runs and writes its JSON (the trainer's advantage step)."""
import pytest

from conftest import quick_benchmark

pytestmark = pytest.mark.runs


def test_quick_run_writes_json(tmp_path):
    out, report = quick_benchmark("advantage_step.py", tmp_path, "advantage_step_cpu.json")
    assert report["benchmark"] == "advantage_step_cpu"
    assert report["command"] == f"benchmarks/advantage_step.py --quick --out {tmp_path}"
    assert report["machine"]["cores"] and report["rewards"] == ["a", "b", "c"]
    (row,) = report["results"]  # 16 x 42, log-tame with the global std, torch on CPU
    assert (row["group_size"], row["groups"], row["aggregation"], row["backend"]) == (16, 42, "log_tame", "torch")
    assert row["median_ms"] > 0 and row["speedup_vs_torch"] == 1
    assert "log_tame" in out.stdout and "wrote" in out.stdout
