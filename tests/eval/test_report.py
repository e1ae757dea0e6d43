"""The run report: each reward on its own panel with first -> last stated, the first and latest
sample grids side by side with the eval prompts, the final training metrics (not only the
eval-only last row), and what a healthy tiny run looks like."""
import json
import re

import pytest
import yaml
from PIL import Image

from conftest import REPO, run_cli
from paco_ds.report.page import change, series, write_report

pytestmark = pytest.mark.fast

TEST_FILE = "paco_ds/data/prompts/tiny_t2is_test.jsonl"
REWARDS = {"combined": [-4.40, -4.35, -4.30, -4.25, -4.20], "jpeg_compressibility": [-4.8, -4.7, -4.75, -4.6, -4.5],
           "subfig_clipT": [0.20, 0.18, 0.22, 0.19, 0.21]}


def _run(tmp_path, rewards=REWARDS, tiny=True):
    run = tmp_path / "tiny_t2is"
    (run / "images").mkdir(parents=True)
    rows = []
    for e in range(5):
        row = {"epoch": e, **{f"reward/{k}/mean": v[e] for k, v in rewards.items()},
               "train/loss": 1e-5, "train/policy_loss": 1e-5, "train/ratio": 1 - 1e-4 * e, "time/sample": 1.0,
               "reward/masked": 0.0, "reward/failures": 0.0, "train/nonfinite_steps": 0.0, "time/epoch": 2.0}
        if e in (0, 4):
            row |= {"eval/jpeg_compressibility/mean": -4.5 + 0.1 * e, "time/eval": 0.5}
        rows.append(row)
    rows.append({"epoch": 5, "eval/jpeg_compressibility/mean": -4.0, "time/eval": 0.5})  # the final eval-only row
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, color in (("eval_epoch0000", (255, 0, 0)), ("eval_epoch0004", (0, 255, 0)),
                        ("eval_epoch0005", (0, 0, 255)), ("train_samples_epoch0000", (9, 9, 9)),
                        ("train_samples_epoch0004", (99, 99, 99))):
        Image.new("RGB", (16, 16), color).save(run / "images" / f"{name}.png")
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"family": "flux", "tiny": tiny},
                                                     "data": {"format": "t2is", "test_file": TEST_FILE},
                                                     "test": {"num_images": 3}}))
    return run


def _prompts(n):
    return [json.loads(line)["prompt"] for line in (REPO / TEST_FILE).read_text().splitlines()[:n]]


def test_each_reward_has_its_own_panel_and_its_change_stated(tmp_path):
    page = write_report(_run(tmp_path)).read_text()
    assert "Train rewards" in page
    for name in REWARDS:  # one image per reward, so one y scale per reward
        assert page.count(f'alt="reward/{name}"') == 1, name
    assert page.count('alt="eval/jpeg_compressibility"') == 1
    # first -> last, the change and the best epoch, as numbers
    assert "<b>combined</b>: -4.4 → -4.2 (<span class=\"up\">+0.2</span>), best -4.2 at epoch 4" in page
    assert "<b>subfig_clipT</b>: 0.2 → 0.21 (<span class=\"up\">+0.01</span>), best 0.22 at epoch 2" in page
    # eval: first and last evaluation, the eval-only last row included
    assert "<b>jpeg_compressibility</b>: -4.5 → -4 (<span class=\"up\">+0.5</span>), best -4 at epoch 5" in page
    assert "train/loss" not in re.sub(r"<pre>.*?</pre>|<table>.*?</table>", "", page, flags=re.S)


def test_first_and_latest_grids_side_by_side_with_the_eval_prompts(tmp_path):
    page = write_report(_run(tmp_path)).read_text()
    evals = re.search(r"Evaluation samples: first and latest.*?</div>", page, re.S).group(0)
    assert 'alt="eval_epoch0000.png"' in evals and 'alt="eval_epoch0005.png"' in evals
    assert "eval_epoch0004.png" not in page  # only the first and the latest
    prompts = re.findall(r"<li>(.*?)</li>", re.search(r"<ol class='prompts'>(.*?)</ol>", page, re.S).group(1))
    assert prompts == [p.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
                       .replace("'", "&#x27;") for p in _prompts(3)]
    train = re.search(r"Training samples: first and latest.*?</div>", page, re.S).group(0)
    assert "train_samples_epoch0000.png" in train and "train_samples_epoch0004.png" in train


def test_final_metrics_show_the_last_training_epoch_and_the_last_eval_apart(tmp_path):
    page = write_report(_run(tmp_path)).read_text()
    final = page[page.index("<h2>Final metrics</h2>"):]
    training = re.search(r"Final training epoch \(epoch 4\)</h3><table>(.*?)</table>", final, re.S).group(1)
    assert "<tr><td>reward/combined/mean</td><td>-4.2</td></tr>" in training
    evaluation = re.search(r"Final evaluation \(epoch 5\)</h3><table>(.*?)</table>", final, re.S).group(1)
    assert "<tr><td>eval/jpeg_compressibility/mean</td><td>-4</td></tr>" in evaluation


@pytest.mark.parametrize("rising", [True, False])
def test_the_page_says_what_a_healthy_tiny_run_looks_like_and_judges_this_one(tmp_path, rising):
    rewards = dict(REWARDS)
    if not rising:
        rewards["combined"] = rewards["combined"][::-1]
    page = " ".join(write_report(_run(tmp_path, rewards)).read_text().split())
    assert "their images are noise and stay noise" in page and "combined training reward rises" in page
    verdict = re.search(r"<ul class='verdict'>(.*?)</ul>", page, re.S).group(1)
    # 5 epochs: the first and last epoch each (a third of the run, at most 3)
    trend = "-4.4 → -4.2" if rising else "-4.2 → -4.4"
    assert f"average of the first 1 epochs → last 1: {trend}" in verdict
    assert ("<span class='up'>rising</span>" in verdict) is rising
    assert "masked rewards: 0" in verdict and "non-finite steps: 0" in verdict


def test_a_real_model_run_gets_no_tiny_model_advice(tmp_path):
    page = write_report(_run(tmp_path, tiny=False)).read_text()
    assert "noise and stay noise" not in page and "<ul class='verdict'>" in page


def test_series_keeps_only_the_epochs_that_logged_the_key():
    rows = [{"epoch": 0, "time/eval": 1.0}, {"epoch": 1}, {"epoch": 2, "time/eval": float("nan")},
            {"epoch": 3, "time/eval": 2.0}]
    assert series(rows, "time/eval") == [(0, 1.0), (3, 2.0)]
    c = change([(0, 1.0), (1, 3.0), (2, 2.0)])
    assert (c["first"], c["last"], c["delta"], c["best"]) == ((0, 1.0), (2, 2.0), 1.0, (1, 3.0))


def test_cli_rebuilds_the_page_and_a_missing_run_exits_2(tmp_path):
    run = _run(tmp_path)
    out = run_cli("-m", "paco_ds.report", str(run))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("report.html") and (run / "report.html").is_file()
    missing = run_cli("-m", "paco_ds.report", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "metrics.jsonl not found" in missing.stderr
