"""Launch geometry of every Triton kernel: block sizes, chunk sizes and warps, as the launchers use them.

It imports neither torch nor triton, so the launchers (kernels/*.py) and the ahead-of-time compile
check (kernels/aot.py, which also runs in a venv holding only triton) read the same numbers: the
configurations compiled there are the ones the launchers can produce.
"""
from __future__ import annotations

# SDE log-prob and KL: CHUNK elements per program fix the reduction tree of a row (the log-prob
# stored at rollout and the one recomputed in training share it); BLOCK elements per iteration.
SDE_CHUNK = 2048
SDE_BLOCK = 1024
FINALIZE_BLOCKS = (16, 32, 64, 128, 256, 512, 1024)  # every value finalize_block() can return

# GRPO advantages: samples per program (and the edge of the group-search tile). fp64 tiles cost 2
# registers per element and thread: 64 x 64 tiles on 4 warps compiled to 255 registers and up to
# 1.8 KB of spills per thread on sm_90; 16 x 16 tiles on 4 warps take at most 80 registers. What
# spills is left (8-16 B in 2 of 32 configurations on sm_90, none on sm_80) is ptxas saving
# registers around its fp64 division and square-root subroutines, once per program.
ADV_BLOCK = 16
ADV_WARPS = 4
ADV_BLOCK_KS = (2, 4, 8, 16)  # reward types per batch, padded to a power of two (at most 16)
MAX_REWARD_TYPES = ADV_BLOCK_KS[-1]

# PPO-clip loss: forward is one program over the batch; backward BLOCK samples per program.
PPO_BLOCK = 1024
PPO_FWD_BLOCKS = (16, 32, 64, 128, 256, 512, 1024)

# Fused linear + CE rows: one program per row streams the vocabulary in BLOCK logits at a time
# (online max and sum of exponentials). 4096 logits on 8 warps hold 16 fp32 values per thread:
# several programs share an SM, where 32768 logits on 32 warps filled its register file.
CE_MAX_BLOCK = 4096
CE_BLOCKS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # every value ce_block() can return
QWEN_VOCABS = (151936, 152064)  # Qwen2.5-VL's tokenizer and its LM head (padded)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int, lo: int = 16, hi: int = 1024) -> int:
    """The power of two at least n, clamped to [lo, hi]."""
    return min(hi, max(lo, 1 << (max(n, 1) - 1).bit_length()))


def finalize_block(n_chunk: int) -> int:
    """BLOCK of sde_finalize / kl_finalize for a row of n_chunk chunk partials."""
    return pow2(n_chunk, FINALIZE_BLOCKS[0], FINALIZE_BLOCKS[-1])


def adv_block_k(k: int) -> int:
    """BLOCK_K of grpo_advantages for k reward types."""
    if k > MAX_REWARD_TYPES:
        raise ValueError(f"the advantage kernel takes at most {MAX_REWARD_TYPES} reward types, not {k}")
    return pow2(k, ADV_BLOCK_KS[0], ADV_BLOCK_KS[-1])


def ppo_fwd_block(b: int) -> int:
    return pow2(b, PPO_FWD_BLOCKS[0], PPO_FWD_BLOCKS[-1])


def ce_block(vocab: int) -> int:
    return pow2(vocab, CE_BLOCKS[0], CE_MAX_BLOCK)


def ce_warps(block: int) -> int:
    """Warps of ce_rows: 16 logits per thread at most, at least one warp's worth of work."""
    return max(1, min(8, block // 512))
