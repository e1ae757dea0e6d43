"""docs/benchmarks.md's switch table and benchmarks/results/switches.json are what benchmarks/switches.py
makes from the benchmarks' committed results: neither drifts from the measurements it cites."""
import json
import subprocess
import sys

import pytest

from distributed_runs import REPO

pytestmark = pytest.mark.fast


def test_the_docs_table_is_the_scripts_output():
    table = subprocess.run([sys.executable, str(REPO / "benchmarks/switches.py"), "--markdown"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout
    assert table.count("\n") == 9  # the header, its rule and 7 switches
    assert table in (REPO / "docs/benchmarks.md").read_text(), "rerun: python benchmarks/switches.py --markdown"


def test_the_committed_json_is_the_scripts_output(tmp_path):
    out = tmp_path / "switches.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks/switches.py"), "--out", str(out)], cwd=REPO,
                   capture_output=True, text=True, check=True)
    fresh = json.loads(out.read_text())
    assert fresh == json.loads((REPO / "benchmarks/results/switches.json").read_text()), \
        "rerun: python benchmarks/switches.py"
    zero3 = next(r for r in fresh["switches"] if r["switch"] == "`model.compile`")
    assert zero3["sources"] == ["compile_blocks_cpu.json", "zero3_compile_cpu.json", "compile_blocks_nvidia-h200.json"]
    assert zero3["cpu"]["zero3_sampling_phase"] > 0
    assert zero3["gpu_measured"]["training_step"] > 1 and f"{zero3['gpu_measured']['sampling_call']:.2f}x" in zero3["gpu"]
