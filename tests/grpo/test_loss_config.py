"""The losses' recipe sections, each declared in its loss's file (paco_ds/grpo/losses/): `train.ppo`,
`train.nft`, `train.awm`, `train.dpo`, and `train.reinforce` of a loss that lives in tests/ only, validate their
own keys, and each loss's cross-checks run for that loss, naming the keys."""
import re
from pathlib import Path

import pytest

from paco_ds.errors import ConfigError
from paco_ds.grpo.plan import load_config

pytestmark = pytest.mark.fast

TINY = "configs/tiny/t2is.yaml"
AWM = "configs/tiny/t2is_awm.yaml"


def _error(recipe: str, sets: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(recipe, sets)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("loss", ["ppo", "nft", "awm", "dpo", "dgpo"])
def test_an_unknown_key_in_a_loss_section_is_refused_naming_it(loss):
    assert f"unknown config key 'train.{loss}.clip_rang'" in _error(TINY, [f"train.{loss}.clip_rang=0.1"])


def test_an_unknown_ppo_key_suggests_the_known_one():
    assert "did you mean 'train.ppo.clip_range'?" in _error(TINY, ["train.ppo.clip_rang=0.1"])


@pytest.mark.parametrize("key, value", [
    ("train.ppo.clip_range", "0"), ("train.ppo.ratio_norm", "maybe"),
    ("train.nft.decay_type", "3"), ("train.nft.beta", ".nan"),
    ("train.awm.time_shift", "-1"), ("train.awm.weighting", "cubic"),
    ("train.dpo.beta", "0"), ("train.dpo.timestep_sampling", "logit"),
])
def test_a_bad_value_names_its_loss_key(key, value):
    assert f"config key '{key}'" in _error(TINY, [f"{key}={value}"])


def test_ppo_keys_live_in_train_ppo():
    cfg = load_config(TINY, ["train.ppo.clip_range=0.2", "train.ppo.ratio_norm=true"])
    assert (cfg.train.ppo.clip_range, cfg.train.ppo.ratio_norm) == (0.2, True)
    assert cfg.train.loss_section is cfg.train.ppo
    awm = load_config(AWM)
    assert awm.train.loss_section is awm.train.awm



REINFORCE = "tests/grpo/reinforce.yaml"  # train.loss: tests.grpo.reinforce_loss:Reinforce


def test_a_loss_outside_paco_ds_brings_its_own_section():
    from paco_ds.recipe import schema as config
    from tests.grpo.reinforce_loss import ReinforceConfig

    cfg = load_config(REINFORCE)
    assert isinstance(cfg.train.loss_section, ReinforceConfig) and cfg.train.reinforce.scale == 2.0
    assert load_config(REINFORCE, ["train.reinforce.scale=0.5"]).train.reinforce.scale == 0.5
    assert "did you mean 'train.reinforce.scale'?" in _error(REINFORCE, ["train.reinforce.scal=1"])
    assert "config key 'train.reinforce.scale'" in _error(REINFORCE, ["train.reinforce.scale=0"])
    msg = _error(REINFORCE, ["sample.noise_level=0"])  # its own cross-check, naming both keys
    assert "train.loss" in msg and "sample.noise_level" in msg
    # Without that loss, its section is an unknown key like any other.
    assert "unknown config key 'train.reinforce'" in _error(TINY, ["train.reinforce={scale: 2}"])
    # The schema names no loss: the sections come from the registry when a recipe is loaded.
    assert not {"ppo", "nft", "awm", "dpo", "dgpo", "reinforce"} & set(config.TrainConfig.model_fields)
    assert not re.search(r"\b(ppo|nft|awm|dpo|reinforce)\b", Path(config.__file__).read_text(), re.I)


def test_a_loss_without_a_section_of_its_own_or_with_a_taken_name():
    # a subclass of a built-in loss shares its section (tests/recipe/outside.py's OwnLoss)
    assert load_config(TINY, ["train.loss=tests.recipe.outside:OwnLoss"]).train.loss_section.clip_range == 0.01
    assert "cannot import loss 'no_such:X'" in _error(TINY, ["train.loss=no_such:X"])
    assert "names no loss: write 'module:attr'" in _error(TINY, ["train.loss=:PPOClip"])
    assert "its name 'ema' is not an identifier of its own" in _error(TINY, ["train.loss=tests.recipe.outside:LossNamedLikeATrainKey"])


@pytest.mark.parametrize("key, value", [("clip_range", "0.2"), ("ratio_norm", "true")])
def test_a_loss_key_outside_its_section_is_unknown(key, value):
    """PPO-clip's keys live in train.ppo: at train's top level they are refused, not ignored."""
    assert f"unknown config key 'train.{key}'" in _error(TINY, [f"train.{key}={value}"])


@pytest.mark.parametrize("recipe, sets, keys", [
    (TINY, ["train.loss=nft", "train.ppo.ratio_norm=true"], ["train.loss=nft", "train.ppo.ratio_norm"]),
    (TINY, ["train.loss=nft", "sample.sde_window={size: 1, range: [0, 2]}"], ["train.loss=nft", "sample.sde_window"]),
    (TINY, ["train.ppo.ratio_norm=true", "sample.sde_type=cps"], ["train.ppo.ratio_norm", "sample.sde_type=flow_grpo"]),
    (AWM, ["train.ppo.ratio_norm=true"], ["train.loss=awm", "train.ppo.ratio_norm"]),
    (AWM, ["train.awm.timestep_sampling=fixed"], ["train.timesteps", "train.awm.timestep_sampling=fixed"]),
    (AWM, ["train.timesteps=[1]"], ["train.timesteps", "train.awm.timestep_sampling=fixed"]),
    (AWM, ["train.awm.num_timesteps=6"], ["train.awm.num_timesteps=6", "train.awm.timestep_fraction"]),
])
def test_each_loss_cross_check_names_its_keys(recipe, sets, keys):
    msg = _error(recipe, sets)
    assert all(k in msg for k in keys), msg


def test_a_section_is_checked_only_for_its_own_loss():
    # 6 distinct steps below 6 x 0.9 cannot be drawn, but AWM does not run: PPO-clip trains.
    assert load_config(TINY, ["sample.num_steps=6", "train.awm.num_timesteps=6"]).train.awm.num_timesteps == 6
    with pytest.raises(ConfigError, match=re.escape("train.awm.num_timesteps=6")):
        load_config(TINY, ["sample.num_steps=6", "train.awm.num_timesteps=6", "train.loss=awm"])
