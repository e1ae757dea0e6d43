"""Preemption (checkpoint.save_on_sigterm, docs/robustness.md): a stop requested on any rank is
answered at the trainer's next check point, where every rank saves one checkpoint together, rank 0
marks the run preempted (<run>/PREEMPTED) and the run ends with stopping.Preempted.

Until the epoch's rewards are scored the state is the epoch's start, saved as `epoch_NNNN`; after,
a mid-epoch checkpoint `epoch_NNNN_step_MMMMMM` keeps the epoch's progress (EpochProgress): its
rollouts and scores, the micro-steps taken, the loss's epoch state and the gradients accumulated
since the last optimizer step (this rank's ZeRO-3 partition), so the resumed run repeats nothing.
Under ZeRO stages 0-2 the accumulated gradients live in DeepSpeed's own reduction buffers, which
nothing restores: there a stop during an accumulation is answered at the next optimizer step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from paco_ds.runtime import stopping
from paco_ds.runtime.checkpoint import CheckpointManager, rng_state
from paco_ds.runtime.distributed import any_true
from paco_ds.grpo.epoch import EpochProgress


class Preemption:
    """The trainer's check points. `state` and `meta`: the trainer's checkpoint state and metadata
    at the time of the save; `loss`: its epoch state goes into a mid-epoch checkpoint."""

    def __init__(self, ckpt: CheckpointManager, engine, trainable: list[torch.nn.Parameter], loss,
                 state: Callable[[], dict], meta: Callable[[], dict], *, zero3: bool, device: torch.device,
                 run_dir: Path, is_main: bool):
        self.ckpt, self.engine, self.trainable, self.loss = ckpt, engine, trainable, loss
        self.state, self.meta = state, meta
        self.zero3, self.device, self.run_dir, self.is_main = zero3, device, run_dir, is_main
        self._start_saved = False  # the epoch's start is a checkpoint already
        self._start_rng: dict | None = None
        self._waiting = False  # a stop is deferred to the next optimizer step

    def epoch_start(self, saved: bool) -> None:
        """The epoch's start, which a preemption until scoring saves: with the RNG state of now,
        unless it is a checkpoint already (`saved`)."""
        self._start_saved, self._start_rng = saved, rng_state()

    def requested(self) -> bool:
        """Whether any rank was asked to save and stop (collective: every rank calls it together)."""
        control = stopping.current()
        return control is not None and control.save_first and any_true(control.requested)

    def check(self, epoch: int, progress: EpochProgress | None = None, accumulating: bool = False) -> None:
        """When any rank was asked to stop: every rank saves here together (the epoch's start, or
        with `progress` a mid-epoch checkpoint) and the run ends with Preempted. `accumulating`:
        micro-steps since the last optimizer step hold gradients. Collective: every rank calls it
        at the same points with the same arguments."""
        if not self.requested():
            return
        control = stopping.current()
        if accumulating and not self.zero3:  # the gradients cannot be saved: wait for the optimizer step
            if not self._waiting and self.is_main:
                print("[preemption] saving after this optimizer step's last micro-step (ZeRO stage < 3 keeps "
                      "accumulated gradients where a checkpoint cannot hold them)", flush=True)
            self._waiting = True
            return
        path = self._save_start(epoch) if progress is None else self._save_progress(epoch, progress)
        reason = control.reason or "another rank was asked to stop"
        if self.is_main:
            stopping.mark_preempted(self.run_dir, path, reason)
        raise stopping.Preempted(f"stopped ({reason}) after saving checkpoint {path}; continue with --resume latest")

    def resume(self, progress: EpochProgress) -> None:
        """Continue a mid-epoch checkpoint's epoch: the loss's epoch state (after `begin_epoch`) and
        the gradients accumulated since the last optimizer step; nothing for an epoch not saved."""
        if progress.grads:
            from deepspeed.utils import safe_set_local_grad

            for p, g in zip(self.trainable, progress.grads):
                safe_set_local_grad(p, g.to(self.device))
            self.engine.optimizer.micro_step_id = progress.micro_step_id
        if progress.loss_epoch is not None:
            self.loss.load_epoch_state(progress.loss_epoch)

    def _save_start(self, epoch: int) -> Path:
        path = self.ckpt.root / f"epoch_{epoch:04d}"
        if self._start_saved:
            return path
        return self.ckpt.save(self.engine, path.name, self.state(), self.meta(), rng=self._start_rng)

    def _save_progress(self, epoch: int, progress: EpochProgress) -> Path:
        progress.loss_epoch = self.loss.epoch_state()
        progress.micro_step_id, progress.grads = self._accumulation()
        return self.ckpt.save(self.engine, f"epoch_{epoch:04d}_step_{progress.done:06d}",
                              {**self.state(), "partial": progress.to_state()},
                              {**self.meta(), "micro_steps_done": progress.done})

    def _accumulation(self) -> tuple[int, list[torch.Tensor] | None]:
        """(micro_step_id, this rank's ZeRO-3 partition of the gradients accumulated since the last
        optimizer step), so that a resume between two optimizer steps loses no micro-step."""
        step_id = accumulated_micro_steps(getattr(self.engine, "optimizer", None))
        if step_id == 0 or not self.zero3:
            return 0, None
        from deepspeed.utils import safe_get_local_grad

        return step_id, [safe_get_local_grad(p).detach().cpu().clone() for p in self.trainable]


def accumulated_micro_steps(optimizer) -> int:
    """The micro-steps a ZeRO-3 optimizer has accumulated since its last step. DeepSpeed counts a
    micro-step at the next forward, not at its backward (`micro_step_id` grows in
    `clear_backward_seen_flag`, after a backward whose epilogue set `_epilogue_ran_this_backward`), so
    right after a backward the one just done is not counted yet: a stop after the epoch's first
    micro-step would save no gradient and lose it. tests/grpo/test_accumulation_resume.py fails if
    a DeepSpeed upgrade changes this."""
    pending = bool(getattr(optimizer, "_epilogue_ran_this_backward", False))
    return int(getattr(optimizer, "micro_step_id", 0)) + pending
