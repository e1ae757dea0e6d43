"""The figures of paco_ds/runtime/throughput.py: FLOPs counted op by op as torch's flop counter counts
them, a measured CPU peak, and the epoch figures computed from them."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from paco_ds.runtime.throughput import GPU_BF16_PEAK, counting, device_peak, epoch_figures, measured_matmul_peak

pytestmark = pytest.mark.fast


def test_counted_flops_equal_torchs_flop_counter_forward_and_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    x = torch.randn(16, 64, requires_grad=True)
    with counting() as ours:
        model(x).square().mean().backward()
    with FlopCounterMode(display=False) as theirs:
        model(x).square().mean().backward()
    assert ours.flops == theirs.get_total_flops() > 3 * 2 * 16 * (64 * 128 + 128 * 32) * 0.99  # fwd + 2x bwd


def test_compiled_code_is_counted_eager_inside_the_block():
    fn = torch.compile(lambda a, b: a @ b, backend="eager")
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with counting() as count:
        fn(a, b)
    assert count.flops == 2 * 8 * 16 * 4


def test_the_cpu_peak_is_measured_and_the_epoch_figures_follow_from_it():
    peak, source = device_peak(torch.device("cpu"), torch.float32)
    assert 1e9 < peak < 1e14 and "measured" in source and "thread" in source
    assert measured_matmul_peak(n=256, repeats=2) > 0
    fig = epoch_figures(images=16, seconds=4.0, world_size=2, flops_per_image=1e9, peak=2e9)
    assert fig == {"throughput/images_per_device_sec": 2.0, "throughput/mfu": 1.0}
    assert "throughput/mfu" not in epoch_figures(16, 4.0, 2, None, 2e9)  # FLOPs not counted yet
    assert GPU_BF16_PEAK["H100 80GB HBM3"] == GPU_BF16_PEAK["H200"] == 989.4e12
