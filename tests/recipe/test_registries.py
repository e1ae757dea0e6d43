"""Policies, rewards and losses outside paco_ds, named by import path ("module:Class") as
aggregations are; an unknown name or a path that does not import is one line naming the key."""
import pytest

from conftest import REPO, TINY, one_line_error, run_cli
from paco_ds.errors import ConfigError
from paco_ds.grpo.losses import loss_class
from paco_ds.grpo.plan import load_config
from paco_ds.models import policy_class
from paco_ds.rewards.registry import build_reward
from tests.recipe.outside import OwnLoss, OwnPolicy, OwnReward

pytestmark = pytest.mark.fast


HERE = "tests.recipe.outside"


def test_a_policy_by_import_path_gives_its_own_defaults():
    cfg = load_config(TINY, [f"model.family={HERE}:OwnPolicy", "model.path=null"])
    assert policy_class(cfg.model.family) is OwnPolicy
    assert cfg.model.path == "someone/own-checkpoint"  # resolved from the out-of-tree class


def test_a_reward_by_import_path_is_built_with_its_arguments(tmp_path):
    recipe = tmp_path / "own.yaml"
    recipe.write_text(f"extends: {TINY}\nrewards:\n  train:\n    terms:\n      _replace: true\n"
                      f"      '{HERE}:OwnReward': {{weight: 1.0, value: 3.5}}\n")
    cfg = load_config(recipe)
    (name, term), = cfg.rewards.train.terms.items()
    reward = build_reward(name, term.kwargs, where="rewards.train.terms")
    assert isinstance(reward, OwnReward) and list(reward.score([None, None], ["a", "b"], [{}, {}]).scores) == [3.5, 3.5]
    with pytest.raises(ConfigError, match=rf"^config key 'rewards.train.terms.{HERE}:OwnReward.scale': "):
        build_reward(name, {"scale": 2}, where="rewards.train.terms")


def test_a_loss_by_import_path():
    cfg = load_config(TINY, [f"train.loss={HERE}:OwnLoss"])
    assert loss_class(cfg.train.loss) is OwnLoss
    with pytest.raises(ConfigError, match=r"^config key 'train.loss': cannot import loss 'no_such:X'"):
        load_config(TINY, ["train.loss=no_such:X"])  # at load: the loss's own section is part of the schema


@pytest.mark.parametrize("value, message", [
    ("no_such_module:Thing", "cannot import model family 'no_such_module:Thing' (No module named 'no_such_module')"),
    (f"{HERE}:Missing", f"cannot import model family '{HERE}:Missing'"),
])
def test_an_import_path_that_does_not_import_names_the_key(value, message):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [f"model.family={value}"])
    assert str(err.value).startswith(f"config key 'model.family': {message}")
    with pytest.raises(ConfigError, match=r"^config key 'rewards.train.terms.no_such:R': cannot import reward"):
        build_reward("no_such:R", {}, where="rewards.train.terms")
    with pytest.raises(ConfigError, match=r"^config key 'train.loss': unknown loss 'ppo_clip'"):
        loss_class("ppo_clip")


def test_unknown_names_and_bad_paths_exit_2_in_one_line():
    line = one_line_error(run_cli("launch/train.py", "--config", str(TINY), "--dry-run", "--set",
                                  "model.family=fluxx"))
    assert "model.family" in line and "unknown model family 'fluxx' (did you mean 'flux'?)" in line
    line = one_line_error(run_cli("launch/train.py", "--config", str(TINY), "--dry-run", "--set",
                                  "model.family=paco_ds.models.nothing:Policy", env={"PYTHONPATH": str(REPO)}))
    assert line.endswith("config key 'model.family': cannot import model family 'paco_ds.models.nothing:Policy' "
                         "(No module named 'paco_ds.models.nothing')")
