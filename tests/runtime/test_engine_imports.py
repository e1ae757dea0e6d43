"""paco_ds.runtime.engine keeps DeepSpeed's Muon modules (and with them torch.compile's Inductor, 2.2 s of
every rank's start-up) out of a run: a ZeRO-2 and a ZeRO-3 engine each take optimizer steps with AdamW in
a fresh process, and Inductor is never imported."""
import json
import subprocess
import sys

import pytest

from tests.distributed_runs import REPO, cpu_env, free_port

pytestmark = pytest.mark.fast

PROBE = """
import json, sys, torch
from paco_ds.runtime.distributed import setup_distributed
from paco_ds.runtime.engine import create_engine
setup_distributed()
moved = {}
for stage in (2, 3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    before = [p.detach().clone() for p in model.parameters()]
    conf = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}}
    engine = create_engine(model, model.parameters(), conf, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    with GatheredParameters(list(engine.module.parameters())):
        moved[stage] = any(not torch.equal(a, b) for a, b in zip(engine.module.parameters(), before))
print(json.dumps({"moved": moved, "inductor": "torch._inductor.compile_fx" in sys.modules,
                  "muon": sys.modules["deepspeed.runtime.zero.muon.original_muon"].__doc__}))
"""


def test_zero_2_and_3_engines_step_without_importing_muon_or_inductor():
    env = cpu_env() | {"MASTER_PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["moved"] == {"2": True, "3": True}, got  # AdamW stepped under both stages
    assert got["inductor"] is False, got
    assert "stand-in" in got["muon"], got
