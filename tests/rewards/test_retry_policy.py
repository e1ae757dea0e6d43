"""The reward clients' one retry rule (paco_ds/rewards/client.py RetryPolicy): transient statuses
(408, 429, 5xx) are retried with jittered backoff, at least as late as the server's Retry-After asks,
within the budget; against a real loopback server for the OpenAI-API client."""
import email.utils
import http.server
import json
import threading
import time

import pytest

from paco_ds.errors import RewardError
from paco_ds.rewards.client import ChatClient, RetryPolicy, retry_after

pytestmark = pytest.mark.fast


def test_retry_after_reads_seconds_and_http_dates():
    assert retry_after({"retry-after": "2"}) == 2.0
    assert retry_after({"retry-after": "-3"}) == 0.0
    assert retry_after({}) is None and retry_after(None) is None and retry_after({"retry-after": "soon"}) is None
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 < retry_after({"retry-after": later}) <= 30
    policy = RetryPolicy(backoff=0.01, max_backoff=0.01)
    assert all(0.005 <= policy.delay(a) <= 0.01 for a in range(5))
    assert policy.delay(0, asked=1.5) == 1.5  # the server's wish wins over a shorter backoff


class _BusyModels(http.server.BaseHTTPRequestHandler):
    """GET /v1/models: 429 with Retry-After for the first `busy` requests (408 with `status`), then the list."""
    busy, status, after, seen = 0, 429, "1", []

    def log_message(self, *args):
        pass

    def do_GET(self):
        cls = type(self)
        cls.seen.append(time.monotonic())
        if cls.busy:
            cls.busy -= 1
            code, body = cls.status, b'{"error": {"message": "busy"}}'
            headers = {"Retry-After": cls.after} if cls.after else {}
        else:
            code, headers = 200, {}
            body = json.dumps({"object": "list", "data": [{"id": "judge", "object": "model", "created": 0,
                                                            "owned_by": "paco_ds"}]}).encode()
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture()
def busy_server():
    _BusyModels.busy, _BusyModels.status, _BusyModels.after, _BusyModels.seen = 0, 429, "1", []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BusyModels)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def test_a_429_is_retried_after_the_servers_retry_after(busy_server):
    _BusyModels.busy = 1
    client = ChatClient(busy_server, "judge", retry=RetryPolicy(backoff=0.01, max_backoff=0.01, budget=10))
    try:
        client.check_model()  # served after one 429
    finally:
        client.close()
    first, second = _BusyModels.seen
    assert second - first >= 1.0  # Retry-After: 1, not the 10 ms backoff


def test_a_408_is_retried_and_a_budget_shorter_than_retry_after_gives_up_in_time(busy_server):
    _BusyModels.busy, _BusyModels.status, _BusyModels.after = 1, 408, ""
    client = ChatClient(busy_server, "judge", retry=RetryPolicy(backoff=0.01, max_backoff=0.01, budget=10))
    client.check_model()
    client.close()
    assert len(_BusyModels.seen) == 2
    _BusyModels.busy, _BusyModels.status, _BusyModels.after, _BusyModels.seen = 10, 429, "30", []
    client = ChatClient(busy_server, "judge", retry=RetryPolicy(backoff=0.01, max_backoff=0.01, budget=2))
    t0 = time.monotonic()
    with pytest.raises(RewardError, match="HTTP 429"):
        client.check_model()
    client.close()
    assert time.monotonic() - t0 < 2 and len(_BusyModels.seen) == 1  # waiting 30 s would overrun the budget
