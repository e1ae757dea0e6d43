"""Z-Image text-to-image-set GRPO for real: the tiny recipe as shipped (PaCo-GRPO's 2x2 sets, the
consistency judge served by the run) on 2 ZeRO-3 CPU processes under the deepspeed launcher, two
epochs; resumed from its epoch-1 checkpoint (in a copy of its directory) it must reproduce its own
metrics exactly, and the LoRA it exported must load into diffusers' ZImagePipeline and change what
the pipeline draws. One launch (and its resume) serves all three checks."""
import numpy as np
import pytest
import torch

from distributed_runs import REPO, family_run_resumes_exactly

pytestmark = pytest.mark.runs_more  # make test-runs-more (not in CI: its time)

RECIPE = REPO / "configs/tiny/z_image_t2is.yaml"
SHORT = ("train.num_epochs=2", "sample.group_size=4", "test.eval_freq=0", "checkpoint.save_freq=1",
         "checkpoint.keep_last=2", "logging.num_train_images=0", "logging.tensorboard=false",
         "train.ema.update_interval=1")  # the export is the EMA: updated at each of the 4 optimizer steps


def _draw(pipe) -> np.ndarray:
    return pipe("a red cube", height=64, width=64, num_inference_steps=2, guidance_scale=0.0, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


def test_tiny_z_image_t2is_trains_on_two_zero3_ranks_resumes_exactly_and_exports_a_loadable_lora(tmp_path):
    full = family_run_resumes_exactly(tmp_path, RECIPE, *SHORT)

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
