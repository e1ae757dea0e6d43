"""`model.attention_backend` (paco_ds/models/attention.py): diffusers' attention dispatcher backend of
the policy's transformer, refused in one line before anything loads where it cannot run, and
applied to every attention processor where it can."""
import pytest
import torch

from conftest import TINY, one_line_error, run_cli
from paco_ds.errors import ConfigError
from paco_ds.grpo.plan import check_recipe, load_config
from paco_ds.grpo.run import check_device_choices
from paco_ds.models.attention import check_attention_backend, set_attention_backend
from paco_ds.models.flux import FluxPolicy
from paco_ds.models.sd3 import SD3Policy

pytestmark = pytest.mark.fast


def _refused(*sets, recipe=TINY) -> str:
    with pytest.raises(ConfigError) as err:
        check_recipe(load_config(recipe, list(sets)), 2)  # what --dry-run runs
    assert "\n" not in str(err.value)
    return str(err.value)


def test_what_cannot_run_is_one_line_naming_the_key_before_anything_loads():
    assert "unknown attention backend 'flsh' (did you mean 'flash'?)" in _refused("model.attention_backend=flsh")
    assert "downloads its kernel from the Hugging Face Hub" in _refused("model.attention_backend=flash_hub")
    # flash-attn is not installed here: diffusers' own requirement, as one line
    assert "install `flash-attn" in _refused("model.attention_backend=flash")
    # SD3's joint attention calls SDPA itself: a backend would silently change nothing
    msg = _refused("model.attention_backend=_native_flash", recipe="configs/tiny/sd3_geneval.yaml")
    assert "SD3Policy" in msg and "dispatcher" in msg
    for ok in ("native", "_native_flash"):  # known and installed; the device is the training processes' check
        check_recipe(load_config(TINY, [f"model.attention_backend={ok}"]), 2)
    check_attention_backend("native", SD3Policy)  # what SD3 runs anyway


def test_the_training_processes_refuse_a_gpu_backend_on_a_cpu():
    cfg = load_config(TINY, ["model.attention_backend=_native_flash"])
    with pytest.raises(ConfigError, match=r"'_native_flash' runs on CUDA devices; this process runs on cpu"):
        check_device_choices(cfg, torch.device("cpu"))
    check_device_choices(load_config(TINY, ["model.attention_backend=_native_math"]), torch.device("cpu"))


def test_the_dry_run_exits_2_with_the_line():
    line = one_line_error(run_cli("launch/train.py", "--config", str(TINY), "--dry-run", "--set",
                                  "model.attention_backend=flsh"))
    assert "config key 'model.attention_backend': unknown attention backend 'flsh'" in line


def test_the_backend_reaches_every_attention_processor_and_keeps_the_output(tiny_cfg):
    policy = FluxPolicy.load(tiny_cfg.model, torch.device("cpu"))
    emb = policy.encode_prompts(["a red fox"])
    x = policy.initial_latents(1, 64, 64, [torch.Generator().manual_seed(0)])
    with torch.no_grad():
        before = policy.velocity(policy.transformer, x, 0.7, emb, 64, 64, 3.5)
        set_attention_backend(policy.transformer, "_native_math")
        after = policy.velocity(policy.transformer, x, 0.7, emb, 64, 64, 3.5)
    backends = {str(getattr(m.processor, "_attention_backend", None).value) for m in policy.transformer.modules()
                if hasattr(getattr(m, "processor", None), "_attention_backend")}
    assert backends == {"_native_math"}
    assert torch.allclose(before, after, atol=1e-5)


def test_the_backend_stays_with_its_model_and_not_the_processs_default(tiny_cfg):
    """diffusers' `set_attention_backend` also sets its process-wide default: another model in the
    process, whose processors name no backend, would run it unasked (the GPU plan's next recipe in the
    same process planned flash attention for a recipe that asked for none)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    default = _AttentionBackendRegistry._active_backend
    first, other = (FluxPolicy.load(tiny_cfg.model, torch.device("cpu")) for _ in range(2))
    set_attention_backend(first.transformer, "_native_math")
    assert _AttentionBackendRegistry._active_backend == default
    assert {getattr(m.processor, "_attention_backend", None) for m in other.transformer.modules()
            if hasattr(getattr(m, "processor", None), "_attention_backend")} == {None}


def test_the_default_sdpa_leaves_cudnn_out_for_the_policy_and_the_sft_model(tiny_cfg, tmp_path, monkeypatch):
    """cuDNN's fused attention fails in its backward at FLUX's 512 px shape on Hopper (the GPU lane's
    diagnose.log): the trainer's default attention, and the SFT model's, take PyTorch's SDPA without it.
    An explicit backend is left alone."""
    from paco_ds.sft.config import load_sft_config
    from paco_ds.sft.model import load_model, write_tiny_base

    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(on))
    policy = FluxPolicy.load(tiny_cfg.model, torch.device("cpu"))
    set_attention_backend(policy.transformer, "_native_math")
    assert calls == []
    for name in (None, "native"):
        set_attention_backend(policy.transformer, name)
    assert calls == [False, False]
    write_tiny_base(tmp_path / "base", 0)
    load_model(tmp_path / "base", load_sft_config("configs/tiny/reward_sft.yaml", []), torch.float32)
    load_model(tmp_path / "base", load_sft_config("configs/tiny/reward_sft.yaml", ["model.attn_implementation=eager"]),
               torch.float32)
    assert calls == [False, False, False]


def test_leaving_cudnn_out_is_the_process_wide_torch_switch():
    from paco_ds.models.attention import sdpa_without_cudnn

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        sdpa_without_cudnn()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


# ------------------------------------------------------------------------------------------------
# The same choice for the Qwen2.5-VL models: the judge's hf engine and the reward-model SFT take
# transformers' `attn_implementation`, checked the same way.
# ------------------------------------------------------------------------------------------------
def test_the_judge_and_sft_refuse_what_cannot_run_in_one_line_naming_the_key(tmp_path):
    from paco_ds.sft.config import load_sft_config

    for key, load in (("reward_servers.attn_implementation", lambda s: load_config(TINY, [s])),
                      ("model.attn_implementation", lambda s: load_sft_config("configs/tiny/reward_sft.yaml", [s]))):
        for value, expect in (("spda", "unknown attention implementation 'spda' (did you mean 'sdpa'?)"),
                              ("kernels-community/flash-attn2", "a kernel on the Hugging Face Hub"),
                              ("flash_attention_2", "needs flash-attn 2")):  # not installed here
            with pytest.raises(ConfigError) as err:
                load(f"{key}={value}")
            assert f"config key '{key}'" in str(err.value) and expect in str(err.value) and "\n" not in str(err.value)
        load(f"{key}=eager")
    with pytest.raises(ConfigError, match="vLLM picks its attention backend itself"):
        load_config(TINY, ["reward_servers.engine=vllm", "reward_servers.models=[{name: j, path: /x}]",
                           "reward_servers.attn_implementation=sdpa"])


def test_a_flash_implementation_is_refused_on_a_cpu_device(monkeypatch):
    import transformers.utils

    from paco_ds.models.attention import check_attn_implementation

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)  # as on a GPU machine
    check_attn_implementation("flash_attention_2", "model.attn_implementation")  # the name and package pass
    with pytest.raises(ConfigError, match=r"'flash_attention_2' runs on CUDA devices; this process runs on cpu"):
        check_attn_implementation("flash_attention_2", "model.attn_implementation", torch.device("cpu"))


def test_the_judge_engine_and_the_sft_model_load_with_the_choice_and_score_the_same(tmp_path):
    """eager against the default (SDPA): the setting reaches the model and changes no score."""
    from paco_ds.serving.hf_engine import Engine
    from paco_ds.sft.config import load_sft_config
    from paco_ds.sft.model import load_model, write_tiny_base

    engines = {name: Engine.load(None, tiny=True, device="cpu", attn_implementation=name) for name in (None, "eager")}
    assert engines["eager"].model.config.text_config._attn_implementation == "eager"
    assert engines[None].model.config.text_config._attn_implementation == "sdpa"
    ids = torch.tensor([[1, 5, 9, 17, 33, 2]])
    with torch.no_grad():
        logits = {k: e.model(input_ids=ids).logits for k, e in engines.items()}
    assert torch.allclose(logits[None], logits["eager"], atol=1e-5)

    write_tiny_base(tmp_path / "base", 0)
    cfg = load_sft_config("configs/tiny/reward_sft.yaml", ["model.attn_implementation=eager"])
    model = load_model(tmp_path / "base", cfg, torch.float32)
    assert model.config.text_config._attn_implementation == "eager"


def test_a_backend_without_masks_is_refused_for_a_family_that_masks_its_prompt_tokens():
    qwen = "configs/tiny/qwen_image_t2is.yaml"
    msg = _refused("model.attention_backend=_native_flash", recipe=qwen)
    assert "'_native_flash' takes no attention mask" in msg and "QwenImagePolicy" in msg and "flash_varlen" in msg
    check_recipe(load_config(qwen, ["model.attention_backend=_native_efficient"]), 2)  # SDPA's masked kernel
    check_recipe(load_config(TINY, ["model.attention_backend=_native_flash"]), 2)  # FLUX passes no mask
    assert "computes in fp16/bf16 only" in _refused("model.attention_backend=_native_flash", "model.dtype=fp32")


def test_the_mask_free_backends_are_those_diffusers_refuses_a_mask_in():
    """NO_MASK_BACKENDS against the installed diffusers: every backend whose function raises on a mask."""
    import inspect
    import re

    from diffusers.models import attention_dispatch as dispatch

    from paco_ds.models.attention import NO_MASK_BACKENDS

    source = inspect.getsource(dispatch)
    refusing = set()
    for m in re.finditer(r"@_AttentionBackendRegistry\.register\(\s*AttentionBackendName\.(\w+)", source):
        body = source[m.end():source.find("@_AttentionBackendRegistry.register", m.end()) % (len(source) + 1)]
        if "attn_mask" in body and "is not supported" in body:
            refusing.add(getattr(dispatch.AttentionBackendName, m.group(1)).value)
    assert NO_MASK_BACKENDS == {b for b in refusing if not b.endswith("_hub")}


def test_native_on_a_family_that_calls_sdpa_itself_is_what_it_runs():
    from paco_ds.grpo.plan import load_config as load

    cfg = load("configs/tiny/sd3_geneval.yaml", ["model.attention_backend=native"])
    policy = SD3Policy.load(cfg.model, torch.device("cpu"))
    set_attention_backend(policy.transformer, "native")  # no processor dispatches; nothing to route, no error
    processors = {type(m.processor).__name__ for m in policy.transformer.modules() if hasattr(m, "processor")}
    assert processors and all("AttnProcessor2_0" in p for p in processors)  # SD3's own, calling SDPA
