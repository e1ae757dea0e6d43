"""The reward-SFT recipes: reference values, the shared loading machinery, and the LoRA targets."""
import re

import pytest

from conftest import REPO
from paco_ds.errors import ConfigError
from paco_ds.sft.config import load_sft_config

pytestmark = pytest.mark.fast

RECIPE = REPO / "configs" / "paco_reward_sft.yaml"
TINY = REPO / "configs" / "tiny" / "reward_sft.yaml"


def test_recipe_has_the_reference_values():
    # PaCo-RL/PaCo-Reward/config/paco_reward_lora.yaml
    c = load_sft_config(RECIPE)
    assert c.model.path == "Qwen/Qwen2.5-VL-7B-Instruct" and c.model.dtype == "bf16"
    assert c.model.image_max_pixels == 2 * 1024**2
    assert c.model.freeze_vision_tower and c.model.freeze_multi_modal_projector
    assert (c.lora.rank, c.lora.alpha, c.lora.dropout, c.lora.target_modules) == (32, 64, 0.0, "all")
    t = c.train
    assert (t.first_token_weight, t.first_token_weight_mode) == (0.1, "exact")
    assert (t.batch_size, t.gradient_accumulation_steps, t.learning_rate, t.num_epochs) == (8, 4, 2e-4, 2)
    assert (t.lr_scheduler, t.warmup_ratio) == ("cosine", 0.1)
    assert c.data.cutoff_len == 16384 and c.data.max_samples == 100000 and len(c.data.train_files) == 2
    assert c.eval.batch_size == 8 and c.eval.every_epochs == 1 and c.checkpoint.every_epochs == 1
    assert c.deepspeed.config == "configs/deepspeed/zero3.json"


def test_tiny_recipe_extends_it():
    c = load_sft_config(TINY)
    assert c.model.tiny and c.data.synthetic is not None and not c.data.train_files
    assert c.train.first_token_weight == 0.1 and c.lora.target_modules == "all"  # inherited


def test_mistakes_are_one_line_with_the_place(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'train.first_token_weigth' "
                                          r"\(did you mean 'train.first_token_weight'\?\)"):
        load_sft_config(TINY, ["train.first_token_weigth=0.2"])
    with pytest.raises(ConfigError, match=r"config key 'train.first_token_weight'.*less than or equal to 1"):
        load_sft_config(TINY, ["train.first_token_weight=1.5"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("extends: " + str(TINY) + "\ndata:\n  train_files: [x.json]\n")
    with pytest.raises(ConfigError,
                       match=r"bad.yaml:2: config key 'data': .*either train_files/eval_files or synthetic"):
        load_sft_config(bad)


def test_lora_targets_all_linear_layers_of_the_language_model():
    from torch import nn

    from paco_ds.models.tiny.qwen_vl import tiny_qwen2_5_vl
    from paco_ds.sft.model import lora_targets

    model, _ = tiny_qwen2_5_vl()
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]

    def matched(cfg):
        return {n for n in linear if re.fullmatch(lora_targets(model, cfg), n)}

    lm = {n for n in linear if n.startswith("model.language_model.")}
    assert len(lm) == 14 and matched(load_sft_config(TINY)) == lm  # 7 per layer; not lm_head, not the vision tower
    both = load_sft_config(TINY, ["model.freeze_vision_tower=false", "model.freeze_multi_modal_projector=false"])
    assert matched(both) == {n for n in linear if n != "lm_head"}
