"""The package layout and set-up: our `kernels` package coexists with transformers/diffusers."""
from pathlib import Path

import pytest

from conftest import REPO, run_cli

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("command", [["launch/train.py"], ["launch/sft.py"], ["launch/evaluate.py"],
                                     ["launch/cluster.py"], ["launch/serve_reward.py"], ["-m", "kernels.bench"]])
def test_every_entry_point_answers_help(command):
    # the product's commands (README) parse their command line before anything heavy is imported
    out = run_cli(*command, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:") and "--help" in out.stdout


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
