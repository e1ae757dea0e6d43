"""The built-in judge server and gateway under hostile clients (paco_ds/serving/protocol.py):
a lone surrogate or a body nested 200,000 deep is a 400, not a 500; idle and half-sent
connections are closed; sleep and wake need the token when one is set, and a loopback peer when
none is.

The requests under test are refused before the model is used, so the engine here is a stub; the
timeouts are tested on a real uvicorn server in a subprocess (protocol.serve, short timeouts).
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient

from conftest import REPO
from paco_ds.serving import gateway, hf_engine
from paco_ds.serving.protocol import MAX_JSON_DEPTH

pytestmark = pytest.mark.fast

MODEL = "judge"
TOKEN_ENV = "PACO_TEST_JUDGE_TOKEN"


class StubEngine:
    """What create_app touches before a request reaches the model; sleep/wake do nothing."""

    def sleep(self, offload_dir=None) -> int:
        return 0

    def wake_up(self) -> None:
        pass


def _engine_app(**kw):
    return hf_engine.create_app(StubEngine(), MODEL, api_key_env=TOKEN_ENV, **kw)


def _gateway_app():
    return gateway.create_app({MODEL: "http://127.0.0.1:9"}, api_key_env=TOKEN_ENV)


CHAT = {"messages": [{"role": "user", "content": "Same?"}], "max_tokens": 1}


def _raw(body: str) -> dict:
    return {"content": body.encode("utf-8"), "headers": {"content-type": "application/json"}}


@pytest.mark.parametrize("make_app", [_engine_app, _gateway_app], ids=["hf_engine", "gateway"])
def test_a_model_name_with_a_lone_surrogate_is_a_400(make_app, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with TestClient(make_app(), raise_server_exceptions=False) as client:
        r = client.post("/v1/chat/completions", **_raw(json.dumps({**CHAT, "model": "judge\ud83d"})))
        assert r.status_code == 400, r.text
        assert "'model' holds a lone UTF-16 surrogate" in r.json()["error"]["message"]
        # a surrogate pair (an emoji) is ordinary text: the usual 404 for a model not served here
        r = client.post("/v1/chat/completions", **_raw(json.dumps({**CHAT, "model": "judge\U0001F600"})))
        assert r.status_code == 404


@pytest.mark.parametrize("make_app", [_engine_app, _gateway_app], ids=["hf_engine", "gateway"])
@pytest.mark.parametrize("depth", [200_000, MAX_JSON_DEPTH + 1])
def test_a_deeply_nested_body_is_a_400(make_app, depth, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    body = '{"model": "judge", "x": ' + "[" * depth + "]" * depth + "}"
    with TestClient(make_app(), raise_server_exceptions=False) as client:
        r = client.post("/v1/chat/completions", **_raw(body))
        assert r.status_code == 400, r.text
        assert "nested deeper than this server accepts" in r.json()["error"]["message"]


def test_sleep_and_wake_are_refused_to_a_remote_peer_without_a_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    app = _engine_app()
    with TestClient(app, client=("10.1.2.3", 40000)) as remote:
        for path in ("/sleep", "/wake_up"):
            r = remote.post(path)
            assert r.status_code == 403 and "refused from 10.1.2.3" in r.json()["error"]["message"]
        assert remote.get("/is_sleeping").json() == {"is_sleeping": False}  # still awake
    for host in ("127.0.0.1", "::1"):
        with TestClient(app, client=(host, 40000)) as local:
            assert local.post("/sleep").json()["is_sleeping"] is True
            assert local.post("/wake_up").json()["is_sleeping"] is False


def test_sleep_and_wake_need_the_token_when_one_is_set(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    app = _engine_app()
    with TestClient(app, client=("127.0.0.1", 40000)) as local:
        assert local.post("/sleep").status_code == 401  # loopback is not enough with a token set
    with TestClient(app, client=("10.1.2.3", 40000), headers={"authorization": "Bearer s3cret"}) as remote:
        assert remote.post("/sleep").json()["is_sleeping"] is True
        assert remote.post("/wake_up").json()["is_sleeping"] is False


_SERVER = """
import sys
sys.path.insert(0, {repo!r})
from fastapi import FastAPI, Request
from paco_ds.serving.protocol import serve

app = FastAPI()

@app.post("/echo")
async def echo(request: Request):
    return {{"n": len(await request.body())}}

serve(app, "127.0.0.1", {port}, idle_timeout=1.0, request_timeout=3.0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", _SERVER.format(repo=str(REPO), port=port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.2)
    yield port
    proc.terminate()
    proc.wait(timeout=10)


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(4096):  # a 400/408-style reply may come first; then EOF
            pass
        return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


def test_idle_and_half_sent_connections_are_closed(server):
    idle = [socket.create_connection(("127.0.0.1", server)) for _ in range(200)]
    half = socket.create_connection(("127.0.0.1", server))
    half.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123")  # 4 of 100 bytes
    assert all(_closed_by_server(s, 10) for s in idle)
    assert _closed_by_server(half, 10)
    for s in idle + [half]:
        s.close()
    # a slowloris (a header byte every 0.3 s, inside the 1 s idle timeout) is closed by the server: only
    # the 3 s request timeout can close a connection that keeps sending (the 40 bytes turn a hang into a
    # failure: 12 s at most)
    with socket.create_connection(("127.0.0.1", server)) as slow:
        slow.sendall(b"POST /echo HTTP/1.1\r\nX-Slow: ")
        sent, closed = 0, False
        while sent < 40 and not closed:
            try:
                slow.sendall(b"a")
            except OSError:
                closed = True
                break
            sent += 1
            closed = _closed_by_server(slow, 0.3)
        assert closed, f"still open after {sent} bytes"
        assert sent >= 4, f"closed after {sent} bytes: before the client had been slow for longer than the idle timeout"
    # a whole request is still answered, and keep-alive within the timeout works
    with socket.create_connection(("127.0.0.1", server)) as ok:
        for _ in range(2):
            ok.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            ok.settimeout(5)
            got = b""
            while b'{"n":3}' not in got:
                chunk = ok.recv(4096)
                assert chunk, f"closed after {got!r}"
                got += chunk
            time.sleep(0.3)


def _png_uri(size, mode="1", fmt="PNG", **save):
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size).save(buf, fmt, **save)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _image_chat(uri):
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "Same?"}]}]}


def test_image_size_is_read_from_the_header_even_behind_a_large_exif_block():
    from paco_ds.serving.protocol import _HEADER_B64_CHARS, image_size

    assert image_size(_png_uri((8000, 6000))) == (8000, 6000)
    exif = b"Exif\x00\x00" + b"x" * 60_000  # pushes a JPEG's size marker past the decoded prefix
    uri = _png_uri((300, 200), mode="RGB", fmt="JPEG", exif=exif)
    assert len(uri) > _HEADER_B64_CHARS and image_size(uri) == (300, 200)


@pytest.mark.parametrize("make_app", [_engine_app, _gateway_app], ids=["hf_engine", "gateway"])
def test_an_image_over_the_pixel_limit_is_refused_from_its_header(make_app, monkeypatch):
    """The stub engine cannot prepare anything: a refusal here happened before any decode."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with TestClient(make_app(), raise_server_exceptions=False) as client:
        r = client.post("/v1/chat/completions", json=_image_chat(_png_uri((8000, 8000))))
        assert r.status_code == 400, r.text
        assert ("image of 8000x8000 = 64000000 pixels exceeds this server's limit of 16777216 pixels "
                "(max_image_pixels)") in r.json()["error"]["message"]


def test_a_request_whose_images_exceed_the_preparation_budget_is_a_413(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with TestClient(_engine_app(prepare_memory_mb=0.5), raise_server_exceptions=False) as client:
        r = client.post("/v1/chat/completions", json=_image_chat(_png_uri((256, 256))))  # 64 Ki px x 20 B = 1.25 MiB
        assert r.status_code == 413, r.text
        assert "over this server's budget of 0.5 MiB (prepare_memory_mb)" in r.json()["error"]["message"]


def test_the_preparation_budget_makes_a_large_request_wait_for_memory_not_for_a_thread():
    import asyncio

    from paco_ds.serving.protocol import MemoryBudget

    async def scenario():
        budget = MemoryBudget(100)
        order = []
        first_in = asyncio.Event()
        release = asyncio.Event()

        async def holder():
            async with budget.hold(70):
                order.append("first in")
                first_in.set()
                await release.wait()
            order.append("first out")

        async def second():
            await first_in.wait()
            async with budget.hold(50):  # 70 + 50 > 100: waits for the first
                order.append("second in")
                assert budget.used == 50

        async def small():
            await first_in.wait()
            async with budget.hold(30):  # 70 + 30 fits: no wait
                order.append("small in")
            release.set()

        await asyncio.wait_for(asyncio.gather(holder(), second(), small()), timeout=30)
        return order, budget

    order, budget = asyncio.run(scenario())
    assert order == ["first in", "small in", "first out", "second in"]
    assert budget.waits == 1 and budget.used == 0
