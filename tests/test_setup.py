"""The package layout and set-up: our `kernels` package coexists with transformers/diffusers."""
from pathlib import Path

from conftest import REPO, run_cli


def test_top_level_layout():
    for name in ["paco_ds", "kernels", "configs", "launch", "tests", "csrc", "benchmarks", "setup.py", "README.md",
                 "Makefile", ".ci/run"]:
        assert (REPO / name).exists(), name


def test_our_kernels_package_does_not_break_transformers_or_diffusers():
    # transformers probes for a PyPI package also called `kernels`; ours must not be mistaken for it.
    code = (
        "import kernels, transformers, diffusers\n"
        "from transformers.utils import is_kernels_available\n"
        "from transformers import CLIPTextModel, Qwen2_5_VLForConditionalGeneration\n"
        "from diffusers import FluxTransformer2DModel, FluxPipeline\n"
        "print(kernels.__file__, is_kernels_available())\n"
    )
    out = run_cli("-c", code)
    assert out.returncode == 0, out.stderr[-2000:]
    path, available = out.stdout.split()[-2:]
    assert Path(path).resolve() == (REPO / "kernels" / "__init__.py").resolve()
    assert available == "False"


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in readme and "make test" in ci
    assert "make demo" in readme
