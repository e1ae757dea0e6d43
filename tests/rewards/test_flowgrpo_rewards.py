"""Flow-GRPO's rewards: OCR with the real recogniser on rendered text, the aesthetic predictor and
ImageReward in their tiny forms against independent computations, the GenEval reward-server client
against a loopback fake server, and the VLM judge templates against a loopback OpenAI-style fake."""
import base64
import http.server
import io
import json
import math
import pickle
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from paco_ds.recipe.schema import RewardSet
from paco_ds.errors import ConfigError, RewardError
from paco_ds.rewards.base import PartialRewardError
from paco_ds.rewards.registry import build_reward
from paco_ds.rewards.runner import RewardRunner

pytestmark = pytest.mark.fast

PROMPT = 'A neon sign that says "Open Late" above a diner door'


def _render(text: str, size=(256, 128)) -> Image.Image:
    im = Image.new("RGB", size, "white")
    ImageDraw.Draw(im).text((12, 40), text, fill="black", font=ImageFont.load_default(size=28))
    return im


def _noise(n, seed=0, size=(64, 48)):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- OCR
def test_ocr_formula_hand_worked():
    from paco_ds.rewards.ocr import edit_distance, ocr_score, quoted_text

    assert quoted_text(PROMPT) == "Open Late" and quoted_text("no quotes here") is None
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3
    assert ocr_score("Open Late", "OPEN LATE") == 1.0  # spaces and case do not count
    assert ocr_score("Open Late", "Welcome! open late tonight") == 1.0  # contained: distance 0
    assert ocr_score("Open Late", "opem late") == pytest.approx(1 - 1 / 8)  # one substitution in 8 characters
    assert ocr_score("Open Late", "") == 0.0  # nothing read: the full length
    assert ocr_score("Open Late", "x" * 40) == 0.0  # capped at the target's length


def test_ocr_reads_rendered_text_with_the_real_recogniser():
    r = build_reward("ocr", {}, tiny=True, device="cpu")
    images = [_render("Open Late"), _render("Opem Late"), Image.new("RGB", (256, 128), "white")]
    res = r(images, [PROMPT] * 3)
    assert res.valid.all()
    assert res.scores[0] == 1.0  # the quoted text, read back
    assert res.scores[2] == 0.0  # a blank image: nothing read
    assert res.scores[0] > res.scores[1] > res.scores[2]
    assert res.parts["recognised_chars"][2] == 0 and res.parts["recognised_chars"][0] >= 8


def test_ocr_without_quoted_text_is_invalid_never_zero():
    r = build_reward("ocr", {}, tiny=True, device="cpu")
    images = [_render("Open Late"), _render("Open Late")]
    with pytest.raises(PartialRewardError, match="prompt 1 has no text in double quotes") as err:
        r(images, [PROMPT, "a sign with no quoted words"])
    assert err.value.failed.tolist() == [False, True]
    assert err.value.result.scores[0] == 1.0 and math.isnan(err.value.result.scores[1])
    # Under on_failure: mask the runner masks that sample only.
    runner = RewardRunner(RewardSet(terms={"ocr": {}}, on_failure="mask"), overlap=False, tiny=True, device="cpu")
    out = runner.score(images, [PROMPT, "a sign with no quoted words"], [{}, {}])["ocr"]
    assert out.valid.tolist() == [True, False] and out.scores[0] == 1.0 and runner.failures == 1
    runner.close()
    with pytest.raises(ConfigError, match="ocr.min_confidence"):
        build_reward("ocr", {"min_confidence": 1.5})


# ---------------------------------------------------------------------------------------------- aesthetic
def test_aesthetic_is_the_head_on_the_normalised_clip_embedding(tmp_path):
    from paco_ds.rewards.aesthetic import AestheticHead, load_head

    r = build_reward("aesthetic", {"batch_size": 2}, tiny=True, device="cpu")
    ims = _noise(3, seed=1)
    res = r(ims, ["x"] * 3)
    with torch.no_grad():
        pix = r.processor(images=ims, return_tensors="pt")["pixel_values"]
        e = r.model.vision_model(pixel_values=pix).pooler_output
        e = r.model.visual_projection(e)
        e = e / e.norm(dim=-1, keepdim=True)
        h = e
        for layer in r.head.layers:  # dropouts are identities in eval
            h = layer(h)
    assert res.valid.all() and np.allclose(res.scores, h[:, 0].numpy(), atol=1e-5)
    assert len(set(np.round(res.scores, 7))) == 3
    # The real loading path reads the predictor's state dict (its names: layers.0 ... layers.7).
    head = AestheticHead(32)
    torch.save(head.state_dict(), tmp_path / "head.pth")
    assert sorted(head.state_dict())[:2] == ["layers.0.bias", "layers.0.weight"]
    loaded = load_head(str(tmp_path / "head.pth"), 32)
    assert torch.equal(loaded.layers[7].weight, head.layers[7].weight)
    with pytest.raises(ConfigError, match="aesthetic.head: '.*head.pth' is not the aesthetic MLP on a 768-d"):
        load_head(str(tmp_path / "head.pth"), 768)
    with pytest.raises(ConfigError, match="aesthetic.head: no file"):
        load_head(str(tmp_path / "missing.pth"), 32)


# ---------------------------------------------------------------------------------------------- ImageReward
def test_imagereward_standardised_head_on_the_cross_attended_text_token():
    from paco_ds.rewards.imagereward import MEAN, STD

    r = build_reward("imagereward", {"batch_size": 2}, tiny=True, device="cpu")
    ims = _noise(3, seed=2)
    prompts = ["a red fox", "a blue whale in the sea", "a red fox"]
    res = r(ims, prompts)
    assert res.valid.all()
    with torch.no_grad():  # one sample at a time, by hand
        pix = r.preprocess(ims[1])[None]
        assert pix.shape[-2:] == (32, 32)
        img = r.vision(pix)
        tok = r.tokenizer([prompts[1]], padding="max_length", truncation=True, max_length=35, return_tensors="pt")
        assert tok["input_ids"].shape == (1, 35)
        txt = r.text(tok["input_ids"], attention_mask=tok["attention_mask"], encoder_hidden_states=img,
                     encoder_attention_mask=torch.ones(img.shape[:-1], dtype=torch.long)).last_hidden_state[:, 0]
        want = (r.head(txt).item() - MEAN) / STD
    assert res.scores[1] == pytest.approx(want, abs=1e-5)
    # The prompt matters, and so does the image (cross-attention reads it into the text token).
    assert res.scores[1] != res.scores[0] == pytest.approx(r([ims[0]], [prompts[0]]).scores[0], abs=1e-6)
    black, white = Image.new("RGB", (32, 32)), Image.new("RGB", (32, 32), "white")
    assert r([black], [prompts[0]]).scores[0] != r([white], [prompts[0]]).scores[0]


def _blip_names(key: str) -> str:
    """transformers' BlipVisionModel name -> BLIP's own ViT name (salesforce/BLIP models/vit.py), by hand."""
    fixed = {"embeddings.class_embedding": "cls_token", "embeddings.position_embedding": "pos_embed",
             "embeddings.patch_embedding.weight": "patch_embed.proj.weight",
             "embeddings.patch_embedding.bias": "patch_embed.proj.bias",
             "post_layernorm.weight": "norm.weight", "post_layernorm.bias": "norm.bias"}
    if key in fixed:
        return fixed[key]
    return (key.replace("encoder.layers.", "blocks.").replace("layer_norm1", "norm1").replace("layer_norm2", "norm2")
            .replace("self_attn.projection", "attn.proj").replace("self_attn.qkv", "attn.qkv"))


def test_imagereward_loads_a_checkpoint_in_the_released_naming(tmp_path):
    from paco_ds.rewards.imagereward import from_checkpoint, load_checkpoint, tiny_blip

    vision, text, _, head, _ = tiny_blip(seed=3)
    state = {**{f"blip.visual_encoder.{_blip_names(k)}": v for k, v in vision.state_dict().items()},
             **{f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()},
             **{f"mlp.{k}": v for k, v in head.state_dict().items()},
             "blip.vision_proj.weight": torch.zeros(2, 2)}  # BLIP_Pretrain's other parts are ignored
    assert "blip.visual_encoder.blocks.0.attn.qkv.weight" in state and "blip.visual_encoder.cls_token" in state
    torch.save(state, tmp_path / "ImageReward.pt")
    v2, t2, h2 = from_checkpoint(load_checkpoint(str(tmp_path / "ImageReward.pt")), vision_heads=2, text_heads=2,
                                 image_size=32)
    pix, ids = torch.randn(2, 3, 32, 32), torch.randint(0, 1000, (2, 35))
    with torch.no_grad():
        for m in (vision, text, head, v2, t2, h2):
            m.eval()
        e, e2 = vision(pixel_values=pix).last_hidden_state, v2(pixel_values=pix).last_hidden_state
        assert torch.equal(e, e2)
        r = head(text(ids, encoder_hidden_states=e).last_hidden_state[:, 0])
        assert torch.allclose(r, h2(t2(ids, encoder_hidden_states=e2).last_hidden_state[:, 0]), atol=1e-6)
    with pytest.raises(ConfigError, match="imagereward.model: the checkpoint has no blip.visual_encoder"):
        from_checkpoint({"something": torch.zeros(1)})


# ---------------------------------------------------------------------------------------------- loopback servers
def _serve(handler_cls):
    """A threaded HTTP server on the first free port of 18800-18899 (this suite's range)."""
    for port in range(18800, 18900):
        try:
            srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler_cls)
            break
        except OSError:
            continue
    else:
        pytest.skip("no free port in 18800-18899")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


class _Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, code, body: bytes, ctype="application/octet-stream", headers: dict | None = None):
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


# ---------------------------------------------------------------------------------------------- GenEval
GENEVAL_META = [
    {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
    {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}],
     "prompt": "a photo of two dogs"},
    {"tag": "color_attr", "include": [{"class": "giraffe", "count": 1, "color": "brown"},
                                      {"class": "stop sign", "count": 1, "color": "white"}],
     "prompt": "a photo of a brown giraffe and a white stop sign"},
]


class _GenEvalServer(_Quiet):
    """Flow-GRPO's reward-server protocol; the 'score' is the image's mean brightness (the server's
    detector is not the client's business), 'strict' 1 when it is above one half."""

    requests: list = []
    fail_next = 0
    busy_next = 0  # answer this many requests 429 with Retry-After: 1
    evil = False
    scores = None  # answer these 'scores' instead of the brightness

    def do_POST(self):
        data = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        cls.requests.append(data)
        if cls.scores is not None:
            n = len(data["images"])
            return self._send(200, pickle.dumps({"scores": cls.scores[:n], "strict_rewards": [1.0] * n,
                                                 "rewards": [1.0] * n}))
        if cls.busy_next:
            cls.busy_next -= 1
            return self._send(429, b"busy", "text/plain", {"Retry-After": "1"})
        if cls.fail_next:
            cls.fail_next -= 1
            return self._send(500, b"Traceback (most recent call last):\nRuntimeError: CUDA out of memory", "text/plain")
        if cls.evil:
            class Evil:
                def __reduce__(self):
                    return (print, ("pwned",))
            return self._send(200, pickle.dumps({"scores": [Evil()]}))
        bright = [np.asarray(Image.open(io.BytesIO(b), formats=["jpeg"])).mean() / 255 for b in data["images"]]
        tags = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
        group = {t: [1.0 if m["tag"] == t else -10.0 for m in data["meta_datas"]] for t in tags}
        self._send(200, pickle.dumps({
            "scores": [float(b) for b in bright], "strict_rewards": [1.0 if b > 0.5 else 0.0 for b in bright],
            "rewards": [0.0 if data["only_strict"] else 1.0 for _ in bright],
            "group_rewards": group, "group_strict_rewards": group}))


@pytest.fixture()
def geneval_server():
    _GenEvalServer.requests, _GenEvalServer.fail_next, _GenEvalServer.evil, _GenEvalServer.scores = [], 0, False, None
    _GenEvalServer.busy_next = 0
    srv, url = _serve(_GenEvalServer)
    yield url
    srv.shutdown()
    srv.server_close()


def test_geneval_client_speaks_flow_grpo_protocol(geneval_server, tmp_path):
    r = build_reward("geneval", {"base_url": geneval_server, "batch_size": 2, "jpeg_quality": 95})
    shades = [Image.new("RGB", (32, 32), (v, v, v)) for v in (40, 200, 150, 250, 90)]
    meta = [GENEVAL_META[i % 3] for i in range(5)]
    res = r(shades, [m["prompt"] for m in meta], meta)
    assert len(_GenEvalServer.requests) == 3 == r.requests  # batches of 2, 2, 1
    first = _GenEvalServer.requests[0]
    assert set(first) == {"images", "meta_datas", "only_strict"} and first["only_strict"] is True
    assert first["meta_datas"] == meta[:2] and first["images"][0][:2] == b"\xff\xd8"  # JPEG bytes
    assert np.allclose(res.scores, [v / 255 for v in (40, 200, 150, 250, 90)], atol=0.01)
    assert res.parts["strict"].tolist() == [0.0, 1.0, 1.0, 1.0, 0.0] and "correct" not in res.parts
    assert len(r.take_latencies()) == 3
    # GenEval's metadata file (one JSON record per prompt) read as a prompt file: each record reaches the server.
    from paco_ds.data.prompts_io import load_prompts

    path = tmp_path / "geneval.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in GENEVAL_META))
    items = load_prompts(path, "t2is")
    r(shades[:3], [it.prompt for it in items], [it.metadata for it in items])
    assert _GenEvalServer.requests[-2]["meta_datas"] == GENEVAL_META[:2]
    assert _GenEvalServer.requests[-1]["meta_datas"] == GENEVAL_META[2:]
    loose = build_reward("geneval", {"base_url": geneval_server, "only_strict": False})
    out = loose(shades[:1], ["p"], meta[:1])
    assert _GenEvalServer.requests[-1]["only_strict"] is False and out.parts["correct"].tolist() == [1.0]


def test_geneval_failures_are_errors_never_zero(geneval_server):
    r = build_reward("geneval", {"base_url": geneval_server, "backoff": 0.01, "retry_budget": 2.0})
    ims = _noise(2)
    # A record without GenEval's fields: that sample only.
    with pytest.raises(PartialRewardError, match=r"sample 1 .*metadata 'tag' is None") as err:
        r(ims, ["a", "b"], [GENEVAL_META[0], {"prompt": "b"}])
    assert err.value.failed.tolist() == [False, True] and np.isfinite(err.value.result.scores[0])
    # A 500 is retried; the answer after it is used.
    _GenEvalServer.fail_next = 2
    assert r(ims, ["a", "b"], GENEVAL_META[:2]).valid.all()
    # A 429 is retried after the Retry-After the server asked for (1 s), not the 10 ms backoff.
    _GenEvalServer.busy_next, t0 = 1, time.monotonic()
    assert r(ims, ["a", "b"], GENEVAL_META[:2]).valid.all()
    assert time.monotonic() - t0 >= 1.0
    # A server that keeps failing: the batch is a RewardError naming the server and its traceback's last line.
    _GenEvalServer.fail_next = 10 ** 6
    with pytest.raises(PartialRewardError, match=r"HTTP 500: RuntimeError: CUDA out of memory"):
        r(ims, ["a", "b"], GENEVAL_META[:2])
    _GenEvalServer.fail_next = 0
    # An answer that would run code when unpickled is refused.
    _GenEvalServer.evil = True
    with pytest.raises(PartialRewardError, match="malformed answer .*refused to build builtins.print"):
        r(ims[:1], ["a"], GENEVAL_META[:1])
    # GenEval's scores are fractions: 7.5 or -4 is not an answer to score with.
    for bad in (7.5, -4.0):
        _GenEvalServer.scores = [0.5, bad]
        with pytest.raises(PartialRewardError, match=rf"invalid answer: 'scores' holds {bad}, outside \[0, 1\]"):
            r(ims, ["a", "b"], GENEVAL_META[:2])
    _GenEvalServer.scores = None
    dead = build_reward("geneval", {"base_url": "http://127.0.0.1:9", "backoff": 0.01, "retry_budget": 0.5,
                                    "startup_timeout": 0})  # a server that went away after start-up
    with pytest.raises(PartialRewardError, match="connection failed"):
        dead(ims[:1], ["a"], GENEVAL_META[:1])


def test_a_geneval_server_that_nobody_started_is_one_line_at_start_up():
    """Not the 600 s retry budget at the first score: the reward is refused when it is built."""
    with pytest.raises(RewardError, match=r"geneval: nothing answers at http://127.0.0.1:9/ \(ConnectError for 1s\): "
                                          r"start Flow-GRPO's GenEval reward server there"):
        build_reward("geneval", {"base_url": "http://127.0.0.1:9", "startup_timeout": 1})


# ---------------------------------------------------------------------------------------------- VLM judges
JUDGE = "judge-tiny"


class _JudgeServer(_Quiet):
    """/v1/models and /v1/chat/completions: answers from `reply(question, images, body)` (text or
    a first-token top-logprobs list)."""

    requests: list = []
    reply = None

    def do_GET(self):
        self._send(200, json.dumps({"object": "list", "data": [{"id": JUDGE, "object": "model"}]}).encode(),
                   "application/json")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        parts = body["messages"][0]["content"]
        question = next(p["text"] for p in parts if p["type"] == "text")
        images = [Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1])))
                  for p in parts if p["type"] == "image_url"]
        type(self).requests.append((question, images, body))
        answer = type(self).reply(question, images, body)
        logprobs = None
        if isinstance(answer, list):
            logprobs = {"content": [{"token": answer[0][0], "logprob": answer[0][1], "bytes": None,
                                     "top_logprobs": [{"token": t, "logprob": lp, "bytes": None} for t, lp in answer]}]}
            answer = answer[0][0]
        self._send(200, json.dumps({
            "id": "x", "object": "chat.completion", "created": 0, "model": JUDGE,
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": logprobs,
                         "message": {"role": "assistant", "content": answer}}]}).encode(), "application/json")


@pytest.fixture()
def judge_server():
    _JudgeServer.requests = []
    srv, url = _serve(_JudgeServer)
    yield url + "/v1"
    srv.shutdown()
    srv.server_close()


def _vlm(url, **kw):
    return build_reward("vlm_score", {"model": JUDGE, "base_url": url, "max_attempts": 1, **kw})


def test_vlm_score_qwenvl_and_unifiedreward_parse_the_answer(judge_server):
    from paco_ds.rewards.vlm_score import QWENVL_TASK, UNIFIEDREWARD_TASK

    ims = [_noise(1, seed=4, size=size)[0] for size in ((64, 48), (40, 40), (50, 30))]
    answers = {(64, 48): "<Thought>sharp</Thought>\n<Score>4</Score>", (40, 40): "<Score>2</Score>",
               (50, 30): "I cannot rate this."}  # by image: requests are answered concurrently
    _JudgeServer.reply = lambda q, images, body: answers[images[0].size]
    r = _vlm(judge_server, template="qwenvl")
    res = r(ims, ["a", "b", "c"])
    assert res.scores[:2].tolist() == [0.8, 0.4] and math.isnan(res.scores[2])  # unparsed: invalid, not 0
    assert res.valid.tolist() == [True, True, False]
    q, images, body = _JudgeServer.requests[0]
    assert q == QWENVL_TASK and images[0].size in answers and body["max_completion_tokens"] == 2048
    assert body["temperature"] == 0.0
    # Cached by image and question: only the unparsed one is asked again.
    _JudgeServer.reply = lambda q, images, body: "<Score>5</Score>"
    again = r(ims, ["a", "b", "c"])
    assert len(_JudgeServer.requests) == 4 and again.scores.tolist() == [0.8, 0.4, 1.0]
    r.close()

    _JudgeServer.reply = lambda q, images, body: "The caption matches well.\nFinal Score: 3.5"
    u = _vlm(judge_server, template="unifiedreward")
    res = u(ims[:1], ['a "fox" in snow'])
    q, images, _ = _JudgeServer.requests[-1]
    assert res.scores.tolist() == [0.7]
    assert q == UNIFIEDREWARD_TASK.format(prompt='a "fox" in snow') and q.endswith('Text Caption: [a "fox" in snow]')
    assert images[0].size == (512, 512)  # Flow-GRPO sends the image at 512x512
    u.close()


@pytest.mark.parametrize("template, answer, sane", [
    ("qwenvl", "<Score>99</Score>", "<Score>3</Score>"),  # a 1-5 template: 99 and 0 are not scores
    ("qwenvl", "<Score>0</Score>", "<Score>3</Score>"),
    ("unifiedreward", "Final Score: 10", "Final Score: 3"),  # ten, not the "1" of "10"
    ("unifiedreward", "Final Score: 5.9", "Final Score: 3.0"),
    ("unifiedreward", "Final Score: 0.5", "Final Score: 3"),
])
def test_vlm_score_outside_what_the_template_allows_is_invalid_not_clamped(judge_server, template, answer, sane):
    from paco_ds.rewards.vlm_score import TEMPLATES, parse_score

    t = TEMPLATES[template]
    assert math.isnan(parse_score(answer, t.pattern, t.scale, t.valid))
    assert parse_score(sane, t.pattern, t.scale, t.valid) == pytest.approx(0.6)
    _JudgeServer.reply = lambda q, images, body: answer
    r = _vlm(judge_server, template=template)
    try:
        res = r(_noise(1, seed=9), ['a "fox"'])
        assert not res.valid.any() and math.isnan(res.scores[0])
    finally:
        r.close()


def test_vlm_score_deqa_reads_the_expected_level_from_logprobs(judge_server):
    from paco_ds.rewards.vlm_score import DEQA_TASK

    top = [("good", math.log(0.6)), (" Excellent", math.log(0.2)), ("fair", math.log(0.1)), ("the", math.log(0.1))]
    _JudgeServer.reply = lambda q, images, body: top
    r = _vlm(judge_server, template="deqa", top_logprobs=5)
    res = r(_noise(1, seed=5), ["ignored"])
    want = (0.6 * 4 + 0.2 * 5 + 0.1 * 3) / 0.9 / 5  # renormalised over the level words, / 5
    assert res.scores[0] == pytest.approx(want, rel=1e-9)
    q, _, body = _JudgeServer.requests[0]
    assert q == DEQA_TASK and body["logprobs"] is True and body["top_logprobs"] == 5
    assert body["max_completion_tokens"] == 1
    _JudgeServer.reply = lambda q, images, body: [("the", -0.2), ("a", -2.0)]  # a distribution (0.95)
    assert not r(_noise(1, seed=6), ["x"]).valid.any()  # no level word: invalid, not 0
    r.close()


def test_vlm_score_bad_config_and_dead_server_name_the_problem(judge_server):
    with pytest.raises(ConfigError, match=r"config key 'rewards.vlm_score.template': input should be 'qwenvl', "
                                          r"'unifiedreward' or 'deqa' \(got 'qwen'\)"):
        _vlm(judge_server, template="qwen")
    with pytest.raises(ConfigError, match="template 'deqa' has no answer pattern"):
        _vlm(judge_server, template="deqa", mode="text")
    with pytest.raises(ConfigError, match="rewards.train.terms.vlm_score.prompt"):
        build_reward("vlm_score", {"prompt": "x"}, where="rewards.train.terms")
    with pytest.raises(RewardError, match="model 'other' is not served"):
        build_reward("vlm_score", {"model": "other", "base_url": judge_server, "max_attempts": 1})
    r = _vlm(judge_server, template="qwenvl", retry_budget=1.0, timeout=0.5)

    def boom(q, images, body):
        raise ConnectionResetError

    _JudgeServer.reply = boom
    with pytest.raises(PartialRewardError, match="vlm_score: 1 of 1 samples failed: reward server"):
        r(_noise(1), ["a"])
    r.close()
