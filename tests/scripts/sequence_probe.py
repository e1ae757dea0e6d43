"""Under the deepspeed launcher, 2 CPU ranks: parallel.sequence: 2 against the unsharded transformer.

For each family (FLUX.1, Qwen-Image, FLUX.2 dev, Wan2.1, Wan2.2-A14B's two experts and Wan2.2-TI2V-5B:
their tiny twins) every rank builds the policy twice as the trainer builds it, from the same seed:
unsharded, on this rank alone (the reference), and with its tokens split over the two ranks inside a
ZeRO-3 engine. Both sample one rollout batch through
the trainer's Rollouts, and train one micro-step of the recipe's loss on the reference's rollout,
the sharded one backpropagated as the trainer does (`group_loss`, DeepSpeed's mean over the ranks).
Each rank writes sequence_rank<r>.json into the given folder: per family, the largest differences of
the velocity, the sampled latents and log-probs, the loss and the LoRA gradients, and the tokens the
first attention saw (half of them when sharded).
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FAMILIES = {"flux": "configs/tiny/t2is.yaml", "qwen_image": "configs/tiny/qwen_image_t2is.yaml",
            "flux2": "configs/tiny/flux2_t2is.yaml", "wan": "configs/tiny/wan_t2v.yaml",
            "wan22": "configs/tiny/wan22_t2v.yaml", "wan22_ti2v": "configs/tiny/wan22_ti2v.yaml"}
SETTINGS = ["parallel.sequence=2", "sample.num_steps=3", "sample.noise_steps=[1]", "sample.same_latent=false",
            "train.ema.enabled=false"]


def first_attention_tokens(transformer) -> list[int]:
    """A pre-hook on the first block's (self-)attention recording its image or video tokens per call (after
    the split), in each sharded transformer (both of Wan2.2's experts). Wan's blocks call theirs
    positionally, the image families' by keyword."""
    from paco_ds.models.sequence import sharded_transformers

    seen = []
    for t in sharded_transformers(transformer):
        attn = next(m for name, m in t.named_modules() if name.endswith(("attn", "attn1")) and hasattr(m, "processor"))
        attn.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(int(kwargs.get("hidden_states", args[0] if args else None).shape[1])),
            with_kwargs=True)
    return seen


def set_lora_b(policy, zero3: bool) -> list:
    """Every LoRA B matrix to the same non-zero values on every rank (at init they are 0: the
    adapter's A matrices would get no gradient); the trainable (name, parameter) pairs."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    named = [(n, p) for n, p in policy.transformer.named_parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(7)
    for name, p in named:
        if "lora_B" in name:
            with GatheredParameters([p], modifier_rank=0, enabled=zero3), torch.no_grad():
                p.data.copy_(torch.randn(p.ds_shape if zero3 else p.shape, generator=gen) * 0.1)
    return named


def compare(family: str, recipe: str, dist, mesh) -> dict:
    import torch
    from deepspeed.utils import safe_get_full_grad

    from paco_ds.grpo import build
    from paco_ds.grpo.losses import build_loss
    from paco_ds.grpo.plan import derive, load_config
    from paco_ds.models import policy_class
    from paco_ds.models.sequence import image_tokens
    from paco_ds.runtime.engine import create_engine
    from paco_ds.runtime.sequence import group_loss
    from paco_ds.sampling.rollouts import Pick
    from paco_ds.sampling.trajectory import training_batch

    cfg = load_config(recipe, SETTINGS)
    items, _ = build.prompts(cfg)
    picks = [Pick(items[i], i, i) for i in range(2)]
    h = w = cfg.train.resolution

    torch.manual_seed(cfg.seed)  # the reference: the unsharded transformer, this rank alone
    ref = build.adapted_policy(cfg, dist.device, {})
    ref_lora = set_lora_b(ref, zero3=False)
    ref_loss = build_loss(cfg, ref)
    ref_rollouts = build.rollouts(cfg, ref, ref_loss, None, {})

    ds = build.ds_config(cfg, derive(cfg, dist.data_world, dataset_size=len(items)), dist)
    ds |= {"gradient_accumulation_steps": 1, "train_batch_size": cfg.train.batch_size * dist.world_size}
    torch.manual_seed(cfg.seed)  # sharded over the group, inside a ZeRO-3 engine: as the trainer builds it
    pol = build.adapted_policy(cfg, dist.device, ds, sequence_mesh=mesh)
    seen = first_attention_tokens(pol.transformer)
    engine = create_engine(pol.transformer, [p for p in pol.transformer.parameters() if p.requires_grad], ds,
                           lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    lora = set_lora_b(pol, zero3=True)
    loss = build_loss(cfg, pol)
    rollouts = build.rollouts(cfg, pol, loss, engine, ds)

    out = {}
    with torch.no_grad():  # one velocity through the engine (ZeRO-3 gathers per forward)
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        x = ref.initial_latents(2, h, w, gens)
        embeds = ref.encode_prompts([p.item.prompt for p in picks])
        sigma = torch.tensor([0.7, 0.7])
        engine.eval()
        v = pol.velocity(engine, x, sigma, embeds, h, w, cfg.sample.guidance_scale)
        v_ref = ref.velocity(ref.transformer.eval(), x, sigma, embeds, h, w, cfg.sample.guidance_scale)
        out["velocity"] = float((v - v_ref).abs().max())
        out["velocity_scale"] = float(v_ref.abs().max())
    sharded_tokens, full_tokens = seen[-1], ref.latent_seq_len(h, w)
    frames = ref.latent_shape(h, w)[1] if hasattr(ref, "num_frames") else 1  # preflight counts one frame's
    with rollouts.module() as module:  # the sampling phase: the transformer gathered once
        traj = rollouts.sample(module, picks, h, w, epoch=0)
    with ref_rollouts.module() as module:
        traj_ref = ref_rollouts.sample(module, picks, h, w, epoch=0)
    out["latents"] = float((traj.x_next - traj_ref.x_next).abs().max())
    out["log_prob"] = float((traj.log_prob - traj_ref.log_prob).abs().max())
    out["log_prob_scale"] = float(traj_ref.log_prob.abs().max())

    batch = training_batch([(traj_ref, 0), (traj_ref, 1)], torch.tensor([1.0, -0.5]), torch.ones(2, dtype=torch.bool))
    engine.train()
    ref.transformer.train()
    value, _ = loss(engine, batch, 0)
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(group_loss(value, dist))  # as the trainer's micro-step
    value_ref, _ = ref_loss(ref.transformer, batch, 0)
    value_ref.backward()
    out["loss"] = float((value - value_ref).abs())
    worst, scale, unused = 0.0, 0.0, []
    for (name, p), (name_ref, p_ref) in zip(lora, ref_lora):
        assert name == name_ref, (name, name_ref)
        g = safe_get_full_grad(p)
        if p_ref.grad is None:  # a layer the loss does not reach (the last block's text stream)
            unused.append(name)
            worst = max(worst, float(g.abs().max()) if g is not None else 0.0)
            continue
        worst = max(worst, float((g - p_ref.grad).abs().max()))
        scale = max(scale, float(p_ref.grad.abs().max()))
    out |= {"grad": worst, "grad_scale": scale, "lora_tensors": len(lora), "unused": unused,
            "tokens": {"sharded": sharded_tokens, "full": full_tokens,
                       "preflight": image_tokens(policy_class(cfg.model.family), h, w) * frames}}
    return out


def main(out_dir: Path) -> None:
    from paco_ds.runtime.distributed import setup_distributed
    from paco_ds.runtime.sequence import grouped, sequence_mesh

    dist = grouped(setup_distributed(), 2)
    mesh = sequence_mesh(dist)
    result = {"rank": dist.rank, "families": {f: compare(f, r, dist, mesh) for f, r in FAMILIES.items()}}
    (out_dir / f"sequence_rank{dist.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]))
