"""An adapter given to evaluation (`--lora`) or to training (`model.lora.path`) is read through
before any model is built: a truncated, foreign, one-sided or non-finite file is one line naming
the file, exit 2."""
import os

import pytest
import torch
from safetensors.torch import save_file

from conftest import REPO, one_line_error, run_cli
from paco_ds.errors import ConfigError
from paco_ds.models.lora import LORA_FILE, check_lora_file

pytestmark = pytest.mark.fast


def adapter(tmp_path, tensors=None):
    tensors = tensors if tensors is not None else {
        "transformer.blocks.0.to_q.lora_A.weight": torch.randn(4, 16),
        "transformer.blocks.0.to_q.lora_B.weight": torch.zeros(16, 4)}
    d = tmp_path / "lora"
    d.mkdir(exist_ok=True)
    save_file(tensors, str(d / LORA_FILE))
    return d


def test_a_whole_adapter_passes_and_names_its_file(tmp_path):
    d = adapter(tmp_path)
    assert check_lora_file(d, "--lora") == d / LORA_FILE
    assert check_lora_file(d / LORA_FILE, "--lora") == d / LORA_FILE


@pytest.mark.parametrize("damage, says", [
    ("truncate", "not a readable safetensors file"),
    ("random", "not a readable safetensors file"),
    ("foreign", "holds no LoRA weights"),
    ("one_sided", "has only one of lora_A/lora_B"),
    ("rank", "do not share a rank"),
    ("nan", "has non-finite values"),
    ("missing", f"no {LORA_FILE} there"),
])
def test_a_damaged_adapter_is_refused_naming_the_file(tmp_path, damage, says):
    d = adapter(tmp_path)
    f = d / LORA_FILE
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:-40])
    elif damage == "random":
        f.write_bytes(os.urandom(600))
    elif damage == "foreign":
        adapter(tmp_path, {"model.weight": torch.randn(3, 3)})
    elif damage == "one_sided":
        adapter(tmp_path, {"a.lora_A.weight": torch.randn(4, 8)})
    elif damage == "rank":
        adapter(tmp_path, {"a.lora_A.weight": torch.randn(4, 8), "a.lora_B.weight": torch.randn(8, 2)})
    elif damage == "nan":
        adapter(tmp_path, {"a.lora_A.weight": torch.full((4, 8), float("nan")), "a.lora_B.weight": torch.randn(8, 4)})
    else:
        f.unlink()
    with pytest.raises(ConfigError, match=says) as err:
        check_lora_file(d, "--lora")
    assert str(d) in str(err.value)


def test_evaluate_and_train_refuse_a_truncated_adapter_in_one_line(tmp_path):
    d = adapter(tmp_path)
    (d / LORA_FILE).write_bytes((d / LORA_FILE).read_bytes()[:-40])
    sets = ["--set", f"output_dir={tmp_path}", "--set", "reward_servers=null"]
    line = one_line_error(run_cli("launch/evaluate.py", "policy", "--config", str(REPO / "configs/tiny/t2is.yaml"),
                                  *sets, "--lora", str(d), timeout=300))
    assert line.startswith("evaluate: error: --lora ") and "not a readable safetensors file" in line
    line = one_line_error(run_cli("launch/train.py", "--config", str(REPO / "configs/tiny/t2is.yaml"), *sets,
                                  "--set", f"model.lora.path={d}", "--dry-run"))
    assert "config key 'model.lora.path':" in line and str(d / LORA_FILE) in line
