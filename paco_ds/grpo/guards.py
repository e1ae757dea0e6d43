"""The trainer's guards against a run that only looks like it trains: non-finite losses or rewards,
and optimizer steps skipped for a non-finite gradient norm, each counted in a row; past
`train.max_consecutive_nonfinite` the run stops with TrainingDiverged (exit 3)."""
from __future__ import annotations

import logging
import math

from paco_ds.errors import TrainingDiverged

log = logging.getLogger(__name__)


class NonfiniteGuard:
    def __init__(self, limit: int):
        self.limit = limit  # train.max_consecutive_nonfinite
        self.streak = 0  # non-finite losses/rewards in a row (a checkpoint keeps it)
        self.bad_grad_streak = 0  # optimizer steps in a row whose gradient norm was not finite

    def finite(self) -> None:
        """A finite loss: the streak ends."""
        self.streak = 0

    def nonfinite(self, what: str) -> None:
        self.streak += 1
        log.warning("%s (%d in a row, limit %d)", what, self.streak, self.limit)
        if self.streak >= self.limit:
            raise TrainingDiverged(f"stopping: {self.streak} non-finite losses/rewards in a row "
                                   f"(train.max_consecutive_nonfinite={self.limit}); last: {what}")

    def grad_norm(self, norm: float, step: int, out: dict) -> None:
        """A non-finite gradient norm means ZeRO-3 skipped the optimizer step (it treats it as an
        overflow): the policy did not change. Counted per epoch (`out`: the micro-step's statistics),
        and a streak stops the run, so a run whose every step is skipped cannot look like a run that
        trained."""
        if math.isfinite(norm):
            out["grad_norm"] = norm
            self.bad_grad_streak = 0
            return
        out["nonfinite_grad"] = 1.0
        self.bad_grad_streak += 1
        log.warning("non-finite gradient norm at step %d: the optimizer step was skipped (%d in a row, limit %d)",
                    step, self.bad_grad_streak, self.limit)
        if self.bad_grad_streak >= self.limit:
            raise TrainingDiverged(f"stopping: {self.bad_grad_streak} optimizer steps in a row had a non-finite "
                                   f"gradient norm and were skipped (train.max_consecutive_nonfinite={self.limit}); "
                                   "the policy has not changed since the last good step")
