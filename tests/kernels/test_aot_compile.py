"""Every Triton kernel compiled for sm_90 and sm_80 by Triton's own compiler, on this CPU machine.

The CPU tests run the kernels in Triton's interpreter, which accepts code the GPU compiler refuses
(a plain float global inside @jit). Here kernels/aot.py compiles every launch configuration
(kernels/geometry.py x the dtypes and switches of the launch sites) for a GPUTarget and reads
ptxas's register and spill report. The launch sites themselves are checked against that list by
recording the launches they make on a sweep of inputs.

Duration: the whole compile runs once per session, 574 compiles: 2 to 3 minutes on 2 quiet
cores with a cold Triton cache (~/.triton/cache), about a minute warm (ptxas -v still runs each time).
"""
import json
import math
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels import aot, geometry as G  # noqa: E402

pytestmark = pytest.mark.runs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results():
    return aot.compile_all(aot.ARCHS)


def test_every_kernel_compiles_for_sm90_and_sm80(results):
    assert {r.arch for r in results} == {80, 90}
    assert {r.kernel for r in results} == set(aot.ORDER)
    assert len(results) == 2 * len(aot.launches())
    failed = [f"sm_{r.arch} {r.config}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed[:10])
    assert all(r.registers > 0 for r in results)  # ptxas reported on every one


def test_no_spills_in_the_hot_kernels(results):
    spills = [f"sm_{r.arch} {r.config}: {r.spill_stores}/{r.spill_loads} B" for r in aot.spills_in_hot_kernels(results)]
    assert not spills, "\n".join(spills)
    assert {r.kernel for r in results if r.hot} == set(aot.HOT)


def test_advantage_kernel_spills_at_most_a_few_bytes(results):
    """64 x 64 fp64 tiles on 4 warps spilled up to 1.8 KB per thread; 16 x 16 tiles leave at most
    the bytes ptxas saves around its fp64 division subroutines (none on sm_80)."""
    adv = [r for r in results if r.kernel == "grpo_advantages"]
    assert adv and max(r.spill_stores + r.spill_loads for r in adv) <= aot.SPILL_BUDGET["grpo_advantages"]
    assert all(r.registers <= 128 for r in adv)
    assert not [r for r in adv if r.arch == 80 and r.spill_stores]


def test_ce_rows_at_qwens_vocabulary_leaves_room_on_the_sm(results):
    """At 152k logits a row streams in BLOCK = CE_MAX_BLOCK: more than one program fits an SM
    (32768 logits on 32 warps at 64 registers filled the register file: one program per SM)."""
    block = G.ce_block(max(G.QWEN_VOCABS))
    rows = [r for r in results if r.kernel == "ce_rows" and f"BLOCK={block} " in r.config]
    assert rows and all(r.occupancy >= 0.5 and 65536 // (r.registers * 32 * r.num_warps) >= 2 for r in rows)


def test_the_check_catches_a_plain_float_global(tmp_path):
    """The SDE kernels' constants as plain Python floats (what the interpreter accepts) fail here,
    and the report names the global."""
    import importlib.util

    text = (Path(aot.__file__).parent / "_triton_sde.py").read_text()
    assert "LOG_SQRT_2PI = tl.constexpr(" in text
    path = tmp_path / "broken_sde.py"
    path.write_text(text.replace("LOG_SQRT_2PI = tl.constexpr(", "LOG_SQRT_2PI = float("))
    spec = importlib.util.spec_from_file_location("broken_sde", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    launch = next(l for l in aot.launches() if l.kernel == "sde_coefficients")
    res = aot.compile_one(launch, 90, fn=mod.sde_coefficients)
    assert not res.ok and "LOG_SQRT_2PI" in res.error and "NameError" in res.error
    assert aot.compile_one(launch, 90).ok


def test_committed_tables_are_this_codes(results):
    """kernels/bench/results/aot_sm*.json list exactly today's configurations; with the same Triton
    their registers and spills are today's (ptxas is deterministic)."""
    for arch in aot.ARCHS:
        doc = json.loads((aot.RESULTS / f"aot_sm{arch}.json").read_text())
        mine = {r.config: r for r in results if r.arch == arch}
        assert {row["config"] for row in doc["results"]} == set(mine)
        assert all(row["ok"] for row in doc["results"])
        if doc["triton"] == triton.__version__:
            for row in doc["results"]:
                assert (row["registers"], row["spill_stores"]) == (mine[row["config"]].registers,
                                                                   mine[row["config"]].spill_stores), row["config"]


# ------------------------------------------------------------------------------------------ launch sites
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32"}


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **constexprs)` records the launch's
    argument types, constexprs and warps instead of running it."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def launch(*args, num_warps=4, **constexprs):
            order = aot.ORDER[self.name]
            sig = []
            for name, arg in zip(order, args):
                if isinstance(arg, torch.Tensor):
                    sig.append((name, "*" + _TYPES[arg.dtype]))
                elif isinstance(arg, bool):
                    sig.append((name, "i1"))
                elif isinstance(arg, int):
                    sig.append((name, "i32" if -2**31 <= arg < 2**31 else "i64"))
                else:
                    sig.append((name, "fp32"))
            sig += [(name, "constexpr") for name in order[len(args):]]
            assert [n for n, _ in sig] == order and set(constexprs) == set(order[len(args):]), self.name
            self.log.append(aot.Launch(self.name, tuple(sig), tuple((k, constexprs[k]) for k in order[len(args):]),
                                       num_warps))
        return launch


@pytest.fixture
def recorded(monkeypatch):
    from kernels import _triton_grpo, _triton_sde, _triton_weighted_ce

    log = []
    for mod in (_triton_sde, _triton_grpo, _triton_weighted_ce):
        for name in aot.ORDER:
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, _Recorder(name, log))
    return log


def _configs(launch):
    # the enumerated list compiles each configuration with and without integers % 16 == 0; a
    # recorded launch matches on everything else
    return (launch.kernel, launch.signature, launch.constexprs, launch.num_warps)


def test_launch_sites_make_only_enumerated_configurations(recorded):
    from kernels import grpo, sde_logprob, weighted_ce

    T = sde_logprob._TritonImpl
    known = {_configs(l) for l in aot.launches()}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (70, 2048 * 3 + 5):
            x = torch.zeros(2, n, dtype=dtype)
            sig = torch.full((2, 3), 0.5)
            for src_dtype in {dtype, torch.float32}:
                src = torch.zeros(2, n, dtype=src_dtype)
                for sde_type in (0, 1):
                    for sample in (False, True):
                        for mean in (False, True):
                            T.sde_fwd(x, x, src, sig, 0.7, sde_type, sample, mean)
                    T.sde_kl_fwd(x, x, x, src, sig, 0.7, sde_type)
                    for nv, nx in ((True, False), (False, True), (True, True)):
                        T.sde_kl_bwd(x, x, x, src, sig, 0.7, sde_type, torch.zeros(2), torch.zeros(2), nv, nx)
                    for gm in (None, torch.zeros(2, n)):
                        for nv, nx in ((True, False), (False, True), (True, True)):
                            T.sde_bwd(x, x, src, sig, 0.7, sde_type, torch.zeros(2), gm, nv, nx)
            T.kl_fwd(x, x, torch.ones(2))
            for a, b in ((True, False), (False, True), (True, True)):
                T.kl_bwd(x, x, torch.ones(2), torch.zeros(2), a, b)
        for v in (97, 1000, 5000) + G.QWEN_VOCABS:
            for grad in (False, True):
                weighted_ce.rows_triton(torch.zeros(3, v, dtype=dtype), torch.zeros(3, dtype=torch.int64),
                                        torch.zeros(3), grad)
    for n in (1, 50, 70_000):  # a row of 2048 * n_chunk elements: finalize blocks 16 .. 1024
        row = torch.zeros(1, n)
        T.sde_fwd(row, row, row, torch.full((1, 3), 0.5), 0.7, 0, False, False)
        T.sde_kl_fwd(row, row, row, row, torch.full((1, 3), 0.5), 0.7, 0)
    for k in (1, 2, 3, 5, 16):
        for tame in (None, "mean", "median", 0.5):
            for global_std in (True, False):
                grpo.advantages_triton(torch.rand(k, 12), torch.ones(k), torch.arange(12) // 3, log_tame=tame,
                                       global_std=global_std)
    for b in (1, 37, 672, 5000):
        grpo._ppo_op(torch.zeros(b), torch.zeros(b), torch.zeros(b), 0.2, math.inf)
        grpo._ppo_bwd_op(torch.zeros(b), torch.zeros(b), torch.zeros(b), torch.ones(1), 0.2, 5.0)
    seen = {_configs(l) for l in recorded}
    assert seen and {k for k, *_ in seen} == set(aot.ORDER)
    missing = seen - known
    assert not missing, sorted(missing)[:5]
