"""PaCo-GRPO on a DeepSpeed engine: the main job (paco_ds/grpo/run.py starts it).

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
of an epoch, every `eval_freq` / `save_freq` epochs, and after the last one. From scoring to its
last micro-step the trainer holds the epoch's progress (paco_ds/grpo/epoch.py), which a
preemption saves (paco_ds/grpo/preemption.py).
"""
from __future__ import annotations

import contextlib
import logging
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from paco_ds.runtime import startup, stopping
from paco_ds.runtime.checkpoint import CheckpointManager
from paco_ds.recipe.schema import Config
from paco_ds.data import KRepeatSampler
from paco_ds.runtime.distributed import DistInfo, all_gather_object, all_reduce_max, all_reduce_mean, any_true
from paco_ds.runtime.engine import create_engine, zero_stage
from paco_ds.runtime.throughput import counting, device_peak, epoch_figures
from paco_ds.runtime.sequence import group_loss, grouped, sequence_mesh
from paco_ds.errors import ConfigError
from paco_ds.grpo import build
from paco_ds.grpo.advantages import EpochRewards, StatTracker, judge_latency_metrics
from paco_ds.grpo.async_rollouts import AsyncRollouts
from paco_ds.sampling.tree import group_members, tree_advantages
from paco_ds.grpo.ema import EMA
# EpochSamples: mid-epoch checkpoints written before it moved to epoch.py pickle it under this module.
from paco_ds.grpo.epoch import EpochProgress, EpochSamples, epoch_line, micro_batches, rank_batch_picks
from paco_ds.grpo.export import export_adapter
from paco_ds.models.compile import compile_counters
from paco_ds.grpo.guards import NonfiniteGuard
from paco_ds.grpo.losses import build_loss
from paco_ds.grpo.plan import derive
from paco_ds.grpo.preemption import Preemption
from paco_ds.images import is_video, make_grid, make_video_grid, to_media
from paco_ds.runtime.metrics import MetricsLogger, own_wandb_run
from paco_ds.recipe.loader import recipe_to_yaml
from paco_ds.rewards.runner import part_scores
from paco_ds.sampling.trajectory import TrainingBatch, make_generator
from paco_ds.sampling.window import window_start

log = logging.getLogger(__name__)


class GRPOTrainer:
    def __init__(self, cfg: Config, dist: DistInfo, servers_ready=lambda: None):
        """`servers_ready`: waits (a collective) until the run's reward servers serve; they start while
        the models are built, and the rewards that talk to them are built after it returns."""
        # parallel.sequence: a sequence group of ranks is one data-parallel rank (runtime/sequence.py)
        dist = grouped(dist, cfg.parallel.sequence)
        self.cfg, self.dist = cfg, dist
        self.run_dir = cfg.run_dir
        _seed_everything(cfg.seed)  # identical on every rank: the tiny model and LoRA init must agree
        self.train_items, self.test_items = build.prompts(cfg)
        self.plan = derive(cfg, dist.data_world, dataset_size=len(self.train_items))
        self._progress: EpochProgress | None = None  # the epoch being trained, or a mid-epoch checkpoint's
        self.ds_config = build.ds_config(cfg, self.plan, dist)
        self.policy = build.adapted_policy(cfg, dist.device, self.ds_config, sequence_mesh=sequence_mesh(dist))
        startup.mark("models")
        self.loss = build_loss(cfg, self.policy)
        self.trainable = [p for p in self.policy.transformer.parameters() if p.requires_grad]
        self.engine = create_engine(self.policy.transformer, self.trainable, self.ds_config,
                                    lr=cfg.train.learning_rate, betas=(cfg.train.adam_beta1, cfg.train.adam_beta2),
                                    eps=cfg.train.adam_epsilon, weight_decay=cfg.train.weight_decay)
        if cfg.deepspeed.engine_compile:  # ZeRO-3 (preflight): the training steps through torch.compile
            self.engine.compile()
        startup.mark("engine")
        self.loss.setup(self.trainable)  # e.g. DiffusionNFT's old policy: a copy of the (partitioned) adapter
        self.ema = EMA(self.trainable, cfg.train.ema.decay, cfg.train.ema.update_interval) \
            if cfg.train.ema.enabled else None
        self.policy.transformer.register_forward_pre_hook(self._count_forward)
        self.sampler = KRepeatSampler(len(self.train_items), cfg.sample.group_size, self.plan.prompts_per_epoch,
                                      dist.data_world, dist.data_rank, cfg.sample.batch_size, cfg.seed)
        servers_ready()
        startup.mark("judges_ready")
        self.train_rewards, self.eval_rewards = build.rewards(cfg, dist)
        startup.mark("rewards")
        self.tracker = StatTracker(cfg.advantage, cfg.rewards.train.aggregation, self.train_rewards.weights,
                                   backend=cfg.kernels.backend)
        self.rollouts = build.rollouts(cfg, self.policy, self.loss, self.engine, self.ds_config)
        # rollout.mode: async: sampler ranks sample and score, these ranks train (paco_ds/grpo/async_rollouts.py)
        self.async_rollouts = AsyncRollouts(cfg, dist, self.plan, self.policy, self.rollouts, self.loss,
                                            zero3=zero_stage(self.ds_config) == 3) \
            if cfg.rollout.mode == "async" else None
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", cfg.checkpoint.keep_last, dist.rank, dist.world_size)
        self.preemption = Preemption(self.ckpt, self.engine, self.trainable, self.loss, self.state, self._meta,
                                     zero3=zero_stage(self.ds_config) == 3, device=dist.device, run_dir=self.run_dir,
                                     is_main=dist.is_main)
        # cluster.colocate: the judges share the trainers' devices (paco_ds/serving/sleep.py).
        from paco_ds.serving.sleep import ColocatedJudges

        self.judges = ColocatedJudges.for_run(cfg, self.run_dir, dist.local_rank, in_flight=lambda: (
            self.train_rewards.in_flight() + self.eval_rewards.in_flight()))
        self.logger: MetricsLogger | None = None
        self.wandb_run_id: str | None = None  # the resumed checkpoint's W&B run, continued by this one
        self.epoch = 0
        self.global_step = 0
        self.guard = NonfiniteGuard(cfg.train.max_consecutive_nonfinite)  # non-finite losses, rewards, grad norms
        # Throughput and MFU (paco_ds/runtime/throughput.py): the device's peak, and the FLOPs of the first
        # rollout batch (per image) and the first training micro-step, counted as they run
        self.peak_flops, self.peak_source = device_peak(dist.device, self.policy.dtype)
        self.sample_flops_per_image: float | None = None
        self._startup: dict[str, float] = {}  # logged with the first epoch this process runs
        self.micro_step_flops: float | None = None

    # ------------------------------------------------------------------------------------ loop
    def fit(self, resume: str | Path | None = None) -> None:
        """The epochs from the first (or from the checkpoint `resume`), then the final evaluation
        and checkpoint, the LoRA export and the run's report."""
        resumed = bool(resume)
        if resumed:
            self.load(resume if isinstance(resume, Path) else self.ckpt.resolve(resume))
        self._open_logs(resumed)
        startup.mark("run_directory")
        if self.dist.is_main:
            log.info("start-up: %s", startup.summary())
        self._startup = {f"time/startup/{k}": v for k, v in startup.marks().items()}
        if self.async_rollouts is not None:  # the samplers start from this adapter, at this epoch (or the next)
            self.async_rollouts.start(self.epoch, self.global_step, within_epoch=self._progress is not None)
        while self.epoch < self.cfg.train.num_epochs:
            self.run_epoch(resumed)
            resumed = False
        self.finish()

    def _open_logs(self, resumed: bool) -> None:
        cfg = self.cfg
        self.logger = MetricsLogger(self.run_dir, self.dist.is_main, cfg.logging.tensorboard)
        if resumed:
            self.logger.truncate_after(self.epoch)
        self.logger.open_wandb(cfg.logging.wandb, cfg.run_name, cfg.model_dump(mode="json"), self.wandb_run_id,
                               resume_at=self.epoch if resumed else None)
        self.wandb_run_id = self.logger.wandb_run_id or self.wandb_run_id  # kept by a run without W&B too
        if self.dist.is_main:
            (self.run_dir / "config.yaml").write_text(recipe_to_yaml(cfg))
            stopping.clear_preempted(self.run_dir)  # training again: an earlier preemption is not this run's status
            log.info("run directory: %s", self.run_dir)
            log.info("MFU against %.3g TFLOP/s per device (%s)", self.peak_flops / 1e12, self.peak_source)

    def run_epoch(self, resumed: bool) -> None:
        """One epoch: its start, its samples and scores (unless a mid-epoch checkpoint holds them),
        training; its metrics logged and printed. `fit` runs the epochs in turn (a benchmark may wrap
        this to time or gate each one)."""
        if self._progress is None:
            metrics = self._epoch_start(resumed)
            t0, busy = time.perf_counter(), self.train_rewards.busy_seconds
            samples = self.sample_epoch()
            t_sample = time.perf_counter() - t0
            # what sample.ode_steps and sample.share_prefix save shows here (a sequence group's calls once)
            metrics["sample/transformer_calls"] = \
                float(sum(all_gather_object(samples.transformer_calls))) / self.dist.sequence
            self.policy.park_text_encoders(True)  # off the GPU until a prompt is encoded (Rollouts.encoded)
            metrics |= samples.metrics
            metrics |= self.score_epoch(samples)
            t_reward = time.perf_counter() - t0 - t_sample
            metrics["time/reward_busy"] = self.train_rewards.busy_seconds - busy
            metrics |= self._colocated_judges(wake=False)
            self._progress = EpochProgress(samples, metrics)
        else:  # resumed from a mid-epoch checkpoint: this epoch's rollouts and scores are in it
            self.policy.park_text_encoders(True)
            self._colocated_judges(wake=False)
            t0, t_sample, t_reward = time.perf_counter(), 0.0, 0.0
        metrics = self._progress.metrics | self.train_epoch()
        self._progress = None
        t_train = time.perf_counter() - t0 - t_sample - t_reward
        seconds = time.perf_counter() - t0
        metrics |= {"time/sample": t_sample, "time/reward_wait": t_reward, "time/train": t_train,
                    "time/epoch": seconds, "global_step": self.global_step,
                    "images_per_sec": self.plan.samples_per_epoch / seconds}
        metrics |= self._startup  # the first epoch this process runs: where its start-up went
        self._startup = {}
        metrics |= epoch_figures(self.plan.samples_per_epoch, seconds, self.dist.world_size, self.flops_per_image(),
                                 self.peak_flops)
        if self.cfg.model.compile or self.cfg.deepspeed.engine_compile:
            metrics |= compile_counters()
        self.logger.log(metrics, step=self.epoch)
        self._print_epoch(metrics)
        self.epoch += 1
        if self.async_rollouts is not None:  # the version the next epoch trains from: the samplers' bound
            self.async_rollouts.epoch_done(self.epoch, self.global_step)

    def flops_per_image(self) -> float | None:
        """Model FLOPs per trained image: its rollout, and its share of the epoch's micro-steps (each
        trains train.batch_size samples at one step); None until both were counted. Under
        parallel.sequence a rank computes its 1/N of each sample's tokens (and heads), so the image's
        FLOPs are N times what this rank counted."""
        if self.sample_flops_per_image is None or self.micro_step_flops is None:
            return None
        return self.dist.sequence * (self.sample_flops_per_image + self.micro_step_flops *
                                     self.plan.micro_steps_per_rank / self.plan.samples_per_rank)

    def _epoch_start(self, resumed: bool) -> dict:
        """The judges awake, the evaluation and checkpoint when due (a resumed run's first epoch is
        its checkpoint already). Until scoring, this is the state a preemption saves."""
        metrics = {"epoch": self.epoch} | self._colocated_judges(wake=True)
        if _due(self.epoch, self.cfg.test.eval_freq):
            metrics |= self.evaluate()
        saved = _due(self.epoch, self.cfg.checkpoint.save_freq) and not resumed
        if saved:
            self.save()
        self.preemption.epoch_start(saved=saved or resumed)
        self.preemption.check(self.epoch)
        return metrics

    def finish(self) -> None:
        """After the last epoch: the same eval/save rule, so a later resume continues seamlessly."""
        final = {"epoch": self.epoch}
        if _due(self.epoch, self.cfg.test.eval_freq):
            final |= self._colocated_judges(wake=True)
            final |= self.evaluate()
            self.logger.log(final, step=self.epoch)
        if self.cfg.checkpoint.save_freq:
            self.save()
        export_adapter(self.policy, self.trainable, self.ema, zero_stage(self.ds_config) == 3, self.run_dir / "lora",
                       self.dist.is_main)
        if self.dist.is_main:
            from paco_ds.report.page import write_report

            report = write_report(self.run_dir)
            print(f"report: {report}", flush=True)

    def _colocated_judges(self, wake: bool) -> dict:
        """Wake or sleep colocated judges (collective); {} when the run does not colocate."""
        return self.judges.switch(wake) if self.judges is not None else {}

    # ------------------------------------------------------------------------------------ 1. sample
    def sample_epoch(self) -> EpochSamples:
        if self.async_rollouts is not None:
            return self._take_rollouts()
        cfg, out = self.cfg, EpochSamples()
        batches = self.sampler.rank_batches(self.epoch)
        member = group_members(self.sampler.epoch_plan(self.epoch).numpy())  # each position's leaf in its group
        calls = self.rollouts.transformer_calls
        with self.loss.sampling(), self.rollouts.module() as module:
            for rb in tqdm(batches, desc=f"epoch {self.epoch} sample", disable=not self.dist.is_main, leave=False):
                for (h, w), picks in self.rollouts.by_size(rank_batch_picks(self.train_items, rb, member),
                                                           cfg.train.resolution):
                    if self.sample_flops_per_image is None:  # counted once, on the run's own code path
                        with counting() as count:
                            traj = self.rollouts.sample(module, picks, h, w, self.epoch)
                        self.sample_flops_per_image = count.flops / len(picks)
                    else:
                        traj = self.rollouts.sample(module, picks, h, w, self.epoch)
                    # scores while we sample on; editing rewards compare against the original references
                    # (once per sequence group: its ranks hold the same images)
                    if self.dist.scores:
                        self.train_rewards.submit(traj.images, traj.prompts, traj.metadata,
                                                  self.rollouts.references(traj))
                    out.trajectories.append(traj)
                if self.preemption.requested():  # collective: every rank has the same number of rollout batches
                    break
        # saved here, not inside: the sampling weights (NFT's old policy) and the gathered transformer
        # are the loss's and the rollouts' until their blocks end
        self.preemption.check(self.epoch)
        out.transformer_calls = self.rollouts.transformer_calls - calls
        return out

    def _take_rollouts(self) -> EpochSamples:
        """rollout.mode: async: this rank's rollouts of the epoch as the sampler ranks scored them, those
        past rollout.max_staleness dropped, the stale ones corrected (paco_ds/grpo/async_rollouts.py)."""
        from paco_ds.rewards.runner import concat_results

        taken, metrics = self.async_rollouts.take_epoch(self.epoch, self.global_step, stopping.saving_requested)
        if taken is None:  # a stop was asked while the trainers waited: the epoch's start is saved here
            self.preemption.check(self.epoch)
            raise RuntimeError("the trainers stopped waiting for rollouts, and no rank was asked to stop")
        trajs, results, more = self.async_rollouts.correct(taken, self.global_step)
        self.loss.sde_logprob_rows += taken.sde_logprob_rows  # sampling's, as a colocated epoch counts them
        rewards = {name: concat_results([r[name] for r in results]) for name in results[0]}
        return EpochSamples(trajs, transformer_calls=taken.transformer_calls, rewards=rewards,
                            judge_latency_s=taken.latencies, reward_failures=taken.failures, metrics=metrics | more)

    # ------------------------------------------------------------------------------------ 2-3. reward, advantage
    def score_epoch(self, samples: EpochSamples) -> dict:
        results = samples.rewards if samples.rewards is not None else self.train_rewards.collect()
        trajs = samples.trajectories
        rewards = EpochRewards.gather(
            positions=np.array([p for t in trajs for p in t.positions], dtype=np.int64),
            groups=np.array([g for t in trajs for g in t.group_ids], dtype=np.int64),
            # a reward that does not apply to a sample (one panel, a pairwise judge) does not mask it
            valid=np.logical_and.reduce([r.valid | ~r.applicable for r in results.values()]),
            scores={name: r.scores for name, r in results.items()},
            parts=part_scores(results),  # e.g. consistency_for_editing's consistency and following
            # this epoch's judge requests, evaluation's included (and the samplers', rollout.mode: async)
            latency_s=self.train_rewards.take_latencies() + (samples.judge_latency_s or []),
            applicable={name: r.applicable for name, r in results.items()}, scored=self.dist.scores)
        adv = self.tracker.compute(rewards.scores, rewards.groups, rewards.valid, device=self.dist.device,
                                   applicable=rewards.applicable)
        sizes = [len(t) for t in trajs]
        per_step = None
        if self.cfg.sample.tree is not None:  # one advantage per trained step: the node each split created
            per_step = tree_advantages(adv.combined, rewards.groups, group_members(rewards.groups),
                                       self.cfg.sample.tree.branches, len(self.cfg.sample.noise_steps),
                                       self.cfg.advantage.clip)
            per_step[~adv.keep] = 0.0
        samples.advantages = rewards.split(adv.advantages if per_step is None else per_step, sizes, torch.float32)
        samples.keep = rewards.split(adv.keep, sizes, torch.bool)

        metrics = rewards.metrics(adv)
        if per_step is not None:
            for d in range(per_step.shape[1]):
                metrics[f"adv/tree_depth{d + 1}_abs_mean"] = float(np.abs(per_step[adv.keep, d]).mean()) \
                    if adv.keep.any() else 0.0
        failures = self.train_rewards.failures if samples.reward_failures is None else samples.reward_failures
        metrics["reward/failures"] = float(sum(all_gather_object(failures)))
        metrics |= judge_latency_metrics(rewards.latency_s)
        if self.dist.is_main and self.cfg.logging.num_train_images:
            n = self.cfg.logging.num_train_images
            images = [im for t in trajs for im in to_media(t.images)][:n]  # images, or each video's frames
            captions = [f"{s:.3g}" for s in adv.combined[rewards.mine][:n]]
            grid = make_video_grid if is_video(images) else make_grid
            self.logger.save_image("train_samples", grid(images, captions=captions), self.epoch)
        metrics["train/height"], metrics["train/width"] = float(trajs[0].height), float(trajs[0].width)
        if not adv.keep.any():  # the same on every rank: computed from the gathered rewards
            self.guard.nonfinite("no sample of the epoch has a valid reward")
        return metrics

    # ------------------------------------------------------------------------------------ 4. train
    def train_epoch(self) -> dict:
        """Train the epoch the trainer holds, from where its progress stands: the epoch's start, or a
        mid-epoch checkpoint's last micro-step. The epoch's `train/` metrics."""
        cfg, progress = self.cfg, self._progress
        samples = progress.samples
        entries = [(k, i) for k, t in enumerate(samples.trajectories) for i in range(len(t))]
        kept = [(k, i) for k, i in entries if samples.keep[k][i]]
        # ZeRO-3 runs collectives in every forward/backward: all ranks must do the same number of
        # micro-steps. Ranks with fewer kept samples pad with zero-advantage steps (no gradient).
        bs, steps_per_epoch = cfg.train.batch_size, cfg.train.optimizer_steps_per_epoch
        n_micro = int(all_reduce_max(-(-len(kept) // bs)))
        if n_micro == 0:
            return {"train/micro_steps": 0.0}
        n_micro = -(-n_micro // steps_per_epoch) * steps_per_epoch
        n_t = len(self.plan.train_timesteps)
        group_len = n_micro * n_t // steps_per_epoch  # micro-steps per optimizer step
        total = cfg.train.num_inner_epochs * n_micro * n_t
        self.loss.begin_epoch(self.epoch)
        self.preemption.resume(progress)  # a mid-epoch checkpoint's accumulated gradients and loss state
        bar = tqdm(total=total, initial=progress.done, desc=f"epoch {self.epoch} train",
                   disable=not self.dist.is_main, leave=False)
        self.engine.train()
        self.preemption.check(self.epoch, progress, accumulating=progress.done % group_len != 0)
        for inner in range(cfg.train.num_inner_epochs):
            gen = make_generator(cfg.seed, "shuffle", self.epoch, inner, self.dist.data_rank)
            for m, (chunk, fillers) in enumerate(micro_batches(kept or entries, n_micro, bs, gen)):
                before = (inner * n_micro + m) * n_t  # the epoch's micro-steps before this batch's
                if before + n_t <= progress.done:  # taken before the preemption checkpoint
                    continue
                batch = samples.batch(chunk, fillers)
                for t in range(max(progress.done - before, 0), n_t):
                    k = m * n_t + t
                    step_stats = self._micro_step(batch, t, boundary=(k + 1) % group_len == 0, scale=group_len)
                    progress.record(step_stats, self.loss.first_of_epoch)
                    bar.update(1)
                    self.preemption.check(self.epoch, progress, accumulating=progress.done % group_len != 0)
        bar.close()
        return self._train_metrics(progress, total)

    def _micro_step(self, batch: TrainingBatch, t: int, boundary: bool, scale: int) -> dict:
        count = counting() if self.micro_step_flops is None else contextlib.nullcontext()
        with count as counted:
            loss, stats = self.loss(self.engine, batch, t)
            skip = any_true(not bool(torch.isfinite(loss)))
            self.engine.set_gradient_accumulation_boundary(boundary)
            if skip:
                # Every rank skips this backward together (ZeRO-3 collectives must match); the
                # optimizer step still happens at the boundary with the other micro-steps' gradients.
                self.guard.nonfinite(f"non-finite loss at epoch {self.epoch}")
            else:
                self.guard.finite()
                self.engine.backward(group_loss(loss, self.dist) / scale, scale_wrt_gas=False)
        if counted is not None and not skip:
            self.micro_step_flops = counted.flops
        self.engine.step()
        out = dict(stats, loss=float(loss.detach()), nonfinite=float(skip))
        if boundary:
            self.global_step += 1
            if self.ema is not None:
                self.ema.step(self.global_step)
            self.loss.after_optimizer_step(self.global_step)
            if self.async_rollouts is not None:  # the samplers take it up between rollout batches
                self.async_rollouts.publish(self.global_step)
            norm = self.engine.get_global_grad_norm()
            if norm is not None:
                self.guard.grad_norm(float(norm), self.global_step, out)
        return out

    def _train_metrics(self, progress: EpochProgress, total: int) -> dict:
        """The epoch's micro-step statistics, rank-averaged, and what the loss adds at the epoch's end."""
        cfg, stats = self.cfg, progress.stats
        out = {f"train/{k}": float(np.mean(v)) for k, v in stats.items() if k not in ("nonfinite", "nonfinite_grad")}
        out = all_reduce_mean(out)
        out["train/nonfinite_steps"] = float(sum(all_gather_object(sum(stats.get("nonfinite", []))))) / self.dist.sequence
        # the gradient norm is global: every rank saw the same skipped steps
        out["train/skipped_optimizer_steps"] = float(sum(stats.get("nonfinite_grad", [])))
        for key, v in progress.first.items():
            out[f"train/{key}_first"] = float(v)
        out["train/micro_steps"] = float(total)
        out["train/forwards_per_step"] = progress.forwards / total
        out["train/lr"] = float(self.engine.get_lr()[0])
        self.loss.end_epoch(self.global_step)
        if cfg.sample.sde_window is not None and cfg.sample.sde_window.per == "epoch":
            out["sample/sde_window_start"] = float(window_start(cfg, self.epoch))
        return self.loss.epoch_metrics(out)

    def _count_forward(self, module, args) -> None:
        if self._progress is not None:  # the epoch's training: one forward per trained sample and step
            self._progress.forwards += 1

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
        return {"epoch": self.epoch, "global_step": self.global_step, "nonfinite_streak": self.guard.streak,
                "tracker": self.tracker.state_dict(), "ema": self.ema.state_dict() if self.ema else None,
                "loss": self.loss.state_dict(),
                "flops": {"sample_per_image": self.sample_flops_per_image, "micro_step": self.micro_step_flops}}

    def _meta(self) -> dict:
        from paco_ds.grpo.preflight import resume_settings

        return {"epoch": self.epoch, "global_step": self.global_step, "run_name": self.cfg.run_name,
                "recipe": resume_settings(self.cfg), "wandb_run_id": self.wandb_run_id,
                "adapter_version": self.global_step}  # the version an async run's samplers restart from

    def save(self) -> Path:
        path = self.ckpt.save(self.engine, f"epoch_{self.epoch:04d}", self.state(), self._meta())
        if self.dist.is_main:
            log.info("checkpoint: %s", path)
        return path

    def missing_state(self, state: dict) -> list[str]:
        """The pieces this run needs from a checkpoint that `state` lacks: another loss's checkpoint
        (resumed with --allow-changed train.loss), one saved without EMA, or an older layout."""
        missing = [k for k in ("epoch", "global_step", "nonfinite_streak", "tracker", "loss") if k not in state]
        if self.ema is not None and state.get("ema") is None:
            missing.append("EMA weights (train.ema.enabled)")
        saved_loss = state.get("loss") if isinstance(state.get("loss"), dict) else {}
        missing += [f"the {self.cfg.train.loss} loss's '{k}' state" for k in self.loss.state_dict() if k not in saved_loss]
        if state.get("partial") is not None:  # a mid-epoch checkpoint
            missing += EpochProgress.missing(state["partial"])
        return missing

    def load(self, path: Path) -> None:
        state, meta = self.ckpt.load(self.engine, path)
        missing = self.missing_state(state)
        if missing:  # resuming without them would diverge from the run that wrote the checkpoint, silently
            raise ConfigError(f"--resume {path}: the checkpoint lacks {', '.join(missing)}, which this run needs "
                              "to continue it exactly; resume with the recipe that wrote it, or start a new run")
        self.epoch, self.global_step = state["epoch"], state["global_step"]
        self.wandb_run_id = own_wandb_run(meta, path, self.ckpt.root)
        self.guard.streak = state["nonfinite_streak"]
        self.tracker.load_state_dict(state["tracker"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        self.loss.load_state_dict(state["loss"])
        flops = state.get("flops") or {}  # counted by the run that wrote the checkpoint (none before it counted)
        self.sample_flops_per_image = flops.get("sample_per_image", self.sample_flops_per_image)
        self.micro_step_flops = flops.get("micro_step", self.micro_step_flops)
        partial = state.get("partial")
        self._progress = EpochProgress.from_state(partial) if partial is not None else None
        if self.dist.is_main:
            within = f", after micro-step {self._progress.done}" if self._progress is not None else ""
            print(f"resumed from {path} at epoch {self.epoch}{within}", flush=True)

    def _print_epoch(self, m: dict) -> None:
        if self.dist.is_main:
            print(epoch_line(m, self.loss.headline), flush=True)

    def close(self, error: BaseException | None = None) -> None:
        """After the fit, however it ended (`error`: what ended it; None when it finished)."""
        if self.async_rollouts is not None:  # the samplers end with the trainers
            self.async_rollouts.end(error)
        self.train_rewards.close()
        self.eval_rewards.close()
        if self.logger is not None:
            self.logger.close(error)


def _due(epoch: int, freq: int) -> bool:
    return freq > 0 and epoch % freq == 0


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
