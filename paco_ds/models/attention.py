"""`model.attention_backend`: the attention kernel of the policy's transformer, one of diffusers'
attention dispatcher backends (`diffusers.models.attention_dispatch.AttentionBackendName`: `native`
PyTorch SDPA, the default; `flash` (flash-attn 2, the `flash` extra), `_flash_3`, `sage`, `flex`,
PyTorch's own `_native_flash` / `_native_efficient` / `_native_cudnn`, ...).

Checked before anything loads: the name (one line listing the known ones), a backend that would
download its kernel from the Hub at run time (refused: nothing downloads at run time), the packages
diffusers requires for it, a family whose attention does not go through the dispatcher (the setting
would do nothing), and, in the training processes, whether it can run on their device.

The Qwen2.5-VL models (the judge's built-in hf engine, `reward_servers.attn_implementation`, and the
reward-model SFT, `model.attn_implementation`) take transformers' names for the same choice, checked
the same way by `check_attn_implementation`:

    policy (diffusers)   judge / SFT (transformers)
    native               sdpa            (the default of both)
    flash                flash_attention_2
    _flash_3             flash_attention_3
    flex                 flex_attention
    _native_math         eager
"""
from __future__ import annotations

from paco_ds.errors import ConfigError
from paco_ds.recipe.loader import suggest

KEY = "model.attention_backend"
# The backends that run on a CPU device (the tiny recipes, the tests); every other one needs CUDA.
CPU_BACKENDS = ("native", "_native_math", "flex")
# The backends whose kernel takes no attention mask (diffusers 0.42 raises "attn_mask is not supported"
# at the first masked call; tests/models/test_attention_backend.py re-reads this from diffusers).
NO_MASK_BACKENDS = frozenset({"flash", "_flash_3", "_native_flash", "_native_xla", "sage",
                              "_sage_qk_int8_pv_fp8_cuda", "_sage_qk_int8_pv_fp8_cuda_sm90",
                              "_sage_qk_int8_pv_fp16_cuda", "_sage_qk_int8_pv_fp16_triton"})
# The backends that compute in fp16/bf16 only (flash-attn, SageAttention, PyTorch's flash kernel).
HALF_ONLY_PREFIXES = ("flash", "_flash", "sage", "_sage", "_native_flash")


def check_attention_backend(name: str | None, policy_cls, device=None, dtype: str | None = None) -> None:
    """Raise ConfigError (one line naming the key) where backend `name` cannot run for the family
    `policy_cls` in `model.dtype` `dtype` (on `device`, when given: the training processes know it,
    `--dry-run` does not)."""
    if name is None:
        return
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    known = [b.value for b in AttentionBackendName]
    if name not in known:
        raise ConfigError(f"config key '{KEY}': unknown attention backend '{name}'{suggest(name, known)}; known: "
                          f"{', '.join(k for k in known if not k.endswith('_hub'))}")
    if name.endswith("_hub"):
        raise ConfigError(f"config key '{KEY}': '{name}' downloads its kernel from the Hugging Face Hub when the run "
                          "starts; install the kernel's package and use the backend without '_hub'")
    if not getattr(policy_cls, "attention_dispatch", False) and name != "native":  # native: what it runs anyway
        raise ConfigError(f"config key '{KEY}': the {policy_cls.__name__} transformer's attention does not go "
                          "through diffusers' attention dispatcher, so a backend would change nothing; leave it unset")
    if getattr(policy_cls, "text_attention_mask", False) and name in NO_MASK_BACKENDS:
        # a batch of prompts of different lengths carries a mask: the first such batch would fail mid-run
        raise ConfigError(f"config key '{KEY}': '{name}' takes no attention mask, and the {policy_cls.__name__} "
                          "transformer masks its padded prompt tokens; use 'flash_varlen' (flash-attn with a key "
                          "mask), '_flash_varlen_3', 'native' or '_native_efficient'")
    if dtype == "fp32" and name.startswith(HALF_ONLY_PREFIXES):
        raise ConfigError(f"config key '{KEY}': '{name}' computes in fp16/bf16 only and model.dtype is fp32; set "
                          "model.dtype: bf16 (or auto, bf16 on a GPU)")
    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except (RuntimeError, ImportError) as err:
        raise ConfigError(f"config key '{KEY}': {' '.join(str(err).split())}") from None
    if device is not None and getattr(device, "type", str(device)) != "cuda" and name not in CPU_BACKENDS:
        raise ConfigError(f"config key '{KEY}': '{name}' runs on CUDA devices; this process runs on {device} "
                          f"(on a CPU: {', '.join(CPU_BACKENDS)})")


def sdpa_without_cudnn() -> None:
    """Take cuDNN's fused attention out of the kernels PyTorch's SDPA chooses from (flash and
    memory-efficient remain; they are what it chose before torch 2.5 preferred cuDNN on Hopper).

    Why: with torch 2.11+cu130 on an H200 and an H100, the first backward through FLUX's attention at
    512 px (1 x 24 heads x 1536 tokens x 128, bf16) fails in cuDNN's kernel, "Expected
    mha_graph.execute(...).is_good()" when launches block, an illegal memory access reported at a
    later call when they do not, and non-finite gradients in a GRPO run; without cuDNN the same steps
    run (tests/gpu/results/nvidia-h200/diagnose.log, tests/gpu/flux_lora_probe.py). It is a process-wide
    switch of PyTorch's; an explicit `_native_cudnn` backend still reaches cuDNN (diffusers restricts
    SDPA to it in its own context)."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)


def set_attention_backend(transformer, name: str | None) -> None:
    """Route the transformer's attention through backend `name` (checked by check_attention_backend).
    The default (None, `native`: PyTorch's SDPA) chooses among flash and memory-efficient kernels only
    (sdpa_without_cudnn)."""
    if name in (None, "native"):
        sdpa_without_cudnn()
    if name is None:
        return
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    # diffusers' set_attention_backend also makes `name` the process-wide default of every model whose
    # processors name none: another model in this process (the GPU plan's next recipe, a reward's) would
    # then run it unasked. Each processor keeps its own; the default goes back to what it was.
    default = _AttentionBackendRegistry._active_backend
    try:
        transformer.set_attention_backend(name)
    finally:
        _AttentionBackendRegistry.set_active_backend(default)
    routed = [m for m in transformer.modules() if getattr(getattr(m, "processor", None), "_attention_backend", None)]
    if not routed and name != "native":  # the dispatcher changed no processor: the setting would silently do nothing
        # ('native' on a family that calls SDPA itself, SD3, is what it runs anyway: the check allows it)
        raise ConfigError(f"config key '{KEY}': no attention processor of {type(transformer).__name__} took "
                          f"'{name}'")


# ------------------------------------------------------------------------------------------------
# transformers' `attn_implementation` (the judge's hf engine, the reward-model SFT)
# ------------------------------------------------------------------------------------------------
# The implementations that run on a CPU device; the flash ones need CUDA and their package.
TRANSFORMERS_CPU = ("eager", "sdpa", "flex_attention")
FLASH_PACKAGES = {"flash_attention_2": "flash-attn 2 (on a CUDA machine: pip install -e '.[flash]')",
                  "flash_attention_3": "flash-attn 3 (FlashAttention's Hopper build, flash_attn_interface)",
                  "flash_attention_4": "flash-attn 4 (flash_attn.cute)"}


def check_attn_implementation(name: str | None, key: str, device=None) -> None:
    """Raise ConfigError (one line naming `key`) where transformers' attention implementation `name`
    cannot run (on `device`, when given). Checked before anything loads: transformers itself would
    fetch a missing flash kernel from the Hub at load time, and nothing downloads at run time."""
    if name is None:
        return
    from transformers import utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ["eager", *(k for k in ALL_ATTENTION_FUNCTIONS if "|" not in k)]  # `paged|...`: generation caches only
    if "/" in name:
        raise ConfigError(f"config key '{key}': '{name}' is a kernel on the Hugging Face Hub, fetched when the model "
                          f"loads; install its package and use one of: {', '.join(known)}")
    if name not in known:
        raise ConfigError(f"config key '{key}': unknown attention implementation '{name}'{suggest(name, known)}; "
                          f"known: {', '.join(known)}")
    if name in FLASH_PACKAGES and not getattr(utils, f"is_{name.replace('_attention', '_attn')}_available")():
        raise ConfigError(f"config key '{key}': '{name}' needs {FLASH_PACKAGES[name]}, which is not installed here")
    if device is not None and getattr(device, "type", str(device)) != "cuda" and name not in TRANSFORMERS_CPU:
        raise ConfigError(f"config key '{key}': '{name}' runs on CUDA devices; this process runs on {device} "
                          f"(on a CPU: {', '.join(TRANSFORMERS_CPU)})")


def attn_implementation_field(value: str | None) -> str | None:
    """A pydantic validator's body for an `attn_implementation` key: the name and its package at load
    (the loader names the key and the file:line); the device is checked where the model loads."""
    try:
        check_attn_implementation(value, "attn_implementation")
    except ConfigError as err:
        raise ValueError(str(err).split(": ", 1)[1]) from None
    return value
