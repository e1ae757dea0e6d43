"""`python benchmarks/grpo_vs_flow_factory.py --quick` runs paco_ds's trainer (the deepspeed launcher, one
process, the timing hooks) on the tiny FLUX folder for one epoch and writes its JSON; without a
Flow-Factory environment it says how to give one and exits 2.

The Flow-Factory half is collected only where one is installed: FLOW_FACTORY_PYTHON (the interpreter of an
environment where Flow-Factory is installed per its README) and FLOW_FACTORY_ROOT (its checkout), passed to
the benchmark as --ff-python and --ff-root. It is not a skip because `make test-runs` allows none
(--allowed-skips=0), and no machine of this project's lanes has Flow-Factory."""
import json
import os
import statistics
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = pytest.mark.runs_more  # benchmarks' quick runs: make test-runs-more

ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
SPREADS = ("epoch_s", "cpu_s", "sample_s", "reward_s", "train_s", "other_s", "transformer_s", "transformer_sample_s",
           "transformer_train_s", "outside_transformer_s", "vae_decode_s", "prompt_encode_s")


def check_side(side: dict, cfg: dict) -> None:
    """One side's measured fields: the counted work of one epoch and consistent seconds."""
    images, steps = cfg["images_per_epoch"], cfg["steps"]
    calls = side["calls_per_epoch"]
    # sampled one image at a time: every step of every image, then one forward per image and trained step
    assert calls["transformer_calls_sample"]["median"] == images * steps
    assert calls["transformer_calls_train"]["median"] == images * len(cfg["noise_steps"])
    assert side["transformer_calls_per_image"] == steps + len(cfg["noise_steps"])
    assert calls["vae_decoded_images"]["median"] == images
    for key in SPREADS:
        s = side[key]
        assert s["min"] <= s["median"] <= s["max"] and len(s["values"]) == cfg["repeats"], key
        assert s["median"] == pytest.approx(statistics.median(s["values"]))
    assert side["transformer_s"]["median"] > 0 and side["outside_transformer_s"]["median"] >= 0
    for e, t, ph in zip(side["epoch_s"]["values"], side["transformer_s"]["values"],
                        zip(side["sample_s"]["values"], side["reward_s"]["values"], side["train_s"]["values"])):
        assert t < e and sum(ph) <= e + 1e-6  # the forwards run inside the phases, the phases inside the epoch
    assert side["images_per_sec"] == pytest.approx(images / side["epoch_s"]["median"])


def test_quick_paco_side_measures_one_epoch(tmp_path):
    out_file = tmp_path / "gvff.json"
    out = run_cli("benchmarks/grpo_vs_flow_factory.py", "--quick", "--paco-only", "--out", str(out_file),
                  timeout=170, env=ENV)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads(out_file.read_text())
    assert report["benchmark"] == "gvff" and report["command"].endswith("--paco-only --out " + str(out_file))
    assert report["machine"]["cores"] and report["machine"]["cpu_model"] and report["machine"]["load_average_at_start"]
    assert len(report["source"]["commit"]) == 40 and isinstance(report["source"]["clean"], bool)
    cfg = report["config"]
    assert cfg["quick"] and cfg["repeats"] == 1 and cfg["warmup_epochs"] == 0 and cfg["dtype"] == "float32"
    assert cfg["paco_user_command"].startswith("deepspeed --num_gpus 1 launch/train.py --config")
    assert "flux_t2is.yaml" in cfg["recipes"]["paco_ds"] and report["flow_factory"] is None
    assert list(report["sides"]) == ["paco_ds"] and report["order"] == [["paco_ds", 0]]
    side = report["sides"]["paco_ds"]
    check_side(side, cfg)
    # paco_ds encodes a prompt the first time a rollout batch draws it, and keeps its embeddings for the
    # group's other images and the later epochs (sample.prompt_cache_gib): one call per prompt in epoch 0
    assert side["calls_per_epoch"]["prompt_encode_calls"]["median"] == len(cfg["prompts"]) < cfg["images_per_epoch"]
    assert side["startup"]["prompt_encode_calls"] == 0


def test_without_flow_factory_says_how_and_exits_2():
    out = run_cli("benchmarks/grpo_vs_flow_factory.py", "--quick", timeout=60, env=ENV)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--ff-python" in out.stderr and "--paco-only" in out.stderr


FLOW_FACTORY = bool(os.environ.get("FLOW_FACTORY_PYTHON") and os.environ.get("FLOW_FACTORY_ROOT"))


def both_sides_do_the_same_work(tmp_path):
    out_file = tmp_path / "gvff_both.json"
    out = run_cli("benchmarks/grpo_vs_flow_factory.py", "--quick", "--ff-python", os.environ["FLOW_FACTORY_PYTHON"],
                  "--ff-root", os.environ["FLOW_FACTORY_ROOT"], "--out", str(out_file), timeout=300, env=ENV)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads(out_file.read_text())
    cfg, sides = report["config"], report["sides"]
    assert list(sides) == ["paco_ds", "flow_factory"]
    for side in sides.values():
        check_side(side, cfg)
    ff = sides["flow_factory"]
    # Flow-Factory encodes its prompt set once while loading, not per epoch
    assert ff["calls_per_epoch"]["prompt_encode_calls"]["median"] == 0 and ff["startup"]["prompt_encode_calls"] >= 1
    assert report["flow_factory"]["source"]["commit"] and "autocast" in report["flow_factory"]["patches"]
    assert report["ratios"]["images_per_sec"] == pytest.approx(
        sides["paco_ds"]["images_per_sec"] / ff["images_per_sec"])
    assert Path(report["flow_factory"]["source"]["root"]).resolve() == Path(os.environ["FLOW_FACTORY_ROOT"]).resolve()


if FLOW_FACTORY:
    test_quick_both_sides_do_the_same_work = both_sides_do_the_same_work
