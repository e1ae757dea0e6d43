"""Run the trainer in one process with a fault injected or a measurement attached, for the
guard tests.

modes:
  nan_loss   the PPO loss is NaN on the 2nd and 3rd micro-steps of the run
  diverge    the PPO loss is always NaN
  nan_grad   the PPO loss is finite, its gradient always NaN (every optimizer step is skipped)
  faults     in one run, each fault that training survives: the first batch scored has NaN rewards, the
             first micro-step's loss a NaN gradient (its optimizer step is skipped), the 2nd and 3rd
             micro-steps NaN losses
  saved_activations  no fault: every transformer forward that builds a graph records the bytes
             autograd keeps for backward (tensors saved outside checkpointed blocks, parameters
             not counted); the largest is written to saved_activations.json in the run directory
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kernels  # noqa: E402
from paco_ds.errors import exit_on_user_error, run_entry_point  # noqa: E402
from paco_ds.rewards.base import RewardResult  # noqa: E402
from paco_ds.rewards.jpeg_compressibility import JpegCompressibility  # noqa: E402


def main():
    mode, config, *sets = sys.argv[1:]
    calls = {"n": 0}
    real_loss = kernels.ppo_clip_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        calls["n"] += 1
        if mode == "diverge" or calls["n"] in (2, 3):
            loss = loss * torch.tensor(float("nan"))
        return loss, stats

    class NanGrad(torch.autograd.Function):  # identity forward, NaN backward
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * float("nan")

    def nan_grad(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        calls["n"] += 1
        if mode == "nan_grad" or calls["n"] == 1:
            loss = NanGrad.apply(loss)
        elif mode == "faults" and calls["n"] in (2, 3):
            loss = loss * torch.tensor(float("nan"))
        return loss, stats

    real_score = JpegCompressibility.score

    def nan_score(self, images, prompts, metadata, ref_images=None):
        res = real_score(self, images, prompts, metadata, ref_images)
        calls["scored"] = calls.get("scored", 0) + 1
        return RewardResult.ok(np.full_like(res.scores, np.nan)) if calls["scored"] == 1 else res

    from paco_ds.models.flux import FluxPolicy

    real_velocity = FluxPolicy.velocity
    saved = {"max_bytes": 0, "forwards": 0}

    def measured_velocity(self, module, *args, **kwargs):
        if not torch.is_grad_enabled():
            return real_velocity(self, module, *args, **kwargs)
        params = list(module.parameters())
        kept = {}

        def pack(t):
            storage = t.untyped_storage()
            # parameters (ZeRO-3 gathers them into new storage during the forward) are not activations
            if storage.data_ptr() not in {p.data.untyped_storage().data_ptr() for p in params}:
                kept[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = real_velocity(self, module, *args, **kwargs)
        saved["max_bytes"] = max(saved["max_bytes"], sum(kept.values()))
        saved["forwards"] += 1
        return out

    if mode in ("nan_loss", "diverge"):
        kernels.ppo_clip_loss = nan_loss
    elif mode == "nan_grad":
        kernels.ppo_clip_loss = nan_grad
    elif mode == "faults":
        kernels.ppo_clip_loss = nan_grad
        JpegCompressibility.score = nan_score
    elif mode == "saved_activations":
        FluxPolicy.velocity = measured_velocity
    else:
        raise SystemExit(f"unknown mode {mode}")
    from paco_ds.grpo.plan import load_config
    from paco_ds.grpo.run import run

    with exit_on_user_error("train"):
        cfg = load_config(config, sets)
        run(cfg)
    if mode == "saved_activations":
        (cfg.run_dir / "saved_activations.json").write_text(json.dumps(saved))


if __name__ == "__main__":
    run_entry_point(main)  # exits without interpreter teardown (paco_ds/errors.py)
