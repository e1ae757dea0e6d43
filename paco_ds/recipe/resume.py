"""What a checkpoint records of its recipe, and what a resume may change (GRPO and reward SFT).

A checkpoint's meta.json holds the values of the recipe keys that matter to a resume. On resume they
are compared with the new recipe before anything loads: a key that would make the resumed run
inconsistent (the tensors' shapes, the loss, the model, the rewards) is one line naming it, exit 2,
unless the user allows that change on purpose (`--allow-changed KEY`); any other change of a recorded
key (epochs, learning rate, evaluation frequency, ...) is allowed and printed once, so a resumed run
is never silently another run.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from paco_ds.errors import ConfigError


def recorded(data: dict, keys: Sequence[str]) -> dict[str, Any]:
    """{dotted key: value} of `data` (a recipe's model_dump(mode='json')) for each of `keys`; a key
    whose section is absent records None."""
    out = {}
    for key in keys:
        node: Any = data
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out[key] = node
    return out


def saved_recipe(path: Path) -> dict[str, Any]:
    """The recorded values of the checkpoint at `path` ({} when it records none)."""
    try:
        return json.loads((Path(path) / "meta.json").read_text()).get("recipe") or {}
    except (OSError, ValueError):
        return {}


def compare(saved: dict, now: dict, must_match: Sequence[str], path: Path, allowed: Sequence[str] = (),
            allow_flag: bool = False) -> str:
    """Raise a ConfigError naming the first key of `must_match` whose value differs (and is not in
    `allowed`); return the other recorded keys that differ as 'key old -> new, ...' ('' if none).
    `allow_flag`: the entry point has --allow-changed (its error says so)."""
    unknown = sorted(set(allowed) - set(now))
    if unknown:
        raise ConfigError(f"--allow-changed {unknown[0]}: not a key a checkpoint records "
                          f"(they are: {', '.join(sorted(now))})")
    for key in must_match:
        if key in saved and saved[key] != now.get(key) and key not in allowed:
            raise ConfigError(f"config key '{key}': --resume {path} was trained with {saved[key]!r}, this recipe "
                              f"gives {now.get(key)!r}; a checkpoint resumes only with the same {key}"
                              + (f" (--allow-changed {key} to resume anyway)" if allow_flag else ""))
    return ", ".join(f"{k} {saved[k]!r} -> {now.get(k)!r}" for k in now
                     if k in saved and saved[k] != now.get(k) and (k not in must_match or k in allowed))
