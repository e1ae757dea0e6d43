"""Reward names -> implementations, imported only when a reward is built.

Config validation checks names against this table without importing torch models; building a
reward imports its module and filters the configured keyword arguments against its constructor.
"""
from __future__ import annotations

import inspect
from typing import Any

from paco_ds.errors import ConfigError
from paco_ds.recipe.loader import resolve

REWARDS: dict[str, str] = {
    # local, in-process
    "jpeg_compressibility": "paco_ds.rewards.jpeg_compressibility:JpegCompressibility",
    "subfig_clipT": "paco_ds.rewards.subfig_clipT:SubfigClipT",
    "pickscore": "paco_ds.rewards.pickscore:PickScore",
    "clip_i": "paco_ds.rewards.clip_i:ClipI",  # editing: reference vs edit
    "ocr": "paco_ds.rewards.ocr:OcrReward",  # Flow-GRPO's rewards (docs/rewards.md)
    "aesthetic": "paco_ds.rewards.aesthetic:Aesthetic",
    "imagereward": "paco_ds.rewards.imagereward:ImageReward",
    # remote, through an OpenAI-compatible reward server
    "consistency_score": "paco_ds.rewards.consistency:ConsistencyScore",
    "consistency_for_editing": "paco_ds.rewards.consistency:ConsistencyForEditing",
    "frame_consistency": "paco_ds.rewards.frame_consistency:FrameConsistency",  # video: pairs of frames
    "edit_score": "paco_ds.rewards.edit_score:EditScore",
    "vlm_score": "paco_ds.rewards.vlm_score:VlmScore",  # Flow-GRPO's qwenvl, deqa, unifiedreward prompts
    "geneval": "paco_ds.rewards.geneval:GenEval",  # Flow-GRPO's reward-server protocol
}


def reward_class(name: str, where: str = "rewards"):
    """The class of reward `name`: a name of REWARDS or "module:Class" (a reward outside paco_ds);
    `where`: the config key of the reward set, for the one-line error."""
    return resolve(name, REWARDS, f"{where}.{name}", "reward")


_CONTEXT = ("device", "tiny", "run_dir", "reward_endpoints", "shared")  # passed by the runner, not the recipe


def check_reward_arguments(name: str, kwargs: dict[str, Any], where: str = "rewards",
                           context: tuple[str, ...] = _CONTEXT) -> tuple[Any, dict]:
    """Every recipe argument of reward `name` is one its constructor takes, else one line naming
    the key (run before the first step and by --dry-run). Returns (class, its parameters)."""
    cls = reward_class(name, where)
    params = inspect.signature(cls.__init__).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key in kwargs:
        if key not in params and not accepts_any:
            valid = [p for p in params if p not in ("self",) and p not in context]
            raise ConfigError(f"config key '{where}.{name}.{key}': '{name}' takes no argument '{key}' "
                              f"(it takes: {', '.join(valid) or 'none'})")
    check_argument_types(cls, kwargs, f"{where}.{name}")
    return cls, params


def check_argument_types(cls, kwargs: dict[str, Any], where: str) -> None:
    """Each value against its constructor parameter's annotation (type, range, choices: the
    component's own file declares them, e.g. `batch_size: Count`), one line naming the key."""
    import typing

    from pydantic import TypeAdapter, ValidationError

    try:
        hints = typing.get_type_hints(cls.__init__, include_extras=True)
    except (NameError, TypeError):  # an annotation this interpreter cannot evaluate: names are checked only
        return
    for key, value in kwargs.items():
        if key not in hints:
            continue
        try:
            TypeAdapter(hints[key]).validate_python(value)
        except ValidationError as err:
            first = err.errors()[0]
            raise ConfigError(f"config key '{where}.{key}': {first['msg'].lower()} (got {value!r})") from None


def build_reward(name: str, kwargs: dict[str, Any], where: str = "rewards", **context: Any):
    """Build one reward. `kwargs` come from the recipe (unknown ones are an error naming the key);
    `context` (device, tiny, run_dir, ...) is passed only where the constructor accepts it."""
    cls, params = check_reward_arguments(name, kwargs, where, tuple(context))
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    ctx = {k: v for k, v in context.items() if k in params or accepts_any}
    return cls(**{**ctx, **kwargs})
