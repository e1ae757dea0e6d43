"""One run per run directory, checkpoints that prove themselves, every input checked
before the first step (and by --dry-run), as one line and exit 2.

Single-process checks only: the trainer's entry point is run with plain `python` (world size 1)
where a check happens before any model or server exists.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY, one_line_error as _one_line_error, run_cli
from paco_ds.runtime import processes
from paco_ds.runtime.checkpoint import CheckpointManager, CorruptCheckpoint
from paco_ds.errors import ConfigError, DataError, UserError
from paco_ds.grpo.plan import check_recipe, load_config
from paco_ds.runtime.runlock import LOCK_NAME, RunDirBusy, RunLock

pytestmark = pytest.mark.fast

NO_JUDGE = ("reward_servers=null", "rewards.train.terms={jpeg_compressibility: {weight: 1.0}}",
            "rewards.test=null")


def _train(run_dir: Path, *sets: str, extra: tuple[str, ...] = (), timeout: float = 120):
    args = ["launch/train.py", "--config", str(TINY), "--set", f"output_dir={run_dir.parent}",
            "--set", f"run_name={run_dir.name}"]
    for s in sets:
        args += ["--set", s]
    return run_cli(*args, *extra, timeout=timeout,
                   env={"OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "1", "RANK": "0",
                        "LOCAL_RANK": "0"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


# ------------------------------------------------------------------------------------ one run per directory
_HOLDER = """
import sys, time
sys.path.insert(0, {repo!r})
from paco_ds.runtime.runlock import RunLock
RunLock({run!r}).acquire()
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process that owns tmp_path/run, as a running training run would."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER.format(repo=str(REPO), run=str(run))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    yield run, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_second_owner_is_refused_naming_the_pid_and_host(holder):
    run, proc = holder
    with pytest.raises(RunDirBusy) as err:
        RunLock(run).acquire()
    msg = str(err.value)
    assert str(run) in msg and f"pid {proc.pid}" in msg and socket.gethostname() in msg


def test_a_lock_is_released_on_kill_and_the_stale_record_is_noticed(holder):
    run, proc = holder
    proc.kill()  # SIGKILL: no `finally`, the kernel drops the flock
    proc.wait()
    lock = RunLock(run).acquire()
    try:
        assert lock.stale is not None and lock.stale["pid"] == proc.pid
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    again = RunLock(run).acquire()  # a clean release leaves no stale record
    assert again.stale is None
    again.release()


def test_a_second_run_into_an_owned_directory_exits_2_and_touches_nothing(holder):
    run, proc = holder
    (run / "metrics.jsonl").write_text('{"epoch": 0}\n')
    before = _tree(run)
    line = _one_line_error(_train(run, *NO_JUDGE, "train.num_epochs=1"))
    assert str(run) in line and f"pid {proc.pid}" in line and socket.gethostname() in line
    assert _tree(run) == before
    assert proc.poll() is None  # the owner goes on


def test_a_refused_start_does_not_stop_servers_it_did_not_start(tmp_path):
    """The servers another run recorded stay up when this run's start is refused."""
    from paco_ds.serving import manager
    from paco_ds.recipe.servers import ServersConfig

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        state_dir = manager.run_state_dir(tmp_path)
        state_dir.mkdir(parents=True)
        (state_dir / manager.STATE_FILE).write_text(json.dumps({
            "endpoints": {}, "servers": [{"name": "judge", "role": "engine", "url": "http://127.0.0.1:1/v1", "pid": other.pid,
                                          "start_time": processes.start_time(other.pid)}]}))
        cfg = ServersConfig(engine="hf", models=[{"name": "m", "tiny": True}], port=0)
        with pytest.raises(UserError, match="still running"):
            with manager.started_for_run(cfg, tmp_path, local_rank=0):
                pass
        time.sleep(0.2)
        assert other.poll() is None, "stopped a judge this run did not start"
    finally:
        other.kill()
        other.wait()


# ------------------------------------------------------------------------------------ checkpoints
def _checkpoint(root: Path, tag: str, epoch: int) -> Path:
    mgr = CheckpointManager(root, keep_last=5, rank=0, world_size=1)
    return mgr.save(None, tag, {"epoch": epoch, "blob": list(range(2000))}, {"epoch": epoch},
                    write_extra=lambda d: (d / "extra.bin").write_bytes(b"x" * 4096))


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


@pytest.mark.parametrize("victim", ["trainer_state_rank0.pt", "extra.bin"])
def test_resume_dir_names_a_truncated_file(tmp_path, victim):
    root = tmp_path / "checkpoints"
    ckpt = _checkpoint(root, "epoch_0002", 2)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert set(meta["files"]) == {"trainer_state_rank0.pt", "extra.bin"}
    assert all(r["size"] > 0 and len(r["sha256"]) == 64 for r in meta["files"].values())
    _cut(ckpt / victim)
    with pytest.raises(CorruptCheckpoint, match=victim):
        CheckpointManager(root, 5, 0, 1).resolve(str(ckpt))


def test_resume_dir_names_a_changed_or_missing_file(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt = _checkpoint(root, "epoch_0002", 2)
    raw = bytearray((ckpt / "extra.bin").read_bytes())
    raw[10] ^= 1  # same size, other content
    (ckpt / "extra.bin").write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpoint, match="extra.bin: checksum"):
        CheckpointManager(root, 5, 0, 1).resolve(str(ckpt))
    (ckpt / "trainer_state_rank0.pt").unlink()
    with pytest.raises(CorruptCheckpoint, match="trainer_state_rank0.pt: missing"):
        CheckpointManager(root, 5, 0, 1).resolve(str(ckpt))


def test_resume_latest_skips_a_corrupt_checkpoint_with_a_warning(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    good = _checkpoint(root, "epoch_0002", 2)
    bad = _checkpoint(root, "epoch_0004", 4)
    mgr = CheckpointManager(root, 5, 0, 1)
    assert mgr.resolve("latest") == bad
    _cut(bad / "trainer_state_rank0.pt", 0.3)
    with caplog.at_level("WARNING"):
        assert mgr.resolve("latest") == good
    assert "epoch_0004" in caplog.text and "trainer_state_rank0.pt" in caplog.text
    _cut(good / "extra.bin")
    with pytest.raises(UserError, match="every checkpoint"):
        mgr.resolve("latest")


def test_a_checkpoint_holding_objects_this_version_lacks_is_one_error_naming_them(tmp_path, monkeypatch):
    """A mid-epoch checkpoint pickles the epoch's samples as objects of the version that wrote it."""
    import importlib
    import sys

    (tmp_path / "gone_module.py").write_text("class Trajectory:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    old = importlib.import_module("gone_module")
    mgr = CheckpointManager(tmp_path / "checkpoints", keep_last=5, rank=0, world_size=1)
    ckpt = mgr.save(None, "epoch_0002", {"epoch": 2, "samples": old.Trajectory()}, {"epoch": 2})
    (tmp_path / "gone_module.py").unlink()
    monkeypatch.delitem(sys.modules, "gone_module")
    with pytest.raises(UserError, match=r"trainer_state_rank0.pt holds gone_module from another paco_ds version; "
                                        r"resume from an end-of-epoch checkpoint"):
        mgr.load(None, mgr.resolve(str(ckpt)))


def test_cli_resume_of_a_truncated_checkpoint_is_one_line_before_anything_starts(tmp_path):
    run = tmp_path / "run"
    ckpt = _checkpoint(run / "checkpoints", "epoch_0002", 2)
    _cut(ckpt / "trainer_state_rank0.pt")
    line = _one_line_error(_train(run, "reward_servers=null", extra=("--resume", str(ckpt))))
    assert "trainer_state_rank0.pt" in line and "--resume" in line


def test_cli_resume_latest_without_a_checkpoint_fails_fast_and_leaves_nothing(tmp_path):
    run = tmp_path / "run"  # the tiny recipe as shipped: it would start the judge first
    line = _one_line_error(_train(run, extra=("--resume", "latest")))
    assert "--resume latest: no checkpoint" in line
    assert not run.exists(), list(run.rglob("*"))  # fast because nothing started: no judge, no run dir


# ------------------------------------------------------------------------------------ before the first step
def _check(*sets: str, world: int = 2):
    check_recipe(load_config(TINY, list(sets)), world)


@pytest.mark.parametrize("sets, words", [
    (("train.resolution=100",), ["'train.resolution'", "100", "multiple of 16"]),
    (("test.resolution=136",), ["'test.resolution'", "136", "multiple of 16"]),
    (("train.resolution=8",), ["'train.resolution'", "multiple of 16"]),
])
def test_resolution_the_family_cannot_use(sets, words):
    with pytest.raises(ConfigError) as err:
        _check(*sets)
    assert all(w in str(err.value) for w in words), err.value


def test_item_size_the_family_cannot_use_names_the_record(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "layout": "2x2", "height": 64}\n{"prompt": "b", "layout": "1x2", "width": 90}\n')
    with pytest.raises(DataError, match=f"{f}:2: 'width' 90 is not a multiple of 16"):
        _check(f"data.train_file={f}", "sample.prompts_per_epoch=1", world=1)


@pytest.mark.parametrize("layout, line", [
    ('"layout": "0x2"', "R, C >= 1"), ('"layout": "2x0"', "R, C >= 1"), ('"layout": "2x2x2"', "'RxC'"),
    ('"layout": "2 by 2"', "'RxC'"), ('"layout": 4', "'RxC'"), ('"layout": "-1x2"', "'RxC'"),
])
def test_t2is_layout_must_be_rxc_naming_file_and_line(tmp_path, layout, line):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok", "layout": "2x2"}\n\n{"prompt": "a grid", %s}\n' % layout)
    with pytest.raises(DataError) as err:
        _check(f"data.train_file={f}")
    assert f"{f}:3" in str(err.value) and line in str(err.value), err.value


def test_t2is_layout_read_from_the_prompt_is_checked_too(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a 0x3 grid of cats"}\n')
    with pytest.raises(DataError, match=f"{f}:1: the prompt's layout '0x3'"):
        _check(f"data.train_file={f}")


@pytest.mark.parametrize("key", ["rewards.train.terms.jpeg_compressibility.qualty=90",
                                 "rewards.train.terms.subfig_clipT.modle=x",
                                 "rewards.test.terms.jpeg_compressibility.colour=1"])
def test_reward_arguments_the_reward_does_not_take(key):
    with pytest.raises(ConfigError) as err:
        _check(key)
    assert f"'{key.split('=')[0]}'" in str(err.value) and "takes no argument" in str(err.value)


def test_missing_deepspeed_config():
    with pytest.raises(ConfigError, match="'deepspeed.config': DeepSpeed config not found: .*nope.json"):
        _check("deepspeed.config=configs/deepspeed/nope.json")


@pytest.mark.parametrize("where", ["file", "under_file", "proc"])
def test_output_dir_that_cannot_be_written(tmp_path, where):
    f = tmp_path / "a_file"
    f.write_text("x")
    out = {"file": f, "under_file": f / "sub", "proc": Path("/proc/paco_ds_nowhere")}[where]
    with pytest.raises(ConfigError, match="'output_dir'"):
        _check(f"output_dir={out}")
    if where != "proc":
        assert f.read_text() == "x"


def test_output_dir_without_write_permission(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:  # root writes through any mode bits: the directory is mounted read-only instead
        _check_in_read_only_bind_mount(tmp_path, d)
        return
    d.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="not writable"):
            _check(f"output_dir={d}")
    finally:
        d.chmod(0o700)


CHECK_OUTPUT_DIR = """
import sys
from paco_ds.errors import ConfigError
from paco_ds.grpo.plan import check_recipe, load_config
try:
    check_recipe(load_config(sys.argv[1], [f"output_dir={sys.argv[2]}"]), 2)
except ConfigError as err:
    print(err)
    sys.exit(3)
"""


def _check_in_read_only_bind_mount(tmp_path: Path, d: Path) -> None:
    """The same check as root: `d` bind-mounted read-only onto itself in a private mount namespace
    (`unshare -m`, as the full-disk tests mount their tmpfs), where root cannot create a file either."""
    (d / "kept").write_text("x")
    mount = ('mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && '
             'touch "$1/probe" 2>/dev/null && { echo "still writable"; exit 9; }; shift && exec "$@"')
    r = subprocess.run(["unshare", "-m", "sh", "-c", mount, "sh", str(d), sys.executable, "-c", CHECK_OUTPUT_DIR,
                        str(TINY), str(d)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, f"exit {r.returncode}: {r.stdout[-1000:]} {r.stderr[-2000:]}"
    run_dir = d / "tiny_t2is"  # the recipe's run_name under output_dir
    assert f"config key 'output_dir': {run_dir} is not writable (Read-only file system in {d})" in r.stdout, r.stdout
    assert sorted(p.name for p in d.iterdir()) == ["kept"]  # nothing left behind, outside the namespace too


@pytest.mark.parametrize("value", [".nan", "1e400", "-.inf", ".inf"])
def test_non_finite_reward_weights(value):
    with pytest.raises(ConfigError, match="rewards.train.terms.pickscore.weight.*finite"):
        load_config(TINY, [f"rewards.train.terms.pickscore.weight={value}"])


def test_non_utf8_recipe_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(f"extends: {TINY}\nrun_name: x\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"bad.yaml:3: not UTF-8"):
        load_config(bad)
    base = tmp_path / "base.yaml"
    base.write_bytes(b"run_name: \xff\n")
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\n")
    with pytest.raises(ConfigError, match=r"base.yaml:1: not UTF-8"):
        load_config(child)


@pytest.mark.parametrize("fmt, name", [("t2is", "p.jsonl"), ("text", "p.txt")])
def test_non_utf8_data_names_file_and_line(tmp_path, fmt, name):
    f = tmp_path / name
    f.write_bytes(b'{"prompt": "fine", "layout": "2x2"}\n{"prompt": "caf\xe9", "layout": "2x2"}\n')
    with pytest.raises(DataError, match=f"{f}:2: not UTF-8"):
        _check(f"data.format={fmt}", f"data.train_file={f}")


def test_cross_check_names_the_keys_and_where_they_were_set():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["train.timesteps=[9]"])
    msg = str(err.value)
    assert "''" not in msg
    assert "'train.timesteps' (--set train.timesteps=[9])" in msg
    lines = TINY.read_text().splitlines()
    section = lines.index("sample:")
    line = next(i for i in range(section, len(lines)) if lines[i].strip().startswith("num_steps:")) + 1
    assert f"'sample.num_steps' (configs/tiny/t2is.yaml:{line})" in msg, msg  # where the recipe set it


@pytest.mark.parametrize("item", ["train.resolution.x=5", "model.lora.rank.a.b=1"])
def test_a_set_that_makes_a_mapping_of_a_value_blames_the_set(item):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [item])
    assert str(err.value).startswith(f"--set {item}:"), err.value


# ------------------------------------------------------------------------------------ the CLI, one line and exit 2
@pytest.mark.parametrize("sets, words", [
    (("train.resolution=100",), ["train.resolution", "multiple of 16"]),
    (("deepspeed.config=nope.json",), ["deepspeed.config", "nope.json"]),
    (("rewards.train.terms.jpeg_compressibility.qualty=1",), ["qualty", "takes no argument"]),
    (("output_dir=/proc/paco_ds_nowhere",), ["output_dir"]),
])
def test_dry_run_reports_each_as_one_line(sets, words):
    args = ["launch/train.py", "--config", str(TINY), "--dry-run", "--world-size", "2"]
    for s in sets:
        args += ["--set", s]
    line = _one_line_error(run_cli(*args))
    assert all(w in line for w in words), line


@pytest.mark.parametrize("extra, words", [
    (("--dry-run", "--world-size", "0"), ["--world-size", ">= 1"]),
    (("--dry-run", "--world-size", "-3"), ["--world-size", ">= 1"]),
    (("--world-size", "2"), ["--world-size", "--dry-run"]),
])
def test_world_size_flag_misuse(extra, words):
    line = _one_line_error(run_cli("launch/train.py", "--config", str(TINY), *extra))
    assert all(w in line for w in words), line


def test_a_run_checks_before_its_first_step(tmp_path):
    """Not only --dry-run: a real start stops on the same check, before servers or files."""
    run = tmp_path / "run"
    line = _one_line_error(_train(run, "train.resolution=100"))
    assert "train.resolution" in line and not run.exists()


# ------------------------------------------------------------------------------------ the judge under abuse
def _png_uri(size: tuple[int, int]) -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", size).save(buf, format="PNG")  # a few KB that decode to size[0] x size[1] pixels
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("size", [(14000, 14000), (9500, 9500), (200000, 500)])
def test_an_image_over_the_pixel_limit_is_a_400_naming_the_limit(size):
    from PIL import Image

    from paco_ds.serving.protocol import ApiError, decode_data_uri

    uri = _png_uri(size)
    assert len(uri) < 200_000
    with pytest.raises(ApiError) as err:
        decode_data_uri(uri)
    assert err.value.status == 400 and str(Image.MAX_IMAGE_PIXELS) in str(err.value)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from paco_ds.models.tiny.qwen_vl import save_tiny_qwen2_5_vl
    from paco_ds.serving.hf_engine import Engine

    return Engine.load(str(save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("judge"))), max_model_len=512)


@pytest.mark.parametrize("text", ["a" * 4_000_000, "word " * 2_000, "\u00e9\u4e2d" * 300_000])
def test_a_huge_text_is_refused_before_tokenising(tiny_engine, text, monkeypatch):
    from paco_ds.serving.protocol import ApiError, parse_chat_request

    req = parse_chat_request({"model": "m", "max_tokens": 1,
                              "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]})
    # What keeps the refusal cheap: the whole text is never templated or tokenised, only a bounded prefix.
    seen, tokenizer = [], tiny_engine.tokenizer
    monkeypatch.setattr(tiny_engine, "tokenizer", lambda t, **kw: seen.append(len(t)) or tokenizer(t, **kw))
    monkeypatch.setattr(tiny_engine, "processor", None)  # templating the request would fail on this
    with pytest.raises(ApiError) as err:
        tiny_engine.prepare(req, 20)
    assert err.value.status == 400 and "max_model_len 512" in str(err.value)
    assert max(seen, default=0) <= 16 * 512


def test_a_text_that_fits_is_still_served(tiny_engine):
    from paco_ds.serving.protocol import parse_chat_request

    req = parse_chat_request({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "Yes or no?"}]})
    prepared = tiny_engine.prepare(req, 20)
    assert 0 < prepared.inputs["input_ids"].shape[1] < 512


def test_dry_run_checks_the_checkpoint_to_resume(tmp_path):
    run = tmp_path / "run"
    args = ["launch/train.py", "--config", str(TINY), "--dry-run", "--world-size", "2", "--set",
            f"output_dir={tmp_path}", "--set", "run_name=run", "--resume", "latest"]
    line = _one_line_error(run_cli(*args))
    assert "--resume latest: no checkpoint" in line and not run.exists()
    _checkpoint(run / "checkpoints", "epoch_0002", 2)
    out = run_cli(*args)
    assert out.returncode == 0 and "resume from: " in out.stdout and "epoch_0002" in out.stdout, out.stderr
