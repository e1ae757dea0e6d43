"""Local rewards (tiny models offline) and the registry."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from paco_ds.errors import ConfigError
from paco_ds.images import split_panels, split_prompt
from paco_ds.rewards.registry import REWARDS, build_reward

pytestmark = pytest.mark.fast

PROMPT = ("FOUR-PANEL Images with a 2x2 grid layout showing a fox.All images share one style. "
          "[TOP]-[LEFT]:A fox sleeps. [TOP]-[RIGHT]:A fox runs. [BOTTOM]-[LEFT]:A fox eats. [BOTTOM]-[RIGHT]:A fox swims.")


def _images(n, size=64, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def test_jpeg_compressibility_prefers_smooth_images():
    r = build_reward("jpeg_compressibility", {})
    smooth = Image.fromarray(np.full((64, 64, 3), 120, dtype=np.uint8))
    res = r([smooth] + _images(1), ["x", "x"])
    assert res.valid.all() and res.scores[0] > res.scores[1]
    buf = io.BytesIO()
    _images(1)[0].save(buf, format="JPEG", quality=95)  # the default quality
    assert res.scores[1] == pytest.approx(-8 * buf.tell() / (64 * 64), rel=1e-12)  # minus bits per pixel
    big = r([smooth.resize((128, 128))], ["x"]).scores[0]
    assert abs(big - res.scores[0]) < abs(res.scores[1] - res.scores[0])  # per-pixel scale


def test_subfig_clipT_scores_each_panel_against_its_own_prompt():
    r = build_reward("subfig_clipT", {"tiny": True}, device="cpu")
    ims = _images(2)
    res = r(ims, [PROMPT, PROMPT], [{"layout": "2x2"}] * 2)
    # independent computation with the same model
    m, pre, tok = r.model, r.preprocess, r.tokenizer
    with torch.no_grad():
        panels = split_panels(ims[0], 2, 2)
        fi = torch.nn.functional.normalize(m.encode_image(torch.stack([pre(p) for p in panels])), dim=-1)
        ft = torch.nn.functional.normalize(m.encode_text(tok(split_prompt(PROMPT)[1:])), dim=-1)
        want = (fi * ft).sum(-1).mean().item()
    assert res.scores[0] == pytest.approx(want, abs=1e-5)
    assert res.scores[0] != pytest.approx(res.scores[1])
    hits = r.cache.hits
    again = r(ims[:1], [PROMPT], [{"layout": "2x2"}])
    assert again.scores[0] == res.scores[0] and r.cache.hits == hits + 4  # panels cached by content


def test_pickscore_formula():
    r = build_reward("pickscore", {"tiny": True}, device="cpu")
    ims = _images(2, seed=3)
    res = r(ims, [PROMPT, "a red fox"])
    with torch.no_grad():
        pix = r.processor(images=ims[:1], return_tensors="pt")["pixel_values"]
        tok = r.processor(text=[PROMPT], truncation=True, max_length=77, return_tensors="pt")
        out = r.model(pixel_values=pix, input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
        want = out.logits_per_image[0, 0].item() / 26  # logit_scale.exp() * cos
    assert res.scores[0] == pytest.approx(want, rel=1e-4)


def test_registry_rejects_unknown_reward_arguments():
    with pytest.raises(ConfigError, match="rewards.train.terms.pickscore.colour"):
        build_reward("pickscore", {"colour": 1}, where="rewards.train.terms")
    with pytest.raises(ConfigError, match="unknown reward"):
        build_reward("nope", {})
    assert {"consistency_score", "subfig_clipT", "pickscore", "jpeg_compressibility"} <= set(REWARDS)


class _Sleeper:
    """A reward that holds each batch until `gate` opens, then takes `seconds`, and records how many
    batches it scored at once."""

    name = "sleeper"

    def __init__(self, remote: bool, seconds: float = 0.05):
        import threading

        self.remote, self.seconds, self.lock = remote, seconds, threading.Lock()
        self.gate = threading.Event()
        self.running = self.peak = 0

    def __call__(self, images, prompts, metadata, ref_images=None):
        import time

        from paco_ds.rewards.base import RewardResult

        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        self.gate.wait(timeout=60)
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1
        return RewardResult.ok([float(m["i"]) for m in metadata])

    def close(self):
        pass


@pytest.mark.parametrize("remote", [True, False])
def test_runner_keeps_several_batches_at_a_remote_judge_and_one_at_a_local_reward(remote):
    """A remote judge's time is its server's latency: batch b+1 must not queue behind batch b's
    answers, or a judge slower per batch than the sampler sets the epoch's pace. A local reward
    shares the trainer's device and scores one batch at a time. Results stay in submission order."""
    from paco_ds.recipe.schema import RewardSet
    from paco_ds.rewards.runner import RewardRunner

    reward = _Sleeper(remote)
    runner = RewardRunner(RewardSet(terms={"jpeg_compressibility": {}}), shared={("jpeg_compressibility", ()): reward},
                          batches_in_flight=3)
    for b in range(6):  # the judge answers nothing yet: a submit that waited for it would never return
        runner.submit(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), ["p"], [{"i": b}])
    assert not any(f.done() for _, futures in runner.pending for f in futures.values())
    reward.gate.set()
    res = runner.collect()["jpeg_compressibility"]
    runner.close()
    assert res.scores.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    # what the timing rests on: batches at the judge at once (two waves of three, not six in a row)
    assert reward.peak == (3 if remote else 1)


def test_runner_rejects_zero_batches_in_flight():
    from paco_ds.recipe.schema import RewardSet
    from paco_ds.rewards.runner import RewardRunner

    with pytest.raises(ValueError, match="batches_in_flight"):
        RewardRunner(RewardSet(terms={"jpeg_compressibility": {}}), batches_in_flight=0)


def test_judge_latency_metrics_pool_ranks_and_name_the_slowest():
    from paco_ds.grpo.advantages import judge_latency_metrics

    m = judge_latency_metrics([[0.010, 0.020, 0.030], [0.200, 0.400], []])
    assert m["judge/latency_ms_p50"] == pytest.approx(30.0)
    assert m["judge/latency_ms_p90"] == pytest.approx(320.0)  # numpy's linear interpolation over 5 values
    assert m["judge/latency_ms_slowest_rank"] == pytest.approx(300.0)  # rank 1's median
    assert judge_latency_metrics([[], []]) == {}  # local rewards only: nothing logged
