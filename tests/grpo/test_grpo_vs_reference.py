"""`python benchmarks/grpo_vs_reference.py --quick` runs both epochs, and paco_ds's with each rollout
switch, on the tiny FLUX and writes its JSON; with --judge both score against one served tiny judge."""
import json

import pytest

from conftest import REPO, run_cli

pytestmark = pytest.mark.runs_more  # benchmarks' quick runs: make test-runs-more


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
    paths = ["paco_ds", "paco_ds+ode", "paco_ds+same_latent", "paco_ds+prefix", "reference"]
    assert report["images_per_sec"] == {name: report[name]["images_per_sec"] for name in paths}
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
    cfg = report["config"]
    sample_a, sample_b = a["calls_per_epoch"]["sample"], b["calls_per_epoch"]["sample"]
    assert cfg["steps"] == 4 and cfg["ode_steps"] == 1 and cfg["noise_steps"] == [1]
    assert sample_a["transformer_forwards"] == sample_b["transformer_forwards"] == 4 * cfg["images"]
    for name in paths:
        assert report[name]["adamw_steps_taken"] == 2 * cfg["repeats"]
    # the switches: only sampling gets cheaper; training's forwards, decodes and encodes stay as in (a)
    variants = {name: report[name] for name in paths[1:-1]}
    for r in variants.values():
        assert r["calls_per_epoch"]["train"] == a["calls_per_epoch"]["train"]
        assert r["vae_decodes_per_image"] == 1 and r["text_encodes_per_trained_step"] == 0
    sample_forwards = {name: r["calls_per_epoch"]["sample"]["transformer_forwards"] for name, r in variants.items()}
    # ode: steps 0 and 1 (the noise step), then 2..4 in ode_steps = 1 step: 3 forwards per image, not 4
    assert sample_forwards["paco_ds+ode"] == 3 * cfg["images"]
    assert sample_forwards["paco_ds+same_latent"] == 4 * cfg["images"]
    # prefix: step 0 walked once per group of 2 instead of per image
    groups = cfg["images"] // cfg["group_size"]
    assert sample_forwards["paco_ds+prefix"] == 4 * cfg["images"] - (cfg["images"] - groups)
    for name, r in variants.items():  # Rollouts' own count agrees with the hooks
        assert r["rollout_transformer_calls"] == sample_forwards[name]
    assert a["rollout_transformer_calls"] == sample_a["transformer_forwards"]
    assert report["variants"]["paco_ds+ode"] == ["sample.ode_solver=ab2", "sample.ode_steps=1"]
    # the ratios are the images/s they say
    for name in paths[:-1]:
        ips = report[name]["images_per_sec"]
        assert report["speedup_vs_reference"][name] == pytest.approx(ips / b["images_per_sec"], rel=1e-12)
        assert report["speedup_vs_paco_ds"][name] == pytest.approx(ips / a["images_per_sec"], rel=1e-12)
    assert report["speedup_vs_reference"]["paco_ds"] == report["speedup"]
    assert report["prefix_vs_same_latent"] == pytest.approx(
        report["paco_ds+prefix"]["images_per_sec"] / report["paco_ds+same_latent"]["images_per_sec"], rel=1e-12)
    assert report["model_compile"]["source"] == "benchmarks/results/compile_blocks_cpu.json"
    assert "paco_ds / reference images/s" in out.stdout and "paco_ds+prefix / paco_ds+same_latent" in out.stdout


def test_quick_run_with_the_judge_on_both_sides(tmp_path):
    """--judge: one tiny judge served on loopback answers both schedules; the requests it counted are
    each schedule's formula (paco_ds: the 6 panel pairs of a 2x2 grid once; the reference: the pairs
    once per criterion), and every score is a probability."""
    out_file = tmp_path / "gvr_judge.json"
    out = run_cli("benchmarks/grpo_vs_reference.py", "--judge", "--quick", "--out", str(out_file), timeout=240,
                  env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out_file.read_text())
    cfg = report["config"]
    assert cfg["judge"] and cfg["reward"] == "consistency_score" and cfg["quick"]
    assert set(report["images_per_sec"]) == {"paco_ds", "reference"}  # no rollout switches with the judge
    items = [json.loads(line) for line in (REPO / report["judge"]["items"]).read_text().splitlines() if line]
    n_crit = {sum(1 for d in it["criteria"].values() for t in d.values() if t) for it in items}
    assert n_crit == {3}  # every tiny T2IS item: 3 non-empty criteria, 2x2 layout
    assert {it["layout"] for it in items} == {"2x2"}
    want = {"paco_ds": 6, "reference": 6 * 3}
    for name, per_image in want.items():
        j = report["judge"][name]
        assert j["expected_requests_per_image"] == per_image
        # counted at the server (its /stats) and at the client, every repeat
        assert j["requests_per_image"] == per_image
        assert j["server_requests_by_repeat"] == j["client_requests_by_repeat"] == \
            [per_image * cfg["images"]] * cfg["repeats"]
        assert j["median"]["generate_s"] > 0 and j["median"]["prepare_cpu_s"] > 0
        assert j["median"]["busy_s"] == pytest.approx(j["median"]["generate_s"] + j["median"]["prepare_cpu_s"])
        assert j["busy_s_per_request"] == pytest.approx(j["median"]["busy_s"] / (per_image * cfg["images"]))
        rewards = [x for rep in report[name]["rewards_by_repeat"] for x in rep]
        assert len(rewards) == cfg["images"] * cfg["repeats"] and all(0.0 <= x <= 1.0 for x in rewards)
        assert report[name]["median"]["reward_wait_s"] >= 0
    ratios = report["judge"]["ratios_reference_over_paco_ds"]
    assert ratios["requests_per_image"] == 3.0
    assert ratios["busy_s_per_request"] == pytest.approx(
        report["judge"]["reference"]["busy_s_per_request"] / report["judge"]["paco_ds"]["busy_s_per_request"])
    assert report["speedup"] == pytest.approx(report["paco_ds"]["images_per_sec"] / report["reference"]["images_per_sec"])
    assert any("tiny judge" in s for s in report["reference_simplifies"])
    assert "reference / paco_ds: requests per image 3.00x" in out.stdout
