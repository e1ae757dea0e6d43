"""Single-process runs of the trainer with a switch that must not change what trains, or changes only
what it says: the KL path's second forward, the C++ and torch kernel backends, gradient checkpointing.
`make test-runs-more` (outside CI's time: 5 launches, about 2.5 min of 2 cores); run it for a change to
the KL path, the kernels' backends or checkpointing."""
import json

import pytest

from distributed_runs import VOLATILE, metrics, stable, tail
from test_train_guards import ONE_EPOCH, _fault, _train

pytestmark = pytest.mark.runs_more


def test_kl_needs_a_second_forward_only_when_beta_is_positive(tmp_path):
    proc = _train(tmp_path / "kl", *ONE_EPOCH, "train.kl_beta=0.05")
    assert proc.returncode == 0, tail(proc)
    row = metrics(tmp_path / "kl")[0]
    assert row["train/forwards_per_step"] == 2.0 and row["train/kl"] > 0
    assert row["train/ratio_first"] == 1.0


# cpp vs torch: their log-probs and sampled latents differ by about one float ulp, which can flip a
# uint8 pixel and with it a byte of a JPEG (0.002 bits per pixel on a 64x64 image): the runs agree
# within these bounds, not bit for bit.
BACKEND_TOLERANCE = {"reward/jpeg_compressibility": 5e-3, "reward/combined": 5e-3, "reward/subfig_clipT": 1e-5,
                     "eval/": 5e-3, "adv/": 2e-2, "train/ratio": 1e-5, "train/grad_norm": 2e-4, "train/": 2e-5}


def test_cpp_and_torch_kernel_backends_train_alike(tmp_path):
    runs = {}
    for backend in ("cpp", "torch"):
        proc = _train(tmp_path / backend, *ONE_EPOCH, "train.num_epochs=2", "test.eval_freq=2",
                      f"kernels.backend={backend}")
        assert proc.returncode == 0, tail(proc)
        runs[backend] = metrics(tmp_path / backend)
    assert len(runs["cpp"]) == len(runs["torch"]) == 3
    for a, b in zip(runs["cpp"], runs["torch"]):
        assert set(a) == set(b)
        for k, v in a.items():
            if k.startswith(VOLATILE):
                continue
            tol = next((t for prefix, t in BACKEND_TOLERANCE.items() if k.startswith(prefix)), 0.0)
            assert abs(v - b[k]) <= tol, (a["epoch"], k, v, b[k])


def test_gradient_checkpointing_changes_memory_not_results(tmp_path):
    runs, saved = {}, {}
    for name, on in (("plain", "false"), ("checkpointed", "true")):
        proc = _fault("saved_activations", tmp_path / name, *ONE_EPOCH, f"model.gradient_checkpointing={on}")
        assert proc.returncode == 0, tail(proc)
        runs[name] = metrics(tmp_path / name)
        saved[name] = json.loads((tmp_path / name / "saved_activations.json").read_text())
    # activations autograd keeps for backward per training forward: the blocks' are recomputed instead
    assert saved["plain"]["forwards"] == saved["checkpointed"]["forwards"] > 0
    assert saved["checkpointed"]["max_bytes"] < 0.5 * saved["plain"]["max_bytes"], saved
    assert stable(runs["checkpointed"]) == stable(runs["plain"])
