"""Run the GRPO trainer as launch/train.py does, then record what the tests check.

Each rank writes probe_rank<r>.json into the run directory: the ZeRO partition report of the
transformer (taken right after the engine is built) and a digest of its gathered LoRA weights
after training.
"""
import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from paco_ds.errors import exit_on_user_error, run_entry_point  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--resume", default=None)
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    with exit_on_user_error("probe"):
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        from paco_ds.grpo.plan import load_config
        from paco_ds.runtime.distributed import setup_distributed
        from paco_ds.runtime.engine import partition_report, zero_stage
        from paco_ds.grpo.trainer import GRPOTrainer
        from paco_ds.serving.manager import started_for_run

        cfg = load_config(args.config, args.overrides)
        dist = setup_distributed()
        with started_for_run(cfg.reward_servers, cfg.run_dir, dist.local_rank):
            trainer = GRPOTrainer(cfg, dist)
            partition = partition_report(trainer.policy.transformer)
            try:
                trainer.fit(args.resume)
                with GatheredParameters(trainer.trainable, enabled=zero_stage(trainer.ds_config) == 3):
                    h = hashlib.sha256()
                    for t in trainer.trainable:
                        h.update(t.detach().cpu().contiguous().numpy().tobytes())
                    digest = h.hexdigest()
                    lora_numel = sum(t.numel() for t in trainer.trainable)
            finally:
                trainer.close()
        out = cfg.run_dir / f"probe_rank{dist.rank}.json"
        out.write_text(json.dumps({"rank": dist.rank, "world_size": dist.world_size, "partition": partition,
                                   "lora_digest": digest, "lora_numel": lora_numel}))


if __name__ == "__main__":
    run_entry_point(main)  # exits without interpreter teardown (paco_ds/errors.py)
