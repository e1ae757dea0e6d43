"""rollout.mode: async in one process: who samples, the files the two sides exchange, the version a sampler
may sample an epoch with, the trainers' drop and decoupled-PPO correction, the loss's behaviour weight,
and the plan's split of a launch's GPUs (paco_ds/grpo/async_rollouts.py, paco_ds/gpu_plan/async_split.py).
The launches are in tests/grpo/test_async_runs.py."""
from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import TINY, one_line_error, run_cli
from paco_ds.grpo.async_rollouts import AsyncRollouts, Exchange, Taken, allowed_version, role_of, trainer_world
from paco_ds.grpo.plan import load_config
from paco_ds.rewards.base import RewardResult
from paco_ds.sampling.trajectory import Trajectory

pytestmark = pytest.mark.fast

ASYNC = ("rollout.mode=async", "rollout.samplers=1")


def test_the_last_ranks_sample_and_the_others_train():
    cfg = load_config(TINY, list(ASYNC))
    roles = [role_of(cfg, r, 3) for r in range(3)]
    assert [r.sampler for r in roles] == [None, None, 0] and {r.trainers for r in roles} == {2}
    assert trainer_world(cfg, 3) == 2 and trainer_world(load_config(TINY), 3) == 3  # colocated: every rank trains


@pytest.mark.parametrize("sets, key", [
    ((), "rollout.samplers"),  # one process: no trainer left
    (("train.loss=nft",), "train.loss"),
    (("train.ppo.ratio_norm=true",), "train.ppo.ratio_norm"),
    (("deepspeed.rollout_gather=per_step",), "deepspeed.rollout_gather"),
])
def test_what_async_cannot_train_is_one_line_naming_the_key(sets, key):
    args = ["launch/train.py", "--config", str(TINY), "--dry-run", "--world-size", "1" if not sets else "3"]
    for s in (*ASYNC, *sets):
        args += ["--set", s]
    assert f"config key '{key}'" in one_line_error(run_cli(*args))


def test_the_dry_run_plans_the_trainers_and_names_the_samplers():
    args = ["launch/train.py", "--config", str(TINY), "--dry-run", "--world-size", "3", "--set", "rollout.mode=async",
            "--set", "rollout.max_staleness=2"]
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    assert "world size                 2" in out.stdout
    assert "async: 1 sampler rank(s) after the 2 trainer rank(s)" in out.stdout and "at most 2 adapter" in out.stdout


# ------------------------------------------------------------------------------------ the files
def test_exchange_publishes_whole_files_and_keeps_the_newest_adapters(tmp_path):
    ex = Exchange(tmp_path)
    ex.reset()
    for v in range(4):
        ex.publish_adapter(v, {"w": torch.full((2,), float(v))})
    assert ex.adapter_versions() == [2, 3] and ex.load_adapter(3)["w"].tolist() == [3.0, 3.0]
    assert ex.load_adapter(0) is None  # dropped: a sampler needs the newest only
    ex.put_batch(1, 0, 2, {"x": 1})
    assert ex.batch_path(1, 0, 2).is_file() and not list((tmp_path / "async/rollouts").glob(".*"))
    assert ex.take_batch(1, 0, 2) == {"x": 1} and not ex.batch_path(1, 0, 2).exists()
    ex.hello(0, {"nonce": "a"})
    assert ex.hellos() == {0: {"nonce": "a"}} and ex.start() is None and ex.ended() is None
    ex.write_trainers(3, 6)
    ex.end("preempted")
    assert ex.trainers() == {"epoch": 3, "epoch_start_version": 6} and ex.ended() == "preempted"
    ex.reset()  # a new launch: nothing of the last one is read
    assert ex.adapter_versions() == [] and ex.hellos() == {} and ex.ended() is None and ex.trainers() is None


@pytest.mark.parametrize("epoch, k, versions, allowed", [
    (3, 0, [4, 5], None),  # epoch 3 trains from 4 + 2 = 6: with k = 0 only version 6 samples it
    (3, 0, [5, 6], 6),
    (3, 1, [4, 5], 5),  # one version stale is allowed
    (3, 2, [3, 4], 4),
    (2, 0, [3, 4], 4),  # the epoch the trainers train next: from 4
    (4, 2, [4, 5], None),  # two epochs ahead: trains from 8
])
def test_a_sampler_samples_an_epoch_only_within_max_staleness_of_its_training_start(epoch, k, versions, allowed):
    announced = {"epoch": 2, "epoch_start_version": 4}  # 2 optimizer steps per epoch
    assert allowed_version(announced, versions, epoch, 2, k) == allowed


def test_a_version_not_announced_yet_is_waited_for():
    # a mid-epoch resume announces the next epoch without its start version until the current one is trained
    assert allowed_version({"epoch": 5, "epoch_start_version": None}, [9], 5, 2, 3) is None
    assert allowed_version(None, [0], 0, 2, 1) is None and allowed_version({"epoch": 0, "epoch_start_version": 0},
                                                                          [], 0, 2, 1) is None


# ------------------------------------------------------------------------------------ the correction
def _traj(n: int, log_prob: torch.Tensor) -> Trajectory:
    return Trajectory(prompts=["p"] * n, metadata=[{}] * n, positions=list(range(n)), group_ids=[0] * n, height=8,
                      width=8, embeds=None, images=torch.zeros(n, 3, 8, 8, dtype=torch.uint8), log_prob=log_prob)


def _trainers(tmp_path, k: int, prox: dict, cap: float = 2.0) -> AsyncRollouts:
    cfg = SimpleNamespace(run_dir=tmp_path, rollout=SimpleNamespace(max_staleness=k, behaviour_weight_cap=cap))
    dist = SimpleNamespace(is_main=True, rank=0)
    policy = SimpleNamespace(transformer=torch.nn.Linear(2, 2))
    rollouts = SimpleNamespace(module=contextlib.nullcontext)
    loss = SimpleNamespace(log_prob=lambda module, traj, t, idx: SimpleNamespace(log_prob=prox[id(traj)][:, t]))
    return AsyncRollouts(cfg, dist, SimpleNamespace(sample_batches_per_rank=3), policy, rollouts, loss, zero3=False)


def _taken(trajs: list, versions: list[int]) -> Taken:
    results = [{"r": RewardResult.ok(np.arange(len(t), dtype=float))} for t in trajs]
    return Taken(trajs, results, versions, [], 0, 0, 0, 0.0, 0.0, 1.0)


def test_stale_batches_train_on_pi_prox_with_truncated_weights_and_a_batch_past_k_is_dropped(tmp_path):
    mu = [torch.tensor([[-1.0, -2.0], [-1.5, -0.5]]) for _ in range(3)]
    fresh, stale, too_old = (_traj(2, m) for m in mu)
    prox = {id(stale): torch.tensor([[-0.5, -2.1], [-1.5, 0.5]])}  # pi_prox / mu: e^0.5, e^-0.1, 1, e^1 (> cap 2)
    trainers = _trainers(tmp_path, k=2, prox=prox)
    trajs, results, m = trainers.correct(_taken([fresh, stale, too_old], [5, 4, 2]), version=5)
    assert torch.equal(trajs[0].log_prob, mu[0]) and torch.equal(trajs[0].behaviour_weight, torch.ones(2, 2))
    assert torch.equal(trajs[1].log_prob, prox[id(stale)])
    expected = torch.tensor([[math.exp(0.5), math.exp(-0.1)], [1.0, 2.0]])
    assert torch.allclose(trajs[1].behaviour_weight, expected)
    assert results[2]["r"].valid.tolist() == [False, False] and results[1]["r"].valid.all()  # dropped: no reward
    assert m["async/dropped_stale"] == 2 and m["async/staleness_max"] == 3 and m["async/proximal_forwards"] == 2
    assert m["async/behaviour_weight_truncated"] == 0.25 and (m["async/version_min"], m["async/version_max"]) == (2, 5)


def test_with_no_stale_batch_the_rollouts_are_trained_as_sampled(tmp_path):
    trajs = [_traj(2, torch.zeros(2, 3)), _traj(1, torch.ones(1, 3))]
    out, results, m = _trainers(tmp_path, k=0, prox={}).correct(_taken(trajs, [4, 4]), version=4)
    assert [t is s for t, s in zip(out, trajs)] == [True, True] and all(t.behaviour_weight is None for t in out)
    assert m["async/staleness_max"] == 0 and m["async/proximal_forwards"] == 0 and m["async/dropped_stale"] == 0


def test_the_ppo_loss_weights_each_term_by_the_behaviour_weight():
    """Decoupled PPO: mean(w * max(-A r, -A clip(r))), r = pi / pi_prox, A clipped before the weight."""
    from paco_ds.grpo.losses.ppo import PPOClip

    cfg = load_config(TINY, ["train.ppo.clip_range=0.1", "advantage.clip=1.5", "kernels.backend=torch"])
    loss = PPOClip(cfg, policy=None)
    lp = torch.tensor([0.05, -0.3, 0.2, 0.0])
    loss.log_prob = lambda module, batch, t, idx: SimpleNamespace(log_prob=lp)
    prox, adv = torch.tensor([0.0, 0.0, 0.0, 0.1]), torch.tensor([2.0, -1.0, 0.5, -3.0])
    w = torch.tensor([[0.5], [2.0], [1.0], [1.5]])
    batch = SimpleNamespace(log_prob=prox[:, None], advantages=adv, behaviour_weight=w)
    got, _ = loss(None, batch, 0)
    a, r = adv.clamp(-1.5, 1.5), torch.exp(lp - prox)
    want = (w[:, 0] * torch.maximum(-a * r, -a * r.clamp(0.9, 1.1))).mean()
    assert torch.isclose(got, want)
    plain, _ = loss(None, SimpleNamespace(log_prob=prox[:, None], advantages=adv, behaviour_weight=None), 0)
    assert torch.isclose(plain, torch.maximum(-a * r, -a * r.clamp(0.9, 1.1)).mean())


# ------------------------------------------------------------------------------------ the plan's split
def _flux_like_plan(world: int = 8):
    """A GpuPlan with FLUX.1-dev's counted FLOPs per image at 512 px (docs/gpu_plan.md) and round memory."""
    from paco_ds.gpu_plan.plan import GiB, GpuPlan

    cols = {"base params (ZeRO-3 shards)": 3 * GiB, "LoRA params": 0, "grads": GiB // 8, "optimizer state": GiB // 4,
            "EMA": GiB // 8, "transformer gathered for sampling": 20 * GiB, "ZeRO buffers": 0, "text encoders": 9 * GiB,
            "VAE": GiB // 4, "reward models": 2 * GiB, "activations": 2 * GiB, "CUDA context": GiB}
    memory = {"sampling": dict(cols), "scoring": dict(cols, activations=3 * GiB),
              "training": dict(cols, **{"transformer gathered for sampling": 0, "text encoders": 0, "ZeRO buffers": 3 * GiB,
                                        "activations": 40 * GiB})}
    return GpuPlan(recipe="flux", family="flux", world_size=world, gpu_gib=80, image_size=(512, 512), dtype="bfloat16",
                   gradient_checkpointing=False, params={"transformer": 12_080_000_000, "lora": 179_000_000},
                   memory=memory, flops={"sampling": 225.8e12, "scoring": 1.9e12, "training": 45.6e12},
                   flops_detail={"transformer_forward": 21.9e12}, counts={}, rollout_bytes=5_000_000)


def test_the_split_balances_the_two_sides_flops():
    from paco_ds.gpu_plan.async_split import describe, split

    cfg = load_config(REPO_FLUX, ["rollout.mode=async"])
    s = split(_flux_like_plan(), cfg, 8)
    # 227.7 TFLOPs per image to sample and score, 45.6 + 21.9 (one proximal forward) to train
    assert math.isclose(s.trainers.flops_per_image, 67.5e12) and math.isclose(s.samplers.flops_per_image, 227.7e12)
    assert (s.samplers.gpus, s.trainers.gpus) == (6, 2)  # 227.7 / 6 = 37.95 against 67.5 / 2 = 33.75
    assert s.samplers.busy == 1.0 and math.isclose(s.trainers.busy, 33.75 / 37.95)
    worse = [max(227.7 / m, 67.5 / (8 - m)) for m in range(1, 8)]
    assert min(worse) == max(227.7 / 6, 67.5 / 2)
    assert math.isclose(s.adapter_gb, 0.358) and s.rollout_mb_per_image == 5.0
    # a trainer's ZeRO state is over the 2 trainers, not the plan's 8 ranks
    assert s.trainer_gib == pytest.approx((3 + 0.125 + 0.25 + 0.125) * 4 + 3 + 0.25 + 2 + 1 + 40)
    text = describe(s, split(_flux_like_plan(), cfg, 8, samplers=2))
    assert "samplers 6:" in text and "set rollout.samplers: 6" in text


REPO_FLUX = TINY.parents[1] / "flux_t2is.yaml"


def test_the_cpu_benchmark_summarises_each_setting_over_its_seeds():
    # benchmarks/async_rollouts.py: a mean and sample spread per setting; one seed has no spread (None, not 0)
    import importlib.util

    from distributed_runs import REPO

    spec = importlib.util.spec_from_file_location("async_bench", REPO / "benchmarks" / "async_rollouts.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    run = {"trainer_wait_s_per_epoch": 1.0, "sampler_wait_s_per_epoch": 0.0, "staleness_mean": 0.0}
    runs = [{**run, "setting": "colocated", "seed": 1, "images_per_sec": 0.3, "reward": [-4.4, -4.0]},
            {**run, "setting": "colocated", "seed": 2, "images_per_sec": 0.5, "reward": [-4.4, -4.2]},
            {**run, "setting": "async k=1", "seed": 1, "images_per_sec": 0.4, "reward": [-4.4, -4.1]}]
    s = bench.summary(runs)
    assert s["colocated"]["images_per_sec"]["mean"] == pytest.approx(0.4)
    assert s["colocated"]["images_per_sec"]["std"] == pytest.approx(0.1414, abs=1e-4)
    assert s["colocated"]["reward_gain"]["values"] == pytest.approx([0.4, 0.2])
    assert s["async k=1"]["reward_gain"] == {"mean": pytest.approx(0.3), "std": None, "n": 1, "values": [pytest.approx(0.3)]}
    assert "(+0.300 ± -, 1 seed(s))" in bench.table(s)
