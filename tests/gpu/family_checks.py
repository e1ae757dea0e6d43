"""One rollout and one training step of every model family's tiny twin, on a device in a dtype: the
GPU lane runs it on CUDA in bf16 (test_families_gpu.py). Sampling with the SDE at one step, the
log-prob of that step recomputed as training does (the importance ratio of an unchanged policy is 1),
and its gradient reaching the LoRA. The tiny twins are built offline from the families' own classes."""
from __future__ import annotations

import torch

from paco_ds.recipe.schema import LoraConfig, ModelConfig
from paco_ds.models import policy_class, with_family_defaults
from paco_ds.models.base import Policy
from paco_ds.models.lora import add_lora
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import make_generator, sample_trajectories, transition_log_prob

PROMPTS = ["a red fox on a bench", "two cats in the snow"]
SIZE = 64


def reference_images(n: int, seed: int = 0) -> list[torch.Tensor]:
    """Smooth random uint8 [3, SIZE, SIZE] images: an editing family's inputs."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 4, 4, generator=g)
    return list((torch.nn.functional.interpolate(low, size=(SIZE, SIZE), mode="bilinear") * 255).to(torch.uint8))


def family_round_trip(family: str, device: torch.device, dtype: str, guidance: float = 1.0) -> dict:
    """Sample 2 images in 4 steps (SDE at step 1), recompute that step's log-prob with gradients and
    back-propagate it into the LoRA. Returns what a caller asserts on."""
    cfg = with_family_defaults(ModelConfig(family=family, tiny=True, dtype=dtype, lora=LoraConfig(rank=4, alpha=8),
                                           max_sequence_length=64))
    cls = policy_class(family)
    policy = cls.load(cfg, device)
    add_lora(policy.transformer, cfg.lora)
    torch.manual_seed(0)
    with torch.no_grad():  # non-zero B matrices: the adapter changes the velocity, as after a step
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    editing = type(policy).encode_condition is not Policy.encode_condition
    condition = policy.encode_condition(reference_images(len(PROMPTS)), SIZE, SIZE) if editing else None
    embeds = policy.encode_prompts(PROMPTS, condition)
    with torch.no_grad():
        spec = SamplingSpec(num_steps=4, guidance=guidance, noise_level=0.7)
        traj = sample_trajectories(policy, policy.transformer, spec, RolloutBatch(
            prompts=PROMPTS, embeds=embeds, height=SIZE, width=SIZE, condition=condition,
            generators=[make_generator(0, i) for i in range(len(PROMPTS))], noise_steps=[1], train_steps=[1]))
    step = transition_log_prob(policy, policy.transformer, traj, 0, [0, 1], spec=spec)
    (-step.log_prob.mean()).backward()
    grads = [p.grad for n, p in policy.transformer.named_parameters() if "lora_" in n and p.requires_grad]
    return {"editing": editing, "images": traj.images, "sampled": traj.log_prob[:, 0].float().cpu(),
            "recomputed": step.log_prob.detach().float().cpu(), "lora_grads": grads,
            "dtype": next(policy.transformer.parameters()).dtype}
