"""Z-Image text-to-image-set GRPO for real: the tiny recipe as shipped (PaCo-GRPO's 2x2 sets, the
consistency judge served by the run) on 2 ZeRO-3 CPU processes under the deepspeed launcher, two
epochs; resumed from its epoch-1 checkpoint (in a copy of its directory) it must reproduce its own
metrics exactly, and the LoRA it exported must load into diffusers' ZImagePipeline and change what
the pipeline draws. One launch (and its resume) serves all three checks."""
import math

import numpy as np
import pytest
import torch

from distributed_runs import REPO, metrics, resume_copy, run_trainer, stable, tail

pytestmark = pytest.mark.runs

RECIPE = REPO / "configs/tiny/z_image_t2is.yaml"
SHORT = ("train.num_epochs=2", "sample.group_size=4", "test.eval_freq=0", "checkpoint.save_freq=1",
         "checkpoint.keep_last=2", "logging.num_train_images=0", "logging.tensorboard=false",
         "train.ema.update_interval=1")  # the export is the EMA: updated at each of the 4 optimizer steps
FIELDS = ["reward/consistency_score/mean", "reward/subfig_clipT/mean", "reward/pickscore/mean", "train/loss",
          "train/grad_norm"]


def _draw(pipe) -> np.ndarray:
    return pipe("a red cube", height=64, width=64, num_inference_steps=2, guidance_scale=0.0, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


def test_tiny_z_image_t2is_trains_on_two_zero3_ranks_resumes_exactly_and_exports_a_loadable_lora(tmp_path):
    full = tmp_path / "full"
    proc = run_trainer(full, *SHORT, config=RECIPE)
    assert proc.returncode == 0, tail(proc)
    rows = [r for r in metrics(full) if "time/epoch" in r]
    assert [r["epoch"] for r in rows] == [0, 1]
    for r in rows:
        assert all(k in r and math.isfinite(r[k]) for k in FIELDS), [k for k in FIELDS if k not in r]
        assert r["train/ratio_first"] == 1.0  # log-probs at training equal those at sampling
        assert r["train/forwards_per_step"] == 1.0  # guidance 0, beta = 0: one forward per trained step
    assert rows[1]["train/grad_norm"] > 0

    resumed = resume_copy(full, tmp_path / "resumed", "epoch_0001", *SHORT, config=RECIPE)
    assert resumed.returncode == 0, tail(resumed)
    assert "resumed from" in resumed.stdout
    assert stable(metrics(tmp_path / "resumed")) == stable(metrics(full))

    # The export (the adapter's EMA) loads with ZImagePipeline's own LoRA loader: every matrix
    # arrives, and the trained B matrices (zero at the start) change the images.
    from safetensors.torch import load_file

    from paco_ds.models.tiny.z_image import tiny_z_image_pipeline

    exported = load_file(full / "lora" / "pytorch_lora_weights.safetensors")
    pipe = tiny_z_image_pipeline(seed=0)
    before = _draw(pipe)
    pipe.load_lora_weights(full / "lora")
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora_B" in n}
    assert len(loaded) == len([k for k in exported if "lora_B" in k]) > 0
    assert any(p.abs().max() > 0 for p in loaded.values())
    assert np.abs(_draw(pipe) - before).max() > 0
