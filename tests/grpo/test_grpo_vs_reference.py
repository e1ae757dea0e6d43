"""`python benchmarks/grpo_vs_reference.py --quick` runs both epochs on the tiny FLUX and writes its JSON."""
import json

import pytest

from conftest import run_cli


def test_quick_run_compares_both_epochs(tmp_path):
    out_file = tmp_path / "gvr.json"
    out = run_cli("benchmarks/grpo_vs_reference.py", "--quick", "--out", str(out_file), timeout=180,
                  env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out_file.read_text())
    assert report["command"].endswith(f"benchmarks/grpo_vs_reference.py --quick --out {out_file}")
    assert report["machine"]["cores"] and report["config"]["quick"] and report["reference_simplifies"]
    a, b = report["paco_ds"], report["reference"]
    assert a["images_per_sec"] > 0 and b["images_per_sec"] > 0
    assert report["images_per_sec"] == {"paco_ds": a["images_per_sec"], "reference": b["images_per_sec"]}
    assert report["speedup"] == pytest.approx(a["images_per_sec"] / b["images_per_sec"], rel=1e-12)
    # the schedule of work, from the hooks: 1 forward per trained step against 3 (old, current, ref) at beta 0
    assert a["trained_steps"] == b["trained_steps"] == report["config"]["images"]
    assert a["forwards_per_trained_step"] == 1 and b["forwards_per_trained_step"] == 3
    assert b["forwards_per_trained_step"] == 3 * a["forwards_per_trained_step"]
    assert a["calls_per_epoch"]["train"]["transformer_forwards"] == a["trained_steps"]
    assert b["calls_per_epoch"]["train"]["transformer_forwards"] == 3 * b["trained_steps"]
    # cached embeddings vs the text encoders re-run in every log-prob; one decode vs two
    assert a["text_encodes_per_trained_step"] == 0 and b["text_encodes_per_trained_step"] == 3
    assert a["vae_decodes_per_image"] == 1 and b["vae_decodes_per_image"] == 2
    # the same sampling and gradient work: same rollout forwards, real AdamW steps in both
    sample_a, sample_b = a["calls_per_epoch"]["sample"], b["calls_per_epoch"]["sample"]
    assert sample_a["transformer_forwards"] == sample_b["transformer_forwards"] == 3 * report["config"]["images"]
    assert a["adamw_steps_taken"] == b["adamw_steps_taken"] == 2 * report["config"]["repeats"]
    assert "paco_ds / reference images/s" in out.stdout
