"""FLUX.2 [dev] and [klein] text-to-image-set GRPO for real: each tiny recipe as shipped (PaCo-GRPO's
2x2 sets, the consistency judge served by the run; dev's guidance embedding, klein's classifier-free
guidance in one batched forward) on 2 ZeRO-3 CPU processes under the deepspeed launcher, two epochs;
resumed from its epoch-1 checkpoint (in a copy of its directory) it must reproduce its own metrics
exactly, and the LoRA it exported must load into diffusers' Flux2Pipeline / Flux2KleinPipeline and
change what the pipeline draws. One launch (and its resume) per family serves all three checks."""
import numpy as np
import pytest
import torch

from distributed_runs import REPO, family_run_resumes_exactly

pytestmark = pytest.mark.runs_more  # make test-runs-more (not in CI: its time)

SHORT = ("train.num_epochs=2", "sample.group_size=4", "test.eval_freq=0", "checkpoint.save_freq=1",
         "checkpoint.keep_last=2", "logging.num_train_images=0", "logging.tensorboard=false",
         "train.ema.update_interval=1")  # the export is the EMA: updated at each of the 4 optimizer steps


def _draw(pipe) -> np.ndarray:
    return pipe(prompt="a red cube", height=64, width=64, num_inference_steps=2, guidance_scale=4.0, output_type="np",
                max_sequence_length=256, generator=torch.Generator().manual_seed(0)).images


@pytest.mark.parametrize("recipe, pipeline", [("flux2_t2is", "tiny_flux2_pipeline"),
                                              ("flux2_klein_t2is", "tiny_flux2_klein_pipeline")])
def test_tiny_flux2_t2is_trains_on_two_zero3_ranks_resumes_exactly_and_exports_a_loadable_lora(tmp_path, recipe,
                                                                                              pipeline):
    full = family_run_resumes_exactly(tmp_path, REPO / "configs" / "tiny" / f"{recipe}.yaml", *SHORT)

    # The export (the adapter's EMA) loads with the pipeline's own LoRA loader: every matrix
    # arrives, and the trained B matrices (zero at the start) change the images.
    from safetensors.torch import load_file

    from paco_ds.models.tiny import flux2

    exported = load_file(full / "lora" / "pytorch_lora_weights.safetensors")
    pipe = getattr(flux2, pipeline)(seed=0)
    before = _draw(pipe)
    pipe.load_lora_weights(full / "lora")
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora_B" in n}
    assert len(loaded) == len([k for k in exported if "lora_B" in k]) > 0
    assert any(p.abs().max() > 0 for p in loaded.values())
    assert np.abs(_draw(pipe) - before).max() > 0
