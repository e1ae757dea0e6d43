"""PaCo-GRPO on a DeepSpeed engine: the main job.

One epoch, top to bottom (docs/design.md):
  1. sample   m prompts x k images with the pre-update weights; ODE steps except the noise steps,
              which use the SDE and record log pi_old. Each finished batch goes to the reward
              workers at once, so scoring overlaps sampling.
  2. reward   collect the scores, gather them from all ranks.
  3. advantage per-prompt GRPO over the gathered epoch (stat tracker), each rank keeps its own.
  4. train    the recipe's loss (paco_ds/grpo/losses/; PPO-clip on the noised steps: one forward
              with grad per sample and step, a second, adapter-disabled one only when train.kl_beta > 0);
              DeepSpeed accumulates, clips, steps; the EMA steps once per optimizer step.
Evaluation (ODE at the test resolution, the test reward set) and checkpoints happen at the start
of an epoch, every `eval_freq` / `save_freq` epochs, and after the last one.
"""
from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from paco_ds import stopping
from paco_ds.checkpoint import CheckpointManager, rng_state
from paco_ds.config import Config
from paco_ds.data import KRepeatSampler, load_prompts
from paco_ds.distributed import (DistInfo, all_gather_object, all_reduce_max, all_reduce_mean, any_true, barrier,
                                 setup_distributed, shutdown_distributed)
from paco_ds.dtypes import resolve_dtype
from paco_ds.engine import build_ds_config, create_engine, load_ds_config, zero_stage
from paco_ds.errors import ConfigError, TrainingDiverged
from paco_ds.grpo.advantages import EpochRewards, StatTracker
from paco_ds.grpo.ema import EMA
from paco_ds.grpo.losses import build_loss
from paco_ds.grpo.plan import derive
from paco_ds.grpo.rollouts import Pick, Rollouts
from paco_ds.images import make_grid, to_pil
from paco_ds.metrics import MetricsLogger
from paco_ds.models import build_policy
from paco_ds.models.compile import compile_blocks
from paco_ds.models.lora import adapter_metadata, add_lora, export_lora, lora_state_dict
from paco_ds.recipe import recipe_to_yaml
from paco_ds.rewards.runner import RewardRunner, part_scores
from paco_ds.sampling.rollout import Trajectory, TrainingBatch, make_generator, training_batch
from paco_ds.sampling.window import window_start
from paco_ds.serving.manager import endpoints_for_run, started_for_run
from paco_ds.storage import writing

log = logging.getLogger(__name__)


def judge_latency_metrics(per_rank: list[list[float]]) -> dict[str, float]:
    """judge/latency_ms_p50 and _p90 over every rank's requests, and the slowest rank's median
    (a rank routed to a far or overloaded judge shows there); {} without remote rewards."""
    pooled = np.concatenate([np.asarray(r, dtype=np.float64) for r in per_rank]) * 1000
    if not pooled.size:
        return {}
    return {"judge/latency_ms_p50": float(np.percentile(pooled, 50)),
            "judge/latency_ms_p90": float(np.percentile(pooled, 90)),
            "judge/latency_ms_slowest_rank": float(max(np.median(r) for r in per_rank if len(r)) * 1000)}


@dataclass
class EpochSamples:
    """The epoch's rollout batches and, once scored, each sample's advantage and whether it trains
    (one [B] tensor per rollout batch)."""
    trajectories: list[Trajectory] = field(default_factory=list)
    advantages: list[torch.Tensor] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)
    transformer_calls: int = 0  # rows x steps the rollouts ran the transformer for (this rank)

    def batch(self, entries: list[tuple[int, int]], fillers: list[bool]) -> TrainingBatch:
        """The training batch of these (rollout batch, sample) entries; a filler trains nothing
        (advantage 0, not kept)."""
        off = torch.tensor(fillers, dtype=torch.bool)
        adv = torch.stack([self.advantages[k][i] for k, i in entries]).masked_fill(off, 0.0)
        keep = torch.stack([self.keep[k][i] for k, i in entries]) & ~off
        return training_batch([(self.trajectories[k], i) for k, i in entries], adv, keep)


class GRPOTrainer:
    def __init__(self, cfg: Config, dist: DistInfo):
        self.cfg, self.dist = cfg, dist
        self.run_dir = cfg.run_dir
        _seed_everything(cfg.seed)  # identical on every rank: the tiny model and LoRA init must agree
        self.train_items = load_prompts(cfg.resolve_path(cfg.data.train_file), cfg.data.format, "data.train_file")
        self.test_items = load_prompts(cfg.resolve_path(cfg.data.test_file), cfg.data.format, "data.test_file") \
            if cfg.data.test_file else []
        if cfg.data.max_test_prompts:
            self.test_items = self.test_items[:cfg.data.max_test_prompts]
        self.plan = derive(cfg, dist.world_size, dataset_size=len(self.train_items))

        # Policy: frozen encoders/VAE per rank; the transformer (with LoRA) goes into the engine.
        # Under ZeRO-3 it is built partitioned: no rank ever holds the whole transformer.
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.model.allow_tf32
        self.ds_config = build_ds_config(
            load_ds_config(cfg.resolve_path(cfg.deepspeed.config)), micro_batch=cfg.train.batch_size,
            grad_accum=self.plan.grad_accum_steps, world_size=dist.world_size, grad_clip=cfg.train.max_grad_norm,
            bf16=resolve_dtype(cfg.model.dtype, dist.device) == torch.bfloat16, zero_stage=cfg.deepspeed.zero_stage,
            overrides=cfg.deepspeed.overrides)
        self.policy = build_policy(cfg.model, dist.device, self.ds_config)
        add_lora(self.policy.transformer, cfg.model.lora)
        if cfg.model.gradient_checkpointing:  # recompute activations in backward: memory for time
            self.policy.transformer.enable_gradient_checkpointing()
        if cfg.model.compile:  # after LoRA: the compiled blocks trace the adapted layers
            compile_blocks(self.policy.transformer)
        self.loss = build_loss(cfg, self.policy)
        trainable = [p for p in self.policy.transformer.parameters() if p.requires_grad]
        self.engine = create_engine(self.policy.transformer, trainable, self.ds_config, lr=cfg.train.learning_rate,
                                    betas=(cfg.train.adam_beta1, cfg.train.adam_beta2), eps=cfg.train.adam_epsilon,
                                    weight_decay=cfg.train.weight_decay)
        self.trainable = trainable
        self.loss.setup(trainable)  # e.g. DiffusionNFT's old policy: a copy of the (partitioned) adapter
        self.ema = EMA(trainable, cfg.train.ema.decay, cfg.train.ema.update_interval) if cfg.train.ema.enabled else None
        self.forwards = 0  # transformer forward calls, to check one forward per trained sample and step
        self.policy.transformer.register_forward_pre_hook(self._count_forward)

        self.sampler = KRepeatSampler(len(self.train_items), cfg.sample.group_size, self.plan.prompts_per_epoch,
                                      dist.world_size, dist.rank, cfg.sample.batch_size, cfg.seed)
        shared: dict = {}
        ctx = {"device": str(dist.device), "run_dir": self.run_dir,
               "reward_endpoints": endpoints_for_run(cfg.reward_servers, self.run_dir)}
        self.train_rewards = RewardRunner(cfg.rewards.train, "rewards.train.terms", shared, cfg.rewards.overlap,
                                          cfg.rewards.batches_in_flight, **ctx)
        self.eval_rewards = RewardRunner(cfg.rewards.eval, "rewards.test.terms" if cfg.rewards.test else
                                         "rewards.train.terms", shared, batches_in_flight=cfg.rewards.batches_in_flight,
                                         **ctx)
        self.tracker = StatTracker(cfg.advantage, cfg.rewards.train.aggregation, self.train_rewards.weights,
                                   backend=cfg.kernels.backend)
        # Rollouts sample with the loss's SDE step, through the engine (or the transformer gathered once).
        # A shared group prefix makes ranks run different numbers of forwards: only where a forward
        # needs no collective (ZeRO-3 gathers per step under rollout_gather=per_step).
        per_step_gather = zero_stage(self.ds_config) == 3 and cfg.deepspeed.rollout_gather == "per_step"
        self.rollouts = Rollouts(cfg, self.policy, self.loss.sde, module=self.engine,
                                 gather_once=zero_stage(self.ds_config) == 3 and cfg.deepspeed.rollout_gather == "once",
                                 train_timesteps=self.plan.train_timesteps, needs=self.loss.needs,
                                 share_prefix=cfg.sample.share_prefix and not per_step_gather)
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", cfg.checkpoint.keep_last, dist.rank, dist.world_size)
        # cluster.colocate: the judges share the trainers' devices (paco_ds/serving/sleep.py).
        from paco_ds.serving.sleep import ColocatedJudges

        self.judges = ColocatedJudges.for_run(cfg, self.run_dir, dist.local_rank, in_flight=lambda: (
            self.train_rewards.in_flight() + self.eval_rewards.in_flight()))
        self.logger: MetricsLogger | None = None
        self.epoch = 0
        self.global_step = 0
        self.nonfinite_streak = 0
        self.bad_grad_streak = 0  # optimizer steps in a row whose gradient norm was not finite
        self._partial: dict | None = None  # a mid-epoch (preemption) checkpoint's epoch to finish
        self._start_saved = False  # this epoch's start is a checkpoint already
        self._start_rng: dict | None = None

    # ------------------------------------------------------------------------------------ loop
    def fit(self, resume: str | Path | None = None) -> None:
        cfg = self.cfg
        resumed = False
        if resume:
            self.load(resume if isinstance(resume, Path) else self.ckpt.resolve(resume))
            resumed = True
        self.logger = MetricsLogger(self.run_dir, self.dist.is_main, cfg.logging.tensorboard, cfg.logging.wandb,
                                    cfg.logging.project, cfg.run_name, cfg.model_dump(mode="json"), resume=resumed)
        if resumed:
            self.logger.truncate_after(self.epoch)
        if self.dist.is_main:
            (self.run_dir / "config.yaml").write_text(recipe_to_yaml(cfg))
            stopping.clear_preempted(self.run_dir)  # training again: an earlier preemption is not this run's status
            log.info("run directory: %s", self.run_dir)
        while self.epoch < cfg.train.num_epochs:
            partial, self._partial = self._partial, None
            if partial is None:
                metrics = {"epoch": self.epoch} | self._colocated_judges(wake=True)
                self.policy.park_text_encoders(False)  # evaluation and sampling encode prompts
                if _due(self.epoch, cfg.test.eval_freq):
                    metrics |= self.evaluate()
                saved = _due(self.epoch, cfg.checkpoint.save_freq) and not resumed
                if saved:
                    self.save()
                # Until scoring, the state is the epoch's start: a preemption saves it as that.
                self._start_saved, self._start_rng = saved or resumed, rng_state()
                resumed = False
                self._check_preemption()
                t0, busy = time.perf_counter(), self.train_rewards.busy_seconds
                samples = self.sample_epoch()
                t_sample = time.perf_counter() - t0
                # what sample.ode_steps and sample.share_prefix save shows here
                metrics["sample/transformer_calls"] = float(sum(all_gather_object(samples.transformer_calls)))
                self.policy.park_text_encoders(True)  # the epoch's embeddings are cached: off the GPU until next epoch
                metrics |= self.score_epoch(samples)
                t_reward = time.perf_counter() - t0 - t_sample
                metrics["time/reward_busy"] = self.train_rewards.busy_seconds - busy
                metrics |= self._colocated_judges(wake=False)
            else:  # resumed from a preemption checkpoint: this epoch's rollouts and scores are in it
                metrics, samples = dict(partial["metrics"]), partial["samples"]
                self.policy.park_text_encoders(True)
                self._colocated_judges(wake=False)
                resumed = False
                t0, t_sample, t_reward = time.perf_counter(), 0.0, 0.0
            self._start_rng = None
            metrics |= self.train_epoch(samples, metrics, partial)
            t_train = time.perf_counter() - t0 - t_sample - t_reward
            metrics |= {"time/sample": t_sample, "time/reward_wait": t_reward, "time/train": t_train,
                        "time/epoch": time.perf_counter() - t0, "global_step": self.global_step,
                        "images_per_sec": self.plan.samples_per_epoch / (time.perf_counter() - t0)}
            self.logger.log(metrics, step=self.epoch)
            self._print_epoch(metrics)
            self.epoch += 1
        # After the last epoch: the same eval/save rule, so a later resume continues seamlessly.
        final = {"epoch": self.epoch}
        if _due(self.epoch, cfg.test.eval_freq):
            final |= self._colocated_judges(wake=True)
            self.policy.park_text_encoders(False)
            final |= self.evaluate()
            self.logger.log(final, step=self.epoch)
        if cfg.checkpoint.save_freq:
            self.save()
        self.export_lora(self.run_dir / "lora")
        if self.dist.is_main:
            from paco_ds.report import write_report

            report = write_report(self.run_dir)
            print(f"report: {report}", flush=True)

    def _colocated_judges(self, wake: bool) -> dict:
        """Wake or sleep colocated judges (collective); {} when the run does not colocate."""
        return self.judges.switch(wake) if self.judges is not None else {}

    # ------------------------------------------------------------------------------------ 1. sample
    def sample_epoch(self) -> EpochSamples:
        cfg, out = self.cfg, EpochSamples()
        batches = self.sampler.rank_batches(self.epoch)
        calls = self.rollouts.transformer_calls
        with self.loss.sampling(), self.rollouts.module() as module:
            for rb in tqdm(batches, desc=f"epoch {self.epoch} sample", disable=not self.dist.is_main, leave=False):
                picks = [Pick(self.train_items[i], i, p) for i, p in zip(rb.indices, rb.positions)]
                for (h, w), picks in self.rollouts.by_size(picks, cfg.train.resolution):
                    traj = self.rollouts.sample(module, picks, h, w, self.epoch)
                    # scores while we sample on; editing rewards compare against the original references
                    self.train_rewards.submit(traj.images, traj.prompts, traj.metadata, self.rollouts.references(traj))
                    out.trajectories.append(traj)
                self._check_preemption()  # every rank has the same number of rollout batches
        out.transformer_calls = self.rollouts.transformer_calls - calls
        return out

    # ------------------------------------------------------------------------------------ 2-3. reward, advantage
    def score_epoch(self, samples: EpochSamples) -> dict:
        results = self.train_rewards.collect()
        trajs = samples.trajectories
        rewards = EpochRewards.gather(
            positions=np.array([p for t in trajs for p in t.positions], dtype=np.int64),
            groups=np.array([g for t in trajs for g in t.group_ids], dtype=np.int64),
            valid=np.logical_and.reduce([r.valid for r in results.values()]),
            scores={name: r.scores for name, r in results.items()},
            parts=part_scores(results),  # e.g. consistency_for_editing's consistency and following
            latency_s=self.train_rewards.take_latencies())  # this epoch's judge requests, evaluation's included
        adv = self.tracker.compute(rewards.scores, rewards.groups, rewards.valid, device=self.dist.device)
        sizes = [len(t) for t in trajs]
        samples.advantages = rewards.split(adv.advantages, sizes, torch.float32)
        samples.keep = rewards.split(adv.keep, sizes, torch.bool)

        metrics = {f"adv/{k}": v for k, v in adv.stats.items()}
        for name, part in rewards.parts.items():
            metrics[f"reward/{name}/mean"] = float(np.nanmean(part)) if np.isfinite(part).any() else float("nan")
        for name, s in rewards.scores.items():
            ok = rewards.valid & np.isfinite(s)
            metrics[f"reward/{name}/mean"] = float(s[ok].mean()) if ok.any() else float("nan")
            metrics[f"reward/{name}/std"] = float(s[ok].std()) if ok.any() else float("nan")
        finite = np.isfinite(adv.combined)
        metrics["reward/combined/mean"] = float(adv.combined[finite].mean()) if finite.any() else float("nan")
        metrics["reward/masked"] = float((~rewards.valid).sum())
        metrics["reward/failures"] = float(sum(all_gather_object(self.train_rewards.failures)))
        metrics |= judge_latency_metrics(rewards.latency_s)
        if self.dist.is_main and self.cfg.logging.num_train_images:
            n = self.cfg.logging.num_train_images
            images = [im for t in trajs for im in to_pil(t.images)][:n]
            captions = [f"{s:.3g}" for s in adv.combined[rewards.mine][:n]]
            self.logger.save_image("train_samples", make_grid(images, captions=captions), self.epoch)
        metrics["train/height"], metrics["train/width"] = float(trajs[0].height), float(trajs[0].width)
        if not adv.keep.any():  # the same on every rank: computed from the gathered rewards
            self._nonfinite("no sample of the epoch has a valid reward")
        return metrics

    # ------------------------------------------------------------------------------------ 4. train
    def train_epoch(self, samples: EpochSamples, metrics: dict | None = None, partial: dict | None = None) -> dict:
        """`metrics`: the epoch's so far, kept in a preemption checkpoint; `partial`: such a
        checkpoint's training state, to continue after its last micro-step."""
        cfg = self.cfg
        entries = [(k, i) for k, t in enumerate(samples.trajectories) for i in range(len(t))]
        kept = [(k, i) for k, i in entries if samples.keep[k][i]]
        # ZeRO-3 runs collectives in every forward/backward: all ranks must do the same number of
        # micro-steps. Ranks with fewer kept samples pad with zero-advantage steps (no gradient).
        bs, steps_per_epoch = cfg.train.batch_size, cfg.train.optimizer_steps_per_epoch
        n_micro = int(all_reduce_max(-(-len(kept) // bs)))
        if n_micro == 0:
            return {"train/micro_steps": 0.0}
        n_micro = -(-n_micro // steps_per_epoch) * steps_per_epoch
        timesteps = list(range(len(self.plan.train_timesteps)))
        self.loss.begin_epoch(self.epoch)
        stats: dict[str, list[float]] = {}
        first: dict[str, float] = {}  # the loss's `first_of_epoch` statistics at the epoch's first micro-step
        self.forwards = 0
        done = 0  # micro-steps of this epoch already taken (before a preemption checkpoint)
        if partial is not None:
            stats, first, self.forwards, done = partial["stats"], partial["first"], partial["forwards"], partial["done"]
            self._restore_accumulation(partial)
            self.loss.load_epoch_state(partial["loss_epoch"])
        total = cfg.train.num_inner_epochs * n_micro * len(timesteps)
        bar = tqdm(total=total, initial=done, desc=f"epoch {self.epoch} train", disable=not self.dist.is_main,
                   leave=False)
        self.engine.train()
        flat = 0
        self._check_preemption(samples, metrics, {"stats": stats, "first": first, "done": done})
        for inner in range(cfg.train.num_inner_epochs):
            gen = make_generator(cfg.seed, "shuffle", self.epoch, inner, self.dist.rank)
            pool = kept or entries
            order = [pool[i] for i in torch.randperm(len(pool), generator=gen).tolist()]
            padded = order + [None] * (n_micro * bs - len(order))  # None: a zero-advantage filler
            group_len = n_micro * len(timesteps) // steps_per_epoch  # micro-steps per optimizer step
            for m in range(n_micro):
                if flat + len(timesteps) <= done:  # taken before the preemption checkpoint
                    flat += len(timesteps)
                    continue
                chunk = padded[m * bs:(m + 1) * bs]
                batch = samples.batch([e if e is not None else pool[j % len(pool)] for j, e in enumerate(chunk)],
                                      fillers=[e is None for e in chunk])
                for t in timesteps:
                    flat += 1
                    if flat <= done:
                        continue
                    k = m * len(timesteps) + t
                    step_stats = self._micro_step(batch, t, boundary=(k + 1) % group_len == 0, scale=group_len)
                    for key in self.loss.first_of_epoch:
                        if key in step_stats:
                            first.setdefault(key, step_stats[key])
                    for key, v in step_stats.items():
                        stats.setdefault(key, []).append(v)
                    bar.update(1)
                    self._check_preemption(samples, metrics, {"stats": stats, "first": first, "done": flat})
        bar.close()
        out = {f"train/{k}": float(np.mean(v)) for k, v in stats.items() if k not in ("nonfinite", "nonfinite_grad")}
        out = all_reduce_mean(out)
        out["train/nonfinite_steps"] = float(sum(all_gather_object(sum(stats.get("nonfinite", [])))))
        # the gradient norm is global: every rank saw the same skipped steps
        out["train/skipped_optimizer_steps"] = float(sum(stats.get("nonfinite_grad", [])))
        for key, v in first.items():
            out[f"train/{key}_first"] = float(v)
        out["train/micro_steps"] = float(total)
        out["train/forwards_per_step"] = self.forwards / total
        out["train/lr"] = float(self.engine.get_lr()[0])
        self.loss.end_epoch(self.global_step)
        if cfg.sample.sde_window is not None and cfg.sample.sde_window.per == "epoch":
            out["sample/sde_window_start"] = float(window_start(cfg, self.epoch))
        return self.loss.epoch_metrics(out)

    def _micro_step(self, batch: TrainingBatch, t: int, boundary: bool, scale: int) -> dict:
        loss, stats = self.loss(self.engine, batch, t)
        skip = any_true(not bool(torch.isfinite(loss)))
        self.engine.set_gradient_accumulation_boundary(boundary)
        if skip:
            # Every rank skips this backward together (ZeRO-3 collectives must match); the
            # optimizer step still happens at the boundary with the other micro-steps' gradients.
            self._nonfinite(f"non-finite loss at epoch {self.epoch}")
        else:
            self.nonfinite_streak = 0
            self.engine.backward(loss / scale, scale_wrt_gas=False)
        self.engine.step()
        out = dict(stats, loss=float(loss.detach()), nonfinite=float(skip))
        if boundary:
            self.global_step += 1
            if self.ema is not None:
                self.ema.step(self.global_step)
            norm = self.engine.get_global_grad_norm()
            if norm is not None:
                self._check_grad_norm(float(norm), out)
        return out

    def _check_grad_norm(self, norm: float, out: dict) -> None:
        """A non-finite gradient norm means ZeRO-3 skipped the optimizer step (it treats it as an
        overflow): the policy did not change. Counted per epoch, and a streak stops the run, so a run
        whose every step is skipped cannot look like a run that trained."""
        if math.isfinite(norm):
            out["grad_norm"] = norm
            self.bad_grad_streak = 0
            return
        out["nonfinite_grad"] = 1.0
        self.bad_grad_streak += 1
        limit = self.cfg.train.max_consecutive_nonfinite
        log.warning("non-finite gradient norm at step %d: the optimizer step was skipped (%d in a row, limit %d)",
                    self.global_step, self.bad_grad_streak, limit)
        if self.bad_grad_streak >= limit:
            raise TrainingDiverged(f"stopping: {self.bad_grad_streak} optimizer steps in a row had a non-finite "
                                   f"gradient norm and were skipped (train.max_consecutive_nonfinite={limit}); "
                                   "the policy has not changed since the last good step")

    # ------------------------------------------------------------------------------------ preemption
    def _check_preemption(self, samples: EpochSamples | None = None, metrics: dict | None = None,
                          progress: dict | None = None) -> None:
        """With checkpoint.save_on_sigterm: when any rank was asked to stop, every rank saves a
        checkpoint here together and the run ends with Preempted. Collective: every rank calls it
        at the same points. Before scoring (no `samples`) the state is the epoch's start; after
        it, a mid-epoch checkpoint keeps the epoch's rollouts, metrics and progress."""
        control = stopping.current()
        if control is None or not control.save_first or not any_true(control.requested):
            return
        if samples is None:
            path = self.ckpt.root / f"epoch_{self.epoch:04d}"
            if not self._start_saved:
                path = self.ckpt.save(self.engine, path.name, self.state(), self._meta(), rng=self._start_rng)
        else:
            partial = {"samples": samples, "metrics": metrics or {}, "forwards": self.forwards,
                       "loss_epoch": self.loss.epoch_state(), **progress, **self._accumulation()}
            tag = f"epoch_{self.epoch:04d}_step_{progress['done']:06d}"
            path = self.ckpt.save(self.engine, tag, {**self.state(), "partial": partial},
                                  {**self._meta(), "micro_steps_done": progress["done"]})
        if self.dist.is_main:
            stopping.mark_preempted(self.run_dir, path, control.reason)
        raise stopping.Preempted(f"stopped ({control.reason}) after saving checkpoint {path}; continue with "
                                 "--resume latest")

    def _accumulation(self) -> dict:
        """The gradients accumulated since the last optimizer step (this rank's ZeRO-3 partition),
        so that a resume between two optimizer steps loses no micro-step."""
        opt = getattr(self.engine, "optimizer", None)
        step_id = int(getattr(opt, "micro_step_id", 0))
        if step_id == 0 or zero_stage(self.ds_config) != 3:
            return {"micro_step_id": 0, "grads": None}
        from deepspeed.utils import safe_get_local_grad

        return {"micro_step_id": step_id, "grads": [safe_get_local_grad(p).detach().cpu().clone()
                                                    for p in self.trainable]}

    def _restore_accumulation(self, partial: dict) -> None:
        if not partial.get("grads"):
            return
        from deepspeed.utils import safe_set_local_grad

        for p, g in zip(self.trainable, partial["grads"]):
            safe_set_local_grad(p, g.to(self.dist.device))
        self.engine.optimizer.micro_step_id = partial["micro_step_id"]

    def _nonfinite(self, what: str) -> None:
        self.nonfinite_streak += 1
        limit = self.cfg.train.max_consecutive_nonfinite
        log.warning("%s (%d in a row, limit %d)", what, self.nonfinite_streak, limit)
        if self.nonfinite_streak >= limit:
            raise TrainingDiverged(f"stopping: {self.nonfinite_streak} non-finite losses/rewards in a row "
                                   f"(train.max_consecutive_nonfinite={limit}); last: {what}")

    def _count_forward(self, module, args) -> None:
        self.forwards += 1

    # ------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """ODE sampling of the test prompts at the test resolution with the test reward set
        (paco_ds/grpo/evaluation.py; `launch/evaluate.py policy` runs the same function)."""
        from paco_ds.grpo.evaluation import eval_grid, evaluate_test_prompts

        metrics, images = evaluate_test_prompts(self.cfg, self.dist, self.rollouts, self.test_items,
                                                self.eval_rewards, self.ema.swapped_in() if self.ema is not None else None)
        if self.dist.is_main and images:
            self.logger.save_image("eval", eval_grid(images), self.epoch)
        return metrics

    # ------------------------------------------------------------------------------------ state
    def state(self) -> dict:
        return {"epoch": self.epoch, "global_step": self.global_step, "nonfinite_streak": self.nonfinite_streak,
                "tracker": self.tracker.state_dict(), "ema": self.ema.state_dict() if self.ema else None,
                "loss": self.loss.state_dict()}

    def _meta(self) -> dict:
        from paco_ds.grpo.preflight import resume_settings

        return {"epoch": self.epoch, "global_step": self.global_step, "run_name": self.cfg.run_name,
                "recipe": resume_settings(self.cfg)}

    def save(self) -> Path:
        path = self.ckpt.save(self.engine, f"epoch_{self.epoch:04d}", self.state(), self._meta())
        if self.dist.is_main:
            log.info("checkpoint: %s", path)
        return path

    # What a mid-epoch (preemption) checkpoint must hold to continue the epoch exactly.
    PARTIAL_STATE = ("samples", "metrics", "forwards", "loss_epoch", "stats", "first", "done", "micro_step_id",
                     "grads")

    def missing_state(self, state: dict) -> list[str]:
        """The pieces this run needs from a checkpoint that `state` lacks: another loss's checkpoint
        (resumed with --allow-changed train.loss), one saved without EMA, or an older layout."""
        missing = [k for k in ("epoch", "global_step", "nonfinite_streak", "tracker", "loss") if k not in state]
        if self.ema is not None and state.get("ema") is None:
            missing.append("EMA weights (train.ema.enabled)")
        saved_loss = state.get("loss") if isinstance(state.get("loss"), dict) else {}
        missing += [f"the {self.cfg.train.loss} loss's '{k}' state" for k in self.loss.state_dict() if k not in saved_loss]
        partial = state.get("partial")
        if partial is not None:
            missing += [f"mid-epoch '{k}'" for k in self.PARTIAL_STATE if k not in partial]
        return missing

    def load(self, path: Path) -> None:
        state, meta = self.ckpt.load(self.engine, path)
        missing = self.missing_state(state)
        if missing:  # resuming without them would diverge from the run that wrote the checkpoint, silently
            raise ConfigError(f"--resume {path}: the checkpoint lacks {', '.join(missing)}, which this run needs "
                              "to continue it exactly; resume with the recipe that wrote it, or start a new run")
        self.epoch, self.global_step = state["epoch"], state["global_step"]
        self.nonfinite_streak = state["nonfinite_streak"]
        self.tracker.load_state_dict(state["tracker"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        self.loss.load_state_dict(state["loss"])
        self._partial = state.get("partial")
        if self.dist.is_main:
            within = f", after micro-step {self._partial['done']}" if self._partial is not None else ""
            print(f"resumed from {path} at epoch {self.epoch}{within}", flush=True)

    def export_lora(self, out_dir: Path) -> Path | None:
        """The (EMA when enabled) adapter in diffusers' format; collective under ZeRO-3."""
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        ema = self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()
        with ema, GatheredParameters(self.trainable, enabled=zero_stage(self.ds_config) == 3):
            sd = lora_state_dict(self.policy.transformer) if self.dist.is_main else None
        if self.dist.is_main:
            path = export_lora(sd, out_dir, adapter_metadata(self.policy.transformer))
            log.info("LoRA exported to %s", path)
        barrier()
        return out_dir if self.dist.is_main else None

    def _print_epoch(self, m: dict) -> None:
        if self.dist.is_main:
            print(epoch_line(m, self.loss.headline), flush=True)

    def close(self) -> None:
        self.train_rewards.close()
        self.eval_rewards.close()
        if self.logger is not None:
            self.logger.close()


def epoch_line(m: dict, headline: dict[str, str]) -> str:
    """An epoch's one line: its rewards, the loss and the statistics the loss declares (`headline`:
    name -> format), the time."""
    rewards = " ".join(f"{k[len('reward/'):-len('/mean')]}={m[k]:.4g}" for k in m
                       if k.startswith("reward/") and k.endswith("/mean"))
    report = "".join(f" {k}={m.get(f'train/{k}', float('nan')):{fmt}}" for k, fmt in headline.items())
    return f"epoch {m['epoch']:4d} | {rewards} | loss={m.get('train/loss', float('nan')):.4g}{report} | {m['time/epoch']:.1f}s"


def _due(epoch: int, freq: int) -> bool:
    return freq > 0 and epoch % freq == 0


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(cfg: Config, resume: str | Path | None = None, export_only: str | Path | None = None,
        allow_changed: tuple[str, ...] = ()) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if export_only:  # one process, from the checkpoint files: no model, no process group, no judge
        _export_only(cfg, export_only)
        return
    # First: a stop (a signal, or the launcher's end) must reach a rank however far it got.
    stopping.install(cfg.checkpoint.save_on_sigterm, cfg.checkpoint.sigterm_grace_s)
    dist = setup_distributed()
    logging.getLogger("paco_ds").setLevel(logging.INFO if dist.is_main else logging.WARNING)
    # Before anything starts or is written (paco_ds/grpo/preflight.py): the recipe and its data,
    # the checkpoint to resume (verified), then the run directory's lock, held for the whole run.
    from paco_ds.grpo.plan import check_recipe
    from paco_ds.runlock import owned_run_dir

    check_recipe(cfg, dist.world_size)
    ckpt = CheckpointManager(cfg.run_dir / "checkpoints", cfg.checkpoint.keep_last, dist.rank, dist.world_size)
    if resume:
        from paco_ds.grpo.preflight import check_resume

        resume = ckpt.resolve(resume, "--resume")
        changed = check_resume(cfg, resume, allow_changed)  # before a model, a judge or the engine exists
        if changed and dist.is_main:
            print(f"resuming {resume} with changed settings: {changed}", flush=True)
    # The recipe's reward servers: started by local rank 0 of each node, awaited by every rank
    # before the rewards are built, stopped when the run ends.
    colocate = cfg.cluster is not None and cfg.cluster.colocate  # the judges must be able to sleep
    # A full disk or a deleted run directory, wherever the write was: one line naming the path.
    with writing(cfg.run_dir, cfg.run_dir), owned_run_dir(cfg.run_dir, dist.is_main), \
            started_for_run(cfg.reward_servers, cfg.run_dir, dist.local_rank, sleep_mode=colocate):
        trainer = GRPOTrainer(cfg, dist)
        try:
            trainer.fit(resume)
        finally:
            trainer.close()
    shutdown_distributed()


def _export_only(cfg: Config, spec: str | Path) -> None:
    """`--export-lora`: on global rank 0 only (any world size, or plain python), the verified
    checkpoint's adapter into <run>/lora, holding the run directory's lock while it writes."""
    import os

    from paco_ds.grpo.export import export_from_checkpoint
    from paco_ds.runlock import RunLock

    if int(os.environ.get("RANK", "0")) != 0:
        return
    ckpt = CheckpointManager(cfg.run_dir / "checkpoints", cfg.checkpoint.keep_last, 0, 1)
    path = ckpt.resolve(str(spec), "--export-lora")
    with RunLock(cfg.run_dir):
        export_from_checkpoint(cfg, path, cfg.run_dir / "lora")
