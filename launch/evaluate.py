"""Evaluation commands.

  python launch/evaluate.py reward --bench consistency_rank|edit_reward --data DIR --judge URL|PATH [--out DIR]
      a reward model on ConsistencyRank or EditReward-Bench: a served judge (http://host:port/v1) or a
      checkpoint directory loaded in this process (`tiny`: the offline tiny judge)
  deepspeed [--num_gpus N] launch/evaluate.py policy --config RECIPE [--lora DIR | --checkpoint latest|DIR]
      the recipe's test prompts sampled with ODE steps at the test resolution and scored with the test
      rewards, base against the trained LoRA, in one table with grids
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paco_ds.errors import exit_on_user_error, run_entry_point  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("reward", help="a judge on ConsistencyRank or EditReward-Bench")
    r.add_argument("--bench", required=True, choices=["consistency_rank", "edit_reward"])
    r.add_argument("--data", required=True, help="the benchmark folder, in the layout it ships in")
    r.add_argument("--judge", required=True, help="http(s)://host:port/v1, a checkpoint directory, or 'tiny'")
    r.add_argument("--model", default=None, help="served model name (default: the server's first)")
    r.add_argument("--out", default=None, help="output folder (default runs/eval/<bench>); results resume here")
    r.add_argument("--template", type=int, default=3, choices=[1, 2, 3], help="ConsistencyRank prompt version")
    r.add_argument("--labels", choices=["auto", "on", "off"], default="auto",
                   help="'<imgN>: ' before each image (auto: on for ConsistencyRank, as the reference's prompt)")
    r.add_argument("--top-logprobs", type=int, default=20)
    r.add_argument("--batch-size", type=int, default=8, help="items per chunk (and the in-process batch)")
    r.add_argument("--max-items", type=int, default=None, help="only the first N items")
    r.add_argument("--max-new-items", type=int, default=None, help="score at most N more items, then stop")
    r.add_argument("--worst", type=int, default=8, help="items on worst.html")
    pol = sub.add_parser("policy", help="base against trained LoRA on the recipe's test prompts")
    from paco_ds.recipe.loader import add_recipe_arguments

    add_recipe_arguments(pol)
    src = pol.add_mutually_exclusive_group()
    src.add_argument("--lora", default=None, help="an exported LoRA directory (pytorch_lora_weights.safetensors)")
    src.add_argument("--checkpoint", default=None, help="'latest' or a checkpoint directory of the recipe's run")
    pol.add_argument("--out", default=None, help="output folder (default <run_dir>/eval)")
    pol.add_argument("--no-base", action="store_true", help="skip the base model")
    return p.parse_known_args(argv)


def main(argv=None):
    args, rest = parse_args(argv)
    rest = [a for a in rest if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    if rest:
        print(f"evaluate: error: unrecognized arguments: {' '.join(rest)}", file=sys.stderr)
        raise SystemExit(2)
    with exit_on_user_error("evaluate"):
        if args.command == "reward":
            from paco_ds.eval import reward_bench
            from paco_ds.eval.judge import open_judge

            judge = open_judge(args.judge, args.model, args.top_logprobs, args.batch_size)
            try:
                labels = None if args.labels == "auto" else args.labels == "on"
                out = args.out or str(Path("runs/eval") / args.bench)
                res = reward_bench.run(args.bench, args.data, judge, out, template=args.template, labels=labels,
                                       chunk=args.batch_size, max_new_items=args.max_new_items, worst=args.worst,
                                       limit=args.max_items)
            finally:
                judge.close()
            if res.get("complete"):
                print(f"results: {out}/results.json, {out}/results.csv; failures: {out}/worst.html", flush=True)
        else:
            from paco_ds.eval.policy import run_policy_eval
            from paco_ds.grpo.plan import load_config

            cfg = load_config(args.config, args.overrides)
            run_policy_eval(cfg, lora=args.lora, checkpoint=args.checkpoint, out=args.out, base=not args.no_base)


if __name__ == "__main__":
    run_entry_point(main)  # exits without interpreter teardown (paco_ds/errors.py)
