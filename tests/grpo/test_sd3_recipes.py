"""Flow-GRPO's SD3.5 recipes validate: the full ones in --dry-run at the 32 ranks they were written for
(tiny data swapped in), the tiny twins at 2. (tests/grpo/test_train_sd3.py trains the twins.)"""
import math
import re

import pytest

from conftest import REPO, run_cli

pytestmark = pytest.mark.fast

PROMPTS = REPO / "paco_ds" / "data" / "prompts"
RECIPES = {  # recipe -> tiny train and test files
    "sd3_geneval": ("tiny_geneval_train.jsonl", "tiny_geneval_test.jsonl"),
    "sd3_ocr": ("tiny_ocr_train.txt", "tiny_ocr_test.txt"),
    "sd3_pickscore": ("tiny_ocr_train.txt", "tiny_ocr_test.txt"),
}


def _field(out: str, name: str) -> str:
    return re.search(rf"^{re.escape(name)}\s+(.*)$", out, re.M).group(1)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_full_sd3_recipes_validate_for_32_ranks_with_flow_grpos_epoch(recipe, tmp_path):
    train, test = RECIPES[recipe]
    lines = (PROMPTS / train).read_text().strip().splitlines()
    many = tmp_path / f"train{PROMPTS.joinpath(train).suffix}"  # 48 prompts: one epoch's unique prompts
    many.write_text("\n".join(lines * math.ceil(48 / len(lines))) + "\n")
    out = run_cli("launch/train.py", "--config", f"configs/{recipe}.yaml", "--dry-run", "--world-size", "32",
                  "--set", f"data.train_file={many}", "--set", f"data.test_file={PROMPTS / test}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert _field(out.stdout, "model") == "sd3: stabilityai/stable-diffusion-3.5-medium"
    assert _field(out.stdout, "samples per epoch") == "1152"  # 48 groups of 24: 4 batches of 9 on 32 GPUs
    assert _field(out.stdout, "trained steps") == "[0, 1, 2, 3, 4, 5, 6, 7, 8]"  # int(10 x 0.99) steps
    assert _field(out.stdout, "gradient accumulation") == "18"  # Flow-GRPO's 2 x 9 timesteps
    assert _field(out.stdout, "optimizer steps per epoch") == "2"
    assert _field(out.stdout, "LoRA targets").split(", ") == [
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k", "attn.to_out.0",
        "attn.to_q", "attn.to_v"]
    reward = recipe.split("_")[1]
    assert _field(out.stdout, "rewards (train)") == f"{reward}x1"
    missing = run_cli("launch/train.py", "--config", f"configs/{recipe}.yaml", "--dry-run", "--world-size", "32")
    assert missing.returncode == 2 and "data.train_file" in missing.stderr  # Flow-GRPO's data is not shipped


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_tiny_sd3_twins_validate_on_two_ranks(recipe):
    out = run_cli("launch/train.py", "--config", f"configs/tiny/{recipe}.yaml", "--dry-run", "--world-size", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert _field(out.stdout, "model") == "sd3: tiny (offline)"
    assert _field(out.stdout, "samples per rank") == "4"
