"""Under the deepspeed launcher: does `gathered_for_phase` keep ZeRO-3 parameters gathered?

Each rank writes pin_rank<r>.json into the given folder: the status of every parameter after each
forward of a phase (pinned, and for contrast with GatheredParameters alone), after the phase,
whether the phase's outputs match the engine's own (per-forward gathering) outputs, and how many
forward hooks the modules hold before, during (DeepSpeed's lifted) and after the phase.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(out_dir: Path) -> None:
    import torch
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    from paco_ds.runtime.distributed import setup_distributed
    from paco_ds.runtime.engine import create_engine, gathered_for_phase

    dist = setup_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 8))
    conf = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = create_engine(model, model.parameters(), conf, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                           weight_decay=0.0)
    params = list(model.parameters())
    status = lambda: [p.ds_status == ZeroParamStatus.AVAILABLE and p.numel() == p.ds_numel for p in params]  # noqa: E731
    hooks = lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())  # noqa: E731
    hooks_before = hooks()
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        engine.eval()
        expected = engine(x)  # the engine gathers and releases around this forward
        before = status()
        pinned, outputs = [], []
        with gathered_for_phase(model) as module:
            hooks_in_phase = hooks()
            for _ in range(3):  # three "denoising steps" of one phase
                outputs.append(module(x))
                pinned.append(status())
        after = status()
        hooks_after = hooks()
        unpinned = []
        with GatheredParameters(params):
            for _ in range(2):
                module(x)
                unpinned.append(status())
    result = {"rank": dist.rank, "partitioned": [p.ds_tensor.numel() < p.ds_numel for p in params],
              "before": before, "pinned": pinned, "after": after, "unpinned": unpinned,
              "outputs_match": all(torch.equal(o, expected) for o in outputs),
              "hooks": {"before": hooks_before, "in_phase": hooks_in_phase, "after": hooks_after,
                        "modules": len(list(model.modules()))}}
    (out_dir / f"pin_rank{dist.rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]))
