"""What a GRPO run checks before its first step (and `--dry-run` checks the same), so that a
mistake found 20-60 s into a run today is one line and exit 2 before any model, server or file
exists:

- every image size the model will be asked for is a multiple of its family's `size_multiple`
  (train/test resolution, and the height/width of each data record, named by file:line);
- no editing record has more input images than the family conditions on (`max_input_images`:
  one for Kontext and Qwen-Image-Edit, three for Qwen-Image-Edit-2509/2511), named by file:line;
- every reward argument of the recipe is one the reward's constructor takes;
- a video family's rewards can score videos (`Reward.video`: frame_consistency, or an image reward's
  per-frame form), an image family's none that judges videos only; the family's own checks
  (`Policy.check_recipe`: model.num_frames, Wan2.2's experts);
- a reward or loss named by import path ("module:Class") imports (a policy's is imported at load);
- the DeepSpeed config file exists and is JSON;
- the output directory can be created and written (probed with a temporary file, removed);
- `--resume DIR`/`latest` names an intact checkpoint (paco_ds/runtime/checkpoint.py verifies its files).

Data layouts (T2IS `RxC`), non-UTF-8 files and non-finite reward weights are checked where they
are read (paco_ds/data, paco_ds/recipe/loader.py, paco_ds/recipe/schema.py).
"""
from __future__ import annotations

from pathlib import Path

from paco_ds.recipe.schema import Config
from paco_ds.errors import ConfigError, DataError
from paco_ds.runtime.metrics import check_wandb
from paco_ds.runtime.storage import check_writable


def check_sizes(cfg: Config, items: list, key: str) -> None:
    from paco_ds.models import policy_class

    from paco_ds.recipe.schema import size_of

    m = policy_class(cfg.model.family).size_multiple
    fam = cfg.model.family
    for name, res in (("train.resolution", cfg.train.resolution), ("test.resolution", cfg.test.resolution)):
        for value in dict.fromkeys(size_of(res)):
            if value % m:
                raise ConfigError(f"config key '{name}': {value} is not a multiple of {m}, which the '{fam}' model "
                                  f"needs (e.g. {max(m, value // m * m)} or {(value // m + 1) * m})")
    for it in items:
        for side in ("height", "width"):
            v = getattr(it, side, None)
            if v and v % m:
                raise DataError(f"{it.where or key}: '{side}' {v} is not a multiple of {m}, which the '{fam}' "
                                f"model needs ({key})")


def check_input_images(cfg: Config, items: list, key: str) -> None:
    """A multi-image record for a family that reads fewer images would train on an instruction that
    names images the model never sees: refused, naming the record."""
    from paco_ds.models import policy_class

    most = policy_class(cfg.model.family).max_input_images
    for it in items:
        n = len(getattr(it, "extra_images", ())) + 1
        if getattr(it, "image", None) is not None and n > most:
            raise DataError(f"{it.where or key}: {n} input images, and model.family '{cfg.model.family}' conditions "
                            f"on at most {most} (multi-image editing: model.family qwen_image_edit_plus)")


def check_reward_arguments(cfg: Config) -> None:
    from paco_ds.rewards.registry import check_reward_arguments as check

    sets = [("rewards.train.terms", cfg.rewards.train)]
    if cfg.rewards.test is not None:
        sets.append(("rewards.test.terms", cfg.rewards.test))
    for where, rset in sets:
        for name, term in rset.terms.items():
            check(name, term.kwargs, where)


def check_video_rewards(cfg: Config) -> None:
    """A video family's samples reach a reward as their frames: a reward that scores images only is
    one line naming it (and the rewards that have a per-frame form); a reward judging videos only is
    one line for an image family."""
    from paco_ds.models import policy_class
    from paco_ds.rewards.registry import REWARDS, reward_class

    fam = cfg.model.family
    video = policy_class(fam).video
    for where, rset in (("rewards.train.terms", cfg.rewards.train), ("rewards.test.terms", cfg.rewards.test)):
        for name in (rset.terms if rset is not None else {}):
            kind = getattr(reward_class(name, where), "video", None)
            if video and kind is None:
                frames = [n for n in REWARDS if getattr(reward_class(n), "video", None) == "frames"]
                raise ConfigError(f"config key '{where}.{name}': '{name}' scores images and has no per-frame form, and "
                                  f"model.family '{fam}' draws videos (per-frame forms: {', '.join(frames)}; the "
                                  "frames together: frame_consistency)")
            if not video and kind == "video":
                raise ConfigError(f"config key '{where}.{name}': '{name}' judges the frames of a video, and "
                                  f"model.family '{fam}' draws images")


def video_lines(cfg: Config, train_items: list) -> list[str]:
    """What --dry-run says of a video recipe: the frames of a sample, and the judge requests per video
    of each reward that asks about frames (`requests_per_video`), over the training records."""
    from paco_ds.models import policy_class
    from paco_ds.rewards.registry import reward_class

    policy = policy_class(cfg.model.family)
    if not policy.video:
        return []
    frames = policy.frames(cfg.model)
    lines = [f"{frames} frames per video"]
    for name, term in cfg.rewards.train.terms.items():
        count = getattr(reward_class(name), "requests_per_video", None)
        if count is None:
            continue
        n = sorted({count(frames, it.metadata, **term.kwargs) for it in train_items} or {count(frames, {}, **term.kwargs)})
        per = f"{n[0]}" if len(n) == 1 else f"{n[0]}-{n[-1]}"
        lines.append(f"{name}: at most {per} judge requests per video ({frames} frames sampled down to "
                     f"{min(frames, term.kwargs.get('max_frames', 8))}, {term.kwargs.get('pairs', 'adjacent')} pairs)")
    return lines


def check_records_for_rewards(cfg: Config, train_items: list, test_items: list | None) -> None:
    """Every record of the data can be scored by the rewards that will score it (a reward's own
    `check_record`: GenEval's tag and include, a quoted text for OCR): one line naming file:line."""
    from paco_ds.rewards.registry import reward_class

    test_set = cfg.rewards.eval  # the test reward set, or the train set where none is given
    for items, rset, key in ((train_items, cfg.rewards.train, "data.train_file"),
                             (test_items or [], test_set, "data.test_file")):
        for name in rset.terms:
            cls = reward_class(name)
            for it in items:
                why = cls.check_record(it.prompt, it.metadata)
                if why:
                    raise DataError(f"{it.where or key}: reward '{name}' cannot score this record: {why}")


def unjudged_records(cfg: Config, train_items: list, test_items: list | None) -> list[str]:
    """What --dry-run says of the records a reward does not apply to by construction (`Reward.applies`:
    a one-panel layout for a pairwise judge): one line per reward and file, with the count, the
    reason and what their samples are trained or evaluated on. A training record that no reward of
    the set applies to could never be trained: one line naming file:line (DataError)."""
    from paco_ds.models import policy_class
    from paco_ds.rewards.registry import reward_class

    frames = policy_class(cfg.model.family).frames(cfg.model)
    lines = []
    for items, rset, key, verb in ((train_items, cfg.rewards.train, "data.train_file", "train"),
                                   (test_items or [], cfg.rewards.eval, "data.test_file", "are evaluated")):
        names = list(rset.terms)
        skipped = {name: [] for name in names}
        for it in items:
            why = {name: reward_class(name).applies_to(it.prompt, it.metadata, frames) for name in names}
            for name, reason in why.items():
                if reason:
                    skipped[name].append(reason)
            if names and all(why.values()) and key == "data.train_file":
                raise DataError(f"{it.where or key}: no reward of rewards.train.terms applies to this record ("
                                + "; ".join(f"{n}: {r}" for n, r in why.items()) + "), so it could never be trained")
        for name, reasons in skipped.items():
            if reasons:
                others = [n for n in names if n != name]
                lines.append(f"{name}: {len(reasons)} of {len(items)} prompts in {key} ({reasons[0]}); their samples "
                             f"{verb} on {', '.join(others)} without it (neither scored nor failed)")
    return lines


# Recorded in each checkpoint (meta.json 'recipe') and compared on resume (paco_ds/recipe/resume.py).
# A change of these makes the resumed run another run (tensors of another shape, another loss's state,
# another model or reward): refused unless --allow-changed names it.
RESUME_MUST_MATCH = ("model.family", "model.path", "model.tiny", "model.lora.rank", "model.lora.alpha",
                     "model.lora.target_modules", "train.loss", "rewards.train.terms", "parallel.sequence")
# Allowed, and printed once when they changed.
RESUME_NOTED = ("train.num_epochs", "train.learning_rate", "train.max_grad_norm", "train.kl_beta", "seed",
                "sample.num_steps", "sample.group_size", "sample.prompts_per_epoch", "test.eval_freq",
                "checkpoint.save_freq", "rewards.train.weights")


def resume_settings(cfg: Config) -> dict:
    """The recipe values a GRPO checkpoint records: RESUME_MUST_MATCH and RESUME_NOTED, the rewards
    as their identity (each name with its arguments) apart from their weights."""
    from paco_ds.recipe.resume import recorded

    out = recorded(cfg.model_dump(mode="json"), [k for k in RESUME_MUST_MATCH + RESUME_NOTED
                                                 if not k.startswith("rewards.")])
    out["rewards.train.terms"] = {name: dict(sorted(t.kwargs.items())) for name, t in cfg.rewards.train.terms.items()}
    out["rewards.train.weights"] = {name: t.weight for name, t in cfg.rewards.train.terms.items()}
    return out


def check_resume(cfg: Config, path: Path, allowed: tuple[str, ...] = ()) -> str:
    """Before anything loads: one line naming a key that must not change (exit 2), else the changed
    settings a resume will use ('' if none). A checkpoint that records no recipe is not compared."""
    from paco_ds.recipe.resume import compare, saved_recipe

    saved = saved_recipe(path)
    if not saved:
        return ""
    return compare(saved, resume_settings(cfg), RESUME_MUST_MATCH, path, allowed, allow_flag=True)


def check_lora_targets(cfg: Config) -> None:
    """model.lora.target_modules against the family's transformer, built on the meta device (no
    weights, well under a second at full size): a target that matches nothing is one line now,
    not after the models are loaded. The module names are the architecture's, whatever its size."""
    from paco_ds.models import policy_class

    targets = cfg.model.lora.target_modules
    if cfg.model.lora.path or not targets:
        return  # a saved adapter brings its own targets
    policy = policy_class(cfg.model.family)
    if getattr(policy, "full_size", None) is None:
        return  # a policy without a full-size description is checked at build
    if set(targets) <= set(policy.lora_targets):
        return  # the family's own (tests/models/test_family_defaults.py): no build needed (about 4 s)
    from paco_ds.models.lora import check_targets

    check_targets(cfg.model.lora.target_modules, policy.full_size.transformer())


def check_compile(cfg: Config) -> None:
    """model.compile under ZeRO-3 runs in the gathered sampling phase, deepspeed.engine_compile compiles
    ZeRO-3's training steps (paco_ds/models/compile.py)."""
    if not (cfg.model.compile or cfg.deepspeed.engine_compile):
        return
    from paco_ds.runtime.engine import gathers_per_step, recipe_zero_stage
    from paco_ds.models.compile import ENGINE_COMPILE_REFUSAL, ZERO3_PER_STEP_REFUSAL

    if cfg.model.compile and gathers_per_step(cfg):
        raise ConfigError(ZERO3_PER_STEP_REFUSAL)
    if cfg.deepspeed.engine_compile and recipe_zero_stage(cfg) != 3:
        raise ConfigError(ENGINE_COMPILE_REFUSAL)


def check_tree(cfg: Config) -> None:
    """Tree rollouts make ranks run different numbers of forwards (a rank computes the nodes its
    leaves need): only where a forward needs no collective, as the shared group prefix."""
    if cfg.sample.tree is None:
        return
    from paco_ds.runtime.engine import gathers_per_step

    if gathers_per_step(cfg):
        raise ConfigError("config key 'sample.tree': needs deepspeed.rollout_gather: once under ZeRO stage 3 (per-step "
                          "gathering is a collective in every forward, and ranks compute different numbers of nodes)")


def check_async_rollouts(cfg: Config) -> None:
    """rollout.mode: async trains what its off-policy correction applies to (paco_ds/grpo/async_rollouts.py)."""
    from paco_ds.grpo.async_rollouts import check_recipe

    check_recipe(cfg)


def check_attention(cfg: Config) -> None:
    """model.attention_backend: a backend diffusers knows, installed, for a family whose attention
    dispatches (its device is checked by the training processes, paco_ds/grpo/run.py)."""
    from paco_ds.models import policy_class
    from paco_ds.models.attention import check_attention_backend

    check_attention_backend(cfg.model.attention_backend, policy_class(cfg.model.family), dtype=cfg.model.dtype)


def check_sequence_length(cfg: Config) -> None:
    """model.max_sequence_length within what the family's text encoder reads."""
    from paco_ds.models import policy_class

    policy = policy_class(cfg.model.family)
    limit = policy.sequence_length_limit(cfg.model.tiny)
    if limit is not None and cfg.model.max_sequence_length is not None and cfg.model.max_sequence_length > limit:
        which = "the tiny twin of " if limit != policy.max_sequence_length_limit else ""
        raise ConfigError(f"config key 'model.max_sequence_length': at most {limit} for {which}model.family "
                          f"'{cfg.model.family}', got {cfg.model.max_sequence_length}")


def check_family(cfg: Config) -> None:
    from paco_ds.models import policy_class

    policy_class(cfg.model.family).check_recipe(cfg)


def check_sequence_parallel(cfg: Config, train_items: list, test_items: list | None) -> None:
    """parallel.sequence: N > 1 splits every sample's tokens over N ranks (paco_ds/models/sequence.py):
    the family must declare the split and dispatch its attention, its heads and its token counts must
    divide by N (prompt tokens of a family without a prompt mask: model.max_sequence_length; image
    tokens at every size the recipe and its data name; an edit's reference tokens are checked when they
    are encoded), and what it runs beside must compose with it. One line naming the key, or nothing."""
    n = cfg.parallel.sequence
    if n == 1:
        return
    from paco_ds.models import policy_class
    from paco_ds.models import sequence as sp
    from paco_ds.grpo.losses import loss_class
    from paco_ds.recipe.schema import size_of
    from paco_ds.runtime.engine import recipe_zero_stage

    policy = policy_class(cfg.model.family)
    why = sp.family_refusal(policy) or sp.backend_refusal(cfg.model.attention_backend)
    if why is None:
        heads = sp.attention_heads(policy, cfg.model)
        why = sp.divides("attention heads", heads, n) if heads is not None else None
    if why is None and not policy.text_attention_mask:  # its prompts are padded to this length, unmasked
        length = policy.options(cfg.model).get("max_sequence_length")
        why = sp.divides("prompt tokens (model.max_sequence_length)", length, n) if length else None
    sizes = {size_of(r): key for key, r in (("train.resolution", cfg.train.resolution),
                                            ("test.resolution", cfg.test.resolution))}
    for items, key in ((train_items, "data.train_file"), (test_items or [], "data.test_file")):
        for it in items:
            if getattr(it, "height", None) or getattr(it, "width", None):
                sizes.setdefault(it.size(cfg.train.resolution), it.where or key)
    for (h, w), where in sizes.items():
        why = why or sp.divides(f"image tokens of {h}x{w} ({where})", sp.image_tokens(policy, h, w), n)
    if why is None and loss_class(cfg.train.loss).gathers_across_ranks:
        why = (f"train.loss {cfg.train.loss} gathers every rank's rows in each micro-step, and the ranks of a "
               "sequence group hold the same samples")
    if why is None and cfg.model.compile and recipe_zero_stage(cfg) != 3:
        # compiled training steps: diffusers' Ulysses backward marks its saved tensors as requiring grad,
        # which dynamo refuses in a full graph (the sampling phase of ZeRO-3, without grad, compiles)
        why = ("model.compile below ZeRO stage 3 compiles the training steps' blocks, whose Ulysses attention "
               "backward does not trace; under ZeRO-3 only sampling runs compiled, which composes")
    if why:
        raise ConfigError(f"config key '{sp.KEY}': {n}: {why}")


def check_deepspeed_config(cfg: Config) -> None:
    from paco_ds.runtime.engine import load_ds_config

    load_ds_config(cfg.resolve_path(cfg.deepspeed.config))


def preflight(cfg: Config, train_items: list, test_items: list | None) -> None:
    check_sizes(cfg, train_items, "data.train_file")
    check_input_images(cfg, train_items, "data.train_file")
    if test_items:
        check_sizes(cfg, test_items, "data.test_file")
        check_input_images(cfg, test_items, "data.test_file")
    check_reward_arguments(cfg)
    check_video_rewards(cfg)
    check_family(cfg)
    check_records_for_rewards(cfg, train_items, test_items)
    if cfg.model.lora.path:
        from paco_ds.models.lora import check_lora_file

        check_lora_file(cfg.model.lora.path, "config key 'model.lora.path':")
    check_deepspeed_config(cfg)
    check_compile(cfg)
    check_tree(cfg)
    check_async_rollouts(cfg)
    check_attention(cfg)
    check_sequence_length(cfg)
    check_sequence_parallel(cfg, train_items, test_items)
    check_lora_targets(cfg)
    check_writable(cfg.run_dir, "output_dir")
    check_wandb(cfg.logging.wandb)  # W&B asked for and not installed: say so now, not by its absence
