"""The seams editing policies and new losses plug into: a Condition travels from the rollout to
every training forward and to the rewards, and advantages travel on the training batch."""
from dataclasses import FrozenInstanceError, dataclass, fields, replace

import numpy as np
import pytest
import torch

from paco_ds.models.base import Condition
from paco_ds.rewards.base import Reward, RewardResult
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import (Trajectory, gather_samples, make_generator, sample_trajectories,
                                     training_batch, transition_log_prob)

pytestmark = pytest.mark.fast


class _ConditionedPolicy:
    """Wraps the tiny FLUX policy as an editing policy would be: the velocity reads the condition
    latents (here: adds their mean, so a lost or mismatched condition changes the result)."""

    def __init__(self, base):
        self.base, self.seen = base, []

    def __getattr__(self, name):
        return getattr(self.base, name)

    def encode_condition(self, images, height, width):
        lat = torch.stack([im.float().mean() / 255.0 for im in images])
        return Condition(images=images, latents=lat[:, None, None].expand(-1, 1, 16).clone(), size=(height, width))

    def velocity(self, module, latents, sigma, embeds, height, width, guidance, condition=None):
        assert condition is not None and condition.latents.shape[0] == latents.shape[0]
        self.seen.append(condition.latents[:, 0, 0].clone())
        v = self.base.velocity(module, latents, sigma, embeds, height, width, guidance)
        return v + condition.latents.mean(dim=(1, 2)).to(v.dtype)[:, None, None]


def _refs(values, sizes=None):
    return [torch.full((3, *(sizes[i] if sizes else (32, 48))), v, dtype=torch.uint8) for i, v in enumerate(values)]


def test_condition_reaches_every_forward_and_the_trained_batch(tiny_policy):
    policy = _ConditionedPolicy(tiny_policy)
    prompts = ["a red cube", "a blue ball"]
    cond = policy.encode_condition(_refs([10, 200], sizes=[(32, 48), (40, 20)]), 64, 64)
    spec = SamplingSpec(num_steps=3, guidance=3.5, noise_level=0.7, keep_final=True)
    traj = sample_trajectories(policy, tiny_policy.transformer, spec, RolloutBatch(
        prompts=prompts, embeds=tiny_policy.encode_prompts(prompts), height=64, width=64, condition=cond,
        generators=[make_generator(0, i) for i in range(2)], noise_steps=[1], train_steps=[1]))
    assert len(policy.seen) == 3 and all(torch.equal(s, cond.latents[:, 0, 0]) for s in policy.seen)
    assert traj.condition.images is cond.images and traj.x_final.shape == traj.x_t[:, 0].shape
    # The recomputed log-prob of the rollout's own transition uses the same condition: it equals pi_old.
    with torch.no_grad():
        step = transition_log_prob(policy, tiny_policy.transformer, traj, 0, slice(None), spec=spec)
    torch.testing.assert_close(step.log_prob.float(), traj.log_prob[:, 0], rtol=0, atol=1e-4)
    # A training batch assembled from single samples keeps each one's condition and advantage.
    batch = training_batch([(traj, 1), (traj, 0)], torch.tensor([-1.5, 0.5]), torch.tensor([False, True]))
    assert [im.shape[1:] for im in batch.condition.images] == [(40, 20), (32, 48)]  # originals, own sizes
    assert [int(im[0, 0, 0]) for im in batch.condition.images] == [200, 10]
    assert batch.advantages.tolist() == [-1.5, 0.5] and batch.keep.tolist() == [False, True]
    assert torch.equal(batch.x_final[0], traj.x_final[1])
    # Without the condition the velocity differs: the condition is not decorative.
    wrong = replace(gather_samples([(traj, 0), (traj, 0)]),
                    condition=Condition(images=cond.images, latents=cond.latents[[1, 1]]))  # sample 1's condition
    with torch.no_grad():
        other = transition_log_prob(policy, tiny_policy.transformer, wrong, 0, slice(None), spec=spec)
    assert not torch.allclose(other.log_prob[0].float(), traj.log_prob[0, 0], atol=1e-3)


def test_a_rollout_is_complete_frozen_and_stacks_every_field(tiny_policy):
    """Per-group SDE windows: each sample carries its own trained steps; the sampler fills in the
    metadata, positions and groups; a stacked batch has every field, a subclass's new one too."""
    prompts = ["a red cube", "a blue ball"]
    spec = SamplingSpec(num_steps=4, guidance=3.5, noise_level=0.7)
    traj = sample_trajectories(tiny_policy, tiny_policy.transformer, spec, RolloutBatch(
        prompts=prompts, embeds=tiny_policy.encode_prompts(prompts), height=64, width=64,
        metadata=[{"k": 0}, {"k": 1}], positions=[7, 3], group_ids=[1, 0],
        generators=[make_generator(0, i) for i in range(2)], noise_steps=[[0, 1], [2, 3]],
        train_steps=[[0, 1], [2, 3]]))
    assert traj.steps.tolist() == [[0, 1], [2, 3]]
    assert (traj.metadata, traj.positions, traj.group_ids) == ([{"k": 0}, {"k": 1}], [7, 3], [1, 0])
    with pytest.raises(FrozenInstanceError):
        traj.positions = [0, 1]
    batch = training_batch([(traj, 1), (traj, 0)], torch.tensor([1.0, -1.0]), torch.tensor([True, True]))
    assert batch.steps.tolist() == [[2, 3], [0, 1]] and batch.positions == [3, 7] and batch.group_ids == [0, 1]
    torch.testing.assert_close(batch.sigma, traj.sigma[[1, 0]], rtol=0, atol=0)

    @dataclass(frozen=True, kw_only=True)
    class Tagged(Trajectory):
        tag: list[str]  # a new per-sample field: one line, stacked by gather_samples

    tagged = Tagged(**{f.name: getattr(traj, f.name) for f in fields(traj)}, tag=["a", "b"])
    assert gather_samples([(tagged, 1), (tagged, 1), (tagged, 0)]).tag == ["b", "b", "a"]


@pytest.mark.parametrize("ref, res, expected", [((480, 640), 512, (448, 592)), ((640, 480), 512, (592, 448)),
                                                ((100, 100), 64, (64, 64)), ((300, 900), 64, (32, 112))])
def test_target_size_keeps_the_reference_aspect_ratio(tiny_policy, ref, res, expected):
    h, w = tiny_policy.target_size(*ref, res)
    assert (h, w) == expected and h % 16 == 0 and w % 16 == 0
    # no square squash: the aspect ratio is off by at most the rounding of each side to 16
    assert abs(w / h - ref[1] / ref[0]) / (ref[1] / ref[0]) <= 8 / h + 8 / w


def test_text_only_policy_refuses_a_condition(tiny_policy):
    with pytest.raises(NotImplementedError, match="takes no condition images"):
        tiny_policy.encode_condition(_refs([1]), 64, 64)


class _RecordRefs(Reward):
    def __init__(self):
        self.refs = None

    def score(self, images, prompts, metadata, ref_images=None):
        self.refs = ref_images
        return RewardResult.ok([float(np.asarray(r).mean()) for r in ref_images])


def test_rewards_receive_the_original_reference_images():
    from paco_ds.recipe.schema import RewardSet
    from paco_ds.rewards.runner import RewardRunner
    from paco_ds.images import to_pil

    reward = _RecordRefs()
    # `shared` hands the runner an already-built reward under the term's name and arguments
    runner = RewardRunner(RewardSet(terms={"jpeg_compressibility": {}}), shared={("jpeg_compressibility", ()): reward})
    refs = _refs([7, 99])
    res = runner.score(torch.zeros(2, 3, 16, 16, dtype=torch.uint8), ["a", "b"], [{}, {}],
                       [to_pil(im[None])[0] for im in refs])
    runner.close()
    assert [im.size for im in reward.refs] == [(48, 32), (48, 32)]  # the original size, not resized
    assert res["jpeg_compressibility"].scores.tolist() == [7.0, 99.0]
