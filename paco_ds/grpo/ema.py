"""EMA of the trainable (LoRA) parameters, stepped once per optimizer step.

The reference stepped its EMA after every micro-batch, so with large accumulation it became a periodic
snapshot (PaCo-RL/PaCo-GRPO/scripts/train_flux.py, its epoch loop). Here `step(global_step)` is called
only after an optimizer step; every `update_interval` optimizer steps, ema <- d*ema + (1-d)*theta
with d = min((1+s)/(10+s), decay). Under ZeRO-3 the EMA holds this rank's shard only (`ds_tensor`),
in fp32, so it costs 1/world of the adapter's memory.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _local(p: torch.nn.Parameter) -> torch.Tensor:
    return p.ds_tensor if hasattr(p, "ds_tensor") else p.data


class ShadowWeights:
    """fp32 copies of this rank's shards of the trainable parameters, blended in place and swapped
    into the parameters for a while (the EMA for eval and export; DiffusionNFT's old policy)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = list(params)
        self.shadow = [_local(p).detach().float().clone() for p in self.params]

    @torch.no_grad()
    def blend(self, decay: float) -> None:
        """shadow <- decay * shadow + (1 - decay) * theta."""
        for s, p in zip(self.shadow, self.params):
            s.mul_(decay).add_(_local(p).float(), alpha=1 - decay)

    @torch.no_grad()
    def load_copies(self, saved: list[torch.Tensor], what: str) -> None:
        """Restore the shadow from a checkpoint's copies (this rank's shards, in parameter order)."""
        if len(saved) != len(self.shadow):
            raise ValueError(f"{what} in the checkpoint does not match the trainable parameters "
                             f"({len(saved)} tensors, {len(self.shadow)} here)")
        for s, t in zip(self.shadow, saved):
            s.copy_(t)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Temporarily load the shadow weights into the parameters."""
        with torch.no_grad():
            backup = [_local(p).detach().clone() for p in self.params]
            for s, p in zip(self.shadow, self.params):
                _local(p).copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for b, p in zip(backup, self.params):
                    _local(p).copy_(b)


class EMA(ShadowWeights):
    def __init__(self, params: list[torch.nn.Parameter], decay: float = 0.9, update_interval: int = 8):
        super().__init__(params)
        self.decay, self.interval = decay, update_interval
        self.num_updates = 0

    def decay_at(self, step: int) -> float:
        return min((1 + step) / (10 + step), self.decay)

    def step(self, global_step: int) -> bool:
        """Call after optimizer step number `global_step` (1-based); returns True if it updated."""
        if global_step % self.interval:
            return False
        self.blend(self.decay_at(global_step))
        self.num_updates += 1
        return True

    def state_dict(self) -> dict:
        return {"shadow": [s.cpu() for s in self.shadow], "num_updates": self.num_updates}

    def load_state_dict(self, state: dict) -> None:
        self.load_copies(state["shadow"], "the EMA")
        self.num_updates = state["num_updates"]
