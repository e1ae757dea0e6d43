"""A judge colocated with training sleeps and wakes (paco_ds/serving/sleep.py): the hf engine's
vLLM-style endpoints served for real (503 while asleep, in-flight requests drained before the
sleep, identical scores after the wake, the judge's RSS awake and asleep), vLLM's command line in
sleep mode, and the tiny recipe run on one node with `cluster.colocate: true` counting its judge's
sleeps and wakes in the metrics."""
import os
import threading
from pathlib import Path

import httpx
import pytest

from paco_ds.serving import manager
from paco_ds.recipe.servers import ServersConfig
from paco_ds.serving.sleep import JudgeSleep, JudgeSleepError, base_url, judges_for_run
from paco_ds.serving.vllm import vllm_command

pytestmark = pytest.mark.fast

MODEL = "paco-reward-tiny"
TOKEN_ENV, TOKEN = "PACO_TEST_SLEEP_TOKEN", "sleep-token-1"
H = {"authorization": f"Bearer {TOKEN}"}
REQUEST = {"model": MODEL, "max_tokens": 1, "logprobs": True, "top_logprobs": 20,
           "messages": [{"role": "user", "content": "Do the two images show the same subject? Answer Yes or No."}]}


def rss_kib(pid: int) -> int:
    return next(int(l.split()[1]) for l in Path(f"/proc/{pid}/status").read_text().splitlines()
                if l.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    os.environ[TOKEN_ENV] = TOKEN
    state_dir = tmp_path_factory.mktemp("judge")
    cfg = ServersConfig(engine="hf", models=[{"name": MODEL, "tiny": True}], port=0, max_logprobs=267,
                        api_key_env=TOKEN_ENV, startup_timeout=120, max_batch_size=1)
    try:
        state = manager.start(cfg, state_dir, exit_with_parent=True)
        yield state, state_dir
    finally:
        manager.stop(state_dir)
        os.environ.pop(TOKEN_ENV, None)


def _chat(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=REQUEST, headers=H, timeout=120)


def test_sleep_refuses_requests_frees_the_weights_and_wakes_to_identical_scores(judge):
    state, _ = judge
    (server,) = state["servers"]
    url, pid = server["url"], server["pid"]
    before = _chat(url)
    assert before.status_code == 200
    helper = JudgeSleep([f"{url}/v1"], TOKEN)
    assert helper.urls == [url] and helper.is_sleeping() == {url: False}
    rss_awake = rss_kib(pid)

    helper.sleep()
    assert helper.is_sleeping() == {url: True}
    refused = _chat(url)
    assert refused.status_code == 503 and "asleep" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "1"
    rss_asleep = rss_kib(pid)
    assert helper.sleep() == 0.0  # already asleep: nothing asked of the judge, nothing counted

    helper.wake()
    assert helper.is_sleeping() == {url: False}
    after = _chat(url)
    assert after.status_code == 200
    assert after.json()["choices"][0]["logprobs"] == before.json()["choices"][0]["logprobs"]  # bit for bit
    m = helper.take_metrics()
    assert m["judge/sleeps"] == 1 and m["judge/wakes"] == 1 and m["judge/wake_s"] > 0
    stats = httpx.get(f"{url}/stats", headers=H).json()
    assert stats["sleeps"] == 1 and stats["wakes"] == 1 and stats["errors_503"] == 1
    # The tiny judge's weights (a few MB) leave the process: its RSS drops by at least most of them.
    print(f"judge RSS awake {rss_awake} KiB, asleep {rss_asleep} KiB")
    assert rss_asleep < rss_awake


def test_sleep_drains_requests_in_flight_and_needs_the_token(judge):
    state, _ = judge
    url = state["servers"][0]["url"]
    assert httpx.post(f"{url}/sleep?level=1", timeout=30).status_code == 401
    assert httpx.post(f"{url}/sleep?level=2", headers=H, timeout=30).status_code == 400
    # vLLM's modes: "abort" (its default) and "keep" are not what this engine does; "wait" is
    refused = httpx.post(f"{url}/sleep?level=1&mode=abort", headers=H, timeout=30)
    assert refused.status_code == 400 and "implements 'wait'" in refused.text
    codes: list[int] = []
    threads = [threading.Thread(target=lambda: codes.append(_chat(url).status_code)) for _ in range(4)]
    start = httpx.get(f"{url}/stats", headers=H).json().get("requests", 0)
    for t in threads:
        t.start()
    while httpx.get(f"{url}/stats", headers=H).json().get("requests", 0) < start + 4:
        pass  # all four are past the gate (max_batch_size 1: at most one is generating)
    r = httpx.post(f"{url}/sleep?level=1", headers=H, timeout=120)
    for t in threads:
        t.join()
    assert r.status_code == 200 and codes == [200] * 4  # every request sent before the sleep finished
    assert r.json()["freed_bytes"] > 0
    assert httpx.post(f"{url}/wake_up", headers=H, timeout=120).json()["is_sleeping"] is False
    assert _chat(url).status_code == 200


def test_a_request_to_a_sleeping_judge_is_answered_after_its_wake(judge):
    """The reward client meets the sleeping judge's 503 + Retry-After: 1 and retries at that pace
    (its own backoff here is 10 ms) until the judge wakes, within its budget."""
    import time

    from paco_ds.rewards.client import ChatClient, RetryPolicy

    state, _ = judge
    url = state["servers"][0]["url"]
    helper = JudgeSleep([f"{url}/v1"], TOKEN)
    helper.sleep()
    refused_before = httpx.get(f"{url}/stats", headers=H).json()["errors_503"]
    client = ChatClient(f"{url}/v1", MODEL, api_key=TOKEN, retry=RetryPolicy(backoff=0.01, max_backoff=0.01, budget=60))
    waker = threading.Timer(1.5, helper.wake)
    t0 = time.monotonic()
    waker.start()
    try:
        top = client.run([client.first_token_logprobs([{"type": "text", "text": REQUEST["messages"][0]["content"]}],
                                                      20)])[0]
    finally:
        client.close()
        waker.join()
    assert len(top) == 20 and time.monotonic() - t0 >= 1.5
    refused = httpx.get(f"{url}/stats", headers=H).json()["errors_503"] - refused_before
    assert 1 <= refused <= 3  # about one refusal per second asleep, not one per 10 ms


def test_helper_names_a_judge_that_does_not_answer():
    with pytest.raises(JudgeSleepError, match=r"judge http://127.0.0.1:9: POST /sleep\?level=1&mode=wait failed"):
        JudgeSleep(["http://127.0.0.1:9/v1"]).sleep()
    # A reward batch still at the judges: refused before any judge is asked (vLLM would abort it
    # or stall it until it wakes).
    with pytest.raises(JudgeSleepError, match=r"2 reward batches are still in flight at the judges \(http://h:1\)"):
        JudgeSleep(["http://h:1/v1"]).sleep(in_flight=2)
    assert base_url("http://h:1/v1/") == "http://h:1"


def test_judges_for_run_under_the_cluster_launcher_are_this_hosts():
    servers = ServersConfig(engine="hf", models=[{"name": MODEL, "tiny": True}])
    env = {"PACO_REWARD_ENDPOINTS": f"{MODEL}=http://127.0.0.1:8000/v1+http://192.0.2.7:8000/v1"}
    assert judges_for_run(servers, "/nonexistent", 0, env) == ["http://127.0.0.1:8000"]
    assert judges_for_run(servers, "/nonexistent", 1, env) == []  # only local rank 0 owns them


def test_vllm_in_sleep_mode():
    cfg = ServersConfig(engine="vllm", models=[{"name": MODEL, "path": "/ckpt"}])
    argv, env = vllm_command(cfg.models[0], cfg, "127.0.0.1", 8000, [0], {}, sleep_mode=True)
    assert "--enable-sleep-mode" in argv and env["VLLM_SERVER_DEV_MODE"] == "1"
    argv, env = vllm_command(cfg.models[0], cfg, "127.0.0.1", 8000, [0], {})
    assert "--enable-sleep-mode" not in argv and "VLLM_SERVER_DEV_MODE" not in env


