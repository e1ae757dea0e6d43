"""A policy small enough to follow by hand, for the flow-matching losses' unit tests (AWM, DPO):
the velocity is w * x_t, and the reference (the adapter disabled) is w = `base`."""
import contextlib
from types import SimpleNamespace

import torch


class LinearVelocity(torch.nn.Module):
    """v = w * x_t; counts its forwards."""

    def __init__(self, w: float, base: float | None = None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w))
        self.base = base
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        return self.w * x


class StubPolicy:
    """The policy interface the losses use; `seen` records each velocity call's (x_t, sigma)."""

    device = torch.device("cpu")

    def __init__(self):
        self.seen = []

    def sigmas(self, n, h, w):
        return torch.linspace(1.0, 0.0, n + 1)

    def velocity(self, module, x_t, sigma, embeds, h, w, guidance, condition=None):
        assert len(embeds) == x_t.shape[0]
        self.seen.append((x_t.detach().clone(), sigma.clone()))
        return module(x_t)

    @contextlib.contextmanager
    def adapter_disabled(self, module):
        """The base weights, when the module has them (the reference); else unchanged."""
        if module.base is None:
            yield
            return
        w = module.w.data.clone()
        module.w.data.fill_(module.base)
        try:
            yield
        finally:
            module.w.data.copy_(w)


class StubBatch(SimpleNamespace):
    def __len__(self):
        return len(self.positions)
