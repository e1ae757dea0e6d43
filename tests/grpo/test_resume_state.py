"""What a checkpoint must hold for the run resuming it (GRPOTrainer.missing_state): a piece the
current recipe needs and the checkpoint lacks is named, never defaulted. The PPO-under-NFT case is
a real resume in tests/grpo/test_train_runs.py."""
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch

from paco_ds.grpo.ema import EMA
from paco_ds.grpo.epoch import EpochProgress, EpochSamples
from paco_ds.grpo.trainer import GRPOTrainer

pytestmark = pytest.mark.fast

COMPLETE = {"epoch": 2, "global_step": 4, "nonfinite_streak": 0, "tracker": {}, "loss": {}, "ema": None}


class StatelessLoss:
    def state_dict(self):
        return {}


class LossWithOld:
    def state_dict(self):
        return {"old": [torch.zeros(2)]}


def missing(state, ema=None, loss=StatelessLoss(), name="ppo"):
    trainer = SimpleNamespace(ema=ema, loss=loss, cfg=SimpleNamespace(train=SimpleNamespace(loss=name)))
    return GRPOTrainer.missing_state(trainer, state)


def test_a_complete_checkpoint_lacks_nothing():
    assert missing(COMPLETE) == []
    partial = {k: None for k in EpochProgress.REQUIRED}
    assert missing({**COMPLETE, "partial": partial}) == []


def test_an_ema_less_checkpoint_resumed_with_ema_is_named():
    ema = EMA([torch.nn.Parameter(torch.zeros(3))], decay=0.9)
    assert missing(COMPLETE, ema=ema) == ["EMA weights (train.ema.enabled)"]
    assert missing({**COMPLETE, "ema": ema.state_dict()}, ema=ema) == []


def test_a_loss_state_the_checkpoint_lacks_is_named():
    assert missing(COMPLETE, loss=LossWithOld(), name="nft") == ["the nft loss's 'old' state"]
    assert missing({**COMPLETE, "loss": {"old": []}}, loss=LossWithOld(), name="nft") == []


def test_an_older_layout_is_named_piece_by_piece():
    old = {k: v for k, v in COMPLETE.items() if k not in ("nonfinite_streak", "loss")}
    partial = {k: None for k in EpochProgress.REQUIRED if k not in ("first", "loss_epoch")}
    assert missing({**old, "partial": partial}) == ["nonfinite_streak", "loss", "mid-epoch 'loss_epoch'",
                                                     "mid-epoch 'first'"]


def test_a_mid_epoch_checkpoint_holds_every_piece_of_the_epochs_progress():
    """The progress's fields are the checkpoint's pieces (the keys a mid-epoch checkpoint has held
    since it was introduced), and the state it saves gives it back."""
    assert tuple(f.name for f in fields(EpochProgress)) == EpochProgress.REQUIRED
    assert EpochProgress.REQUIRED == ("samples", "metrics", "forwards", "loss_epoch", "stats", "first", "done",
                                      "micro_step_id", "grads")
    progress = EpochProgress(EpochSamples(transformer_calls=3), {"reward/masked": 0.0}, forwards=4,
                             loss_epoch={"visits": {}}, micro_step_id=1, grads=[torch.ones(2)])
    progress.record({"loss": 0.5, "ratio": 1.0}, first_of_epoch=("ratio",))
    progress.record({"loss": 0.25, "ratio": 0.9}, first_of_epoch=("ratio",))
    state = progress.to_state()
    assert list(state) == list(EpochProgress.REQUIRED) and EpochProgress.missing(state) == []
    assert (state["done"], state["stats"], state["first"]) == (2, {"loss": [0.5, 0.25], "ratio": [1.0, 0.9]},
                                                                {"ratio": 1.0})
    back = EpochProgress.from_state(state)
    assert back.samples.transformer_calls == 3 and back.grads[0].equal(torch.ones(2))
    assert (back.done, back.forwards, back.loss_epoch, back.micro_step_id) == (2, 4, {"visits": {}}, 1)
