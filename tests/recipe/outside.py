"""A policy, a reward and losses that live outside paco_ds, for the recipes that name them by import
path (`tests.recipe.outside:OwnLoss`): one module, imported under one name whichever tests collect it."""
from paco_ds.grpo.losses.ppo import PPOClip
from paco_ds.models.flux import FluxPolicy
from paco_ds.rewards.base import Reward, RewardResult


class OwnPolicy(FluxPolicy):
    default_path = "someone/own-checkpoint"


class OwnReward(Reward):
    name = "own"

    def __init__(self, value: float = 1.0):
        self.value = value

    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        return RewardResult.ok([self.value] * len(images))


class OwnLoss(PPOClip):
    pass


class LossNamedLikeATrainKey(PPOClip):
    """Its section would be train.ema and replace the EMA settings: refused."""
    name = "ema"
    section = type("EmaLikeSection", (PPOClip.section,), {})
