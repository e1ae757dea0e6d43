"""Qwen-Image text-to-image-set GRPO for real: the tiny recipe as shipped (PaCo-GRPO's 2x2 sets, the
consistency judge served by the run) on 2 ZeRO-3 CPU processes under the deepspeed launcher, two
epochs, then resumed from its epoch-1 checkpoint (in a copy of its directory): it must reproduce its
own metrics exactly."""
import pytest

from distributed_runs import REPO, family_run_resumes_exactly

pytestmark = pytest.mark.runs_more  # make test-runs-more (not in CI: its time)

RECIPE = REPO / "configs/tiny/qwen_image_t2is.yaml"
SHORT = ("train.num_epochs=2", "sample.group_size=4", "test.eval_freq=0", "checkpoint.save_freq=1",
         "checkpoint.keep_last=2", "logging.num_train_images=0", "logging.tensorboard=false")


def test_tiny_qwen_image_t2is_trains_on_two_zero3_ranks_and_resumes_exactly(tmp_path):
    full = family_run_resumes_exactly(tmp_path, RECIPE, *SHORT)
    assert (full / "lora" / "pytorch_lora_weights.safetensors").is_file()
