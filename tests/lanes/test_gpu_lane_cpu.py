"""GPU-path details checked without a GPU: the wheel bundle's requirement check against the GPU
image, NCCL bound to the rank's device at init, the CUDA RNG restore across GPU counts, and the GPU
lane's own checks (tests/gpu/lane_checks.py) on a CPU run's outputs and on the committed GPU results:
the grpo stage's (trained, adapter changed, evaluation changed with the EMA), the bench stage's targets,
and the source record every results file carries (kernels/bench/source.py)."""
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import bundle  # noqa: E402
import lane_checks  # noqa: E402

from conftest import REPO  # noqa: E402
from kernels.bench import OP_TARGETS, op_targets, targets_line  # noqa: E402
from kernels.bench import source  # noqa: E402

pytestmark = pytest.mark.fast


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}")


def test_a_package_of_unknown_version_on_the_image_does_not_meet_a_version_range(tmp_path):
    _wheel(tmp_path, "open_clip_torch", "3.3.0", ["timm>=1.0.17", "ftfy"])
    have = {n: v for n, (v, _) in bundle.wheels(tmp_path).items()}
    bad = bundle.unmet(have, {"timm": None, "ftfy": None}, tmp_path, sorted(have))
    assert bad == ["open-clip-torch needs timm>=1.0.17: timm's version on the GPU image is unknown "
                   "(record it in image_packages.txt or bundle timm)"]  # ftfy: no range, any version does
    assert bundle.unmet(have, {"timm": bundle.Version("1.0.19"), "ftfy": None}, tmp_path, sorted(have)) == []


def test_nccl_is_bound_to_the_ranks_device_at_init(monkeypatch):
    import deepspeed

    import paco_ds.runtime.distributed as d

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: any(c[0] == "init" for c in calls))
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend, kw.get("device_id"))))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: calls.append(("ds", kw.get("dist_backend"))))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 3)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 4)
    for k, v in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29777"}.items():
        monkeypatch.setenv(k, v)
    info = d.setup_distributed()
    assert ("init", "nccl", torch.device("cuda", 1)) in calls
    assert calls.index(("set_device", 1)) < calls.index(("init", "nccl", torch.device("cuda", 1)))
    assert info.device == torch.device("cuda", 1)


def test_cuda_rng_restore_takes_the_devices_both_runs_see(monkeypatch):
    from paco_ds.runtime import checkpoint

    restored = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def set_all(states):  # torch's own check: one state per visible device, no more
        if len(states) > 1:
            raise RuntimeError("invalid device ordinal")
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device: restored.__setitem__(device, s))
    state = {"python": __import__("random").getstate(), "numpy": __import__("numpy").random.get_state(),
             "torch": torch.get_rng_state(), "cuda": [torch.tensor([1], dtype=torch.uint8),
                                                      torch.tensor([2], dtype=torch.uint8)]}
    checkpoint.set_rng_state(state)  # saved with 2 GPUs visible, resumed with 1
    assert list(restored) == [0] and int(restored[0][0]) == 1


# ------------------------------------------------------------------------------------ the grpo stage's checks
# The fast tier's shared run (tests/grpo/test_train.py: 4 epochs, evaluations at 0, 2 and 4, checkpoints at 2
# and 4), read here by the grpo stage's checker: one launch per session for both files.
FAST = ("train.num_epochs=4", "sample.group_size=4", "test.eval_freq=2", "checkpoint.save_freq=2",
        "checkpoint.keep_last=2", "logging.wandb.mode=offline")


@pytest.fixture(scope="module")
def full_run(runs):
    return runs.get("t2is_full", *FAST, script="tests/scripts/train_probe.py").ok().dir


def test_the_grpo_stage_checker_passes_a_cpu_run_that_trained(full_run):
    """The shared run keeps the recipe's EMA interval (8 optimizer steps, 2 per epoch): its epoch-2
    evaluation comes before the EMA's first update, so only the final one (epoch 4) must differ; the GPU
    recipe updates once an epoch, and there every evaluation after the first must differ."""
    line = lane_checks.check_grpo_run(full_run, gpu=False, every_eval_after_an_update=False)
    assert "4 epochs" in line and "adapter changed" in line and "differ from epoch 0's" in line, line
    with pytest.raises(AssertionError, match="epoch 2 came after 4 optimizer steps and no EMA update"):
        lane_checks.check_grpo_run(full_run, gpu=False, every_eval_after_an_update=True)
    with pytest.raises(AssertionError, match="the GPU stage runs the Triton kernels in bf16: kernels.backend auto"):
        lane_checks.check_grpo_run(full_run, gpu=True, every_eval_after_an_update=False)


def test_the_grpo_stage_checker_fails_an_adapter_that_did_not_change(full_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(full_run, run, ignore=shutil.ignore_patterns("images", "wandb", "tb", "*.html"))
    ckpts = sorted(p for p in (run / "checkpoints").iterdir() if (p / "meta.json").is_file())
    assert [p.name for p in ckpts] == ["epoch_0002", "epoch_0004"]
    for f in ckpts[0].iterdir():  # the last checkpoint's weights made the first's
        if f.is_file() and f.name != "meta.json":
            shutil.copy(f, ckpts[1] / f.name)
    cfg = __import__("yaml").safe_load((run / "config.yaml").read_text())
    with pytest.raises(AssertionError, match="the adapter did not change between epoch_0002 .* and epoch_0004"):
        lane_checks.check_adapter_changed(run, cfg)


def _eval(epoch: int, value: float, step: int | None) -> list[dict]:
    rows = [{"epoch": epoch, "eval/jpeg/mean": value, "eval/height": 128.0}]
    if step is not None:
        rows.append({"epoch": epoch, "train/loss": 0.1, "global_step": step})
    return rows


@pytest.mark.parametrize("interval, values, every, error", [
    (2, [1.0, 2.0, 3.0], True, None),
    (8, [1.0, 1.0, 3.0], False, None),  # epoch 2 came before the first update: it may repeat epoch 0
    (8, [1.0, 1.0, 3.0], True, "epoch 2 came after 4 optimizer steps and no EMA update"),
    (2, [1.0, 1.0, 3.0], True, "evaluation at epoch 2 .* is identical to epoch 0's"),
    (2, [1.0, 2.0, 1.0], True, "evaluation at epoch 4 .* is identical to epoch 0's"),
    (16, [1.0, 1.0, 1.0], False, "no evaluation came after an EMA update"),
])
def test_an_evaluation_after_an_ema_update_must_differ_from_the_first(interval, values, every, error):
    rows = [*_eval(0, values[0], 2), {"epoch": 1, "train/loss": 0.1, "global_step": 4}, *_eval(2, values[1], 6),
            {"epoch": 3, "train/loss": 0.1, "global_step": 8}, *_eval(4, values[2], None)]
    cfg = {"train": {"ema": {"enabled": True, "update_interval": interval}}}
    assert [(e, s) for e, s, _ in lane_checks.ema_updates_before_evals(cfg, rows)] == [(0, 0), (2, 4), (4, 8)]
    if error is None:
        assert "differ from epoch 0's" in lane_checks.check_evaluations(cfg, rows, every)
    else:
        with pytest.raises(AssertionError, match=error):
            lane_checks.check_evaluations(cfg, rows, every)


def test_the_gpu_recipe_evaluates_only_after_ema_updates():
    """configs/tiny/t2is_gpu.yaml: each evaluation after epoch 0 follows at least one EMA update, so the
    grpo stage's strict check can pass within its 4 epochs."""
    from paco_ds.grpo.plan import load_config

    cfg = load_config(REPO / "configs" / "tiny" / "t2is_gpu.yaml").model_dump()
    plan = lane_checks.planned_ema_updates(cfg)
    assert [e for e, _, _ in plan] == [0, 2, 4]
    assert plan[0][2] == 0 and all(updates >= 1 for _, _, updates in plan[1:]), plan


# ------------------------------------------------------------------------------------ the bench stage's targets
def test_each_op_has_one_target_and_the_committed_gpu_results_say_which_missed():
    assert set(OP_TARGETS) == set(__import__("kernels.bench", fromlist=["OPS"]).OPS)
    results = REPO / "kernels" / "bench" / "results"
    ops = __import__("kernels.bench", fromlist=["OPS"]).OPS
    with pytest.raises(AssertionError, match=r"no triton column for \['sde_kl_fwd_bwd'\]"):
        lane_checks.check_bench(results / "nvidia-h200.json")  # the one-pass op has not run on a GPU yet
    line, missed = lane_checks.check_bench(results / "nvidia-h200.json", [op for op in ops if op != "sde_kl_fwd_bwd"])
    assert "kl_fwd_bwd" in missed and "sde_fwd" not in missed, line  # the KL kernel: 0.37-0.60x of eager torch
    assert f"{len(missed)} of 6 op targets missed" in line
    h100 = op_targets(json.loads((results / "nvidia-h100-80gb-hbm3.json").read_text())["results"])
    assert h100["kl_fwd_bwd"]["status"] == "missed" and h100["kl_fwd_bwd"]["rows_met"] == 0
    assert h100["sde_fwd"]["status"] == "met" and h100["sde_fwd"]["backend"] == "triton"
    rows = [{"op": "sde_fwd", "backend": "torch", "runs": "torch", "speedup_vs_eager": 1.0},
            {"op": "sde_fwd", "backend": "cpp", "runs": "cpp", "speedup_vs_eager": 1.5},
            {"op": "ppo_fwd_bwd", "backend": "torch", "runs": "torch", "speedup_vs_eager": 1.0}]
    assert targets_line(op_targets(rows)) == "all 1 op targets met"


def test_a_bench_without_a_triton_column_fails_the_stage(tmp_path):
    doc = {"results": [{"op": op, "backend": "torch", "runs": "torch", "speedup_vs_eager": 1.0} for op in OP_TARGETS]}
    (tmp_path / "b.json").write_text(json.dumps(doc))
    with pytest.raises(AssertionError, match="no triton column for"):
        lane_checks.check_bench(tmp_path / "b.json")


# ------------------------------------------------------------------------------------ the source record
def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def test_the_source_state_from_git_and_from_a_record_in_a_copy_without_git(tmp_path):
    repo = tmp_path / "repo"
    (repo / "kernels" / "bench" / "results").mkdir(parents=True)
    (repo / "a.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("/.whl/\n")  # as the project's
    _git(repo, "init", "-q")
    _git(repo, "add", "a.py", ".gitignore")
    _git(repo, "commit", "-q", "-m", "a")
    head = _git(repo, "rev-parse", "HEAD")
    (repo / "kernels" / "bench" / "results" / "gpu.json").write_text("{}")  # a result written by a run
    assert source.source_state(repo) == {"commit": head, "clean": True, "from": "git", "changes": []}
    rec = source.record(repo / ".whl" / "source.json", repo)
    assert rec["commit"] == head and rec["clean"] and set(rec["files"]) == {"a.py", ".gitignore"}

    copy = tmp_path / "copy"  # what a GPU machine gets: the tree and .whl/, no .git
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    state = source.source_state(copy)
    assert (state["commit"], state["clean"]) == (head, True) and "no .git here" in state["from"]
    (copy / "a.py").write_text("x = 2\n")
    state = source.source_state(copy)
    assert (state["commit"], state["clean"], state["changes"]) == (head, False, ["a.py (since the record)"])
    (copy / ".whl" / "source.json").unlink()
    assert source.source_state(copy)["commit"] == "unknown" and source.source_state(copy)["clean"] is None

    (repo / "a.py").write_text("x = 3\n")  # an uncommitted change: not clean
    assert source.source_state(repo)["changes"] == ["a.py"] and source.source_state(repo)["clean"] is False


def test_stamp_records_the_source_in_json_jsonl_and_junit_xml(tmp_path):
    state = {"commit": "abc", "clean": False, "from": "git", "changes": ["x.py"]}
    (tmp_path / "r.json").write_text(json.dumps({"results": [1]}))
    (tmp_path / "m.jsonl").write_text('{"epoch": 0}\n{"epoch": 1}\n')
    (tmp_path / "p.xml").write_text('<testsuites><testsuite name="pytest" tests="1"><testcase name="t"/>'
                                    '</testsuite></testsuites>')
    for name in ("r.json", "m.jsonl", "p.xml"):
        assert source.stamp(tmp_path / name, state) and not source.stamp(tmp_path / name, state)  # once
    assert json.loads((tmp_path / "r.json").read_text()) == {"results": [1], "source": state}
    lines = [json.loads(l) for l in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines == [{"source": state}, {"epoch": 0}, {"epoch": 1}]
    import xml.etree.ElementTree as ET

    props = {p.get("name"): p.get("value") for p in ET.parse(tmp_path / "p.xml").getroot().iter("property")}
    assert props == {"source_commit": "abc", "source_clean": "False", "source_from": "git"}


# ------------------------------------------------------------------------------------ the lane's own records
FAKE_GPU = """
import torch
import triton  # before the patch: it looks for a GPU driver of its own when imported

class _Props:
    name, total_memory, major, minor = "Fake GPU", 2**30, 9, 0

torch.cuda.is_available = lambda: True
torch.cuda.get_device_properties = lambda device=0: _Props()
torch.cuda.get_device_name = lambda device=0: _Props.name
torch.backends.cudnn.version = lambda: 0
"""


def test_the_lane_records_the_source_in_its_summary_and_machine_json(tmp_path):
    """tests/gpu/run_lane.sh on a CPU that passes for a GPU (torch.cuda patched by a sitecustomize): its
    machine.json, source.json and summary.json record the commit and whether the tree was clean, and an
    unknown stage fails the lane."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(FAKE_GPU)
    res = tmp_path / "results"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OUT", "LANE_STAGES")}
    proc = subprocess.run(["bash", str(REPO / "tests" / "gpu" / "run_lane.sh")], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**env, "GPU_PYTHON": sys.executable, "PYTHONPATH": str(fake),
                                                       "LANE_STAGES": "none", "LANE_RESULTS": str(res)})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "unknown stage 'none'" in proc.stdout
    want = source.source_state()
    recorded = json.loads((res / "source.json").read_text())
    assert (recorded["commit"], recorded["clean"]) == (want["commit"], want["clean"]) and recorded["from"] == "git"
    machine = json.loads((res / "machine.json").read_text())
    assert machine["gpu"] == "Fake GPU" and machine["source"] == recorded
    summary = json.loads((res / "summary.json").read_text())
    assert summary["source"] == recorded and summary["machine"]["source"] == recorded
    assert summary["stages"]["none"]["status"] == "failed"
