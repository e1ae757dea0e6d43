"""The GRPO trainer for real: the deepspeed launcher, 2 processes, ZeRO-3 over gloo, tiny models.

The fast tier's one shared run: 4 epochs of the tiny recipe as shipped (all three PaCo rewards, the
consistency judge on an hf-engine server the run starts and stops; through tests/scripts/train_probe.py,
which also records the partitioning and the gathered LoRA of each rank), launched once per session by
the run cache, serves every check here. Its resume, a killed rank and a run that learns are in
tests/grpo/test_train_runs.py.
"""
import json
import math
import subprocess

import pytest
from PIL import Image

from distributed_runs import REPO, cpu_env, metrics, tail

pytestmark = pytest.mark.fast

# Short runs: 4 epochs of 2 prompts x 4 images, eval and checkpoints every 2.
FAST = ("train.num_epochs=4", "sample.group_size=4", "test.eval_freq=2", "checkpoint.save_freq=2",
        "checkpoint.keep_last=2", "logging.wandb.mode=offline")

EPOCH_FIELDS = [
    "reward/jpeg_compressibility/mean", "reward/jpeg_compressibility/std", "reward/subfig_clipT/mean",
    "reward/pickscore/mean", "reward/consistency_score/mean", "reward/combined/mean", "adv/adv_abs_mean", "adv/zero_std_ratio", "adv/global_std",
    "train/loss", "train/policy_loss", "train/kl", "train/ratio", "train/ratio_first", "train/clipfrac",
    "train/grad_norm", "train/nonfinite_steps", "time/sample", "time/reward_wait", "time/train", "time/epoch",
    "images_per_sec", "throughput/images_per_device_sec", "throughput/mfu", "global_step",
]


@pytest.fixture(scope="module")
def full_run(runs):
    return runs.get("t2is_full", *FAST, script="tests/scripts/train_probe.py").ok().dir


def _probes(run_dir):
    return [json.loads((run_dir / f"probe_rank{r}.json").read_text()) for r in (0, 1)]


def test_zero3_partitions_every_transformer_parameter(full_run):
    for probe in _probes(full_run):
        assert probe["world_size"] == 2
        rows = probe["partition"]
        assert len(rows) > 50
        bad = [r["name"] for r in rows if not r["local"] < r["full"]]
        assert not bad, f"not partitioned: {bad[:5]}"


def test_both_ranks_hold_identical_lora_after_gather(full_run):
    a, b = _probes(full_run)
    assert a["lora_numel"] == b["lora_numel"] > 0
    assert a["lora_digest"] == b["lora_digest"]


def test_metrics_have_every_field_for_every_epoch(full_run):
    rows = [r for r in metrics(full_run) if "time/epoch" in r]
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        missing = [k for k in EPOCH_FIELDS if k not in r]
        assert not missing, (r["epoch"], missing)
        assert all(isinstance(r[k], (int, float)) and math.isfinite(r[k]) for k in EPOCH_FIELDS)
        assert r["global_step"] == 2 * (r["epoch"] + 1)  # two optimizer steps per epoch
    evals = [r for r in metrics(full_run) if "eval/jpeg_compressibility/mean" in r]
    assert [r["epoch"] for r in evals] == [0, 2, 4]


def test_ratio_is_exactly_one_on_the_first_micro_step_and_one_forward_per_step(full_run):
    rows = [r for r in metrics(full_run) if "time/epoch" in r]
    assert len(rows) == 4
    for r in rows:
        assert r["train/ratio_first"] == 1.0
        assert r["train/forwards_per_step"] == 1.0  # beta = 0: no reference forward
        # noise at every step (sample.noise_steps 0..5): nothing is shared or walked in fewer steps
        assert r["sample/transformer_calls"] == 2 * 4 * 6  # 2 prompts x 4 images x 6 steps
        assert r["train/ratio"] != 1.0  # the second optimizer step sees the updated policy


def test_train_and_eval_images_have_their_own_resolutions(full_run):
    rows = metrics(full_run)
    assert {r["train/height"] for r in rows if "train/height" in r} == {64.0}
    assert {(r["eval/height"], r["eval/width"]) for r in rows if "eval/height" in r} == {(128.0, 128.0)}
    grid = Image.open(full_run / "images" / "eval_epoch0004.png")
    assert grid.size[0] >= 2 * 128  # a grid of 128 px eval images


def test_run_leaves_checkpoints_lora_and_report(full_run):
    ckpts = sorted(p.name for p in (full_run / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["epoch_0002", "epoch_0004"]  # keep_last=2 removed epoch_0000
    assert (full_run / "checkpoints" / "latest").read_text() == "epoch_0004"
    assert (full_run / "lora" / "pytorch_lora_weights.safetensors").is_file()
    page = (full_run / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 3 and "Train rewards" in page


def test_wandb_has_the_runs_numbers_and_grids_at_their_epochs(full_run):
    """logging.wandb.mode=offline: rank 0 alone wrote one W&B run and finished it with exit 0; its
    history is metrics.jsonl's numbers epoch for epoch and the sample grids of images/ at theirs
    (the same pixels), and every checkpoint carries its id, which a resume continues."""
    from wandb_records import exit_code, history, numbers, offline_runs, run_record, split_images

    [segment] = offline_runs(full_run)
    run = run_record(segment)
    assert exit_code(segment) == 0 and run.display_name == full_run.name
    for ckpt in ("epoch_0002", "epoch_0004"):
        assert json.loads((full_run / "checkpoints" / ckpt / "meta.json").read_text())["wandb_run_id"] == run.run_id
    scalars, images = split_images(history(segment))
    assert scalars == {r["epoch"]: numbers(r) for r in metrics(full_run)}
    grids = sorted(p.stem for p in (full_run / "images").glob("*.png"))
    assert sorted(f"{key.split('/')[1]}_epoch{step:04d}" for step, row in images.items() for key in row) == grids
    for step, row in images.items():
        for key, image in row.items():
            sent = Image.open(segment.parent / "files" / image["path"]).convert("RGB")
            kept = Image.open(full_run / "images" / f"{key.split('/')[1]}_epoch{step:04d}.png").convert("RGB")
            assert sent.tobytes() == kept.tobytes()





def test_export_lora_from_one_process_matches_the_runs_own_export(full_run, tmp_path):
    """--export-lora reads the ZeRO checkpoint files: plain python (world size 1; the run had 2),
    no judge started, and the adapter (EMA, as the run exports it) is the run's own, bit for bit."""
    import shutil
    import sys

    import torch
    from safetensors.torch import load_file

    from distributed_runs import TINY

    run = tmp_path / full_run.name
    shutil.copytree(full_run / "checkpoints", run / "checkpoints", symlinks=True)
    proc = subprocess.run([sys.executable, "launch/train.py", "--config", str(TINY), "--set", f"output_dir={tmp_path}",
                           "--set", f"run_name={run.name}", "--export-lora", "latest"], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc)
    assert "from epoch_0004" in proc.stdout and "written by 2 ranks, EMA" in proc.stdout
    assert not (run / "reward_servers").exists()
    ours = load_file(run / "lora" / "pytorch_lora_weights.safetensors")
    theirs = load_file(full_run / "lora" / "pytorch_lora_weights.safetensors")
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(float(v.abs().max()) > 0 for k, v in ours.items() if "lora_B" in k)  # trained, not the init
    # One adapter config from both paths, peft's own: peft reads adapter_config.json, diffusers the
    # same config from the weights file's metadata.
    import json

    from diffusers import FluxPipeline
    from peft import LoraConfig

    configs = [LoraConfig.from_pretrained(str(d / "lora")) for d in (run, full_run)]
    assert configs[0].to_dict() == configs[1].to_dict()
    assert (configs[0].r, configs[0].lora_alpha) == (8, 16) and configs[0].target_modules
    for d in (run, full_run):
        _, metadata = FluxPipeline.lora_state_dict(str(d / "lora"), return_lora_metadata=True)
        stored = json.loads((d / "lora" / "adapter_config.json").read_text())
        assert metadata["transformer.r"] == stored["r"] == 8  # diffusers keys the metadata by component
        assert sorted(metadata["transformer.target_modules"]) == sorted(stored["target_modules"])


def _dry_resume(full_run, tmp_path, *sets, allow=()):
    """`--dry-run --resume latest` of a copy of the shared run's checkpoints with `sets`."""
    import shutil

    from conftest import run_cli

    shutil.copytree(full_run / "checkpoints", tmp_path / "run" / "checkpoints", symlinks=True)
    args = ["launch/train.py", "--config", str(REPO / "configs/tiny/t2is.yaml"), "--dry-run", "--resume", "latest",
            "--set", f"output_dir={tmp_path}", "--set", "run_name=run", *FAST_SETS]
    for s in sets:
        args += ["--set", s]
    for key in allow:
        args += ["--allow-changed", key]
    return run_cli(*args)


FAST_SETS = [a for s in FAST for a in ("--set", s)]


@pytest.mark.parametrize("change, key", [("train.loss=nft", "train.loss"), ("model.lora.rank=4", "model.lora.rank"),
                                         ("rewards.train.terms.consistency_score.top_logprobs=100", "rewards.train.terms")])
def test_a_resume_that_would_be_another_run_is_refused_naming_the_key(full_run, tmp_path, change, key):
    from conftest import one_line_error

    line = one_line_error(_dry_resume(full_run, tmp_path, change))
    assert f"config key '{key}': --resume" in line and f"this recipe gives" in line, line
    assert f"--allow-changed {key} to resume anyway" in line


def test_a_safe_change_on_resume_is_allowed_and_said_once(full_run, tmp_path):
    out = _dry_resume(full_run, tmp_path, "train.num_epochs=6", "test.eval_freq=3")
    assert out.returncode == 0, out.stderr
    assert "changed settings: train.num_epochs 4 -> 6, test.eval_freq 2 -> 3" in out.stdout


def test_allow_changed_resumes_a_deliberate_change(full_run, tmp_path):
    out = _dry_resume(full_run, tmp_path, "train.loss=nft", allow=("train.loss",))
    assert out.returncode == 0, out.stderr
    assert "changed settings: train.loss 'ppo' -> 'nft'" in out.stdout


def test_every_epoch_logs_images_per_device_second_and_an_mfu_that_the_counted_flops_give(full_run):
    """images/device-s is the epoch's images over its seconds and the 2 ranks; MFU is the counted FLOPs
    per image at that rate over the CPU's measured matmul peak: a fraction of it, not more."""
    for r in (r for r in metrics(full_run) if "time/epoch" in r):
        assert r["throughput/images_per_device_sec"] == pytest.approx(r["images_per_sec"] / 2)
        assert 0 < r["throughput/mfu"] < 1
