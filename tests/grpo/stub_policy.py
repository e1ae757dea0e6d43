"""A policy small enough to follow by hand, for the flow-matching losses' unit tests (AWM, DPO, DGPO):
the velocity is w * x_t, and the reference (the adapter disabled) is w = `base`."""
import contextlib
from types import SimpleNamespace

import torch

from paco_ds.models.base import TextEmbeds


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


def grouped_batch(adv, groups, x_final=None, keep=None) -> StubBatch:
    """A micro-batch of len(adv) samples of latent shape (4, 2) in prompt groups `groups`, at
    positions 10, 11, ...; x_final seeded (1) unless given; every sample kept unless `keep`."""
    n = len(adv)
    x = torch.randn(n, 4, 2, generator=torch.Generator().manual_seed(1)) if x_final is None else x_final
    return StubBatch(x_final=x, positions=[10 + i for i in range(n)], group_ids=list(groups), height=64, width=64,
                     embeds=TextEmbeds(torch.zeros(n, 1, 1)), condition=None, advantages=torch.tensor(adv),
                     keep=torch.ones(n, dtype=torch.bool) if keep is None else torch.tensor(keep))


def stub_loss(loss_cls, recipe: str, w: float = 0.3, base: float | None = None, *sets: str):
    """(loss, policy, module, cfg): `loss_cls` of `recipe` (with `sets`) on a StubPolicy and a
    LinearVelocity(w, base), set up and at the start of epoch 0."""
    from paco_ds.grpo.plan import load_config

    cfg = load_config(recipe, list(sets))
    policy, module = StubPolicy(), LinearVelocity(w, base)
    loss = loss_cls(cfg, policy)
    loss.setup([module.w])
    loss.begin_epoch(0)
    return loss, policy, module, cfg
