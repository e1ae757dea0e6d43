"""PaCo-Reward SFT on a DeepSpeed engine (ZeRO-3 by default, ZeRO-2 selectable).

Top to bottom: check the data (before any model is built, so a data mistake costs seconds), load
Qwen2.5-VL partitioned, add the LoRA, wrap model + fused loss (paco_ds/sft/model.py) in the
engine with torch AdamW and a warm-up + cosine schedule, then per epoch:

  train   micro-batches in a seeded order keyed by the epoch (paco_ds/sft/data.py train_batches);
          DeepSpeed accumulates `gradient_accumulation_steps` micro-batches per optimizer step (a short
          last group closes the epoch, as the HF Trainer does), clips and steps; each micro-batch loss
          is normalised by its own supervised tokens (as PaCo-Reward's LLaMA-Factory trainer does).
  eval    loss, token accuracy and first-token (Yes/No) accuracy on the eval records, each
          counted once however the ranks split them.
  save    an atomic checkpoint (engine, trainer state, RNG, the exported adapter), also every
          `checkpoint.every_steps` optimizer steps, so a resumed run repeats the same steps.

Every optimizer step writes a line to metrics.jsonl (and TensorBoard); at the end the adapter is
exported to <run>/adapter. `launch/sft.py export` turns an adapter into a merged model directory.
"""
from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from paco_ds.runtime.checkpoint import CheckpointManager
from paco_ds.runtime.dtypes import resolve_dtype
from paco_ds.runtime.distributed import (DistInfo, all_gather_object, all_reduce_mean, barrier, setup_distributed,
                                 shutdown_distributed)
from paco_ds.runtime.engine import build_ds_config, create_engine, load_ds_config, partition_report, zero_stage
from paco_ds.errors import DataError, TrainingDiverged
from paco_ds.runtime.metrics import MetricsLogger, own_wandb_run
from paco_ds.recipe.loader import recipe_to_yaml
from paco_ds.sft import data as sft_data
from paco_ds.sft.config import SFTConfig
from paco_ds.sft.loss import first_token_weights, sequence_stats
from paco_ds.sft.model import (RewardSFTModel, add_lora, base_path, enable_gradient_checkpointing, load_model,
                               load_processor, write_tiny_base, zero3_loading)

log = logging.getLogger(__name__)



def data_files(cfg: SFTConfig, is_main: bool) -> tuple[list[Path], list[Path]]:
    """The train and eval files: the configured ones, or the synthetic set drawn into <run>/data."""
    if cfg.data.synthetic is None:
        return [cfg.resolve_path(f) for f in cfg.data.train_files], [cfg.resolve_path(f) for f in cfg.data.eval_files]
    out = cfg.run_dir / "data"
    s = cfg.data.synthetic
    if is_main:
        sft_data.write_synthetic_dataset(out, s.num_train, s.num_eval, s.image_size, s.seed)
    barrier()
    return [out / "train.json"], [out / "eval.json"]


def load_datasets(cfg: SFTConfig, processor, rank: int = 0, world_size: int = 1):
    """(encoder, train set, eval set or None), every record checked; the cutoff check is shared
    out over the ranks and the first failure (by file order) is raised on all of them."""
    train_files, eval_files = data_files(cfg, rank == 0)
    image_dir = cfg.resolve_path(cfg.data.image_dir) if cfg.data.image_dir else None
    encoder = sft_data.Encoder(processor, cfg.data.cutoff_len, cfg.model.image_min_pixels, cfg.model.image_max_pixels)
    sets = []
    for files, key in ((train_files, "data.train_files"), (eval_files, "data.eval_files")):
        if not files:
            sets.append(None)
            continue
        records = sft_data.load_records(files, key, image_dir, cfg.data.max_samples)
        sets.append(sft_data.SFTDataset(records, encoder))
    errors = [ds.first_error(range(rank, len(ds), world_size)) for ds in sets if ds is not None]
    for gathered in zip(*all_gather_object(errors)):
        found = [e for e in gathered if e is not None]
        if found:
            raise DataError(min(found)[1])
    return encoder, sets[0], sets[1]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _due(count: int, every: int) -> bool:
    return every > 0 and count % every == 0


class SFTTrainer:
    def __init__(self, cfg: SFTConfig, dist: DistInfo):
        self.cfg, self.dist = cfg, dist
        self.run_dir = cfg.run_dir
        _seed_everything(cfg.seed)  # identical on every rank: the LoRA init must agree
        base = base_path(cfg)
        if cfg.model.tiny:
            if dist.is_main:
                write_tiny_base(base, cfg.seed)
            barrier()
        self.processor = load_processor(base, cfg)
        self.encoder, self.train_set, self.eval_set = load_datasets(cfg, self.processor, dist.rank, dist.world_size)
        self.collate = sft_data.Collator(self.encoder.pad_id, self.encoder.image_pad)

        t = cfg.train
        self.micro_per_epoch = len(sft_data.train_batches(len(self.train_set), dist.world_size, dist.rank,
                                                          t.batch_size, cfg.seed, 0))
        self.steps_per_epoch = math.ceil(self.micro_per_epoch / t.gradient_accumulation_steps)
        self.total_steps = self.steps_per_epoch * t.num_epochs
        self.dtype = resolve_dtype(cfg.model.dtype, dist.device)
        self.ds_config = build_ds_config(
            load_ds_config(cfg.resolve_path(cfg.deepspeed.config)), micro_batch=t.batch_size,
            grad_accum=t.gradient_accumulation_steps, world_size=dist.world_size, grad_clip=t.max_grad_norm,
            bf16=self.dtype == torch.bfloat16, zero_stage=cfg.deepspeed.zero_stage, overrides=cfg.deepspeed.overrides)
        self.zero3 = zero_stage(self.ds_config) == 3

        self._zero3_loading = zero3_loading(self.ds_config) if self.zero3 else None  # alive with the model
        model = load_model(base, cfg, self.dtype)
        self.peft = add_lora(model, cfg)
        if cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(self.peft)
        self.module = RewardSFTModel(self.peft, t.first_token_weight, t.first_token_weight_mode,
                                     t.loss_chunk_size or None, cfg.kernels.backend)
        self.trainable = [(n, p) for n, p in self.peft.named_parameters() if p.requires_grad]
        self.engine = create_engine(self.module, [p for _, p in self.trainable], self.ds_config, lr=t.learning_rate,
                                    betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon,
                                    weight_decay=t.weight_decay, lr_scheduler=self._scheduler)
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", cfg.checkpoint.keep_last, dist.rank, dist.world_size)
        self.logger: MetricsLogger | None = None
        self.wandb_run_id: str | None = None  # the resumed checkpoint's W&B run, continued by this one
        self.epoch = 0  # completed epochs
        self.step_in_epoch = 0  # optimizer steps done in the current epoch
        self.global_step = 0
        self.epoch_losses: list[float] = []
        self.epoch_accs: list[float] = []  # first-token accuracy per optimizer step (console only)

    def _scheduler(self, optimizer):
        from transformers import get_scheduler

        t = self.cfg.train
        name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[t.lr_scheduler]
        return get_scheduler(name, optimizer, num_warmup_steps=math.ceil(t.warmup_ratio * self.total_steps),
                             num_training_steps=self.total_steps)

    # ------------------------------------------------------------------------------------ loop
    def fit(self, resume: str | None = None) -> None:
        cfg = self.cfg
        if resume:
            self.load(self.ckpt.resolve(resume))
        self.logger = MetricsLogger(self.run_dir, self.dist.is_main, cfg.logging.tensorboard)
        if resume:
            self.logger.truncate_after(self.global_step + 1, key="step")
        self.logger.open_wandb(cfg.logging.wandb, cfg.run_name, cfg.model_dump(mode="json"), self.wandb_run_id,
                               resume_at=self.global_step + 1 if resume else None)
        self.wandb_run_id = self.logger.wandb_run_id or self.wandb_run_id  # kept by a run without W&B too
        if self.dist.is_main:
            (self.run_dir / "config.yaml").write_text(recipe_to_yaml(cfg))
            rows = partition_report(self.module)
            held = sum(r["local"] for r in rows) / sum(r["full"] for r in rows)
            trainable = sum(r["full"] for r in rows if r["trainable"])
            print(f"run directory: {self.run_dir} | {len(self.train_set)} train records, "
                  f"{len(self.eval_set) if self.eval_set else 0} eval | {self.steps_per_epoch} optimizer steps per "
                  f"epoch x {cfg.train.num_epochs} | world size {self.dist.world_size}, "
                  f"ZeRO-{zero_stage(self.ds_config)}: rank 0 holds {held:.1%} of the parameters; "
                  f"{trainable:,} trainable (LoRA)", flush=True)
        if cfg.eval.at_start and self.global_step == 0 and self.eval_set is not None:
            self._log_eval(self.evaluate())
        saving = cfg.checkpoint.every_epochs > 0 or cfg.checkpoint.every_steps > 0
        while self.epoch < cfg.train.num_epochs:
            t_epoch = time.perf_counter()
            self.train_epoch()
            self.epoch += 1
            self.step_in_epoch = 0
            metrics = {"train/epoch_loss": float(np.mean(self.epoch_losses))}
            acc = float(np.mean(self.epoch_accs)) if self.epoch_accs else float("nan")
            self.epoch_losses, self.epoch_accs = [], []
            if self.eval_set is not None and _due(self.epoch, cfg.eval.every_epochs):
                metrics |= self.evaluate()
            self._log_eval(metrics)
            self._print_epoch(metrics, acc, time.perf_counter() - t_epoch)
            last = self.epoch == cfg.train.num_epochs
            if saving and (last or _due(self.epoch, cfg.checkpoint.every_epochs)
                           or _due(self.global_step, cfg.checkpoint.every_steps)):
                self.save()
        self.export_adapter(self.run_dir / "adapter")

    def train_epoch(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        ga = t.gradient_accumulation_steps
        batches = sft_data.train_batches(len(self.train_set), self.dist.world_size, self.dist.rank, t.batch_size,
                                         cfg.seed, self.epoch)
        start = self.step_in_epoch * ga
        loader = torch.utils.data.DataLoader(self.train_set, batch_sampler=batches[start:], collate_fn=self.collate,
                                             num_workers=cfg.data.num_workers)
        bar = tqdm(total=len(batches), initial=start, desc=f"epoch {self.epoch + 1}/{t.num_epochs}",
                   disable=not self.dist.is_main, leave=False, dynamic_ncols=True)
        self.engine.train()
        group: list[dict] = []
        t0 = time.perf_counter()
        for m, batch in enumerate(loader, start=start):
            group_start = m - m % ga
            group_len = min(ga, len(batches) - group_start)
            boundary = m + 1 == group_start + group_len
            lr = float(self.engine.get_lr()[0])  # the rate this group's optimizer step applies
            out = self.engine(**batch.model_inputs(self.dist.device))
            self.engine.set_gradient_accumulation_boundary(boundary)
            self.engine.backward(out.loss / group_len, scale_wrt_gas=False)
            self.engine.step()
            stats = sequence_stats(out.shifted, out.predictions, out.token_loss)
            group.append({"loss": float(out.loss.detach()), "token_acc": stats["token_acc"].mean().item(),
                          "first_token_acc": stats["first_correct"].mean().item(),
                          "first_token_loss": stats["first_loss"].mean().item()})
            bar.update(1)
            if not boundary:
                continue
            self.global_step += 1
            self.step_in_epoch += 1
            metrics = all_reduce_mean({f"train/{k}": float(np.mean([g[k] for g in group])) for k in group[0]})
            group = []
            if not math.isfinite(metrics["train/loss"]):
                raise TrainingDiverged(f"non-finite loss at optimizer step {self.global_step} (epoch {self.epoch + 1})")
            norm = self.engine.get_global_grad_norm()
            metrics |= {"step": self.global_step, "epoch": self.epoch + self.step_in_epoch / self.steps_per_epoch,
                        "train/lr": lr, "train/grad_norm": float(norm) if norm is not None else float("nan"),
                        "time/step": time.perf_counter() - t0}
            t0 = time.perf_counter()
            self.epoch_losses.append(metrics["train/loss"])
            self.epoch_accs.append(metrics["train/first_token_acc"])
            self.logger.log(metrics, step=self.global_step)
            bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", first_acc=f"{metrics['train/first_token_acc']:.2f}")
            if self.dist.is_main and _due(self.global_step, t.log_every):
                tqdm.write(f"step {self.global_step}/{self.total_steps} | epoch {metrics['epoch']:.2f} | "
                           f"loss {metrics['train/loss']:.4f} | first-token acc {metrics['train/first_token_acc']:.3f}"
                           f" | lr {lr:.3g}")
            if self.step_in_epoch < self.steps_per_epoch and _due(self.global_step, cfg.checkpoint.every_steps):
                self.save()
        bar.close()

    # ------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss (the training formula over the whole eval set as one batch), token accuracy and
        first-token accuracy (averaged over records, as the reference's ComputeAccuracy)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        batches = sft_data.eval_batches(len(self.eval_set), self.dist.world_size, self.dist.rank, cfg.eval.batch_size)
        loader = torch.utils.data.DataLoader(self.eval_set, batch_sampler=[idx for idx, _ in batches],
                                             collate_fn=self.collate, num_workers=cfg.data.num_workers)
        self.engine.eval()
        rows = []
        for batch, (_, counted) in zip(tqdm(loader, desc="eval", disable=not self.dist.is_main, leave=False), batches):
            out = self.engine(**batch.model_inputs(self.dist.device))
            w = first_token_weights(out.shifted, cfg.train.first_token_weight, cfg.train.first_token_weight_mode)
            weighted = (w * out.token_loss).sum(dim=1)
            stats = sequence_stats(out.shifted, out.predictions, out.token_loss)
            keys = ("n_tokens", "token_acc", "first_correct", "first_loss")
            for j, (index, keep) in enumerate(zip(batch.indices, counted)):
                if keep:
                    rows.append((index, weighted[j].item(), *(stats[k][j].item() for k in keys)))
        self.engine.train()
        table = np.array(sorted(r for rs in all_gather_object(rows) for r in rs), dtype=np.float64)
        return {"eval/loss": table[:, 1].sum() / table[:, 2].sum(), "eval/token_acc": table[:, 3].mean(),
                "eval/first_token_acc": table[:, 4].mean(), "eval/first_token_loss": table[:, 5].mean(),
                "eval/records": float(len(table)), "time/eval": time.perf_counter() - t0}

    def _log_eval(self, metrics: dict) -> None:
        metrics = {"step": self.global_step, "epoch": float(self.epoch), **metrics}
        self.logger.log(metrics, step=self.global_step)

    def _print_epoch(self, m: dict, first_acc: float, seconds: float) -> None:
        """One console line per epoch, as the GRPO run prints: train loss and first-token accuracy,
        and the evaluation's when it ran."""
        if not self.dist.is_main:
            return
        line = (f"epoch {self.epoch}/{self.cfg.train.num_epochs} | step {self.global_step} | loss "
                f"{m['train/epoch_loss']:.4f} | first-token acc {first_acc:.3f}")
        if "eval/loss" in m:
            line += (f" | eval loss {m['eval/loss']:.4f} token acc {m['eval/token_acc']:.3f} first-token acc "
                     f"{m['eval/first_token_acc']:.3f}")
        tqdm.write(f"{line} | {seconds:.1f}s")

    # ------------------------------------------------------------------------------------ state
    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        """The LoRA weights (gathered under ZeRO-3; collective), on rank 0."""
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters([p for _, p in self.trainable], enabled=self.zero3):
            return {n: p.detach().cpu().clone() for n, p in self.trainable} if self.dist.is_main else None

    def export_adapter(self, out_dir: Path) -> None:
        from paco_ds.sft.export import save_adapter

        state = self.adapter_state()
        if self.dist.is_main:
            save_adapter(self.peft, state, out_dir, self.processor)
            print(f"adapter: {out_dir}", flush=True)
        barrier()

    def save(self) -> Path:
        from paco_ds.sft.export import save_adapter

        state = {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
                 "epoch_losses": list(self.epoch_losses)}
        meta = {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
                "run_name": self.cfg.run_name, "recipe": resume_settings(self.cfg), "wandb_run_id": self.wandb_run_id}
        adapter = self.adapter_state()
        path = self.ckpt.save(self.engine, f"step_{self.global_step:07d}", state, meta,
                              write_extra=lambda d: save_adapter(self.peft, adapter, d / "adapter", self.processor))
        if self.dist.is_main:
            log.info("checkpoint: %s", path)
        return path

    def load(self, path: Path) -> None:
        changed = check_resume_settings(self.cfg, path)  # before the engine meets tensors of another shape
        if changed and self.dist.is_main:
            print(f"resuming {path} with changed settings: {changed}", flush=True)
        state, meta = self.ckpt.load(self.engine, path)
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        self.global_step, self.epoch_losses = state["global_step"], state["epoch_losses"]
        self.wandb_run_id = own_wandb_run(meta, path, self.ckpt.root)
        if self.dist.is_main:
            print(f"resumed from {path} at optimizer step {self.global_step} (epoch {self.epoch + 1}, "
                  f"step {self.step_in_epoch} of {self.steps_per_epoch})", flush=True)

    def close(self, error: BaseException | None = None) -> None:
        """After the fit, however it ended (`error`: what ended it; None when it finished)."""
        if self.logger is not None:
            self.logger.close(error)


# What a checkpoint's tensors are shaped by: resuming with another value cannot load them.
_SHAPE_KEYS = ("lora.rank", "lora.target_modules", "model.path", "model.freeze_vision_tower",
               "model.freeze_multi_modal_projector")
# What changes the run from here on: allowed, but said, so a resumed run is never silently another run.
_TRAJECTORY_KEYS = ("lora.alpha", "lora.dropout", "train.learning_rate", "train.num_epochs", "train.lr_scheduler",
                    "train.warmup_ratio", "train.weight_decay", "train.batch_size",
                    "train.gradient_accumulation_steps", "train.first_token_weight", "train.max_grad_norm", "seed")


def resume_settings(cfg: SFTConfig) -> dict:
    """The recipe values a checkpoint records so that a resume can be compared with them."""
    from paco_ds.recipe.resume import recorded

    return recorded(cfg.model_dump(mode="json"), _SHAPE_KEYS + _TRAJECTORY_KEYS)


def check_resume_settings(cfg: SFTConfig, path: Path) -> str:
    """Raise a ConfigError naming the key when the checkpoint's LoRA shape differs from the
    recipe's; return the other recorded settings that differ ('key: old -> new, ...', or '')."""
    import json

    from paco_ds.recipe.resume import compare, saved_recipe

    saved = saved_recipe(path)
    if not saved:  # a checkpoint written before the recipe was recorded: its adapter config has the rank
        try:
            adapter = json.loads((Path(path) / "adapter" / "adapter_config.json").read_text())
            saved = {"lora.rank": adapter["r"]}
        except (OSError, ValueError, KeyError):
            return ""
    return compare(saved, resume_settings(cfg), _SHAPE_KEYS, path)


def run(cfg: SFTConfig, resume: str | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from paco_ds.runtime import stopping

    # As GRPO runs: a signal or the launcher's end stops this rank (SFT saves no preemption
    # checkpoint: it resumes from its last periodic one), and a rank whose peer failed waits for
    # the launcher so that the run's status is the failed rank's (paco_ds.runtime.distributed.exit_after_peer).
    from paco_ds.runtime.metrics import check_wandb

    check_wandb(cfg.logging.wandb)  # before anything starts
    stopping.install(save_first=False)
    dist = setup_distributed()
    logging.getLogger("paco_ds").setLevel(logging.INFO if dist.is_main else logging.WARNING)
    from paco_ds.models.attention import check_attn_implementation

    check_attn_implementation(cfg.model.attn_implementation, "model.attn_implementation", dist.device)
    from paco_ds.runtime.runlock import fit_in_run_dir

    # One run per run directory, as GRPO runs; a full disk or a deleted run directory is one line.
    fit_in_run_dir(cfg.run_dir, dist.is_main, lambda: SFTTrainer(cfg, dist), resume)
    shutdown_distributed()
