"""parallel.sequence (paco_ds/models/sequence.py, paco_ds/runtime/sequence.py): what cannot shard is
one line at --dry-run, masked prompts are padded to a multiple of the group, and one rank of an
emulated group (the GPU plan's) runs its half of the tokens. The sharded forward, log-prob and
gradients against the unsharded ones are tests/grpo/test_sequence_probe.py (the sequence tier), and a
run of two sequence groups tests/grpo/test_sequence_parallel.py (the runs tier)."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, TINY, one_line_error, run_cli

pytestmark = pytest.mark.fast


def _dry_run(*sets: str, config=TINY, world: int = 4):
    args = ["launch/train.py", "--config", str(config), "--dry-run", "--world-size", str(world),
            "--set", "parallel.sequence=2"]
    for s in sets:
        args += ["--set", s]
    return run_cli(*args, timeout=120)


@pytest.mark.parametrize("sets, says", [
    (["parallel.sequence=3"], "config key 'parallel.sequence': 3 does not divide the world size 4"),
    (["parallel.sequence=4"], "config key 'parallel.sequence': 4: 2 attention heads do not split over 4 ranks"),
    (["model.max_sequence_length=15"], "15 prompt tokens (model.max_sequence_length) do not split over 2 ranks"),
    (["train.resolution=48"], "9 image tokens of 48x48 (train.resolution) do not split over 2 ranks"),
    (["train.resolution=[48,80]"], "15 image tokens of 48x80 (train.resolution) do not split over 2 ranks"),
    (["model.family=z_image"], "the ZImageTransformer2DModel transformer declares no context-parallel split"),
    (["model.attention_backend=_native_math"], "attention backend '_native_math' has no sequence-parallel form"),
    (["model.compile=true", "deepspeed.zero_stage=2"], "model.compile below ZeRO stage 3 compiles the training"),
])
def test_what_cannot_shard_is_one_line_at_the_dry_run(sets, says):
    assert says in one_line_error(_dry_run(*sets))


def test_a_loss_that_gathers_every_ranks_rows_is_refused():
    line = one_line_error(_dry_run(config=REPO / "configs" / "tiny" / "t2is_dgpo.yaml"))
    assert "config key 'parallel.sequence': 2: train.loss dgpo gathers every rank's rows" in line


def test_the_dry_run_plans_the_epoch_for_the_groups():
    proc = _dry_run()
    assert proc.returncode == 0, proc.stderr
    rows = dict(line.split(None, 1) if "  " not in line else [s.strip() for s in line.split("  ", 1)]
                for line in proc.stdout.splitlines() if line.strip())
    assert rows["world size"] == "4"
    assert rows["sequence parallel"].startswith("parallel.sequence=2: 2 groups of 2 ranks")
    # 2 prompts x 8 images over 2 data-parallel ranks (the groups), not 4
    assert rows["samples per rank"] == "8"


def test_a_checkpoint_resumes_only_with_its_own_sequence_degree(tmp_path):
    from paco_ds.errors import ConfigError
    from paco_ds.grpo.plan import load_config
    from paco_ds.grpo.preflight import check_resume, resume_settings

    saved = resume_settings(load_config(TINY, ["parallel.sequence=2"]))
    (tmp_path / "meta.json").write_text(json.dumps({"recipe": saved}))
    assert check_resume(load_config(TINY, ["parallel.sequence=2"]), tmp_path) == ""
    with pytest.raises(ConfigError, match="config key 'parallel.sequence': --resume .* was trained with 2"):
        check_resume(load_config(TINY, []), tmp_path)


def test_masked_prompts_are_padded_to_a_multiple_of_the_group():
    from paco_ds.models.sequence import pad_prompt

    text = torch.randn(2, 5, 3)
    padded, mask = pad_prompt(text, None, 4)
    assert padded.shape == (2, 8, 3) and torch.equal(padded[:, :5], text) and not padded[:, 5:].any()
    assert mask.tolist() == [[True] * 5 + [False] * 3] * 2
    mine = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert pad_prompt(text, mine, 2)[1].tolist() == [[True, True, True, False, False, False], [True] * 5 + [False]]
    same, kept = pad_prompt(text, mine, 5)
    assert same is text and kept is mine  # already a multiple: untouched


def test_one_rank_of_an_emulated_group_runs_half_of_the_tokens(tiny_cfg):
    """The GPU plan's emulation (a process group of torch's fake backend, whose collectives move nothing):
    the first attention sees this rank's 8 of the 16 image tokens at 64 x 64, the output is gathered to
    all 16, and a size whose tokens do not split is one line naming the key."""
    from paco_ds.models.flux import FluxPolicy
    from paco_ds.models.sequence import shard_sequence
    from paco_ds.runtime.sequence import emulated_group

    policy = FluxPolicy.load(tiny_cfg.model, torch.device("cpu"))
    seen = []
    policy.transformer.transformer_blocks[0].attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
    embeds = policy.encode_prompts(["a cat", "a dog"])
    with emulated_group(2) as mesh, torch.no_grad():
        assert shard_sequence(policy, mesh) == 2 and policy.sequence_degree == 2
        x = policy.initial_latents(2, 64, 64, [torch.Generator().manual_seed(i) for i in range(2)])
        v = policy.velocity(policy.transformer, x, torch.tensor([0.5, 0.5]), embeds, 64, 64, 3.5)
        assert v.shape == x.shape == (2, 16, x.shape[2]) and seen == [8]
        x = policy.initial_latents(2, 16, 16, [torch.Generator().manual_seed(i) for i in range(2)])
        with pytest.raises(ValueError, match="parallel.sequence=2: the transformer's 'hidden_states' has 1 tokens"):
            policy.velocity(policy.transformer, x, torch.tensor([0.5, 0.5]), embeds, 16, 16, 3.5)
    assert not torch.distributed.is_initialized()  # the emulated group is gone after the block


def test_both_of_wan22s_experts_are_sharded():
    """Wan2.2-A14B's policy transformer holds two experts (paco_ds/models/wan22.py): each is sharded as
    its class declares, so a step on either side of the boundary runs half of the video's tokens, and the
    velocity is gathered whole. (A module holding no transformer that declares a split is refused.)"""
    from paco_ds.models import policy_class, with_family_defaults
    from paco_ds.models.sequence import shard_sequence, sharded_transformers
    from paco_ds.recipe.schema import ModelConfig
    from paco_ds.runtime.sequence import emulated_group

    cfg = with_family_defaults(ModelConfig(family="wan22", tiny=True, dtype="fp32", max_sequence_length=16,
                                           num_frames=5))
    policy = policy_class("wan22").load(cfg, torch.device("cpu"))
    experts = sharded_transformers(policy.transformer)
    assert experts == [policy.transformer.transformer, policy.transformer.transformer_2]
    seen = {0: [], 1: []}
    for i, expert in enumerate(experts):
        expert.blocks[0].attn1.register_forward_pre_hook(lambda m, args, kw, i=i: seen[i].append(args[0].shape[1]),
                                                         with_kwargs=True)
    embeds = policy.encode_prompts(["a fox in the snow"])
    x = policy.initial_latents(1, 32, 32, [torch.Generator().manual_seed(0)])
    with emulated_group(2) as mesh, torch.no_grad():
        assert shard_sequence(policy, mesh) == 2
        for sigma in (0.95, 0.3):  # the high-noise expert, then the low-noise one
            v = policy.velocity(policy.transformer, x, torch.tensor([sigma]), embeds, 32, 32, 1.0)
            assert v.shape == x.shape
    assert seen == {0: [policy.latent_seq_len(32, 32) // 2], 1: [policy.latent_seq_len(32, 32) // 2]}
    with pytest.raises(ValueError, match="declares no _cp_plan"):
        sharded_transformers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_wan22s_heads_are_read_from_its_experts_published_config():
    """The full-size heads preflight divides by N: Wan2.2-A14B's policy builds its two experts as one
    module, whose own config holds no heads; each expert has Wan2.1-14B's 40."""
    from paco_ds.models import policy_class, with_family_defaults
    from paco_ds.models.sequence import attention_heads
    from paco_ds.recipe.schema import ModelConfig

    assert attention_heads(policy_class("wan22"), with_family_defaults(ModelConfig(family="wan22"))) == 40
