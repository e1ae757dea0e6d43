"""Under the deepspeed launcher: a ZeRO-3 run stopped after k micro-steps of an optimizer step and
resumed in a fresh engine from what a mid-epoch checkpoint keeps (paco_ds/grpo/preemption.py: the
micro-step count and this rank's gradient partitions) ends the optimizer step with the parameters of
the run that was never stopped. Each rank writes accumulation_rank<r>.json: per k, the count saved
and whether the parameters are equal.
"""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ACCUMULATION = 4


def main(out_dir: Path) -> None:
    import torch

    from paco_ds.runtime.distributed import setup_distributed
    from paco_ds.runtime.engine import create_engine
    from paco_ds.grpo.epoch import EpochProgress
    from paco_ds.grpo.preemption import Preemption

    dist = setup_distributed()
    conf = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}

    def engine():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        eng = create_engine(model, model.parameters(), conf, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return eng, Preemption(None, eng, trainable, None, dict, dict, zero3=True, device=torch.device("cpu"),
                               run_dir=out_dir, is_main=dist.rank == 0)

    def micro_step(eng, i):
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(100 * i + dist.rank))
        eng.set_gradient_accumulation_boundary((i + 1) % ACCUMULATION == 0)  # as the trainer's micro-step
        eng.backward(eng(x).square().mean())
        eng.step()  # the optimizer steps at the boundary only

    def params(eng):
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters(list(eng.module.parameters())):
            return [p.detach().clone() for p in eng.module.parameters()]

    full, _ = engine()
    for i in range(ACCUMULATION):
        micro_step(full, i)
    expected = params(full)
    results = []
    for k in (1, 2, ACCUMULATION - 1):
        stopped, pre = engine()
        for i in range(k):
            micro_step(stopped, i)
        saved = EpochProgress(samples=None, metrics={}, done=k)
        saved.micro_step_id, saved.grads = pre._accumulation()
        resumed, pre2 = engine()  # a fresh process's engine, from the same weights
        pre2.loss = SimpleNamespace(load_epoch_state=lambda s: None)
        pre2.resume(saved)
        for i in range(k, ACCUMULATION):
            micro_step(resumed, i)
        got = params(resumed)
        results.append({"k": k, "saved_micro_steps": saved.micro_step_id,
                        "equal": all(torch.equal(a, b) for a, b in zip(got, expected)),
                        "max_diff": max(float((a - b).abs().max()) for a, b in zip(got, expected)),
                        "moved": any(not torch.equal(a, b) for a, b in zip(got, params(stopped)))})
    (out_dir / f"accumulation_rank{dist.rank}.json").write_text(json.dumps(results))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]))
