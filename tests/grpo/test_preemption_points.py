"""Where a preemption is answered (paco_ds/grpo/preemption.py): under ZeRO-3 at once, mid-accumulation
included (the accumulated gradient partitions go into the checkpoint); under ZeRO stages 0-2, whose
accumulated gradients a checkpoint cannot hold, at the next optimizer step."""
from types import SimpleNamespace

import pytest
import torch

from paco_ds.runtime import stopping
from paco_ds.grpo.epoch import EpochProgress
from paco_ds.grpo.preemption import Preemption

pytestmark = pytest.mark.fast


class RecordingCheckpoints:
    def __init__(self, root):
        self.root, self.saved = root, []

    def save(self, engine, tag, state, meta, **kw):
        self.saved.append((tag, meta.get("micro_steps_done")))
        return self.root / tag


def _preemption(tmp_path, zero3: bool, monkeypatch) -> tuple[Preemption, RecordingCheckpoints]:
    monkeypatch.setattr(stopping, "current", lambda: SimpleNamespace(save_first=True, requested=True,
                                                                     reason="SIGTERM", preempt=True))
    monkeypatch.setattr(stopping, "mark_preempted", lambda *a: None)
    ckpt = RecordingCheckpoints(tmp_path)
    engine = SimpleNamespace(optimizer=SimpleNamespace(micro_step_id=0))
    loss = SimpleNamespace(epoch_state=lambda: {})
    return Preemption(ckpt, engine, [], loss, lambda: {}, lambda: {}, zero3=zero3, device=torch.device("cpu"),
                      run_dir=tmp_path, is_main=True), ckpt


def test_below_zero3_a_stop_mid_accumulation_waits_for_the_optimizer_step(tmp_path, monkeypatch, capsys):
    pre, ckpt = _preemption(tmp_path, zero3=False, monkeypatch=monkeypatch)
    progress = EpochProgress(samples=None, metrics={}, done=5)
    pre.check(3, progress, accumulating=True)  # 5 of 8 micro-steps of an optimizer step: not here
    pre.check(3, progress, accumulating=True)
    assert ckpt.saved == [] and capsys.readouterr().out.count("saving after this optimizer step") == 1
    progress.done = 8
    with pytest.raises(stopping.Preempted):
        pre.check(3, progress, accumulating=False)
    assert ckpt.saved == [("epoch_0003_step_000008", 8)]


def test_under_zero3_a_stop_mid_accumulation_saves_at_once(tmp_path, monkeypatch):
    pre, ckpt = _preemption(tmp_path, zero3=True, monkeypatch=monkeypatch)
    with pytest.raises(stopping.Preempted):
        pre.check(3, EpochProgress(samples=None, metrics={}, done=5), accumulating=True)
    assert ckpt.saved == [("epoch_0003_step_000005", 5)]
