"""The tiny reward SFT end to end: 2 ZeRO-3 processes on CPU, exact resume, export, ZeRO-2.

One full run (6 epochs, 36 optimizer steps, a mid-epoch checkpoint at step 9) is shared by the
tests of this module; the resumed run restarts from that checkpoint in another directory.
"""
import json
import socket

import pytest

from conftest import REPO, run_cli
from distributed_runs import wandb_env

pytestmark = pytest.mark.runs

TINY = str(REPO / "configs" / "tiny" / "reward_sft.yaml")
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning", **wandb_env(REPO / "build" / "wandb")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_sft(out_dir, *sets, resume=None, timeout=300):
    args = ["-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()), "launch/sft.py",
            "--config", TINY, "--set", f"output_dir={out_dir}"]
    for s in sets:
        args += ["--set", s]
    if resume:
        args += ["--resume", str(resume)]
    out = run_cli(*args, timeout=timeout, env=ENV)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_full")
    log = deepspeed_sft(out, "checkpoint.every_steps=9", "checkpoint.keep_last=20", "logging.wandb.mode=offline")
    return out / "tiny_reward_sft", log.stdout


def test_tiny_run_lowers_the_loss_and_reports_first_token_accuracy(full_run):
    run, stdout = full_run
    rows = metrics(run)
    evals = [r for r in rows if "eval/loss" in r]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["epoch"] for r in evals] == [0, 1, 2, 3, 4, 5, 6] and [r["step"] for r in steps] == list(range(1, 37))
    assert evals[-1]["eval/loss"] < 0.7 * evals[0]["eval/loss"]
    assert evals[-1]["eval/token_acc"] > evals[0]["eval/token_acc"] + 0.2
    assert all(0 <= r["eval/first_token_acc"] <= 1 and r["eval/records"] == 16 for r in evals)
    assert all(0 <= r["train/first_token_acc"] <= 1 for r in steps)
    first, last = (sum(r["train/loss"] for r in steps[k:k + 6]) / 6 for k in (0, 30))
    assert last < 0.7 * first
    # warm-up then cosine: 10% of 36 steps -> 4 warm-up steps, the first at lr 0
    lrs = [r["train/lr"] for r in steps]
    assert lrs[0] == 0 and max(lrs) == pytest.approx(1e-2) and lrs[-1] < 1e-3
    epoch_lines = [l for l in stdout.splitlines() if l.startswith("epoch ") and " | loss " in l]
    assert [l.split()[1] for l in epoch_lines] == [f"{k}/6" for k in range(1, 7)], stdout[-3000:]  # one per epoch
    assert all("first-token acc" in l and "eval loss" in l for l in epoch_lines)
    assert "ZeRO-3: rank 0 holds 50.0% of the parameters" in stdout  # partitioned from load (zero.Init)
    for ckpt in ("step_0000009", "step_0000036"):
        assert (run / "checkpoints" / ckpt / "adapter" / "adapter_model.safetensors").is_file()
    assert (run / "checkpoints" / "latest").read_text() == "step_0000036"
    assert (run / "adapter" / "adapter_config.json").is_file() and list((run / "tb").iterdir())


def test_resume_continues_exactly(full_run, tmp_path):
    """From the shared run's step-9 checkpoint, in another directory: the same steps after it. A
    checkpoint of another directory starts another W&B run (this directory's own)."""
    from wandb_records import offline_runs, run_record

    run, _ = full_run
    out = deepspeed_sft(tmp_path, "logging.wandb.mode=offline", resume=run / "checkpoints" / "step_0000009")
    [first], [elsewhere] = offline_runs(run), offline_runs(tmp_path / "tiny_reward_sft")
    assert run_record(elsewhere).run_id != run_record(first).run_id and not run_record(elsewhere).resume
    assert "resumed from" in out.stdout and "at optimizer step 9 (epoch 2, step 3 of 6)" in out.stdout

    def by_step(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows if r["step"] > 9]

    resumed = by_step(metrics(tmp_path / "tiny_reward_sft"))
    assert len(resumed) == 27 + 5  # steps 10..36 and the evaluations after epochs 2..6
    assert resumed == by_step(metrics(run))  # the same losses, gradient norms, learning rates, evaluations


def test_wandb_has_every_optimizer_step(full_run):
    """logging.wandb.mode=offline: rank 0's one W&B run holds each optimizer step's numbers (a step's
    training and evaluation lines together, as W&B keeps one row per step), finished with exit 0, and
    the checkpoints carry its id."""
    from wandb_records import exit_code, history, numbers, offline_runs, run_record

    run, _ = full_run
    [segment] = offline_runs(run)
    run_id = run_record(segment).run_id
    assert exit_code(segment) == 0 and run_record(segment).project == "paco_reward"
    assert json.loads((run / "checkpoints" / "step_0000009" / "meta.json").read_text())["wandb_run_id"] == run_id
    by_step: dict = {}
    for row in metrics(run):
        by_step.setdefault(row["step"], {}).update(numbers(row))
    assert history(segment) == by_step


def test_export_merges_the_adapter_into_a_model_that_scores_a_pair(full_run, tmp_path):
    from PIL import Image
    from peft import PeftModel
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from paco_ds.sft.export import p_yes

    run, _ = full_run
    out = run_cli("launch/sft.py", "export", "--config", TINY, "--set", f"output_dir={run.parent}",
                  "--checkpoint", str(run / "checkpoints" / "step_0000036"), "--out", str(tmp_path / "merged"),
                  timeout=180, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"merged model: {tmp_path / 'merged'}" in out.stdout

    merged = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "merged").eval()
    processor = AutoProcessor.from_pretrained(tmp_path / "merged")
    assert processor.image_processor.size["longest_edge"] == 3136  # the training image limit travels along
    record = json.loads((run / "data" / "eval.json").read_text())[1]
    images = [Image.open(run / "data" / p).convert("RGB") for p in record["images"]]
    question = record["messages"][0]["content"].replace("<image>", "")
    score = p_yes(merged, processor, images, question)
    assert 0 < score < 1

    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(run / "tiny_base").eval()
    untrained = p_yes(base, processor, images, question)
    in_process = PeftModel.from_pretrained(base, run / "checkpoints" / "step_0000036" / "adapter").eval()
    assert p_yes(in_process, processor, images, question) == pytest.approx(score, abs=1e-5)
    assert p_yes(in_process.merge_and_unload(), processor, images, question) == pytest.approx(score, abs=1e-6)
    assert abs(score - untrained) > 1e-3  # the adapter changed the reward

    # The merged directory is what the reward server serves: its P(Yes) over HTTP is the same.
    import math

    import httpx

    from paco_ds.rewards.consistency import data_uri
    from paco_ds.serving import manager
    from paco_ds.recipe.servers import ServersConfig

    cfg = ServersConfig(engine="hf", models=[{"name": "paco-reward-sft", "path": str(tmp_path / "merged")}],
                        port=0, max_logprobs=267, startup_timeout=120)
    state = manager.start(cfg, tmp_path / "server", exit_with_parent=True)
    try:
        content = [*({"type": "image_url", "image_url": {"url": data_uri(im)}} for im in images),
                   {"type": "text", "text": question}]
        r = httpx.post(f"{state['endpoints']['paco-reward-sft']}/chat/completions", timeout=60, json={
            "model": "paco-reward-sft", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 1, "logprobs": True, "top_logprobs": 267})
    finally:
        manager.stop(tmp_path / "server")
    assert r.status_code == 200, r.text
    top = {t["token"]: t["logprob"] for t in r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}
    served = 1 / (1 + math.exp(top["No"] - top["Yes"]))
    assert served == pytest.approx(score, abs=1e-5)
