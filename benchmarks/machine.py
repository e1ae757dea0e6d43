"""Who ran a benchmark: recorded next to every result so numbers are never quoted without it."""
from __future__ import annotations

import os
import platform
import sys


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "load_avg_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    return info


def command_line() -> str:
    return " ".join([os.path.basename(sys.executable), "-m", *sys.argv]) if sys.argv else ""
