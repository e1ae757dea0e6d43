"""`launch/evaluate.py policy` on the tiny recipe's exported LoRA: the trained LoRA from a 2-process
run, evaluated in 1 process through the same function as the in-training evaluation, reproduces
the run's own final evaluation (per-prompt seeds, not per-rank ones), and the base column
reproduces the evaluation before training (a fresh LoRA is the identity)."""
import json
import subprocess
import sys

import pytest

from distributed_runs import REPO, cpu_env, free_port, metrics, run_trainer, tail

pytestmark = pytest.mark.runs

# The test rewards need no judge; training without it (jpeg alone) still moves the LoRA.
NO_JUDGE = ("reward_servers=null", "rewards.train.terms={jpeg_compressibility: {weight: 1.0}}")


def test_policy_eval_of_the_exported_lora_matches_the_training_run(tmp_path):
    run = tmp_path / "train"
    p = run_trainer(run, "train.num_epochs=1", "test.eval_freq=1", "train.ema.enabled=false",
                    "checkpoint.save_freq=0", *NO_JUDGE)
    assert p.returncode == 0, tail(p)
    rows = [r for r in metrics(run) if "eval/subfig_clipT/mean" in r]
    before, after = rows[0], rows[-1]
    assert after["epoch"] == 1 and after["eval/jpeg_compressibility/mean"] != before["eval/jpeg_compressibility/mean"]

    out = tmp_path / "eval"
    # one process (no launcher needed for a world of 1); the training run had 2
    cmd = [sys.executable, str(REPO / "launch/evaluate.py"), "policy", "--config", str(REPO / "configs/tiny/t2is.yaml"), "--set", f"output_dir={tmp_path}",
           "--set", "run_name=policy", *(a for s in NO_JUDGE for a in ("--set", s)), "--lora", str(run / "lora"),
           "--out", str(out)]
    e = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert e.returncode == 0, tail(e)
    assert "base" in e.stdout and "trained" in e.stdout and "delta" in e.stdout
    res = json.loads((out / "policy_eval.json").read_text())["metrics"]
    for name in ("jpeg_compressibility", "subfig_clipT"):
        key = f"eval/{name}/mean"
        assert res["base"][key] == pytest.approx(before[key], abs=1e-4)
        assert res["trained"][key] == pytest.approx(after[key], abs=1e-4)
    for grid in ("base.png", "trained.png", "base_vs_trained.png"):
        assert (out / grid).stat().st_size > 0
    assert "jpeg_compressibility" in (out / "policy_eval.csv").read_text()


def test_policy_eval_of_a_lora_builds_no_trainer_and_no_optimizer(tmp_path, monkeypatch):
    """Evaluating an exported LoRA builds the policy, its rollouts and the test rewards only: no
    GRPOTrainer, no DeepSpeed engine and no optimizer; the LoRA is applied (trained != base)."""
    import deepspeed
    import torch

    from paco_ds.eval.policy import run_policy_eval
    from paco_ds.grpo import trainer
    from paco_ds.grpo.plan import load_config
    from paco_ds.models import build_policy
    from paco_ds.models.lora import adapter_config, add_lora, export_lora, lora_state_dict

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    cfg = load_config(REPO / "configs/tiny/t2is.yaml", [f"output_dir={tmp_path}", "run_name=noopt",
                                                        "reward_servers=null", "data.max_test_prompts=2"])
    policy = build_policy(cfg.model, torch.device("cpu"))  # a LoRA that changes the images
    add_lora(policy.transformer, cfg.model.lora)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(0))
    export_lora(lora_state_dict(policy.transformer), tmp_path / "lora", adapter_config(policy.transformer))

    made, engines = [], []
    init = torch.optim.Optimizer.__init__

    def counted(self, *args, **kwargs):
        made.append(type(self).__name__)
        init(self, *args, **kwargs)

    def no_trainer(*args, **kwargs):
        raise AssertionError("the evaluation built a GRPOTrainer")

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", counted)
    monkeypatch.setattr(deepspeed, "initialize", lambda *a, **k: engines.append(1) or (None,) * 4)
    monkeypatch.setattr(trainer.GRPOTrainer, "__init__", no_trainer)
    res = run_policy_eval(cfg, lora=str(tmp_path / "lora"), out=str(tmp_path / "eval"))
    assert made == [] and engines == []
    table = res["table"]["jpeg_compressibility"]
    assert set(table) == {"base", "trained", "delta"} and table["delta"] != 0
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # the count sees an optimizer
    assert made == ["SGD"]
