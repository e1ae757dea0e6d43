"""Load an SD3 folder plainly and partitioned under ZeRO-3 on every rank, as the trainer would, and
record what tests/models/test_sd3.py checks: the partitioned transformer gathers to exactly the plain
weights, each rank holds about half of them, and the guided velocity through the LoRA'd engines
(plain vs partitioned load) is bitwise the same.

Run under the deepspeed launcher (2 ranks, gloo); writes sd3_zero3_rank<r>.json into --out.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    from zero3_load_probe import start_probe  # the same start-up as the FLUX probe (this folder)

    args, dist, ds_config = start_probe()

    import torch
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    from paco_ds.recipe.schema import LoraConfig, ModelConfig
    from paco_ds.runtime.distributed import shutdown_distributed
    from paco_ds.runtime.engine import create_engine, partition_report
    from paco_ds.models import with_family_defaults
    from paco_ds.models.lora import add_lora
    from paco_ds.models.sd3 import SD3Policy

    cfg = with_family_defaults(ModelConfig(family="sd3", path=args.folder, dtype="fp32", max_sequence_length=32,
                                           lora=LoraConfig(rank=4, alpha=8)))
    report: dict = {"rank": dist.rank, "world_size": dist.world_size}
    outs = {}
    for mode, conf in (("naive", None), ("partitioned", ds_config)):
        policy = SD3Policy.load(cfg, dist.device, ds_config=conf)
        if mode == "partitioned":
            ref = SD3Policy.load(cfg, dist.device).transformer.state_dict()
            rows = partition_report(policy.transformer)
            report["partitioned"] = all(hasattr(q, "ds_id") for q in policy.transformer.parameters())
            report["full"], report["local"] = sum(r["full"] for r in rows), sum(r["local"] for r in rows)
            unequal = []
            for name, q in policy.transformer.named_parameters():
                with GatheredParameters([q]):
                    if not torch.equal(q.data, ref[name]):
                        unequal.append(name)
            report["unequal"] = unequal
        torch.manual_seed(3)
        add_lora(policy.transformer, cfg.lora)
        named = [(n, q) for n, q in policy.transformer.named_parameters() if q.requires_grad]
        engine = create_engine(policy.transformer, [q for _, q in named], ds_config, lr=1e-4, betas=(0.9, 0.999),
                               eps=1e-8, weight_decay=0.0)
        gen = torch.Generator().manual_seed(4)
        for name, q in named:
            if "lora_B" in name:
                with GatheredParameters([q], modifier_rank=0), torch.no_grad():
                    q.data.copy_(torch.randn(q.shape, generator=gen) * 0.1)
        latents = policy.initial_latents(2, 64, 64, [torch.Generator().manual_seed(i) for i in range(2)])
        embeds = policy.encode_prompts(["a red cube", 'a sign that says "hi"'])
        with torch.no_grad():
            outs[mode] = policy.velocity(engine, latents, torch.tensor([0.7, 0.3]), embeds, 64, 64, 4.5)
        del engine, policy
    report["forward_equal"] = bool(torch.equal(outs["naive"], outs["partitioned"]))
    report["forward_abs_mean"] = float(outs["naive"].abs().mean())
    Path(args.out, f"sd3_zero3_rank{dist.rank}.json").write_text(json.dumps(report, indent=1))
    shutdown_distributed()


if __name__ == "__main__":
    main()
