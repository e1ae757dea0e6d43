"""The policy losses, selected by `train.loss`: one file each, its recipe section (`train.<name>`)
declared beside it.

- `ppo`  paco_ds/grpo/losses/ppo.py  PPO-clip on SDE log-probs (PaCo-GRPO, Flow-GRPO; GRPO-Guard)
- `nft`  paco_ds/grpo/losses/nft.py  DiffusionNFT (arXiv 2509.16117)
- `awm`  paco_ds/grpo/losses/awm.py  Advantage Weighted Matching (arXiv 2509.25050)
- `dpo`  paco_ds/grpo/losses/dpo.py  online Diffusion-DPO on each group's best and worst (arXiv 2311.12908)
- `dgpo` paco_ds/grpo/losses/dgpo.py Direct Group Preference Optimization (arXiv 2510.08425)

A loss outside paco_ds is given as "module:Class" (a subclass of base.Loss); its `section`, if it
declares one, is its recipe keys under train.<its name>, checked like a built-in loss's.
"""
from __future__ import annotations

from paco_ds.errors import ConfigError
from paco_ds.recipe.loader import resolve

# train.loss -> "module:Class", imported when needed (the schema, the trainer), so that naming a
# loss costs nothing until it is used.
LOSSES: dict[str, str] = {
    "ppo": "paco_ds.grpo.losses.ppo:PPOClip",
    "nft": "paco_ds.grpo.losses.nft:NFT",
    "awm": "paco_ds.grpo.losses.awm:AWM",
    "dpo": "paco_ds.grpo.losses.dpo:DPO",
    "dgpo": "paco_ds.grpo.losses.dgpo:DGPO",
}
DEFAULT_LOSS = "ppo"


def loss_class(name: str):
    """The Loss class of `train.loss`: a name of LOSSES or "module:Class" (a loss outside paco_ds)."""
    return resolve(name, LOSSES, "train.loss", "loss")


def loss_sections(loss: str) -> tuple[tuple[str, str, type], ...]:
    """(train.loss value, section name, section class) of every built-in loss that declares a
    section and, when `loss` is an import path, of that loss: what the recipe schema composes."""
    out = []
    for value in list(LOSSES) + ([loss] if ":" in loss else []):
        cls = loss_class(value)
        section = getattr(cls, "section", None)
        if section is None:
            continue
        name = getattr(cls, "name", "")
        # a subclass of a built-in loss may share its section; another section needs a name of its own
        taken = value not in LOSSES and name in LOSSES and loss_class(name).section is not section
        from paco_ds.recipe.schema import TrainConfig  # a section named like a train key would replace that key

        if not name.isidentifier() or taken or (name in TrainConfig.model_fields and name not in LOSSES):
            raise ConfigError(f"config key 'train.loss': {value} declares a recipe section, keyed by its `name` "
                              f"(train.<name>), but its name {name!r} is not an identifier of its own")
        out.append((value, name, section))
    return tuple(out)


def build_loss(cfg, policy):
    return loss_class(cfg.train.loss)(cfg, policy)
