"""Load a FLUX folder both ways on every rank, as the trainer would, and record what the test checks.

Run under the deepspeed launcher (2 ranks, ZeRO-3, gloo). Per rank it writes zero3_rank<r>.json
into --out: whether the partitioned load gathers to exactly the naive weights, the partition sizes,
whether the RNG was left alone, and whether the LoRA'd engines (naive vs partitioned load) give
bitwise equal forwards.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def lora_cfg():
    from paco_ds.recipe.schema import LoraConfig

    return LoraConfig(rank=4, alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_out", "ff.net.2"])


def lora_engine(policy, ds_config, lora_seed: int):
    """What the trainer does after loading: LoRA (seeded), then deepspeed.initialize; then the
    LoRA B matrices get the same non-zero values everywhere so the adapter shows in the output."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    from paco_ds.runtime.engine import create_engine
    from paco_ds.models.lora import add_lora

    torch.manual_seed(lora_seed)
    add_lora(policy.transformer, lora_cfg())
    named = [(n, p) for n, p in policy.transformer.named_parameters() if p.requires_grad]
    engine = create_engine(policy.transformer, [p for _, p in named], ds_config, lr=1e-4, betas=(0.9, 0.999),
                           eps=1e-8, weight_decay=0.0)
    gen = torch.Generator().manual_seed(lora_seed + 1)
    for name, p in named:
        if "lora_B" in name:
            with GatheredParameters([p], modifier_rank=0), torch.no_grad():
                p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return engine, named


def start_probe():
    """(args, dist, ds_config): --folder and --out, the process group, and the ZeRO-3 engine config
    the trainer would build, with every parameter partitioned (no persistence threshold)."""
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()

    from paco_ds.runtime.distributed import setup_distributed
    from paco_ds.runtime.engine import build_ds_config, load_ds_config

    dist = setup_distributed()
    repo = Path(__file__).resolve().parents[2]
    ds_config = build_ds_config(load_ds_config(repo / "configs" / "deepspeed" / "zero3.json"), micro_batch=1,
                                grad_accum=1, world_size=dist.world_size, grad_clip=1.0, bf16=False,
                                overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    return args, dist, ds_config


def main():
    args, dist, ds_config = start_probe()

    import torch
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    from paco_ds.recipe.schema import ModelConfig
    from paco_ds.runtime.distributed import shutdown_distributed
    from paco_ds.runtime.engine import partition_report
    from paco_ds.models.base import TextEmbeds
    from paco_ds.models.flux import FluxPolicy

    report: dict = {"rank": dist.rank, "world_size": dist.world_size}

    # Weights, in fp32 (the CPU dtype: a cast from the bf16 checkpoint) and in bf16 (the GPU one).
    for dtype in ("fp32", "bf16"):
        cfg = ModelConfig(path=args.folder, dtype=dtype)
        naive = FluxPolicy.load(cfg, dist.device)
        rng = torch.random.get_rng_state()
        part = FluxPolicy.load(cfg, dist.device, ds_config=ds_config)
        report[f"{dtype}_rng_untouched"] = bool(torch.equal(rng, torch.random.get_rng_state()))
        ref = naive.transformer.state_dict()
        rows = partition_report(part.transformer)
        report[f"{dtype}_partitioned"] = all(hasattr(q, "ds_id") for q in part.transformer.parameters())
        report[f"{dtype}_full"] = sum(r["full"] for r in rows)
        report[f"{dtype}_local"] = sum(r["local"] for r in rows)
        report[f"{dtype}_naive_numel"] = sum(t.numel() for t in ref.values())
        unequal = []
        for name, q in part.transformer.named_parameters():
            with GatheredParameters([q]):
                if not (q.dtype == ref[name].dtype and torch.equal(q.data, ref[name])):
                    unequal.append(name)
        report[f"{dtype}_unequal"] = unequal
        report[f"{dtype}_names_match"] = sorted(ref) == sorted(part.transformer.state_dict())
        report[f"{dtype}_eval"] = not part.transformer.training and not naive.transformer.training
        del naive, part, ref

    # The trainer's next steps on both loads: LoRA with the same seed, the engine, one forward.
    cfg = ModelConfig(path=args.folder, dtype="fp32")
    gen = torch.Generator().manual_seed(7)
    outs, loras = {}, {}
    for mode, conf in (("naive", None), ("partitioned", ds_config)):
        policy = FluxPolicy.load(cfg, dist.device, ds_config=conf)
        engine, named = lora_engine(policy, ds_config, lora_seed=3)
        with GatheredParameters([p for _, p in named]):
            loras[mode] = {n: p.detach().clone() for n, p in named}
        gen.manual_seed(7)
        latents = policy.initial_latents(2, 32, 32, [torch.Generator().manual_seed(i) for i in range(2)])
        embeds = TextEmbeds(torch.randn(2, 8, 32, generator=gen), torch.randn(2, 32, generator=gen))
        with torch.no_grad():
            outs[mode] = policy.velocity(engine, latents, torch.tensor([0.7, 0.3]), embeds, 32, 32, 3.5)
        report[f"{mode}_engine_local"] = sum(r["local"] for r in partition_report(policy.transformer))
        del engine, policy
    report["lora_names_match"] = sorted(loras["naive"]) == sorted(loras["partitioned"])
    report["lora_equal"] = report["lora_names_match"] and all(
        torch.equal(loras["naive"][n], loras["partitioned"][n]) for n in loras["naive"])
    report["lora_numel"] = sum(t.numel() for t in loras["naive"].values())
    report["forward_equal"] = bool(torch.equal(outs["naive"], outs["partitioned"]))
    report["forward_abs_mean"] = float(outs["naive"].abs().mean())
    report["forward_shape"] = list(outs["naive"].shape)
    Path(args.out, f"zero3_rank{dist.rank}.json").write_text(json.dumps(report, indent=1))
    shutdown_distributed()


if __name__ == "__main__":
    main()
