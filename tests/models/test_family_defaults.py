"""A family's defaults live with the family: `model.path` and `model.lora.target_modules` left unset
take the policy class's own, and a configured LoRA target that matches nothing is a user error."""
import re

import pytest
import torch
import yaml

from conftest import REPO, TINY, run_cli
from paco_ds.recipe.schema import LoraConfig, ModelConfig
from paco_ds.errors import ConfigError
from paco_ds.grpo.plan import load_config
from paco_ds.models import POLICIES, policy_class, with_family_defaults
from paco_ds.models.flux import FluxPolicy
from paco_ds.models.flux_kontext import KontextPolicy
from paco_ds.models.lora import add_lora
from paco_ds.models.qwen_image import QwenImagePolicy
from paco_ds.models.qwen_image_edit import QwenEditPolicy
from paco_ds.models.qwen_image_edit_plus import QwenEditPlusPolicy

pytestmark = pytest.mark.fast

QWEN_OWN = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
            "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
            "txt_mlp.net.2"]
TINY_EDIT = REPO / "paco_ds" / "data" / "prompts" / "tiny_edit"


def _qwen_recipe_without_defaults(tmp_path):
    """configs/qwen_edit.yaml with no model.path and no lora.target_modules, on the tiny edit data."""
    recipe = yaml.safe_load((REPO / "configs" / "qwen_edit.yaml").read_text())
    del recipe["model"]["path"], recipe["model"]["lora"]["target_modules"]
    recipe["data"] = {"format": "edit", "train_file": str(TINY_EDIT / "train_metadata.jsonl"),
                      "test_file": str(TINY_EDIT / "test_metadata.jsonl")}
    recipe["deepspeed"]["config"] = str(REPO / "configs" / "deepspeed" / "zero3.json")
    recipe["output_dir"] = str(tmp_path / "runs")
    recipe["sample"]["prompts_per_epoch"] = 1  # the tiny set has 7 prompts
    path = tmp_path / "qwen_edit_no_defaults.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_every_family_names_its_own_checkpoint_and_targets():
    assert set(POLICIES) == {"flux", "flux_kontext", "flux2", "flux2_klein", "qwen_image", "qwen_image_edit",
                             "qwen_image_edit_plus", "sd3", "wan", "wan22", "wan22_ti2v", "z_image"}
    assert FluxPolicy.default_path == "black-forest-labs/FLUX.1-dev"
    assert KontextPolicy.default_path == "black-forest-labs/FLUX.1-Kontext-dev"
    assert QwenEditPolicy.default_path == "Qwen/Qwen-Image-Edit"
    assert list(QwenEditPolicy.lora_targets) == QWEN_OWN
    assert QwenImagePolicy.default_path == "Qwen/Qwen-Image"  # the text-to-image sibling, the same MMDiT
    assert list(QwenImagePolicy.lora_targets) == QWEN_OWN
    assert QwenEditPlusPolicy.default_path == "Qwen/Qwen-Image-Edit-2509"  # 2511 by model.path
    assert list(QwenEditPlusPolicy.lora_targets) == QWEN_OWN
    assert (QwenEditPlusPolicy.max_input_images, QwenEditPolicy.max_input_images, KontextPolicy.max_input_images) == (3, 1, 1)
    assert QwenImagePolicy.attention_dispatch and QwenEditPolicy.attention_dispatch
    assert KontextPolicy.lora_targets == FluxPolicy.lora_targets  # the same transformer class
    assert not {"img_mlp.net.2", "txt_mlp.net.2"} & set(FluxPolicy.lora_targets)


def test_qwen_edit_recipe_without_path_and_targets_resolves_to_qwens_own(tmp_path):
    cfg = load_config(_qwen_recipe_without_defaults(tmp_path))
    assert cfg.model.family == "qwen_image_edit"
    assert cfg.model.path == "Qwen/Qwen-Image-Edit"  # not FLUX.1-dev
    assert cfg.model.lora.target_modules == QWEN_OWN  # MLPs included, in Qwen-Image's names


def test_dry_run_shows_the_resolved_path_and_targets(tmp_path):
    out = run_cli("launch/train.py", "--config", str(_qwen_recipe_without_defaults(tmp_path)), "--dry-run",
                  "--world-size", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    model = re.search(r"^model\s+(.*)$", out.stdout, re.M).group(1)
    targets = re.search(r"^LoRA targets\s+(.*)$", out.stdout, re.M).group(1)
    assert model == "qwen_image_edit: Qwen/Qwen-Image-Edit"
    assert targets.split(", ") == QWEN_OWN


def test_a_recipe_that_sets_them_keeps_its_own(tmp_path):
    cfg = load_config(_qwen_recipe_without_defaults(tmp_path),
                      ["model.path=/models/qwen-edit-copy", "model.lora.target_modules=[attn.to_q, attn.to_v]"])
    assert cfg.model.path == "/models/qwen-edit-copy"
    assert cfg.model.lora.target_modules == ["attn.to_q", "attn.to_v"]
    kontext = with_family_defaults(ModelConfig(family="flux_kontext"))
    assert kontext.path == KontextPolicy.default_path  # FLUX.1-dev is never a Kontext default
    assert load_config(TINY).model.path == "black-forest-labs/FLUX.1-dev"


def test_the_resolved_qwen_targets_put_lora_on_the_mlps():
    cfg = with_family_defaults(ModelConfig(family="qwen_image_edit", tiny=True, dtype="fp32",
                                           lora=LoraConfig(rank=4, alpha=8)))
    torch.manual_seed(0)
    policy = policy_class(cfg.family).load(cfg, torch.device("cpu"))
    add_lora(policy.transformer, cfg.lora)
    adapted = {n.rsplit(".lora_", 1)[0] for n, p in policy.transformer.named_parameters() if ".lora_" in n}
    for target in QWEN_OWN:  # every target of the family got an adapter somewhere
        assert any(a.endswith("." + target) for a in adapted), target
    assert any(".img_mlp." in a for a in adapted) and any(".txt_mlp." in a for a in adapted)


def test_a_target_that_matches_no_module_names_the_key(tiny_policy):
    from copy import deepcopy

    transformer = deepcopy(tiny_policy.transformer)
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules.*'img_mlp\.net\.2' matches no module"):
        add_lora(transformer, LoraConfig(target_modules=["attn.to_q", "img_mlp.net.2"]))


@pytest.mark.parametrize("family, recipe", [("flux", "t2is"), ("sd3", "sd3_pickscore"), ("qwen_image_edit", "qwen_edit"),
                                            ("qwen_image", "qwen_image_t2is"), ("z_image", "z_image_t2is"),
                                            ("qwen_image_edit_plus", "qwen_edit_plus"), ("flux2", "flux2_t2is"),
                                            ("flux2_klein", "flux2_klein_t2is"), ("wan22", "wan22_t2v")])
def test_a_target_that_matches_no_module_is_one_line_in_the_dry_run(tmp_path, family, recipe):
    """Checked against the family's transformer built on the meta device, before any model loads."""
    from conftest import one_line_error

    line = one_line_error(run_cli("launch/train.py", "--config", str(REPO / f"configs/tiny/{recipe}.yaml"), "--dry-run",
                                  "--set", f"output_dir={tmp_path}", "--set", "model.lora.target_modules=[to_qq]"))
    assert "config key 'model.lora.target_modules': 'to_qq' matches no module of the" in line, line
    assert line.endswith("(did you mean 'to_q'?)"), line


def test_the_qwen_image_recipes_resolve_to_qwen_images_own():
    for recipe in ("configs/qwen_image_t2is.yaml", "configs/tiny/qwen_image_t2is.yaml"):
        cfg = load_config(REPO / recipe, ["data.train_file=paco_ds/data/prompts/tiny_t2is_train.jsonl",
                                          "data.test_file=paco_ds/data/prompts/tiny_t2is_test.jsonl"])
        assert (cfg.model.family, cfg.model.path) == ("qwen_image", "Qwen/Qwen-Image")
        assert cfg.model.lora.target_modules == QWEN_OWN and cfg.model.max_sequence_length == 512
        assert cfg.data.format == "t2is" and "consistency_score" in cfg.rewards.train.terms
