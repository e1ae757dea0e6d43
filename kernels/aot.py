"""Every Triton kernel compiled ahead of time for NVIDIA GPUs, on a machine without one.

Why: Triton's interpreter (what the CPU tests run) accepts code the GPU compiler refuses, and says
nothing of registers or spills. Here each kernel goes through Triton's own compiler for a
`GPUTarget` (sm_80: A100, sm_90: H100/H200) at every launch configuration the launchers can
produce, and the ptxas bundled in the triton wheel reports its resources.

The configurations come from kernels/geometry.py (the numbers the launchers use) crossed with the
dtypes and constexpr switches each launch site passes; tests/kernels/test_aot_compile.py checks, by
recording real launches, that every configuration a launcher makes is in this list.

This module needs triton only (no torch): the kernel sources are loaded from their files, so it
runs in a venv holding nothing but the GPU machines' Triton (`make test-triton36`).

    python -m kernels.aot [--arch 90 --arch 80] [--out DIR] [--jobs 2]

prints the table and writes DIR/aot_sm<arch>.json (default kernels/bench/results/).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the sibling geometry importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import geometry as G  # type: ignore
else:
    from . import geometry as G

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "bench" / "results"
ARCHS = (90, 80)
# The kernels on the training step's path at full size: a spill there is a defect, not a note.
HOT = ("sde_fwd", "sde_bwd", "kl_fwd", "kl_bwd", "sde_kl_fwd", "sde_kl_bwd", "ppo_fwd", "ppo_bwd", "ce_rows")
# Bytes of spill stores + loads per thread tolerated elsewhere: the advantage kernel (once per
# epoch) keeps a few around ptxas's fp64 division / square-root subroutines.
SPILL_BUDGET = {"grpo_advantages": 32}
# Kernel source files (relative to kernels/) and the kernels each defines.
SOURCES = {
    "_triton_sde.py": ("sde_coefficients", "sde_fwd", "sde_finalize", "sde_bwd", "kl_fwd", "kl_finalize", "kl_bwd",
                       "sde_kl_fwd", "sde_kl_finalize", "sde_kl_bwd"),
    "_triton_grpo.py": ("grpo_advantages", "ppo_fwd", "ppo_bwd"),
    "_triton_weighted_ce.py": ("ce_rows",),
}
NATIVE = ("fp32", "bf16", "fp16")
# Register file and limits per SM of sm_80 and sm_90 (CUDA occupancy calculator's tables).
SM = {80: dict(regs=65536, warps=64, blocks=32, smem=167936), 90: dict(regs=65536, warps=64, blocks=32, smem=232448)}


@dataclass(frozen=True)
class Launch:
    """One compile: a kernel, its argument types, its constexprs and warps."""

    kernel: str
    signature: tuple  # ((arg, type), ...) in argument order; "constexpr" for constexprs
    constexprs: tuple  # ((arg, value), ...)
    num_warps: int = 4
    aligned: tuple = ()  # integer args whose value is a multiple of 16 (Triton specialises on it)

    @property
    def key(self) -> str:
        cx = ",".join(f"{k}={v}" for k, v in self.constexprs)
        sig = ",".join(t for _, t in self.signature if t != "constexpr")
        al = f" n%16=0[{','.join(self.aligned)}]" if self.aligned else ""
        return f"{self.kernel}({sig}) {cx} w={self.num_warps}{al}"


@dataclass
class Result:
    kernel: str
    config: str
    arch: int
    ok: bool
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    shared: int = 0  # bytes of shared memory per program (Triton's dynamic + ptxas's static)
    num_warps: int = 0
    occupancy: float = 0.0  # resident warps / 64 per SM, from registers, shared memory and warps
    error: str = ""
    seconds: float = 0.0
    hot: bool = False
    extra: dict = field(default_factory=dict)


def _sig(kernel: str, types_: dict, constexprs: dict, order: list[str], **kw) -> Launch:
    sig = tuple((a, "constexpr" if a in constexprs else types_[a]) for a in order)
    return Launch(kernel, sig, tuple(constexprs.items()), **kw)


# ------------------------------------------------------------------------------------------ launch configurations
SDE_COEF = ["sig_ptr", "a", "coef_ptr", "N", "SDE_TYPE"]
SDE_FWD = ["x_ptr", "v_ptr", "src_ptr", "coef_ptr", "partial_ptr", "prev_ptr", "mean_ptr", "N", "n_chunk",
           "SAMPLE", "WRITE_MEAN", "CHUNK", "BLOCK"]
SDE_FIN = ["partial_ptr", "coef_ptr", "lp_ptr", "std_ptr", "n_chunk", "BLOCK"]
SDE_BWD = ["x_ptr", "v_ptr", "xn_ptr", "coef_ptr", "g_ptr", "gm_ptr", "gv_ptr", "gx_ptr", "N",
           "HAS_GM", "WRITE_GV", "WRITE_GX", "BLOCK"]
KL_FWD = ["a_ptr", "b_ptr", "partial_ptr", "N", "n_chunk", "CHUNK", "BLOCK"]
KL_FIN = ["partial_ptr", "std_ptr", "out_ptr", "N", "n_chunk", "BLOCK"]
KL_BWD = ["a_ptr", "b_ptr", "std_ptr", "g_ptr", "ga_ptr", "gb_ptr", "N", "WRITE_GA", "WRITE_GB", "BLOCK"]
SDE_KL_FWD = ["x_ptr", "v_ptr", "vr_ptr", "xn_ptr", "coef_ptr", "partial_ptr", "kl_partial_ptr", "N", "n_chunk", "CHUNK",
              "BLOCK"]
SDE_KL_FIN = ["partial_ptr", "kl_partial_ptr", "coef_ptr", "lp_ptr", "std_ptr", "kl_ptr", "N", "n_chunk", "BLOCK"]
SDE_KL_BWD = ["x_ptr", "v_ptr", "vr_ptr", "xn_ptr", "coef_ptr", "g_ptr", "gk_ptr", "gv_ptr", "gx_ptr", "N", "WRITE_GV",
              "WRITE_GX", "BLOCK"]
ADV = ["r_ptr", "w_ptr", "g_ptr", "param_ptr", "adv_ptr", "comb_ptr", "cv_ptr", "tamed_ptr", "tau_ptr", "K", "N",
       "TAME", "GLOBAL_STD", "BLOCK_K", "BLOCK"]
PPO_FWD = ["lp_ptr", "old_ptr", "adv_ptr", "out_ptr", "B", "lo", "hi", "clip_range", "adv_clip", "BLOCK"]
PPO_BWD = ["lp_ptr", "old_ptr", "adv_ptr", "g_ptr", "grad_ptr", "B", "lo", "hi", "adv_clip", "BLOCK"]
CE = ["logits_ptr", "stride", "labels_ptr", "coef_ptr", "ce_ptr", "pred_ptr", "V", "WRITE_GRAD", "BLOCK"]
ORDER = {"sde_coefficients": SDE_COEF, "sde_fwd": SDE_FWD, "sde_finalize": SDE_FIN, "sde_bwd": SDE_BWD, "kl_fwd": KL_FWD,
         "kl_finalize": KL_FIN,
         "kl_bwd": KL_BWD, "sde_kl_fwd": SDE_KL_FWD, "sde_kl_finalize": SDE_KL_FIN, "sde_kl_bwd": SDE_KL_BWD,
         "grpo_advantages": ADV, "ppo_fwd": PPO_FWD, "ppo_bwd": PPO_BWD, "ce_rows": CE}


def _p(t: str) -> str:
    return "*" + t


def launches() -> list[Launch]:
    """Every (kernel, argument types, constexprs, warps) the launchers can produce.

    Element counts N (and the CE row stride and vocabulary) are compiled both unspecialised and as
    multiples of 16, the value Triton specialises on: real latents (tokens x 64 channels) and
    Qwen's vocabularies are multiples of 16, the tests' ragged shapes are not.
    """
    out: list[Launch] = []
    n_al = [(), ("N",)]
    for dt in NATIVE:
        # scored transitions: src is the stored x' (x's dtype, or fp32 when it was widened);
        # sampled ones: src is the noise (x's dtype or fp32) and x' is written in x's dtype.
        for src in sorted({dt, "fp32"}):
            for sample in (False, True):
                for mean in (False, True):
                    for al in n_al:
                        t = dict(x_ptr=_p(dt), v_ptr=_p(dt), src_ptr=_p(src), coef_ptr="*fp32", partial_ptr="*fp32",
                                 prev_ptr=_p(dt), mean_ptr="*fp32", N="i32", n_chunk="i32")
                        out.append(_sig("sde_fwd", t, dict(SAMPLE=sample, WRITE_MEAN=mean, CHUNK=G.SDE_CHUNK,
                                                           BLOCK=G.SDE_BLOCK), SDE_FWD, aligned=al))
            # log-prob and KL in one pass (training): x' is the stored one, in x's dtype or fp32
            for al in n_al:
                t = dict(x_ptr=_p(dt), v_ptr=_p(dt), vr_ptr=_p(dt), xn_ptr=_p(src), coef_ptr="*fp32",
                         partial_ptr="*fp32", kl_partial_ptr="*fp32", N="i32", n_chunk="i32")
                out.append(_sig("sde_kl_fwd", t, dict(CHUNK=G.SDE_CHUNK, BLOCK=G.SDE_BLOCK), SDE_KL_FWD, aligned=al))
                for gv, gx in ((True, False), (False, True), (True, True)):
                    t = dict(x_ptr=_p(dt), v_ptr=_p(dt), vr_ptr=_p(dt), xn_ptr=_p(src), coef_ptr="*fp32",
                             g_ptr="*fp32", gk_ptr="*fp32", gv_ptr=_p(dt), gx_ptr=_p(dt), N="i32")
                    out.append(_sig("sde_kl_bwd", t, dict(WRITE_GV=gv, WRITE_GX=gx, BLOCK=G.SDE_BLOCK), SDE_KL_BWD,
                                    aligned=al))
            # backward: xn is x' as saved (the sampled x' in x's dtype, or the scored src)
            for has_gm in (False, True):
                for gv, gx in ((True, False), (False, True), (True, True)):
                    for al in n_al:
                        t = dict(x_ptr=_p(dt), v_ptr=_p(dt), xn_ptr=_p(src), coef_ptr="*fp32", g_ptr="*fp32",
                                 gm_ptr="*fp32", gv_ptr=_p(dt), gx_ptr=_p(dt), N="i32")
                        out.append(_sig("sde_bwd", t, dict(HAS_GM=has_gm, WRITE_GV=gv, WRITE_GX=gx,
                                                           BLOCK=G.SDE_BLOCK), SDE_BWD, aligned=al))
        for al in n_al:
            t = dict(a_ptr=_p(dt), b_ptr=_p(dt), partial_ptr="*fp32", N="i32", n_chunk="i32")
            out.append(_sig("kl_fwd", t, dict(CHUNK=G.SDE_CHUNK, BLOCK=G.SDE_BLOCK), KL_FWD, aligned=al))
            for ga, gb in ((True, False), (False, True), (True, True)):
                t = dict(a_ptr=_p(dt), b_ptr=_p(dt), std_ptr="*fp32", g_ptr="*fp32", ga_ptr=_p(dt), gb_ptr=_p(dt),
                         N="i32")
                out.append(_sig("kl_bwd", t, dict(WRITE_GA=ga, WRITE_GB=gb, BLOCK=G.SDE_BLOCK), KL_BWD, aligned=al))
        for ce_block in G.CE_BLOCKS:
            for grad in (False, True):
                t = dict(logits_ptr=_p(dt), stride="i32", labels_ptr="*i64", coef_ptr="*fp32", ce_ptr="*fp32",
                         pred_ptr="*i64", V="i32")
                als = [()] + ([("stride", "V")] if ce_block == G.CE_MAX_BLOCK else [])  # Qwen: 151936, 152064
                for al in als:
                    out.append(_sig("ce_rows", t, dict(WRITE_GRAD=grad, BLOCK=ce_block), CE,
                                    num_warps=G.ce_warps(ce_block), aligned=al))
    for sde_type in (0, 1):
        t = dict(sig_ptr="*fp32", a="fp32", coef_ptr="*fp32", N="i32")
        out.append(_sig("sde_coefficients", t, dict(SDE_TYPE=sde_type), SDE_COEF))
    for block in G.FINALIZE_BLOCKS:
        t = dict(partial_ptr="*fp32", coef_ptr="*fp32", lp_ptr="*fp32", std_ptr="*fp32", n_chunk="i32")
        out.append(_sig("sde_finalize", t, dict(BLOCK=block), SDE_FIN))
        t = dict(partial_ptr="*fp32", std_ptr="*fp32", out_ptr="*fp32", N="i32", n_chunk="i32")
        out.append(_sig("kl_finalize", t, dict(BLOCK=block), KL_FIN))
        t = dict(partial_ptr="*fp32", kl_partial_ptr="*fp32", coef_ptr="*fp32", lp_ptr="*fp32", std_ptr="*fp32",
                 kl_ptr="*fp32", N="i32", n_chunk="i32")
        out.append(_sig("sde_kl_finalize", t, dict(BLOCK=block), SDE_KL_FIN))
    for tame in (0, 1, 2, 3):
        for global_std in (False, True):
            for bk in G.ADV_BLOCK_KS:
                t = dict(r_ptr="*fp64", w_ptr="*fp64", g_ptr="*i64", param_ptr="*fp64", adv_ptr="*fp64",
                         comb_ptr="*fp64", cv_ptr="*fp64", tamed_ptr="*i32", tau_ptr="*fp64", K="i32", N="i32")
                out.append(_sig("grpo_advantages", t, dict(TAME=tame, GLOBAL_STD=global_std, BLOCK_K=bk,
                                                           BLOCK=G.ADV_BLOCK), ADV, num_warps=G.ADV_WARPS))
    for block in G.PPO_FWD_BLOCKS:
        t = dict(lp_ptr="*fp32", old_ptr="*fp32", adv_ptr="*fp32", out_ptr="*fp32", B="i32", lo="fp32", hi="fp32",
                 clip_range="fp32", adv_clip="fp32")
        out.append(_sig("ppo_fwd", t, dict(BLOCK=block), PPO_FWD))
    t = dict(lp_ptr="*fp32", old_ptr="*fp32", adv_ptr="*fp32", g_ptr="*fp32", grad_ptr="*fp32", B="i32", lo="fp32",
             hi="fp32", adv_clip="fp32")
    out.append(_sig("ppo_bwd", t, dict(BLOCK=G.PPO_BLOCK), PPO_BWD))
    return out


# ------------------------------------------------------------------------------------------ compiling
_modules: dict[str, types.ModuleType] = {}


def kernel_functions() -> dict:
    """name -> @triton.jit function, loaded from the source files without importing `kernels`
    (whose package imports torch). A scratch package mirrors the folders, so the sources' relative
    imports (one kernel file borrows another's helpers) resolve among these same files."""
    if not _modules:
        root = "_paco_aot_kernels"
        dirs = sorted({s.rsplit("/", 1)[0] for s in SOURCES if "/" in s})
        for name, path in [(root, HERE)] + [(f"{root}.{d.replace('/', '.')}", HERE / d) for d in dirs]:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(path)]
            sys.modules[name] = pkg
        for src in SOURCES:
            name = f"{root}.{src[:-3].replace('/', '.')}"
            spec = importlib.util.spec_from_file_location(name, HERE / src)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            _modules[src] = mod
    return {k: getattr(_modules[src], k) for src, names in SOURCES.items() for k in names}


def _ptxas_path() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")


def _ptxas_report(ptx: str, arch: int) -> dict:
    """ptxas -v of the PTX, with the options Triton passes for its cubin: registers, spills, smem."""
    gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([_ptxas_path(), "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu}", str(src),
                              "-o", str(Path(d) / "k.o")], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip()[-2000:])
    log = out.stderr + out.stdout
    num = (lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else 0)
    return dict(registers=num(r"Used (\d+) registers"), spill_stores=num(r"(\d+) bytes spill stores"),
                spill_loads=num(r"(\d+) bytes spill loads"), stack=num(r"(\d+) bytes stack frame"),
                smem=num(r"(\d+) bytes smem"))


def occupancy(arch: int, registers: int, num_warps: int, shared: int) -> float:
    """Resident warps per SM / 64: registers are allocated per warp in units of 256, shared memory
    per block (the CUDA occupancy calculator's rules, without its per-arch reserved bytes)."""
    sm = SM[arch]
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = sm["regs"] // (per_warp * num_warps)
    by_warps = sm["warps"] // num_warps
    by_smem = sm["smem"] // shared if shared else sm["blocks"]
    blocks = min(by_regs, by_warps, by_smem, sm["blocks"])
    return blocks * num_warps / sm["warps"]


def describe(err: BaseException) -> str:
    """One line: the innermost cause (Triton wraps the NameError of a kernel in CompilationErrors)
    and where in the kernel source it stopped."""
    chain, e = [], err
    while e is not None:
        chain.append(e)
        e = e.__cause__
    messages = [getattr(e, "error_message", None) or ("" if hasattr(e, "node") else str(e)) for e in chain]
    text = next((m for m in reversed(messages) if m and m.strip()), type(chain[-1]).__name__)
    text = " ".join(line.strip() for line in str(text).splitlines() if line.strip())
    # the innermost place in the kernel sources (a helper @jit function, if it failed there)
    node = next((e.node for e in reversed(chain) if getattr(e, "node", None) is not None and hasattr(e.node, "lineno")),
                None)
    src = next((e.src for e in reversed(chain) if getattr(e, "node", None) is node and getattr(e, "src", None)), None)
    where = ""
    if node is not None and src:
        first = src.strip().splitlines()[0]
        where = f" (in {first.split('(')[0].replace('def ', '')}, line {node.lineno} of the function)"
    return f"{type(chain[-1]).__name__}: {text[:200]}{where}"


def compile_one(launch: Launch, arch: int, fn=None) -> Result:
    """Compile one launch for sm_<arch> (`fn` replaces the kernel of that name, for tests)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = fn or kernel_functions()[launch.kernel]
    res = Result(launch.kernel, launch.key, arch, ok=False, num_warps=launch.num_warps, hot=launch.kernel in HOT)
    t0 = time.perf_counter()
    try:
        # Pointers are 16-byte aligned (torch allocations); `aligned` integers are multiples of 16.
        attrs = {(i,): [["tt.divisibility", 16]] for i, (a, t) in enumerate(launch.signature)
                 if t.startswith("*") or a in launch.aligned}
        src = ASTSource(fn=fn, signature=dict(launch.signature), constexprs=dict(launch.constexprs), attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": launch.num_warps})
        rep = _ptxas_report(compiled.asm["ptx"], arch)
        res.registers, res.spill_stores, res.spill_loads, res.stack = (rep["registers"], rep["spill_stores"],
                                                                        rep["spill_loads"], rep["stack"])
        res.shared = max(int(compiled.metadata.shared), rep["smem"])
        res.occupancy = occupancy(arch, res.registers, launch.num_warps, res.shared)
        res.ok = True
    except Exception as err:  # every compile failure is a result to report, whatever its type
        res.error = describe(err)
    res.seconds = time.perf_counter() - t0
    return res


def _work(item):
    launch, arch = item
    return compile_one(launch, arch)


def compile_all(archs=ARCHS, jobs: int | None = None, only: tuple[str, ...] = ()) -> list[Result]:
    """Compile every launch for every arch; `jobs` worker processes (default: the cores, at most 2)."""
    items = [(launch, arch) for arch in archs for launch in launches() if not only or launch.kernel in only]
    jobs = jobs or min(2, os.cpu_count() or 1)
    if jobs <= 1:
        return [_work(i) for i in items]
    import multiprocessing as mp

    # spawn: the workers start clean (a parent may have imported triton under TRITON_INTERPRET).
    env_interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with mp.get_context("spawn").Pool(jobs) as pool:
            return pool.map(_work, items, chunksize=4)
    finally:
        if env_interpret is not None:
            os.environ["TRITON_INTERPRET"] = env_interpret


def spills_in_hot_kernels(results: list[Result]) -> list[Result]:
    """Results that spill in a hot kernel, or more than SPILL_BUDGET bytes in another."""
    return [r for r in results if r.ok and (r.spill_stores + r.spill_loads >
                                            (0 if r.hot else SPILL_BUDGET.get(r.kernel, 1 << 30)))]


def summary(results: list[Result]) -> list[dict]:
    """Per (arch, kernel): configurations, failures, and the worst registers / spills / shared / occupancy."""
    rows: dict = {}
    for r in results:
        row = rows.setdefault((r.arch, r.kernel), dict(arch=r.arch, kernel=r.kernel, configs=0, failed=0, registers=0,
                                                      spill_bytes=0, shared=0, warps=set(), min_occupancy=1.0))
        row["configs"] += 1
        if not r.ok:
            row["failed"] += 1
            continue
        row["registers"] = max(row["registers"], r.registers)
        row["spill_bytes"] = max(row["spill_bytes"], r.spill_stores + r.spill_loads)
        row["shared"] = max(row["shared"], r.shared)
        row["warps"].add(r.num_warps)
        row["min_occupancy"] = min(row["min_occupancy"], r.occupancy)
    out = []
    for row in rows.values():
        row["warps"] = ",".join(str(w) for w in sorted(row["warps"]))
        out.append(row)
    return sorted(out, key=lambda r: (-r["arch"], r["kernel"]))


def table(rows: list[dict]) -> str:
    head = f"{'arch':<6}{'kernel':<17}{'configs':>8}{'failed':>7}{'max regs':>9}{'max spill B':>12}" \
           f"{'max smem B':>11}{'warps':>8}{'min occ.':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"sm_{r['arch']:<3}{r['kernel']:<17}{r['configs']:>8}{r['failed']:>7}{r['registers']:>9}"
                     f"{r['spill_bytes']:>12}{r['shared']:>11}{r['warps']:>8}{r['min_occupancy']:>9.2f}")
    return "\n".join(lines)


def write_json(results: list[Result], out_dir: Path, command: str) -> list[Path]:
    import triton

    paths = []
    for arch in sorted({r.arch for r in results}):
        rs = [r for r in results if r.arch == arch]
        doc = dict(command=command, arch=f"sm_{arch}", triton=triton.__version__,
                   summary=[{k: v for k, v in row.items() if k != "arch"} for row in summary(rs)],
                   results=[{k: v for k, v in asdict(r).items() if k not in ("arch", "extra", "seconds")}
                            for r in rs])
        path = Path(out_dir) / f"aot_sm{arch}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        paths.append(path)
    return paths


def read_tables(out_dir: Path = RESULTS) -> str:
    """The table of the committed results (what `python -m kernels.bench` prints), or ''."""
    rows = []
    for path in sorted(Path(out_dir).glob("aot_sm*.json"), reverse=True):
        doc = json.loads(path.read_text())
        arch = int(doc["arch"][3:])
        rows += [dict(row, arch=arch) for row in doc["summary"]]
    return table(rows) if rows else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.aot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, action="append", choices=sorted(SM), help="compute capability x10 "
                    "(repeatable; default 90 and 80)")
    ap.add_argument("--out", type=Path, default=None, help=f"write aot_sm<arch>.json here (default {RESULTS}); "
                    "'-' writes nothing")
    ap.add_argument("--jobs", type=int, default=None, help="compile processes (default: cores, at most 2)")
    ap.add_argument("--kernel", action="append", default=[], help="only these kernels (repeatable)")
    args = ap.parse_args(argv)
    archs = tuple(args.arch or ARCHS)
    t0 = time.perf_counter()
    results = compile_all(archs, args.jobs, tuple(args.kernel))
    print(table(summary(results)))
    failed = [r for r in results if not r.ok]
    spills = spills_in_hot_kernels(results)
    for r in failed:
        print(f"FAILED sm_{r.arch} {r.config}: {r.error}")
    for r in spills:
        print(f"SPILLS sm_{r.arch} {r.config}: {r.spill_stores} B stored, {r.spill_loads} B loaded")
    import triton

    print(f"{len(results)} compiles with triton {triton.__version__} in {time.perf_counter() - t0:.0f} s")
    if args.out is None or str(args.out) != "-":
        cmd = "python -m kernels.aot" + "".join(f" --arch {a}" for a in archs)
        for p in write_json(results, args.out or RESULTS, cmd):
            print(f"wrote {p}")
    return 1 if failed or spills else 0


if __name__ == "__main__":
    sys.exit(main())
