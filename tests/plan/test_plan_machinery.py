"""The GPU plan's machinery, fast: fake CUDA tensors, their device checks and memory count, the
full-size FLUX.1-dev and SD3.5-Medium parts built from the repo's configs, and the CLI's input checks.
The full-size plans of the paper recipes (minutes each) are tests/plan/ (make test-plan)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO, TINY, one_line_error, run_cli

pytestmark = pytest.mark.fast


@pytest.fixture
def mode():
    from paco_ds.gpu_plan.fake import FakeCuda

    return FakeCuda()


def test_flux_dev_transformer_counts_its_parameters():
    from paco_ds.models.flux import FluxPolicy
    from paco_ds.models.full_size import count

    t = FluxPolicy.full_size.transformer()
    assert count(t) == 11_901_408_320
    assert next(t.parameters()).device.type == "meta"  # nothing materialised


def test_device_tensors_are_fake_and_host_tensors_real(mode):
    from torch._subclasses.fake_tensor import FakeTensor

    with mode:
        host = torch.arange(4.0) * 2
        dev = host.to("cuda")
    assert not isinstance(host, FakeTensor) and host.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert isinstance(dev, FakeTensor) and dev.device.type == "cuda"


def test_host_device_mix_raises_as_on_a_gpu(mode):
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    with mode:
        dev = torch.zeros(8, 4, device="cuda")
        assert (dev + torch.tensor(1.0)).device.type == "cuda"  # a 0-dim host scalar is allowed on GPUs too
        with pytest.raises(FakeTensorDeviceMismatchError):
            dev + torch.ones(8, 4)


def test_small_device_values_read_back_and_large_ones_are_nan(mode):
    with mode:
        mask = torch.tensor([1, 1, 0, 1], device="cuda").bool()
        assert int(mask.sum()) == 3
        picked = torch.zeros(4, 2, device="cuda")[mask]  # boolean-mask indexing: data-dependent shape
        assert tuple(picked.shape) == (3, 2)
        big = torch.zeros(1 << 17, device="cuda")
        assert float(big.sum()) != float(big.sum())  # NaN: no host copy of a large tensor
    assert mode.ignored == 2


def test_memory_peak_and_tags(mode):
    with mode, mode.measure("phase") as phase:
        a = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        with mode.tagged("other"):
            b = torch.empty(1 << 19, dtype=torch.uint8, device="cuda")
        del a, b
        c = torch.empty(1 << 18, dtype=torch.uint8, device="cuda")
    assert phase.peak == (1 << 20) + (1 << 19)
    assert phase.at_peak == {"activations": 1 << 20, "other": 1 << 19}
    assert mode.total == c.untyped_storage().nbytes() == 1 << 18


def test_a_module_moved_to_another_fake_device_keeps_its_tags(mode):
    """The training pass moves the transformer onto fake meta tensors: its weights stay "transformer"
    and its adapter "lora", never training's activations."""
    from paco_ds.gpu_plan.fake import move_fake, to_fake_cuda

    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8, bias=False))
    module[1].weight.requires_grad_(False)
    to_fake_cuda(mode, module, torch.bfloat16)
    mode.track_module(module[1], "transformer")
    with mode.tagged("lora"):
        [mode._track(p) for p in module[0].parameters()]  # (no name left holding a weight the move replaces)
    before = {k: v for k, v in mode.live.items() if v}
    with mode:
        move_fake(mode, module, torch.device("meta"))
    assert {k: v for k, v in mode.live.items() if v} == before == {"lora": (64 * 64 + 64) * 2, "transformer": 64 * 8 * 2}
    assert all(p.device.type == "meta" for p in module.parameters())


def test_sde_step_with_a_host_tensor_in_its_inputs_is_caught(mode):
    import kernels
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    with mode:
        x = torch.zeros(1, 1024, 64, device="cuda", dtype=torch.bfloat16)
        v = torch.zeros_like(x)
        step = kernels.sde_step(x, v, 0.94, 0.88, 0.7, 0.94, noise=torch.zeros(1, 1024, 64, device="cuda"),
                                backend="torch")
        assert step.log_prob.device.type == "cuda" and step.log_prob.shape == (1,)
        with pytest.raises(FakeTensorDeviceMismatchError):
            kernels.sde_step(x, v, 0.94, 0.88, 0.7, 0.94, noise=torch.zeros(1, 1024, 64), backend="torch")


def test_gpu_memory_needs_dry_run():
    proc = run_cli("launch/train.py", "--config", str(TINY), "--gpu-memory", "80")
    assert "--gpu-memory plans a --dry-run only" in one_line_error(proc)


def test_gpu_memory_refuses_the_tiny_model():
    proc = run_cli("launch/train.py", "--config", str(TINY), "--dry-run", "--world-size", "2", "--gpu-memory", "80")
    assert "model.tiny" in one_line_error(proc)


def test_gpu_memory_names_a_family_it_cannot_plan(monkeypatch):
    """A family whose policy describes no full-size model: one line naming the key, not a traceback."""
    import paco_ds.gpu_plan as gp
    from paco_ds.errors import ConfigError
    from paco_ds.grpo.plan import load_config
    from paco_ds.models.sd3 import SD3Policy

    from paco_ds.models import POLICIES

    monkeypatch.setattr(SD3Policy, "full_size", None)
    cfg = load_config(REPO / "configs" / "sd3_pickscore.yaml", [])
    planned = ", ".join(name for name in POLICIES if name != "sd3")  # every other family describes one
    with pytest.raises(ConfigError, match=rf"config key 'model.family'.*`full_size`: {planned}\); "
                       r"SD3Policy of 'sd3' has none"):
        gp.print_plan(cfg, 8, 80)


def test_every_family_and_local_reward_describes_its_full_size_model():
    """The plan asks the policy and each reward for its full-size model: every built-in family has
    one; rewards report their models on the device (none for remote judges and model-free ones)."""
    from paco_ds.models import POLICIES, policy_class
    from paco_ds.rewards.registry import REWARDS, reward_class

    assert all(policy_class(name).full_size is not None for name in POLICIES)
    device = torch.device("cuda", 0)
    local = {name for name in REWARDS if reward_class(name).full_size(device) is not None}
    assert local == {"subfig_clipT", "pickscore", "clip_i", "aesthetic", "imagereward"}
    assert not {name for name in REWARDS if reward_class(name).remote} & local


def test_the_verdict_names_the_largest_rollout_batch_that_fits():
    """Sampling and scoring activations grow with sample.batch_size, the rest of those phases does
    not: 80 GiB with 50 GiB fixed and 6 GiB of activations per sample at batch 2 leaves room for 10."""
    from paco_ds.gpu_plan.plan import GiB, GpuPlan, largest_rollout_batch, verdict

    def plan(batch, sampling_act, scoring_act):
        memory = {"sampling": {"base": 50 * GiB, "activations": sampling_act},
                  "scoring": {"base": 50 * GiB, "activations": scoring_act},
                  "training": {"base": 60 * GiB}}
        return GpuPlan("r", "flux", 8, 80, (512, 512), "bfloat16", False, {}, memory, {}, {}, {}, rollout_batch=batch)

    assert largest_rollout_batch(plan(2, 12 * GiB, 6 * GiB)) == 5  # sampling: 30 GiB / 6 GiB per sample
    assert largest_rollout_batch(plan(2, 2 * GiB, 6 * GiB)) == 10  # scoring now limits: 30 / 3
    text = verdict(plan(2, 2 * GiB, 6 * GiB))
    assert text.startswith("fits on 8 x 80 GiB") and "sample.batch_size: 10 is the largest that fits" in text
    assert "not one rollout sample fits" in verdict(plan(1, 31 * GiB, 1 * GiB))
    assert largest_rollout_batch(plan(2, 0, 0)) is None  # nothing counted: nothing to scale
    assert "no larger sample.batch_size is estimated" in verdict(plan(2, 0, 0))
