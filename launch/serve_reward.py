"""Reward servers: `serve_reward.py start|status|stop`.

    python launch/serve_reward.py start --config configs/serving/vllm_paco_reward.yaml
    python launch/serve_reward.py start --engine hf --tiny paco-reward-tiny --port 0
    VLLM_MODEL_PATHS=... VLLM_MODEL_NAMES=... python launch/serve_reward.py start   # the reference's variables
    python launch/serve_reward.py status
    python launch/serve_reward.py stop
"""
import argparse
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paco_ds.errors import ConfigError, exit_on_user_error  # noqa: E402

DEFAULT_RUN_DIR = "runs/reward_servers"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start the servers and wait until they answer")
    start.add_argument("--config", help="YAML with a reward_servers section (a serving file or a training recipe)")
    start.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a key of the file, e.g. --set reward_servers.port=9000")
    start.add_argument("--engine", choices=["vllm", "hf"])
    start.add_argument("--model", dest="models", action="append", default=[], metavar="NAME=PATH",
                       help="a served model name and its checkpoint (repeatable)")
    start.add_argument("--tiny", dest="tiny_models", action="append", default=[], metavar="NAME",
                       help="serve the tiny offline Qwen2.5-VL under NAME (engine hf)")
    start.add_argument("--layout", choices=["auto", "single", "gateway", "separate"])
    start.add_argument("--host")
    start.add_argument("--port", type=int, help="public port (0: a free one)")
    start.add_argument("--gpus", help="comma-separated GPU indices to split among the models")
    start.add_argument("--gpu-memory-utilization", type=float, help="vLLM's share of each GPU's memory")
    start.add_argument("--max-model-len", type=int, help="longest prompt + answer in tokens")
    start.add_argument("--timeout", type=float, dest="startup_timeout", help="seconds to wait for readiness")
    start.add_argument("--dry-run", action="store_true", help="print the commands, start nothing")
    status = sub.add_parser("status", help="show the recorded servers (exit code 1 if one is down)")
    stop = sub.add_parser("stop", help="stop the recorded servers")
    for cmd in (start, status, stop):
        cmd.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help=f"servers.json and logs ({DEFAULT_RUN_DIR})")
    return p.parse_args(argv)


def _flags(args) -> dict:
    models = []
    for item in args.models:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--model {item!r}: expected NAME=PATH")
        models.append({"name": name, "path": path})
    models += [{"name": n, "tiny": True} for n in args.tiny_models]
    gpus = None
    if args.gpus is not None:
        try:
            gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
        except ValueError:
            raise ConfigError(f"--gpus {args.gpus!r}: expected comma-separated integers") from None
    return {"engine": args.engine, "layout": args.layout, "host": args.host, "port": args.port, "gpus": gpus,
            "gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": args.max_model_len,
            "startup_timeout": args.startup_timeout, "models": models or None}


def main(argv=None) -> None:
    args = parse_args(argv)
    with exit_on_user_error("serve_reward"):
        from paco_ds.serving import manager

        if args.command == "start":
            from paco_ds.serving.config import build_servers_config

            cfg = build_servers_config(args.config, args.overrides, _flags(args), os.environ)
            if args.dry_run:
                for s in manager.plan(cfg, manager.visible_gpus(cfg)):
                    env = " ".join(f"{k}={'***' if 'KEY' in k else v}" for k, v in s.env.items())
                    print(f"[{s.role} {s.name}] {env + ' ' if env else ''}{shlex.join(s.argv)}")
                return
            state = manager.start(cfg, args.run_dir)
            for s in state["servers"]:
                print(f"{s['role']:8} {s['name']:24} {s['url']}  pid {s['pid']}  log {s['log']}")
            for model, url in state["endpoints"].items():
                print(f"model '{model}': base_url {url}")
        elif args.command == "status":
            rows = manager.status(args.run_dir)
            for s in rows:
                print(f"{s['role']:8} {s['name']:24} {s['url']}  pid {s['pid']}  "
                      f"{'alive' if s['alive'] else 'dead'}  health {s['health']}")
            sys.exit(0 if all(s["alive"] and s["health"] == "200" for s in rows) else 1)
        else:
            stopped = manager.stop(args.run_dir)
            print(f"stopped: {', '.join(stopped)}" if stopped else f"nothing running in {args.run_dir}")


if __name__ == "__main__":
    main()
