"""A sampler process of `rollout.mode: async` (how it meets the trainers: paco_ds/grpo/async_rollouts.py).

It holds the whole frozen model and the adapter, no optimizer and no process group. Each epoch it
samples its share of the epoch plan's rank batches (sampler j of M takes every M-th of the epoch's
(batch, trainer rank) pairs), each with the newest adapter the trainers have published that is
within `rollout.max_staleness` of the version the epoch's training will start from, waiting for the
trainers otherwise. Each finished rollout batch goes to the rewards at once (`rollout.scoring:
streamed`: the judge's requests go out as the samples finish; `after_sampling`: an epoch's batches
once it is sampled), and a writer thread hands every scored rank batch to the trainers as soon as
its last reward is in. The sampler ends with the trainers: 0 when they finished, 75 when they
saved a preemption checkpoint.

The samples are the colocated run's: the same KRepeatSampler plan over the T trainer ranks, the same
rollout batches, and one `Rollouts` per trainer rank, so a group prefix shared by a rank's batches
is walked as that rank would walk it (exact with one sampler; with several, a prefix may be walked
in another batch, equal up to the batch's floating-point order).
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass

import torch

from paco_ds.data import KRepeatSampler
from paco_ds.grpo import build
from paco_ds.grpo.async_rollouts import (POLL_S, Exchange, RolloutPeerLost, Role, allowed_version, gone, new_nonce,
                                         process_record)
from paco_ds.grpo.epoch import rank_batch_picks
from paco_ds.grpo.losses import build_loss
from paco_ds.grpo.plan import derive
from paco_ds.runtime import stopping
from paco_ds.runtime.distributed import DistInfo
from paco_ds.sampling.rollouts import Rollouts
from paco_ds.sampling.tree import group_members

log = logging.getLogger(__name__)


@dataclass
class RankBatch:
    """One sampled rank batch on its way to the trainers."""

    epoch: int
    rank: int  # the trainer rank it is for
    index: int  # its place among that rank's batches of the epoch
    trajectories: list
    version: int
    transformer_calls: int
    sde_logprob_rows: int  # SDE transitions given a log-prob (the loss counts them, sampling's included)
    waited_s: float  # how long the sampler waited for an adapter version before sampling it
    t_start: float
    t_end: float


class _Writer(threading.Thread):
    """Takes each submitted rank batch's reward results in submission order and publishes the batch."""

    def __init__(self, exchange: Exchange, rewards):
        super().__init__(name="paco-rollout-writer", daemon=True)
        self.exchange, self.rewards = exchange, rewards
        self.todo: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self._failures = 0

    def run(self) -> None:
        while (rb := self.todo.get()) is not None:
            try:
                results = [self.rewards.collect_oldest() for _ in rb.trajectories]
                failures, self._failures = self.rewards.failures - self._failures, self.rewards.failures
                self.exchange.put_batch(rb.epoch, rb.rank, rb.index, {
                    "trajectories": rb.trajectories, "results": results, "version": rb.version,
                    "latencies": self.rewards.take_latencies(), "failures": failures,
                    "transformer_calls": rb.transformer_calls, "sde_logprob_rows": rb.sde_logprob_rows, "waited_s": rb.waited_s, "t_start": rb.t_start,
                    "t_end": rb.t_end})
            except BaseException as err:  # noqa: BLE001 - the main thread raises it at its next check
                self.error = err
                return
            finally:
                self.todo.task_done()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def drain(self) -> None:
        """Wait until every submitted batch is published (or one failed)."""
        while self.todo.unfinished_tasks and self.error is None:
            time.sleep(POLL_S)
        self.check()


class Sampler:
    def __init__(self, cfg, role: Role, device: torch.device):
        self.cfg, self.role, self.device = cfg, role, device
        self.exchange = Exchange(cfg.run_dir)
        self.items, _ = build.prompts(cfg)
        self.plan = derive(cfg, role.trainers, dataset_size=len(self.items))
        self.k = cfg.rollout.max_staleness
        torch.manual_seed(cfg.seed)  # the adapter's initial weights are the trainers' (published as version 0)
        self.policy = build.adapted_policy(cfg, device, {})  # the whole transformer, no ZeRO
        self.params = dict(self.policy.transformer.named_parameters())
        self.loss = build_loss(cfg, self.policy)  # its SDE step and what it needs a rollout to keep
        s = cfg.sample
        self.plans = [KRepeatSampler(len(self.items), s.group_size, self.plan.prompts_per_epoch, role.trainers, r,
                                     s.batch_size, cfg.seed) for r in range(role.trainers)]
        self.rollouts = [build.rollouts(cfg, self.policy, self.loss, None, {}) for _ in range(role.trainers)]
        self.version: int | None = None
        self.trainer0: dict | None = None
        self.rewards = None
        self.writer: _Writer | None = None

    # ---------------------------------------------------------------- the run
    def run(self) -> None:
        start = self.handshake()
        self.trainer0 = start.get("trainer0")
        dist = DistInfo(self.role.rank, self.role.launch_world, int(os.environ.get("LOCAL_RANK", "0")), self.device)
        self.rewards = build.train_rewards(self.cfg, build.reward_context(self.cfg, dist))
        self.writer = _Writer(self.exchange, self.rewards)
        self.writer.start()
        first, last = start["first_epoch"], self.cfg.train.num_epochs
        print(f"[sampler {self.role.sampler}] rank {self.role.rank}: epochs {first}-{last - 1} for "
              f"{self.role.trainers} trainer rank(s), from adapter version {start['version']}", flush=True)
        try:
            for epoch in range(first, last):
                if not self.sample_epoch(epoch):
                    break
            self.writer.drain()
            self.await_trainers()
        finally:
            self.writer.todo.put(None)
            self.rewards.close()

    def handshake(self) -> dict:
        """Say hello (with a nonce of this launch) until the trainers answer it; their start record."""
        me = {"nonce": new_nonce(), "rank": self.role.rank, **process_record()}
        while True:
            self.exchange.hello(self.role.sampler, me)
            start = self.exchange.start()
            if start is not None and start["samplers"].get(str(self.role.sampler)) == me["nonce"]:
                return start
            time.sleep(POLL_S * 4)

    def sample_epoch(self, epoch: int) -> bool:
        """This sampler's rank batches of `epoch`; False when a stop was asked."""
        cfg, role = self.cfg, self.role
        units = [(r, b) for b in range(self.plan.sample_batches_per_rank) for r in range(role.trainers)]
        member = group_members(self.plans[0].epoch_plan(epoch).numpy())  # each position's leaf in its group
        held = []
        for r, b in units[role.sampler::role.samplers]:
            waited = self.await_version(epoch)
            if waited is None:
                return False
            rollouts, rank_batch = self.rollouts[r], self.plans[r].rank_batches(epoch)[b]
            calls, rows, t0 = rollouts.transformer_calls, self.loss.sde_logprob_rows, time.time()
            with self.loss.sampling(), rollouts.module() as module:
                trajs = [rollouts.sample(module, picks, h, w, epoch) for (h, w), picks in
                         rollouts.by_size(rank_batch_picks(self.items, rank_batch, member), cfg.train.resolution)]
            rb = RankBatch(epoch, r, b, trajs, self.version, rollouts.transformer_calls - calls,
                           self.loss.sde_logprob_rows - rows, waited, t0, time.time())
            if cfg.rollout.scoring == "streamed":
                self.submit(rb)
            else:
                held.append(rb)
        for rb in held:  # after_sampling: the epoch's batches to the rewards once all are sampled
            self.submit(rb)
        return True

    def submit(self, rb: RankBatch) -> None:
        for traj in rb.trajectories:
            self.rewards.submit(traj.images, traj.prompts, traj.metadata, Rollouts.references(traj))
        self.writer.todo.put(rb)

    # ---------------------------------------------------------------- versions
    def allowed(self, epoch: int) -> int | None:
        """The newest published adapter version if `epoch` may be sampled with it, else None (wait)."""
        return allowed_version(self.exchange.trainers(), self.exchange.adapter_versions(), epoch,
                               self.plan.optimizer_steps_per_epoch, self.k)

    def await_version(self, epoch: int) -> float | None:
        """Wait until `epoch` may be sampled and load the newest adapter; the seconds waited, or None when
        a stop was asked (checkpoint.save_on_sigterm: the trainers save, this sampler has nothing to)."""
        t0 = time.perf_counter()
        while True:
            self.writer.check()
            if stopping.saving_requested():
                self.stop()
                return None
            self.check_trainers()
            version = self.allowed(epoch)
            if version is not None and (version == self.version or self.load(version)):
                return time.perf_counter() - t0
            time.sleep(POLL_S)

    def load(self, version: int) -> bool:
        state = self.exchange.load_adapter(version)
        if state is None:  # replaced by a newer one meanwhile
            return False
        missing = [n for n in state if n not in self.params]
        if missing:
            raise RuntimeError(f"the trainers' adapter has parameters this sampler's model lacks: {missing[:3]}")
        with torch.no_grad():
            for name, value in state.items():  # in the trainers' dtype: the same arithmetic as their gathered copy
                self.params[name].data = value.to(self.device)
        self.version = version
        return True

    # ---------------------------------------------------------------- ends
    def check_trainers(self) -> None:
        """The trainers ended early (they stopped, or saved and stopped), or their rank 0 is gone."""
        ended = self.exchange.ended()
        if ended is not None:  # written before they exit
            if ended != "finished":
                self.end_as(ended)
            return
        if self.trainer0 is not None and gone(self.trainer0):
            raise RolloutPeerLost(f"the trainers' rank 0 (pid {self.trainer0['pid']}) ended while sampler "
                                  f"{self.role.sampler} sampled for it; its own output says why")

    def stop(self) -> None:
        control = stopping.current()
        self.exchange.ask_stop(f"sampler {self.role.sampler} (rank {self.role.rank}): {control.reason}")
        self.writer.drain()
        self.await_trainers()

    def await_trainers(self) -> None:
        """Until the trainers end (they publish how): this process ends as they did."""
        while (ended := self.exchange.ended()) is None:
            self.writer.check()
            if stopping.saving_requested() and self.exchange.stop_asked() is None:
                self.exchange.ask_stop(f"sampler {self.role.sampler} (rank {self.role.rank}): "
                                       f"{stopping.current().reason}")
            self.check_trainers()
            time.sleep(POLL_S * 4)
        self.end_as(ended)

    def end_as(self, ended: str) -> None:
        if ended == "finished":
            return
        if ended == "preempted":
            raise stopping.Preempted(f"sampler {self.role.sampler}: the trainers saved a checkpoint and stopped; "
                                     "continue with --resume latest")
        raise RolloutPeerLost(f"sampler {self.role.sampler}: the trainers stopped; their output says why")


def run_sampler(cfg, role: Role) -> None:
    """The process of sampler `role.sampler`, from a loaded recipe (paco_ds/grpo/run.py)."""
    from paco_ds.grpo.plan import check_recipe
    from paco_ds.runtime.storage import writing

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    check_recipe(cfg, role.trainers)  # the trainers check the same: each process stops with the same line
    with writing(cfg.run_dir, cfg.run_dir):
        Sampler(cfg, role, device).run()
    sys.stdout.flush()
