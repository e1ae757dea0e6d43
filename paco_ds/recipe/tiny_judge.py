"""The tiny judge's shape, as numbers both the serving config (its checks at load) and the tiny
model builder (paco_ds.models.tiny.qwen_vl) read; nothing imported, so either may import it."""

# Its text attention: vLLM's CPU attention only has kernels for head sizes 32, 64, 80, 96, 112,
# 128, 160, 192, 224, 256 and 512 (a head size of 16 starts, then kills the server on its first
# request), so the tiny judge uses 32 and both engines serve the very same weights.
TINY_JUDGE_HEAD_DIM = 32
# Its vocabulary: 256 byte tokens, "Ye", "Yes", "No", and Qwen's 8 special tokens
# (len(paco_ds.models.tiny.qwen_tokenizer()), checked by a test). A request's top_logprobs and a
# server's max_logprobs above it are configuration errors.
TINY_JUDGE_VOCAB_SIZE = 256 + 3 + 8
