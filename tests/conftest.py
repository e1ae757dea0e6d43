"""Shared fixtures. Everything runs on CPU with tiny models built offline."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
sys.path.insert(0, str(REPO))

TINY = REPO / "configs" / "tiny" / "t2is.yaml"

TIERS = ("fast", "runs", "runs_more", "async_runs", "stop", "stop_more", "plan", "plan_more", "video", "sequence", "cluster", "cluster_more", "slurm", "slurm_more", "vllm", "gpu")  # pytest.ini's markers


def tiers_of(item) -> set[str]:
    """The tier markers a test carries (its own, its class's, its module's): exactly one is allowed, so
    `pytest -m TIER` selects each test in one tier only."""
    return {m.name for m in item.iter_markers() if m.name in TIERS}


# Launches of a training, SFT or evaluation entry point made by this session (counted at Popen, so every
# helper's launches count), reported at the end: the run cache exists to keep this number small.
LAUNCH_SCRIPTS = ("launch/train.py", "launch/sft.py", "launch/evaluate.py", "tests/scripts/fault_probe.py",
                  "tests/scripts/train_probe.py")
LAUNCHES: list[str] = []
_popen_init = subprocess.Popen.__init__


# A launch that died of SIGABRT ("terminate called ...": 250 from the deepspeed launcher, -6 from a plain
# process) fails the session whichever test made it: a finished run must exit with its own status.
ABORTED: list[str] = []
_popen_wait, _popen_poll = subprocess.Popen.wait, subprocess.Popen.poll


def _counting_popen_init(self, args, *a, **kw):
    argv = [str(x) for x in args] if isinstance(args, (list, tuple)) else [str(args)]
    hit = next((s for s in LAUNCH_SCRIPTS for x in argv if x.endswith(s)), None)
    self._paco_launch = hit
    if hit and not {"--dry-run", "--help"} & set(argv):
        LAUNCHES.append(hit)
    _popen_init(self, args, *a, **kw)


def _note_exit(proc) -> None:
    if getattr(proc, "_paco_launch", None) and proc.returncode in (250, -6) and not getattr(proc, "_paco_noted", False):
        proc._paco_noted = True
        ABORTED.append(f"{proc._paco_launch} (pid {proc.pid}) exited {proc.returncode}")


def _noting_wait(self, *a, **kw):
    code = _popen_wait(self, *a, **kw)
    _note_exit(self)
    return code


def _noting_poll(self):
    code = _popen_poll(self)
    _note_exit(self)
    return code


subprocess.Popen.__init__ = _counting_popen_init
subprocess.Popen.wait = _noting_wait
subprocess.Popen.poll = _noting_poll


def pytest_sessionfinish(session, exitstatus):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller reports
        workeroutput["paco_launches"], workeroutput["paco_aborted"] = list(LAUNCHES), list(ABORTED)
    if ABORTED:
        session.exitstatus = 1


class _WorkerReports:
    """pytest-xdist's controller collects each worker's launches and aborts."""

    @staticmethod
    def pytest_testnodedown(node, error):
        out = getattr(node, "workeroutput", {})
        LAUNCHES.extend(out.get("paco_launches", []))
        ABORTED.extend(out.get("paco_aborted", []))


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_WorkerReports(), "paco-worker-reports")


def pytest_terminal_summary(terminalreporter):
    if LAUNCHES:
        from collections import Counter

        by = ", ".join(f"{n} {s}" for s, n in Counter(LAUNCHES).most_common())
        terminalreporter.write_line(f"launches of an entry point this session: {len(LAUNCHES)} ({by})")
    for line in ABORTED:
        terminalreporter.write_line(f"ABORTED (SIGABRT at exit; fails the session): {line}", red=True)


def pytest_collection_modifyitems(config, items):
    bad = [f"{item.nodeid} ({', '.join(sorted(tiers_of(item))) or 'none'})" for item in items
           if len(tiers_of(item)) != 1]
    if bad:
        raise pytest.UsageError(f"{len(bad)} tests declare no tier or several (exactly one of {', '.join(TIERS)}, "
                                "pytest.ini lists them): " + "; ".join(bad[:5]))


def shared_file(*parts: str) -> Path:
    """A data file of the reference (its T2IS prompt metadata, PickScore test prompts) from a copy
    beside the repository (SHARED_DATA); the test is skipped when it is absent."""
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} not present")
    return p


# Entry points whose --dry-run starts no process group, model or server: such a call runs in this process
# (the same main(), its output captured), a few milliseconds instead of seconds of imports per call.
IN_PROCESS_DRY_RUN = ("launch/train.py", "launch/cluster.py", "launch/serve_reward.py")
_ENTRY_MODULES: dict = {}


def run_entry(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python script args...` in this process: the script's main(argv) with stdout and stderr captured
    and its SystemExit as the return code (an uncaught exception: its traceback and 1, as Python does)."""
    import contextlib
    import importlib.util
    import io
    import traceback

    mod = _ENTRY_MODULES.get(script)
    if mod is None:
        spec = importlib.util.spec_from_file_location(f"entry_{Path(script).stem}", REPO / script)
        mod = _ENTRY_MODULES[script] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    out, err, saved = io.StringIO(), io.StringIO(), dict(os.environ)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                mod.main(list(args))
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:  # noqa: BLE001 - what an uncaught exception does to a process
                traceback.print_exc()
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess([script, *args], code, out.getvalue(), err.getvalue())


def run_cli(*args: str, timeout: float = 120, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run a command with the project on PYTHONPATH; returns the completed process. A --dry-run of an
    entry point that starts nothing runs in this process (run_entry)."""
    if args and args[0] in IN_PROCESS_DRY_RUN and "--dry-run" in args and cwd == REPO:
        return run_entry(*args, env=env)
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def dry_run(recipe: Path, output_dir: Path, *sets: str) -> subprocess.CompletedProcess:
    """`launch/train.py --dry-run` of `recipe` with `--set` of each of `sets`, writing under `output_dir`."""
    return run_cli("launch/train.py", "--config", str(recipe), "--dry-run", "--set", f"output_dir={output_dir}",
                   *[a for s in sets for a in ("--set", s)])


def load_exported_lora(policy, pipe, folder: Path):
    """Export the policy's adapter into `folder` as a run does and load it into the family's diffusers
    `pipe` (load_lora_weights): every trained LoRA matrix arrives. Returns the pipeline."""
    from paco_ds.models.lora import adapter_config, export_lora, lora_state_dict

    state = lora_state_dict(policy.transformer)
    path = export_lora(state, folder, adapter_config(policy.transformer))
    pipe.load_lora_weights(folder)
    loaded = [n for n, _ in pipe.transformer.named_parameters() if "lora_B" in n]
    assert path.exists() and len(loaded) == len([n for n in state if "lora_B" in n])
    return pipe


def assert_loaded_lora_matches(policy, pipe, x, sigma, embeds, height, width, guidance, condition=None):
    """The velocity through the pipeline's transformer (the export loaded by `load_exported_lora`)
    equals the policy's own with its adapter, and differs from the policy's with the adapter off."""
    import torch

    with torch.no_grad():
        ours = policy.velocity(policy.transformer, x, sigma, embeds, height, width, guidance, condition=condition)
        theirs = policy.velocity(pipe.transformer, x, sigma, embeds, height, width, guidance, condition=condition)
        with policy.adapter_disabled():
            base = policy.velocity(policy.transformer, x, sigma, embeds, height, width, guidance, condition=condition)
    assert torch.allclose(ours, theirs, atol=1e-6) and not torch.allclose(ours, base, atol=1e-4)


def save_diffusers_layout(parts: dict, folder: Path, names: tuple[str, ...]) -> Path:
    """Write tiny components as a checkpoint folder in diffusers' layout (one subfolder per part in
    `names`, plus the scheduler's config), for a policy's real loading code to read."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    for name in names:
        parts[name].save_pretrained(folder / name)
    FlowMatchEulerDiscreteScheduler(**parts["scheduler_config"]).save_config(folder / "scheduler")
    return folder


def quick_benchmark(script: str, out_dir: Path, report: str, timeout: float = 300):
    """`python benchmarks/<script> --quick --out out_dir` on one thread: the finished process and the
    JSON report it wrote (out_dir/<report>)."""
    import json

    proc = run_cli(f"benchmarks/{script}", "--quick", "--out", str(out_dir), timeout=timeout,
                   env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, json.loads((out_dir / report).read_text())


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """A user's mistake: exit code 2 and exactly one line on stderr, no traceback; returns the line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


# Triton on CPU needs TRITON_INTERPRET=1 before `import triton`, and earlier tests may import it
# (deepspeed does): a kernel test module re-runs itself in a subprocess with the variable set.
TRITON_DEVICE = "cuda" if __import__("torch").cuda.is_available() else "cpu"
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
triton_kernel_test = pytest.mark.skipif(TRITON_DEVICE == "cpu" and not TRITON_INTERPRETED,
                                        reason="runs in the TRITON_INTERPRET=1 subprocess of test_in_the_interpreter")
in_parent_on_cpu = pytest.mark.skipif(TRITON_DEVICE != "cpu" or TRITON_INTERPRETED,
                                      reason="the kernels run in this process")


def run_in_triton_interpreter(test_file: str, min_passed: int) -> None:
    """Run `test_file` under TRITON_INTERPRET=1 and check that its kernel tests ran and passed."""
    out = run_cli("-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, timeout=600,
                  env={"TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    passed = re.search(r"(\d+) passed", out.stdout.strip().splitlines()[-1])
    assert passed and int(passed.group(1)) >= min_passed, out.stdout[-2000:]  # every kernel test ran


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """The session's run cache (tests/distributed_runs.py): `runs.get(name, *overrides, ...)`."""
    from distributed_runs import RunCache

    cache = os.environ.get("PACO_RUN_CACHE")
    if cache:
        return RunCache(Path(cache).resolve(), persist=True)
    base = tmp_path_factory.getbasetemp()  # under pytest-xdist, a worker's; its parent is the session's
    return RunCache((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "runs")


@pytest.fixture(scope="session")
def tiny_cfg():
    from paco_ds.grpo.plan import load_config

    return load_config(TINY)


@pytest.fixture(scope="session")
def tiny_policy(tiny_cfg):
    """A tiny FLUX policy with a LoRA whose B matrices are non-zero (so the adapter matters)."""
    import torch

    from paco_ds.models.flux import FluxPolicy

    return with_active_lora(FluxPolicy.load(tiny_cfg.model, torch.device("cpu")), tiny_cfg.model.lora)


def with_active_lora(policy, lora_cfg, seed: int = 1):
    """`policy` with a LoRA on its transformer whose B matrices are seeded non-zero values (a fresh
    adapter's are zero), so that the adapter changes the output."""
    import torch

    from paco_ds.models.lora import add_lora

    add_lora(policy.transformer, lora_cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return policy


@pytest.fixture(autouse=True)
def _diffusers_attention_backend_restored():
    """diffusers' `set_attention_backend` also sets a process-wide active backend: a test that routes one
    model through `_native_flash` must not hand that to the next test's model (on the GPU lane it reached a
    masked Z-Image transformer, which that kernel refuses)."""
    module = sys.modules.get("diffusers.models.attention_dispatch")
    before = module._AttentionBackendRegistry._active_backend if module else None
    yield
    module = sys.modules.get("diffusers.models.attention_dispatch")
    if module is not None:
        registry = module._AttentionBackendRegistry
        registry._active_backend = before or module.AttentionBackendName(module.DIFFUSERS_ATTN_BACKEND)


# ------------------------------------------------------------------------------------ the skip policy
# A lane that tested nothing must not pass. Each lane (every make target, and the GPU lane's pytest stage)
# declares the skips it allows on pytest's command line:
#   --allowed-skips=N    turns the policy on: at most N skips whose reason matches no --allow-skip
#   --allow-skip=TEXT    (repeatable) a skip whose reason contains TEXT is allowed, however many
# With the policy on, more skips than allowed, or a session in which no test passed, fails the session
# (exit status 1, one line saying why). Without --allowed-skips (a file run by hand) nothing changes.
# Command-line options, not environment variables: a test's own pytest subprocess (the Triton
# interpreter's) must not inherit its parent's allowance.
SKIP_POLICY_EXIT = 1


def skip_policy_verdict(passed: int, skips: list[tuple[str, str]], allowed: int, reasons: list[str]) -> str | None:
    """Why a session with `passed` passed tests and `skips` (test id, reason) breaks a lane's policy of at
    most `allowed` skips besides those whose reason contains one of `reasons`; None if it does not."""
    other = [(test, why) for test, why in skips if not any(r in why for r in reasons)]
    if len(other) > allowed:
        test, why = other[0]
        return (f"skip policy: {len(other)} tests skipped for a reason this lane does not allow (at most {allowed}); "
                f"first: {test}: {why}")
    if passed == 0:
        return f"skip policy: no test passed ({len(skips)} skipped): a lane that tested nothing fails"
    return None


class _SkipPolicy:
    def __init__(self):
        self.passed, self.skips, self.verdict = 0, [], None

    def pytest_runtest_logreport(self, report):
        if hasattr(report, "wasxfail"):
            return
        if report.when == "call" and report.passed:
            self.passed += 1
        elif report.skipped:
            why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skips.append((report.nodeid, why.removeprefix("Skipped: ")))

    def pytest_sessionfinish(self, session):
        allowed = session.config.getoption("allowed_skips")
        if allowed is None or hasattr(session.config, "workerinput"):  # off, or a pytest-xdist worker
            return
        self.verdict = skip_policy_verdict(self.passed, self.skips, allowed, session.config.getoption("allow_skip"))
        if self.verdict and session.exitstatus == 0:
            session.exitstatus = SKIP_POLICY_EXIT

    def pytest_terminal_summary(self, terminalreporter):
        if self.verdict:
            terminalreporter.write_line(self.verdict, red=True)


def pytest_addoption(parser, pluginmanager):
    group = parser.getgroup("paco_ds skip policy", "the skips a lane allows (tests/conftest.py)")
    group.addoption("--allowed-skips", type=int, default=None, metavar="N",
                    help="fail the session when more than N tests are skipped for a reason no --allow-skip "
                         "names, or when no test passed (default: no policy)")
    group.addoption("--allow-skip", action="append", default=[], metavar="TEXT",
                    help="a skip whose reason contains TEXT is allowed (repeatable)")
    pluginmanager.register(_SkipPolicy(), "paco-skip-policy")
