"""`model.attention_backend`: the attention kernel of the policy's transformer, one of diffusers'
attention dispatcher backends (`diffusers.models.attention_dispatch.AttentionBackendName`: `native`
PyTorch SDPA, the default; `flash` (flash-attn 2, the `flash` extra), `_flash_3`, `sage`, `flex`,
PyTorch's own `_native_flash` / `_native_efficient` / `_native_cudnn`, ...).

Checked before anything loads: the name (one line listing the known ones), a backend that would
download its kernel from the Hub at run time (refused: nothing downloads at run time), the packages
diffusers requires for it, a family whose attention does not go through the dispatcher (the setting
would do nothing), and, in the training processes, whether it can run on their device.
"""
from __future__ import annotations

from paco_ds.errors import ConfigError
from paco_ds.recipe import suggest

KEY = "model.attention_backend"
# The backends that run on a CPU device (the tiny recipes, the tests); every other one needs CUDA.
CPU_BACKENDS = ("native", "_native_math", "flex")


def check_attention_backend(name: str | None, policy_cls, device=None) -> None:
    """Raise ConfigError (one line naming the key) where backend `name` cannot run for the family
    `policy_cls` (on `device`, when given: the training processes know it, `--dry-run` does not)."""
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
    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except (RuntimeError, ImportError) as err:
        raise ConfigError(f"config key '{KEY}': {' '.join(str(err).split())}") from None
    if device is not None and getattr(device, "type", str(device)) != "cuda" and name not in CPU_BACKENDS:
        raise ConfigError(f"config key '{KEY}': '{name}' runs on CUDA devices; this process runs on {device} "
                          f"(on a CPU: {', '.join(CPU_BACKENDS)})")


def set_attention_backend(transformer, name: str | None) -> None:
    """Route the transformer's attention through backend `name` (checked by check_attention_backend)."""
    if name is None:
        return
    transformer.set_attention_backend(name)
    routed = [m for m in transformer.modules() if getattr(getattr(m, "processor", None), "_attention_backend", None)]
    if not routed:  # the dispatcher changed no processor: the setting would silently do nothing
        raise ConfigError(f"config key '{KEY}': no attention processor of {type(transformer).__name__} took "
                          f"'{name}'")
