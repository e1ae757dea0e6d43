"""`launch/evaluate.py reward` on the tiny offline benchmarks (made in their shipped layouts) with
the tiny judge, served by the hf engine on loopback and loaded in-process: the same scores, a
resumed run that reports what an uninterrupted one does, requests deduplicated, the outputs."""
import json
import math

import pytest

from conftest import REPO, run_cli
from paco_ds.eval import reward_bench
from paco_ds.eval.benchmarks import make_tiny_consistency_rank, make_tiny_edit_reward
from paco_ds.eval.judge import LocalJudge, ServedJudge
from paco_ds.serving import manager
from paco_ds.recipe.servers import ServersConfig


MODEL = "paco-reward-tiny"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("benches")
    return make_tiny_consistency_rank(root / "cr"), make_tiny_edit_reward(root / "er")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = tmp_path_factory.mktemp("judge")
    cfg = ServersConfig(engine="hf", models=[{"name": MODEL, "tiny": True}], port=0, max_logprobs=267,
                        max_batch_size=1, startup_timeout=120)
    try:
        yield manager.start(cfg, state, exit_with_parent=True)["endpoints"][MODEL]
    finally:
        manager.stop(state)


@pytest.fixture(scope="module")
def local():
    return LocalJudge("tiny", top_logprobs=267)


def _scores(summary):
    if summary["bench"] == "consistency_rank":
        return [s for it in summary["items"] for s in it["scores"]]
    return [s for it in summary["items"] for k in ("prompt_following", "consistency") for s in it[k]]


@pytest.mark.fast
@pytest.mark.parametrize("bench", ["consistency_rank", "edit_reward"])
def test_served_and_in_process_judges_agree_and_a_resumed_run_equals_one_run(bench, data, server, local, tmp_path):
    root = data[0] if bench == "consistency_rank" else data[1]
    served = ServedJudge(server, top_logprobs=267)
    try:
        a = reward_bench.run(bench, root, served, tmp_path / "served", chunk=2)
    finally:
        served.close()
    b = reward_bench.run(bench, root, local, tmp_path / "local", chunk=2)
    sa, sb = _scores(a), _scores(b)
    assert len(sa) == len(sb) > 0 and all(math.isfinite(x) for x in sa)
    assert max(abs(x - y) for x, y in zip(sa, sb)) < 1e-5
    assert len(set(round(x, 6) for x in sa)) > 1  # the judge tells the images apart
    # questions asked once: ConsistencyRank 3 items x 4 candidates; EditReward 4 pairs x 2 outputs x
    # 2 prompts although each pair is listed 3 times (one record per dimension)
    assert a["requests"] == (12 if bench == "consistency_rank" else 16)

    # interrupted after one item, a torn last line, then resumed: the same table, nothing counted twice
    out = tmp_path / "resumed"
    first = reward_bench.run(bench, root, local, out, chunk=2, max_new_items=1)
    assert first["complete"] is False
    with (out / "items.jsonl").open("a") as f:
        f.write('{"hash": "cut sho')
    c = reward_bench.run(bench, root, local, out, chunk=2)
    n_items = len(b["items"])
    assert c["metrics"] == b["metrics"]
    assert len(c["items"]) == n_items and _scores(c) == _scores(b)
    again = reward_bench.run(bench, root, local, out, chunk=2)      # complete: nothing asked again
    assert again["requests"] == 0 and again["metrics"] == b["metrics"]
    for name in ("results.json", "results.csv", "items.csv", "worst.html"):
        assert (out / name).stat().st_size > 0
    page = (out / "worst.html").read_text()
    assert page.count("<img src=\"data:image/png;base64,") >= (5 if bench == "consistency_rank" else 3)


@pytest.mark.runs_more  # a launch of launch/evaluate.py: make test-runs-more
def test_cli_table_and_bad_input(data, tmp_path):
    out = tmp_path / "cli"
    p = run_cli(str(REPO / "launch/evaluate.py"), "reward", "--bench", "edit_reward", "--data", str(data[1]),
                "--judge", "tiny", "--top-logprobs", "267", "--out", str(out), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "subject-add" in p.stdout and "average" in p.stdout and "advanced" in p.stdout
    res = json.loads((out / "results.json").read_text())
    assert set(res["metrics"]["strict"]) == {"prompt_following", "consistency", "overall"}
    header = (out / "results.csv").read_text().splitlines()[0]
    assert header.startswith("task_type,prompt_following_strict,prompt_following_geq")

    bad = tmp_path / "bad"
    (bad / "images").mkdir(parents=True)
    (bad / "prompt_data.jsonl").write_text('{"idx": "0"}\n')
    (bad / "consistency_full_rank.jsonl").write_text('{"folder": "0", "ref_image": "r.png"}\n')
    p = run_cli(str(REPO / "launch/evaluate.py"), "reward", "--bench", "consistency_rank", "--data", str(bad),
                "--judge", "tiny", "--out", str(tmp_path / "o"), timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].endswith("consistency_full_rank.jsonl:1: no 'comp_images'")
    p = run_cli(str(REPO / "launch/evaluate.py"), "reward", "--bench", "edit_reward", "--data", str(data[1]),
                "--judge", "http://127.0.0.1:9/v1", "--out", str(tmp_path / "o2"), timeout=300,
                )
    assert p.returncode == 2 and "Traceback" not in p.stderr and "127.0.0.1:9" in p.stderr
