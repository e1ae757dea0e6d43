"""The figures users compare across trainers, per epoch: images per device-second and MFU.

MFU (model FLOPs utilisation) = counted model FLOPs per image x images per device-second / the
device's peak. The FLOPs are counted on the run's own code path, op by op, with the formulas of
`torch.utils.flop_counter` (`op_flops`, which the GPU plan's fake-CUDA pass uses too): one rollout
batch and one training micro-step of the first epoch are counted as they run, and an epoch's FLOPs
per image are the sampled batch's per image plus the micro-steps each image is trained in. The peak
is the card's dense bf16 peak on a GPU (the vendor's figure, `GPU_BF16_PEAK`) and, on a CPU, a
matmul measured at start-up in the run's own dtype and threads (`measured_matmul_peak`); the run logs
which with `device/peak_tflops` and says it once in its log.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets; matched on
# the start of torch.cuda.get_device_name() after "NVIDIA ".
GPU_BF16_PEAK = {
    "H200": 989.4e12, "H100 80GB HBM3": 989.4e12, "H100 SXM": 989.4e12, "H100 NVL": 835.0e12,
    "H100 PCIe": 756.0e12, "H100": 756.0e12, "GH200": 989.4e12, "B200": 2250e12, "A100": 312.0e12,
    "A800": 312.0e12, "L40S": 362.1e12, "L40": 181.0e12, "A40": 149.7e12, "A10": 125.0e12,
    "RTX 6000 Ada": 364.2e12, "GeForce RTX 4090": 165.2e12, "GeForce RTX 3090": 71.0e12,
}


def op_flops(func, args, kwargs, out) -> float:
    """Model FLOPs of one aten op (torch.utils.flop_counter's formula; 0 for ops without one)."""
    formula = flop_registry.get(func._overloadpacket)
    return float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0


class FlopCount(TorchDispatchMode):
    """Counts the model FLOPs of every op dispatched inside it (no module tracking, so nothing
    is kept alive: gradient checkpointing still frees what it frees)."""

    def __init__(self):
        super().__init__()
        self.flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.flops += op_flops(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def counting() -> Iterator[FlopCount]:
    """Count the FLOPs of the block; compiled regions run eager inside it (a compiled graph's kernels
    never reach a dispatch mode), which costs that one block the compiled speed."""
    mode = FlopCount()
    stance = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") \
        else contextlib.nullcontext()
    with stance, mode:
        yield mode


def measured_matmul_peak(dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` n x n matmuls on the CPU with this process's threads: the
    peak a CPU run's MFU is measured against (a data sheet does not know the threads a rank has)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up: the BLAS library's first call sets itself up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def device_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).removeprefix("NVIDIA ").strip()
        for key in sorted(GPU_BF16_PEAK, key=len, reverse=True):  # the most specific name first
            if name.startswith(key):
                return GPU_BF16_PEAK[key], f"{name}: dense bf16 data-sheet peak"
        return float("nan"), f"{name}: no bf16 peak known (GPU_BF16_PEAK), MFU not computed"
    peak = measured_matmul_peak(dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32)
    return peak, (f"CPU: measured {str(dtype).removeprefix('torch.')} 1024^3 matmul, "
                  f"{torch.get_num_threads()} thread(s)")


def epoch_figures(images: int, seconds: float, world_size: int, flops_per_image: float | None,
                  peak: float) -> dict[str, float]:
    """images/device-second and MFU of an epoch that trained `images` on `world_size` devices in
    `seconds`."""
    per_device = images / seconds / world_size
    out = {"throughput/images_per_device_sec": per_device}
    if flops_per_image and peak == peak and peak > 0:
        out["throughput/mfu"] = flops_per_image * per_device / peak
    return out

