"""FLUX's resolution-shifted sigma schedule
(PaCo-RL/PaCo-GRPO/paco_grpo/diffusers_patch/flux_pipeline.py), as small math.

Raw sigmas linspace(1, 1/N, N) are shifted exponentially by mu, which grows linearly with the
number of packed image tokens L: sigma -> e^mu / (e^mu + 1/sigma - 1). A terminal 0 is appended.
The transformer is called with timestep = sigma (diffusers passes timestep/1000 = sigma).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShiftConfig:
    """FLUX.1's scheduler constants (scheduler/scheduler_config.json)."""

    base_seq_len: int = 256
    max_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15
    use_dynamic_shifting: bool = True
    shift: float = 3.0  # used only without dynamic shifting

    @classmethod
    def of_scheduler(cls, conf: dict, family: str, unsupported: tuple[str, ...] = ()) -> "ShiftConfig":
        """The shift of a FlowMatchEulerDiscreteScheduler config, with the class's own defaults where
        the config is silent (no dynamic shift, shift 1); a config asking for a schedule this module
        does not compute (karras/exponential/beta sigmas, a terminal stretch, a non-exponential time
        shift, or one of `unsupported`) is refused."""
        asks = [k for k in ("shift_terminal", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                            "invert_sigmas", *unsupported) if conf.get(k)]
        if asks or (conf.get("use_dynamic_shifting") and conf.get("time_shift_type", "exponential") != "exponential"):
            raise ValueError(f"unsupported {family} scheduler config {conf}: only a fixed shift or FLUX's exponential "
                             "dynamic shift (the pipeline's mu) is implemented")
        return cls.from_scheduler_config({"use_dynamic_shifting": False, "shift": 1.0} | dict(conf))

    @classmethod
    def from_scheduler_config(cls, conf: dict) -> "ShiftConfig":
        return cls(base_seq_len=conf.get("base_image_seq_len", 256), max_seq_len=conf.get("max_image_seq_len", 4096),
                   base_shift=conf.get("base_shift", 0.5), max_shift=conf.get("max_shift", 1.15),
                   use_dynamic_shifting=conf.get("use_dynamic_shifting", True), shift=conf.get("shift", 3.0))


def calculate_mu(image_seq_len: int, cfg: ShiftConfig = ShiftConfig()) -> float:
    m = (cfg.max_shift - cfg.base_shift) / (cfg.max_seq_len - cfg.base_seq_len)
    b = cfg.base_shift - m * cfg.base_seq_len
    return image_seq_len * m + b


def flux_sigmas(num_steps: int, image_seq_len: int, cfg: ShiftConfig = ShiftConfig()) -> torch.Tensor:
    """num_steps + 1 sigmas (float32), from 1 down to the terminal 0."""
    raw = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    if cfg.use_dynamic_shifting:
        e = math.exp(calculate_mu(image_seq_len, cfg))
        shifted = e / (e + (1.0 / raw - 1.0))
    else:
        shifted = cfg.shift * raw / (1 + (cfg.shift - 1) * raw)
    return torch.cat([shifted, torch.zeros(1, dtype=torch.float64)]).to(torch.float32)
