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

Under ZeRO-3 a block's parameters are shards that DeepSpeed gathers in forward hooks on every
module; DeepSpeed marks those hooks not to be traced, so a compiled block would break its graph at
each of them. The sampling phase (deepspeed.rollout_gather: once) holds the whole parameters and
lifts the hooks (paco_ds/runtime/engine.py, gathered_for_phase), so there the blocks run compiled, whole
graphs; the training steps, whose hooks must gather each shard, run the blocks eager. DeepSpeed's
own route for those is `engine.compile()` (deepspeed.engine_compile: whole-module torch.compile,
broken at the hooks); its DeepCompile needs CUDA to build (docs/benchmarks.md measures both).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

ZERO3_PER_STEP_REFUSAL = (
    "model.compile: true under ZeRO stage 3 needs deepspeed.rollout_gather: once: the compiled blocks run "
    "while sampling holds the parameters whole; with per_step, DeepSpeed gathers each module's parameters in "
    "forward hooks inside every block, which a compiled block cannot trace without graph breaks")

ENGINE_COMPILE_REFUSAL = (
    "deepspeed.engine_compile: true is for ZeRO stage 3 (its training steps); under ZeRO stages 0-2 "
    "model.compile: true compiles the training steps' blocks without graph breaks")


def repeated_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The transformer's repeated blocks by diffusers' `_repeated_blocks` (peft's LoRA wrapping
    leaves the block classes in place)."""
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    blocks = [m for m in transformer.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} names no repeated blocks to compile (_repeated_blocks)")
    return blocks


def compile_blocks(transformer: nn.Module, *, gathered_phases_only: bool = False, **compile_kwargs) -> int:
    """Compile every repeated block in place (diffusers' `compile_repeated_blocks`); returns how many.
    `fullgraph=True` makes a graph break inside a block an error instead of a silent slowdown.

    `gathered_phases_only` (ZeRO-3): the compiled blocks are parked and run only inside
    `compiled_while_gathered`, the sampling phase that holds the parameters whole without DeepSpeed's
    hooks (engine.gathered_for_phase); everywhere else (the training steps, whose ZeRO-3 hooks gather
    each module's shard) the blocks run eager."""
    blocks = repeated_blocks(transformer)  # a family without repeated blocks: the error names the attribute
    transformer.compile_repeated_blocks(fullgraph=True, **compile_kwargs)
    if gathered_phases_only:
        for block in blocks:  # nn.Module.compile sets _compiled_call_impl; __call__ runs it when set
            block._parked_compiled_call, block._compiled_call_impl = block._compiled_call_impl, None
    return len(blocks)


@contextlib.contextmanager
def compiled_while_gathered(transformer: nn.Module) -> Iterator[int]:
    """Run the parked compiled blocks (compile_blocks(gathered_phases_only=True)) for the block; yields
    how many (0 when the transformer has none: eager, or compiled everywhere). A whole-transformer
    compile of the training steps (DeepSpeed's engine.compile(), deepspeed.engine_compile) is set aside
    for the block: it was traced with ZeRO-3's hooks, which the gathered phase lifts."""
    blocks = [m for m in transformer.modules() if getattr(m, "_parked_compiled_call", None) is not None]
    whole = transformer._compiled_call_impl
    transformer._compiled_call_impl = None
    for block in blocks:
        block._compiled_call_impl = block._parked_compiled_call
    try:
        yield len(blocks)
    finally:
        for block in blocks:
            block._compiled_call_impl = None
        transformer._compiled_call_impl = whole


def compile_counters() -> dict[str, float]:
    """dynamo's running totals in this process, logged each epoch under model.compile: compiled graphs,
    recompilations and graph breaks (after the first epoch's shapes, none of them should grow)."""
    from torch._dynamo.utils import counters

    return {"compile/graphs": float(counters["stats"]["unique_graphs"]),
            "compile/recompiles": float(sum(counters["recompiles"].values())),
            "compile/graph_breaks": float(sum(counters["graph_break"].values()))}
