"""`parallel.sequence: N`: DeepSpeed-Ulysses sequence parallelism of the policy transformer's attention.

N consecutive ranks form a sequence group (paco_ds/runtime/sequence.py). Inside a group each rank
holds 1/N of every sample's tokens, text and image alike, from the embedders to the output
projection; the blocks (norms, modulation, MLPs, projections) run on the rank's own tokens, and
attention trades heads for sequence with an all-to-all (Ulysses: each rank gathers the whole
sequence for H/N of the heads, attends, and sends each output back to the rank that owns its
token). The RoPE ids or frequencies and the prompt mask are split with the tokens, so each shard
rotates by its own positions and masks its own padding. The output tokens are gathered after the
final projection, so the velocity, the SDE step and its log-prob are the unsharded ones on every
rank of the group (no reduction of the log-prob is needed).

This is diffusers' own context parallelism: `ContextParallelConfig(ulysses_degree=N)`, the
transformer class's declared split (`_cp_plan`: which inputs are split along which dimension, where
the output is gathered) and the attention dispatcher's `TemplatedUlyssesAttention` (forward and
backward all-to-alls). It is applied here with the pieces `ModelMixin.enable_parallelism` applies,
because that method derives a device index from `torch.accelerator.device_count()` (0 in a CPU
process: ZeroDivisionError) and takes a mesh of the sequence dimension only, where a run's sequence
groups sit beside data parallelism in one mesh. So a family declares nothing of its own: its
transformer class names the split, its attention goes through the dispatcher
(`Policy.attention_dispatch`), its head count divides by N, and its token counts divide by N (a
family that masks its padded prompt tokens pads them further to a multiple of N: `pad_prompt`).

Gradients: the gather after the output projection hands each rank the gradient of its own tokens,
and the attention's all-to-all sends each key's and value's gradient back to the rank that owns it,
so a rank's LoRA gradient is its shard's part of the sample's gradient, and the group's parts sum
to the whole (`LOSS_SCALE`: the trainer scales the loss by N, so that DeepSpeed's mean over all
ranks is the mean over sequence groups).
"""
from __future__ import annotations

import math

import torch
from torch import nn

KEY = "parallel.sequence"


def transformer_class(policy_cls) -> type | None:
    """The family's diffusers transformer class (None: it names none)."""
    from paco_ds.models.base import import_class

    return import_class(policy_cls.transformer_class) if getattr(policy_cls, "transformer_class", "") else None


def family_refusal(policy_cls) -> str | None:
    """Why family `policy_cls` cannot shard its sequence (None: it can)."""
    klass = transformer_class(policy_cls)
    if klass is None or getattr(klass, "_cp_plan", None) is None:
        name = klass.__name__ if klass is not None else policy_cls.__name__
        return (f"the {name} transformer declares no context-parallel split of its inputs and output "
                "(diffusers' `_cp_plan`), so its tokens cannot be sharded")
    if not getattr(policy_cls, "attention_dispatch", False):
        return f"the {klass.__name__} transformer's attention does not go through diffusers' attention dispatcher"
    return None


def backend_refusal(name: str | None) -> str | None:
    """Why attention backend `name` (None: native) cannot run Ulysses attention (None: it can)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    backend = AttentionBackendName(name or "native")
    if _AttentionBackendRegistry._is_context_parallel_available(backend):
        return None
    usable = sorted(b for b in _AttentionBackendRegistry._supports_context_parallel if not b.endswith("_hub"))
    return f"attention backend '{backend.value}' has no sequence-parallel form in diffusers (those that do: {', '.join(usable)})"


def attention_heads(policy_cls, model_cfg) -> int | None:
    """The transformer's attention heads as the recipe builds it: the tiny twin's, or the family's
    published full-size config (on the meta device: about a second); None where neither is known
    (the loaded checkpoint is checked when it is sharded)."""
    if model_cfg.tiny:
        return model_cfg.tiny_spec.num_attention_heads
    full = getattr(policy_cls, "full_size", None)
    if full is None:
        return None
    # Wan2.2-A14B's two experts have the same heads; their gcd is what N must divide in any case
    return math.gcd(*(t.config.num_attention_heads for t in sharded_transformers(full.transformer())))


def image_tokens(policy_cls, height: int, width: int) -> int:
    """The image tokens of a height x width image: one per `size_multiple` square of pixels (the
    2x2 patches of the families that shard their sequence: tests/models/test_sequence.py)."""
    m = policy_cls.size_multiple
    return (height // m) * (width // m)


def divides(what: str, count: int, n: int) -> str | None:
    """One clause when `count` `what` do not split over n ranks (None when they do)."""
    if count % n:
        return f"{count} {what} do not split over {n} ranks"
    return None


def pad_prompt(text: torch.Tensor, mask: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt tokens [B, S, D] and their mask [B, S] (None: all valid) padded with masked tokens to a
    multiple of n (a family that masks its padding: the padded keys are masked, their queries' outputs
    never reach the image tokens). Unchanged when S divides by n."""
    pad = -text.shape[1] % n
    if not pad:
        return text, mask
    if mask is None:
        mask = torch.ones(text.shape[:2], dtype=torch.bool, device=text.device)
    text = nn.functional.pad(text, (0, 0, 0, pad))
    return text, nn.functional.pad(mask.bool(), (0, pad), value=False)


def shard_sequence(policy, mesh) -> int:
    """Run the policy's transformer sequence-parallel over the "ulysses" dimension of `mesh` (a
    DeviceMesh with dimensions ("data", "ring", "ulysses"), paco_ds/runtime/sequence.py): its inputs
    split as its class's `_cp_plan` says, its attention processors' Ulysses all-to-all, its output
    gathered; the policy pads masked prompts to a multiple of N (`Policy.sequence_degree`). What
    `ModelMixin.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N, mesh=mesh))` does,
    without its device lookup (module docstring). Returns N."""
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig

    n = mesh["ulysses"].size()
    cp = ContextParallelConfig(ulysses_degree=n, mesh=mesh)
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(torch.distributed.get_rank(), torch.distributed.get_world_size(), None, mesh=mesh)
    for transformer in sharded_transformers(policy.transformer):
        heads = transformer.config.num_attention_heads
        if heads % n:  # a checkpoint other than the family's published one: preflight checked that one
            raise ValueError(f"{KEY}={n}: the transformer's {heads} attention heads do not split over {n} ranks")
        transformer._parallel_config = config
        for module in transformer.modules():
            processor = getattr(module, "processor", None)
            if processor is not None and hasattr(processor, "_parallel_config"):
                processor._parallel_config = config
        apply_context_parallel(transformer, cp, transformer._cp_plan)
        # before diffusers' split: a length that does not divide is one line naming the key, not its assert
        transformer.register_forward_pre_hook(_check_lengths(transformer._cp_plan, n), with_kwargs=True)
    policy.sequence_degree = n
    return n


def sharded_transformers(module: nn.Module) -> list[nn.Module]:
    """The transformers that declare a split: `module` itself, or, for a module that holds several (Wan2.2's
    two experts, paco_ds/models/wan22.py), each of its children that does; every one is sharded alike."""
    if getattr(module, "_cp_plan", None) is not None:
        return [module]
    found = [m for m in module.children() if getattr(m, "_cp_plan", None) is not None]
    if not found:
        raise ValueError(f"{type(module).__name__} declares no _cp_plan: its sequence cannot be sharded")
    return found


def _check_lengths(plan: dict, n: int):
    """A forward pre-hook: the inputs the plan splits at the transformer's entry divide by n."""
    from diffusers.models._modeling_parallel import ContextParallelInput

    split = {name: cpi for entry in plan.values() if isinstance(entry, dict) for name, cpi in entry.items()
             if isinstance(name, str) and isinstance(cpi, ContextParallelInput) and not cpi.split_output}

    def check(module, args, kwargs):
        for name, cpi in split.items():
            x = kwargs.get(name)
            if isinstance(x, torch.Tensor) and x.dim() == (cpi.expected_dims or x.dim()) and x.shape[cpi.split_dim] % n:
                raise ValueError(f"{KEY}={n}: the transformer's '{name}' has {x.shape[cpi.split_dim]} tokens, which do "
                                 f"not split over {n} ranks")
        return None

    return check
