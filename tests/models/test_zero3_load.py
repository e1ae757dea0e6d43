"""Loading the FLUX transformer partitioned under ZeRO-3 (paco_ds/models/zero_load.py).

The real check runs 2 ranks with the deepspeed launcher on CPU over gloo: a small FLUX folder
(sharded transformer safetensors with an index, as FLUX.1-dev's) is loaded plainly and
partitioned; the partitioned load must gather to exactly the plain weights, hold about half of
them per rank, leave the RNG alone, and, after LoRA and deepspeed.initialize, give a forward that
is bitwise the plain one.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from distributed_runs import REPO, cpu_env, free_port, rank_launcher

pytestmark = pytest.mark.runs

SMALL_FLUX = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
              "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
              "guidance_embeds": True, "axes_dims_rope": [4, 6, 6]}


@pytest.fixture(scope="module")
def sharded_folder(tmp_path_factory):
    from paco_ds.models.tiny.flux import save_flux_folder

    return save_flux_folder(tmp_path_factory.mktemp("flux") / "small", SMALL_FLUX, max_shard_size="100KB")


def test_save_flux_folder_reused_only_with_same_arguments(sharded_folder):
    from paco_ds.models.tiny.flux import save_flux_folder

    assert save_flux_folder(sharded_folder, SMALL_FLUX, max_shard_size="100KB") == sharded_folder
    with pytest.raises(ValueError, match="other arguments"):
        save_flux_folder(sharded_folder, SMALL_FLUX, seed=1, max_shard_size="100KB")


def test_checkpoint_index_single_file_and_sharded(sharded_folder, tmp_path):
    from diffusers import FluxTransformer2DModel

    from paco_ds.models.zero_load import checkpoint_index, read_tensor

    model = FluxTransformer2DModel.from_pretrained(sharded_folder / "transformer")
    sharded = checkpoint_index(sharded_folder / "transformer")
    assert len({f.name for f in sharded.values()}) > 1  # really sharded
    model.save_pretrained(tmp_path / "single")
    single = checkpoint_index(tmp_path / "single")
    assert sorted(sharded) == sorted(single) == sorted(model.state_dict())
    for name, ref in model.state_dict().items():
        assert torch.equal(read_tensor(sharded[name], name), ref)
        assert torch.equal(read_tensor(single[name], name), ref)


@pytest.mark.parametrize("change, error", [({"num_single_layers": 2}, "missing"),
                                           ({"joint_attention_dim": 48}, "shapes differ")])
def test_mismatched_checkpoint_is_refused_before_any_collective(sharded_folder, change, error):
    from diffusers import FluxTransformer2DModel

    from paco_ds.models.zero_load import load_partitioned

    with pytest.raises(ValueError, match=error):  # no process group here: it must fail before one is used
        load_partitioned(FluxTransformer2DModel(**{**SMALL_FLUX, **change}), sharded_folder / "transformer")


def test_partitioned_load_equals_naive_two_ranks(sharded_folder, tmp_path):
    cmd = [*rank_launcher(2, free_port()), str(REPO / "tests" / "scripts" / "zero3_load_probe.py"),
           "--folder", str(sharded_folder),
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + "\n---\n" + proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"zero3_rank{r}.json").read_text()) for r in range(2)]
    for rep in reports:
        assert rep["world_size"] == 2
        for dtype in ("fp32", "bf16"):  # the CPU dtype (cast from the bf16 files) and the GPU one
            assert rep[f"{dtype}_partitioned"] and rep[f"{dtype}_names_match"] and rep[f"{dtype}_eval"]
            assert rep[f"{dtype}_unequal"] == []  # torch.equal per gathered tensor, same dtype
            assert rep[f"{dtype}_rng_untouched"]
            assert rep[f"{dtype}_full"] == rep[f"{dtype}_naive_numel"]
            # each rank holds ceil(numel / 2) of every tensor: half, up to one padding element each
            assert abs(rep[f"{dtype}_local"] / rep[f"{dtype}_full"] - 0.5) < 0.01
        assert rep["naive_engine_local"] == rep["partitioned_engine_local"]
        assert rep["lora_numel"] > 0 and rep["lora_equal"]
        assert rep["forward_equal"] and rep["forward_abs_mean"] > 0
    assert reports[0]["forward_abs_mean"] == reports[1]["forward_abs_mean"]
