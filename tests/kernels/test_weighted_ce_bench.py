"""`python benchmarks/weighted_ce.py --quick` runs and writes its JSON (a smoke run at small sizes)."""
import pytest

from conftest import quick_benchmark

pytestmark = pytest.mark.runs


def test_quick_run_writes_json(tmp_path):
    out, report = quick_benchmark("weighted_ce.py", tmp_path, "weighted_ce_cpu.json", timeout=120)
    assert report["command"] == f"python benchmarks/weighted_ce.py --quick --out {tmp_path}"
    assert report["config"]["vocab"] == 16384 and report["machine"]["cores"] and report["method"]
    rows = {r["variant"]: r for r in report["results"]}
    assert set(rows) == {"naive", "fused"}
    assert all(r["median_s"] > 0 and r["peak_bytes"] > 0 for r in rows.values())
    # the naive path holds at least its fp32 logits; the fused one computes the same loss and gradient
    assert rows["naive"]["peak_bytes"] >= report["analytic_bytes"]["naive_logits_fp32"]
    assert report["agreement"]["grad_rel_diff"] < 1e-5 and report["agreement"]["loss_abs_diff"] < 1e-5
    assert len(report["ratios"]["time_by_round"]) == 2 and "fused / naive: memory" in out.stdout
    # the verdict on each target is printed, and a miss is said in so many words
    for k in ("memory", "time"):
        verdict = "met" if report["targets"][f"{k}_met"] else "MISSED"
        assert f"target <= {report['targets'][f'{k}_ratio_max']}: {verdict})" in out.stdout, out.stdout
    missed = [k for k in ("memory", "time") if not report["targets"][f"{k}_met"]]
    assert ("TARGET MISSED" in out.stdout) == bool(missed), out.stdout
