"""The tiny models' tokenizers, built offline: CLIP's real BPE from open_clip's bundled merges."""
import pytest

from paco_ds.models.tiny import clip_tokenizer

pytestmark = pytest.mark.fast


def test_the_clip_tokenizer_gives_clips_ids_and_each_call_its_own():
    a, b = clip_tokenizer(), clip_tokenizer()
    # CLIP's ids: <|startoftext|> a</w> photo</w> of</w> a</w> cat</w> <|endoftext|>
    assert a("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407] and len(a) == 49408
    assert a is not b and a._tokenizer is not b._tokenizer  # built apart, not shared
    a.model_max_length = 3  # one caller's settings do not reach another's
    assert len(a("a photo of a cat", truncation=True).input_ids) == 3
    assert len(b("a photo of a cat", truncation=True).input_ids) == 7 and b.model_max_length == 77
