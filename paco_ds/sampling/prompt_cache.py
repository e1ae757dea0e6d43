"""What a prompt is encoded into, kept across epochs: its text embeddings and, for an edit, its
encoded reference images (the `Condition`), per (data split, prompt index, image size).

A recipe draws its prompts from a fixed file, so epoch after epoch the same prompts come back; their
text encoders (T5-XXL, Qwen2.5-VL-7B, Mistral-Small-3.1: billions of parameters) and the reference
images' VAE encode would compute again what an earlier epoch computed. The entries live in host
memory, least recently used first out past `sample.prompt_cache_gib` (0 turns the cache off). Each
prompt is encoded alone: its embeddings are the same whichever batch it comes in (a batch of several
prompts could round a row differently, by about 1e-7, and pad it to another length).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable

import torch

from paco_ds.models.base import Condition, TextEmbeds


def _nbytes(value) -> int:
    tensors = []
    for part in value:
        if isinstance(part, TextEmbeds):
            tensors += [part.prompt_embeds, part.pooled, part.mask]
        elif isinstance(part, Condition):
            tensors.append(part.latents)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class PromptCache:
    """An LRU map key -> (TextEmbeds row, Condition row or None), on the host, bounded in bytes."""

    def __init__(self, budget_bytes: float):
        self.budget = budget_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[Hashable, tuple] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def encoded(self, keys: list[Hashable], encode: Callable[[list[int]], tuple[TextEmbeds, Condition | None]]
                ) -> tuple[TextEmbeds, Condition | None]:
        """The batch's embeddings and condition for `keys` (one per row): the cached rows, and for each
        other key `encode([row])`, the row's fresh embeddings and condition. Each prompt is encoded
        alone, so its rows do not depend on the batch it first came in (nor does a resumed run's)."""
        if self.budget <= 0:  # the cache is off: the batch as encoded
            self.misses += len(keys)
            return encode(list(range(len(keys))))
        fresh: dict[Hashable, tuple] = {}
        for r, key in enumerate(keys):
            if key in self._entries or key in fresh:
                self.hits += 1
                continue
            self.misses += 1
            embeds, condition = encode([r])
            fresh[key] = (embeds.to("cpu"), condition.to("cpu") if condition is not None else None)
        for key, value in fresh.items():
            self._put(key, value)
        rows = [fresh[k] if k in fresh else self._get(k) for k in keys]
        embeds = TextEmbeds.cat([e for e, _ in rows])
        condition = Condition.cat([c for _, c in rows]) if rows[0][1] is not None else None
        return embeds, condition

    def _get(self, key):
        self._entries.move_to_end(key)
        return self._entries[key]

    def _put(self, key, value) -> None:
        self._entries[key] = value
        self.bytes += _nbytes(value)
        while self.bytes > self.budget and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self.bytes -= _nbytes(old)
