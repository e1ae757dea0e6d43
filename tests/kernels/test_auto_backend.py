"""`kernels.backend: auto` on CUDA tensors runs each op on the backend that measured faster on the GPUs:
the Triton kernel, except for the ops in kernels.AUTO_TORCH_ON_CUDA, whose kernel the committed
benchmark results (kernels/bench/results/<gpu>.json) measured slower than eager torch at most shapes.
The routing itself is checked with a stand-in CUDA device: no GPU runs here."""
import json
import statistics

import pytest

import kernels
from conftest import REPO
from kernels.bench.run import KERNEL_OP

pytestmark = pytest.mark.fast

GPU_RESULTS = sorted((REPO / "kernels" / "bench" / "results").glob("nvidia-*.json"))


def _median_speedups() -> dict[str, list[float]]:
    """Per kernels op, the median Triton speed-up over eager torch on each benchmarked GPU."""
    out: dict[str, list[float]] = {}
    for path in GPU_RESULTS:
        by_op: dict[str, list[float]] = {}
        for row in json.loads(path.read_text())["results"]:
            if row["backend"] == "triton" and row.get("speedup_vs_eager") and row["op"] in KERNEL_OP:
                by_op.setdefault(KERNEL_OP[row["op"]], []).append(row["speedup_vs_eager"])
        for op, values in by_op.items():
            out.setdefault(op, []).append(statistics.median(values))
    return out


def test_the_torch_routed_ops_are_those_the_gpus_measured_slower():
    assert len(GPU_RESULTS) >= 2  # the H100 and the H200
    medians = _median_speedups()
    slower = {op for op, per_gpu in medians.items() if all(m < 1.0 for m in per_gpu)}
    assert slower == set(kernels.AUTO_TORCH_ON_CUDA) == {"kl_to_reference"}, medians
    assert all(m > 1.0 for op, per_gpu in medians.items() if op not in slower for m in per_gpu), medians


def test_auto_routes_those_ops_to_torch_on_cuda_and_the_others_to_triton(monkeypatch):
    monkeypatch.setattr(kernels, "_has_triton", lambda: True)
    assert kernels.active_backend("kl_to_reference", "cuda", "auto") == "torch"
    assert kernels.active_backend("sde_step", "cuda", "auto") == "triton"
    assert kernels.active_backend("ppo_clip_loss", "cuda", "auto") == "triton"
    assert kernels.active_backend("kl_to_reference", "cuda", "triton") == "triton"  # asked for by name: it runs
