"""`python -m kernels.bench` runs and writes its JSON and PNG (a smoke run on small settings)."""
import json

import pytest

from conftest import run_cli

pytestmark = pytest.mark.runs


def test_bench_quick_run_writes_json_and_png(tmp_path):
    out = run_cli("-m", "kernels.bench", "--quick", "--ops", "sde_fwd_bwd,grpo_advantages", "--out", str(tmp_path),
                  timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "cpu.json").read_text())
    assert (tmp_path / "cpu.png").stat().st_size > 0
    assert report["command"].startswith("OMP_NUM_THREADS=1 python -m kernels.bench --quick --ops")
    assert report["machine"]["cores"] and report["machine"]["torch"] and report["copy_bandwidth_gbs"] > 0
    assert report["timing"]["cache_flush_bytes"] > 0  # CPU: the caches are flushed before each timed call
    rows = {(r["op"], r["backend"]) for r in report["results"]}
    assert {("sde_fwd_bwd", "torch"), ("sde_fwd_bwd", "cpp"), ("grpo_advantages", "torch")} <= rows
    for r in report["results"]:
        assert r["median_ms"] > 0 and r["gbs"] > 0 and r["pct_copy"] > 0
        assert r["runs"] == r["backend"]  # what ran is what the row is named for (a fallback reads "cpp->torch")
        assert r["pct_copy"] <= 100 or "note" in r  # a figure above the copy bandwidth says why
    adv = {r["backend"]: r for r in report["results"] if r["op"] == "grpo_advantages"}
    assert adv["torch"]["speedup_vs_eager"] == 1 and adv["torch"]["groups"] > 0
    assert report["targets"]["backend"] == "cpp" and set(report["targets"]["speedup_vs_eager_by_batch"]) == {"1", "4"}
    assert "sde_fwd_bwd" in out.stdout and "vs eager" in out.stdout


def test_bench_prints_the_committed_compile_table(capsys):
    """`python -m kernels.bench --aot` prints, per GPU arch, every compiled kernel's worst registers,
    spills, shared memory and occupancy from kernels/bench/results/aot_sm*.json (under a second)."""
    import importlib

    from kernels import aot

    bench = importlib.import_module("kernels.bench.__main__")
    assert bench.main(["--aot"]) == 0
    out = capsys.readouterr().out
    for arch in aot.ARCHS:
        doc = json.loads((aot.RESULTS / f"aot_sm{arch}.json").read_text())
        for row in doc["summary"]:
            line = next(l for l in out.splitlines() if l.startswith(f"sm_{arch}") and f" {row['kernel']} " in l)
            assert line.split()[2:5] == [str(row["configs"]), str(row["failed"]), str(row["registers"])]


def test_help_and_bad_arguments_answer_before_torch_is_imported():
    """`--help` and an argument error come from the command line alone: torch (seconds to import) is
    imported only once the arguments are good."""
    code = ("import runpy, sys\n"
            "sys.argv = ['kernels.bench', *sys.argv[1:]]\n"
            "try:\n"
            "    runpy.run_module('kernels.bench', run_name='__main__')\n"
            "finally:\n"
            "    print('torch imported:', 'torch' in sys.modules)\n")
    out = run_cli("-c", code, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage: python -m kernels.bench" in out.stdout and "--ops OPS" in out.stdout
    assert out.stdout.strip().endswith("torch imported: False")
    out = run_cli("-c", code, "--ops", "sde_fwd,nope")
    assert out.returncode == 2 and "unknown ops ['nope']" in out.stderr
    assert out.stdout.strip().endswith("torch imported: False")
