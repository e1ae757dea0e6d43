"""`model.compile`: regional compilation of the policy transformer's repeated blocks.

Each of the transformer's repeated blocks (diffusers' `_repeated_blocks`: FLUX's double and
single blocks, Qwen-Image's blocks) is compiled in place by diffusers' own
`ModelMixin.compile_repeated_blocks` (`nn.Module.compile` on each): the blocks of one class share
one compiled graph (dynamo inlines
modules, so parameters are graph inputs), so compiling 57 FLUX blocks costs about what compiling two
does, and state-dict keys, LoRA names and checkpoints are those of the eager model. Embedders,
the final norm and the projection stay eager. Sampling (no grad, eval) and training (grad, train
mode) each compile once per block class on their first call; a new image size compiles once more
with that dimension dynamic (dynamo's automatic dynamic shapes), and nothing recompiles after that
(tests/models/test_compile.py reads dynamo's counters).
"""
from __future__ import annotations

from torch import nn

ZERO3_REFUSAL = ("model.compile: true cannot run under ZeRO stage 3: DeepSpeed gathers each block's partitioned "
                 "parameters in module hooks that a compiled block would trace (graph breaks, and a recompile "
                 "whenever a gathered parameter changes shape); use ZeRO stage 0-2 or model.compile: false")


def repeated_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The transformer's repeated blocks by diffusers' `_repeated_blocks` (peft's LoRA wrapping
    leaves the block classes in place)."""
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    blocks = [m for m in transformer.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} names no repeated blocks to compile (_repeated_blocks)")
    return blocks


def compile_blocks(transformer: nn.Module, **compile_kwargs) -> int:
    """Compile every repeated block in place (diffusers' `compile_repeated_blocks`); returns how many.
    `fullgraph=True` makes a graph break inside a block an error instead of a silent slowdown."""
    blocks = repeated_blocks(transformer)  # a family without repeated blocks: the error names the attribute
    transformer.compile_repeated_blocks(fullgraph=True, **compile_kwargs)
    return len(blocks)
