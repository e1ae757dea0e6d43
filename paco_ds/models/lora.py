"""LoRA on the policy transformer (peft through diffusers), and export in diffusers' format.

Only the adapter is trained; the base stays frozen and is reached with the adapter disabled
(the KL reference). `export_lora` writes `pytorch_lora_weights.safetensors`, the file that
`FluxPipeline.load_lora_weights(dir)` reads.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from paco_ds.recipe.schema import LoraConfig
from paco_ds.errors import ConfigError
from paco_ds.recipe.loader import suggest

ADAPTER = "default"


LORA_FILE = "pytorch_lora_weights.safetensors"


def check_lora_file(path: str | Path, key: str) -> Path:
    """The adapter file at `path` (a directory holding LORA_FILE, or the file), read through before
    any model is built: a truncated, foreign or empty file is one line naming `key` and the file,
    not a SafetensorError after the judge and the transformer are up. Every lora_A needs its lora_B
    of the same rank, and no tensor may be non-finite (a diverged export would evaluate as noise)."""
    from safetensors import SafetensorError, safe_open

    p = Path(path).expanduser()
    file = p / LORA_FILE if p.is_dir() else p
    if not file.is_file():
        raise ConfigError(f"{key} {path}: no {LORA_FILE} there")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise ConfigError(f"{key} {file}: not a readable safetensors file ({err})") from None
    down = {k[: -len("lora_A.weight")]: v for k, v in tensors.items() if k.endswith("lora_A.weight")}
    up = {k[: -len("lora_B.weight")]: v for k, v in tensors.items() if k.endswith("lora_B.weight")}
    if not down:
        raise ConfigError(f"{key} {file}: holds no LoRA weights (no '*.lora_A.weight' among its "
                          f"{len(tensors)} tensors)")
    for stem in sorted(set(down) ^ set(up)):
        raise ConfigError(f"{key} {file}: '{stem}' has only one of lora_A/lora_B")
    for stem, a in down.items():
        b = up[stem]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ConfigError(f"{key} {file}: '{stem}' lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                              "share a rank")
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ConfigError(f"{key} {file}: tensor '{name}' has non-finite values")
    return file


def check_targets(targets: list[str], transformer: nn.Module) -> None:
    """Every configured target must match a module of `transformer`, by peft's rule (the name, or
    a suffix after a dot): one that matches nothing would silently leave those layers untrained
    (another family's module names, a typo)."""
    names = [name for name, _ in transformer.named_modules() if name]
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in names):
            suffixes = {".".join(n.split(".")[-k:]) for n in names for k in (1, 2, 3)}
            raise ConfigError(f"config key 'model.lora.target_modules': '{t}' matches no module of the "
                              f"{type(transformer).__name__}{suggest(t, suffixes)}")


def add_lora(transformer: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Freeze the base and attach a LoRA adapter (or load the one at `cfg.path`)."""
    transformer.requires_grad_(False)
    if cfg.path:  # a directory with pytorch_lora_weights.safetensors, or the file itself
        path = Path(cfg.path)
        where = {"weight_name": path.name} if path.is_file() else {"use_safetensors": True}
        transformer.load_lora_adapter(str(path.parent if path.is_file() else path), adapter_name=ADAPTER,
                                      prefix="transformer", **where)
        for name, p in transformer.named_parameters():
            if "lora_" in name:
                p.requires_grad_(True)
        return transformer
    if cfg.target_modules is None:
        raise ValueError("model.lora.target_modules is unset: fill in the family's own first "
                         "(paco_ds.models.with_family_defaults)")
    check_targets(cfg.target_modules, transformer)
    transformer.add_adapter(peft_config(cfg), adapter_name=ADAPTER)
    return transformer


def lora_state_dict(transformer: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter weights in diffusers' naming (no 'transformer.' prefix, no adapter name)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(transformer, adapter_name=ADAPTER).items()}


def peft_config(cfg: LoraConfig, trained: list[str] | None = None):
    """The adapter's peft `LoraConfig`: what `add_lora` attaches, and what an export from a
    checkpoint (no model built) writes, so that both exports carry the same config. `trained`: the
    adapter's weight names, to keep only the targets that were adapted."""
    from peft import LoraConfig as PeftLoraConfig

    targets = sorted(cfg.target_modules)
    if trained is not None:
        present = {n.split(".lora_")[0] for n in trained}
        targets = [t for t in targets if any(p == t or p.endswith("." + t) for p in present)]
    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          init_lora_weights=True if cfg.init == "default" else cfg.init, target_modules=targets)


def adapter_config(transformer: nn.Module):
    """The peft config of the adapter `add_lora` attached (rank, alpha, targets)."""
    return transformer.peft_config[ADAPTER]


def config_dict(config) -> dict:
    """A peft config as JSON-ready data (its sets sorted), as diffusers stores it in the weights file."""
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.to_dict().items()}


def export_family_lora(policy_cls, state_dict: dict[str, torch.Tensor], out_dir: str | Path, config) -> Path:
    """`export_lora` of a family's adapter into the files its pipeline reads (`Policy.lora_files`: one,
    or a second transformer's beside it in its own folder). Returns the first file's path."""
    files = policy_cls.lora_files(state_dict)
    paths = [export_lora(sd, Path(out_dir) / folder, config) for folder, sd in files.items()]
    return paths[0]


def export_lora(state_dict: dict[str, torch.Tensor], out_dir: str | Path, config) -> Path:
    """Write an adapter that the family's diffusers pipeline loads (`load_lora_weights(out_dir)`),
    its peft `config` stored in the weights file (so a loader restores the alpha/r scale instead of
    assuming alpha = r) and as peft's own adapter_config.json beside it."""
    from diffusers import FluxPipeline

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    FluxPipeline.save_lora_weights(out_dir, transformer_lora_layers=state_dict, safe_serialization=True,
                                   transformer_lora_adapter_metadata=config_dict(config))
    config.save_pretrained(out_dir)
    return out_dir / LORA_FILE
