"""What the full-size plan tests share (tests/plan/test_full_scale_plans.py, `make test-plan`; and
tests/plan/test_more_plans.py, `make test-plan-more`): the shipped tiny prompt files that stand in for the
recipes' (a plan's shapes come from the recipe's resolution and the models, not from the prompts), and the
plan made in this process or printed by the CLI."""
from __future__ import annotations

from tests.conftest import REPO, run_cli

T2IS_DATA = ["data.train_file=paco_ds/data/prompts/tiny_t2is_train.jsonl",
             "data.test_file=paco_ds/data/prompts/tiny_t2is_test.jsonl", "sample.prompts_per_epoch=8"]
EDIT_DATA = ["data.train_file=paco_ds/data/prompts/tiny_edit/train_metadata.jsonl",
             "data.test_file=paco_ds/data/prompts/tiny_edit/test_metadata.jsonl", "sample.prompts_per_epoch=7"]
MULTI_EDIT_DATA = ["data.train_file=paco_ds/data/prompts/tiny_edit/train_multi.jsonl",
                   "data.test_file=paco_ds/data/prompts/tiny_edit/test_multi.jsonl", "sample.prompts_per_epoch=4"]
GiB = 2 ** 30
QWEN_IMAGE_TRANSFORMER_PARAMS = 20_430_401_088  # without the LoRA (Qwen-Image's, Edit's and Edit-2509/2511's)


def plan(recipe: str, overrides: list[str], **kw):
    """The plan of configs/`recipe` on 8 ranks of 80 GiB, made in this process."""
    from paco_ds.gpu_plan.plan import gpu_plan
    from paco_ds.grpo.plan import load_config

    return gpu_plan(load_config(REPO / "configs" / recipe, overrides), 8, 80, **kw)


def cli_plan(recipe: str, gib: int, *overrides: str) -> str:
    """What launch/train.py prints for `recipe` (a file in configs/) with --dry-run --world-size 8
    --gpu-memory `gib`, the tiny T2IS prompts and `overrides` set."""
    args = [a for o in (*T2IS_DATA, *overrides) for a in ("--set", o)]
    proc = run_cli("launch/train.py", "--config", f"configs/{recipe}", "--dry-run", "--world-size", "8",
                   "--gpu-memory", str(gib), *args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def check_editing_plan(recipe: str, data: list[str], transformer: int | None) -> None:
    """An editing recipe fits on 8 x 80 GiB and on 8 x 141; the text encoders are parked for training,
    the gathered transformer is in sampling only."""
    import dataclasses

    made = plan(recipe, data)
    assert made.fits, made.to_json()["verdict"]
    assert dataclasses.replace(made, gpu_gib=141).fits  # and on 8 x 141 GiB (H200)
    if transformer:  # the real class built on meta: 2511's zero_cond_t adds no parameter
        assert made.params["transformer"] - made.params["lora"] == transformer
    assert made.memory["training"]["text encoders"] == 0 < made.memory["sampling"]["text encoders"]
    assert made.memory["sampling"]["transformer gathered for sampling"] > 15 * GiB
    assert made.flops["training"] > 0 and made.flops["sampling"] > made.flops["training"] / 4


def check_t2is_family_cli_plan(family: str, transformer: str, text_encoders: str) -> None:
    """A family's T2IS recipe planned from the CLI states its transformer's parameters (base and LoRA),
    its text encoders' and a verdict that fits on 8 x 80 GiB."""
    out = cli_plan(f"{family}_t2is.yaml", 80)
    assert f"GPU plan per rank ({family}, 512x512, bfloat16" in out
    params = next(line for line in out.splitlines() if line.startswith("parameters:"))
    assert transformer in params and text_encoders in params
    verdict = next(line for line in out.splitlines() if line.startswith("verdict:"))
    assert verdict.startswith("verdict: fits on 8 x 80 GiB"), verdict


def sd3_data(tmp_path, name: str) -> list[str]:
    """A shipped tiny prompt file repeated to 48 prompts: one epoch of Flow-GRPO's SD3 recipes at 8 ranks."""
    src = REPO / "paco_ds" / "data" / "prompts" / name
    lines = src.read_text().strip().splitlines()
    many = tmp_path / f"train{src.suffix}"
    many.write_text("\n".join(lines * -(-48 // len(lines))) + "\n")
    return [f"data.train_file={many}", f"data.test_file={src}"]
