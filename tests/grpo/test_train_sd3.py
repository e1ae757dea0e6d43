"""Flow-GRPO's SD3.5 recipes for real (tests/grpo/test_sd3_recipes.py validates them): every tiny twin
trains on 2 ZeRO-3 CPU ranks under the deepspeed launcher and logs its rewards: the GenEval twin (a loopback
GenEval server in Flow-GRPO's protocol) for two epochs and resumed exactly from its own checkpoint,
and the OCR twin with the PickScore twin's reward beside its own (the real recogniser, the tiny PickScore
model) for one epoch."""
import http.server
import io
import json
import math
import pickle
import threading

import numpy as np
import pytest
from PIL import Image

from conftest import REPO
from distributed_runs import metrics, resume_copy, run_trainer, stable, tail

pytestmark = pytest.mark.runs_more  # make test-runs-more (not in CI: its time)

PROMPTS = REPO / "paco_ds" / "data" / "prompts"





# ---------------------------------------------------------------------------------------------- a real run
class _FakeGenEval(http.server.BaseHTTPRequestHandler):
    """Flow-GRPO's reward-server protocol; the score is the image's mean brightness (the detector is
    the server's business, not the trainer's); every request's metadata is recorded."""

    metadata: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        data = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).metadata.extend(data["meta_datas"])
        bright = [float(np.asarray(Image.open(io.BytesIO(b))).mean() / 255) for b in data["images"]]
        body = pickle.dumps({"scores": bright, "strict_rewards": [float(b > 0.5) for b in bright],
                             "rewards": bright, "group_rewards": {}, "group_strict_rewards": {}})
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def geneval_url():
    for port in range(18950, 19000):  # this file's range
        try:
            srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), _FakeGenEval)
            break
        except OSError:
            continue
    else:
        pytest.skip("no free port in 18950-18999")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{port}"
    srv.shutdown()
    srv.server_close()


def _records(name: str) -> list[dict]:
    return [json.loads(line) for line in (PROMPTS / name).read_text().splitlines() if line.strip()]


TWIN = REPO / "configs" / "tiny" / "sd3_geneval.yaml"
SHORT = ("train.num_epochs=2", "test.eval_freq=1", "checkpoint.save_freq=1", "checkpoint.keep_last=3",
         "logging.tensorboard=false")


@pytest.fixture(scope="module")
def geneval_run(geneval_url, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sd3") / "full"
    proc = run_trainer(run_dir, *SHORT, f"rewards.train.terms.geneval.base_url={geneval_url}", config=TWIN)
    assert proc.returncode == 0, tail(proc)
    return run_dir


def test_tiny_sd3_geneval_trains_with_guidance_kl_and_its_reward(geneval_run):
    rows = [r for r in metrics(geneval_run) if "time/epoch" in r]
    assert [r["epoch"] for r in rows] == [0, 1]
    for r in rows:
        assert 0 <= r["reward/geneval/mean"] <= 1 and r["reward/geneval/std"] > 0
        assert 0 <= r["reward/geneval/strict/mean"] <= 1  # the server's strict part, logged beside it
        assert r["train/ratio_first"] == 1.0  # the recomputed guided log-prob is bitwise the sampled one
        assert r["train/forwards_per_step"] == 2.0  # beta > 0: policy + reference, each one batched CFG forward
        assert r["train/kl"] >= 0 and math.isfinite(r["train/loss"]) and r["global_step"] == 2 * (r["epoch"] + 1)
    assert rows[1]["train/ratio"] != 1.0  # the policy moved
    evals = [r for r in metrics(geneval_run) if "eval/geneval/mean" in r]
    assert [r["epoch"] for r in evals] == [0, 1, 2]
    records = _records("tiny_geneval_train.jsonl") + _records("tiny_geneval_test.jsonl")
    sent = _FakeGenEval.metadata  # GenEval records reached the server whole, as the files have them
    assert sent and all(m in records for m in sent)
    assert (geneval_run / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_tiny_sd3_geneval_resumes_exactly(geneval_run, geneval_url, tmp_path):
    """Resume the run from its own epoch-1 checkpoint in a copy of its directory: the second epoch
    must come out exactly as it did the first time."""
    run_dir = tmp_path / "resumed"
    proc = resume_copy(geneval_run, run_dir, "epoch_0001", *SHORT,
                       f"rewards.train.terms.geneval.base_url={geneval_url}", config=TWIN)
    assert proc.returncode == 0, tail(proc)
    assert "resumed from" in proc.stdout
    assert stable(metrics(run_dir)) == stable(metrics(geneval_run))


# ---------------------------------------------------------------------------------- the other twins
# The OCR twin's recipe with the PickScore twin's reward beside its own: one epoch of one run trains on both
# rewards (the two twins share prompts, policy and trainer; tests/grpo/test_sd3_recipes.py validates each
# recipe as written). What they add to the GenEval twin is their reward (the real OCR recogniser, the tiny
# PickScore model); the checkpoint state is the GenEval twin's, whose resume is proven exact above.
TWINS = ("train.num_epochs=1", "test.eval_freq=1", "logging.tensorboard=false",
         "rewards.train.terms.pickscore={weight: 1.0, tiny: true}")


@pytest.mark.parametrize("reward", ["ocr", "pickscore"])
def test_tiny_sd3_twin_rewards_train_an_epoch_and_are_logged(reward, runs):
    run = runs.get("sd3_ocr_pickscore", *TWINS, config=REPO / "configs" / "tiny" / "sd3_ocr.yaml").ok()
    rows = run.metrics()
    epochs = run.epochs()
    assert [r["epoch"] for r in epochs] == [0] and epochs[0]["global_step"] == 2
    r = epochs[0]
    assert math.isfinite(r[f"reward/{reward}/mean"]) and math.isfinite(r[f"reward/{reward}/std"])
    if reward == "ocr":  # random 64 px images show little text to read: scores in [0, 1], mostly 0
        assert 0 <= r["reward/ocr/mean"] <= 1
    else:
        assert r["reward/pickscore/std"] > 0  # a model's scores of different images
    assert r["train/ratio_first"] == 1.0 and math.isfinite(r["train/loss"]) and r["train/kl"] >= 0
    evals = [e for e in rows if f"eval/{reward}/mean" in e]
    assert [e["epoch"] for e in evals] == [0, 1] and all(math.isfinite(e[f"eval/{reward}/mean"]) for e in evals)
    assert (run.dir / "lora" / "pytorch_lora_weights.safetensors").is_file()
