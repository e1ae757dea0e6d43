"""model.compile under ZeRO-3 for real: 2 ZeRO-3 CPU processes of the tiny recipe, whose sampling
phase (deepspeed.rollout_gather: once) runs the compiled blocks on the whole parameters with
DeepSpeed's hooks lifted, and whose training steps run eager (paco_ds/models/compile.py)."""
import pytest

from distributed_runs import TINY, resumes_exactly

pytestmark = pytest.mark.runs_more  # make test-runs-more (not in CI: its time)


def test_compiled_sampling_under_zero3_has_no_graph_break_nor_recompile_after_the_first_epoch(tmp_path):
    compiled = resumes_exactly(tmp_path, TINY, "model.compile=true")  # and the resumed copy matches it
    first, second = compiled
    assert first["compile/graphs"] > 0, "the blocks ran compiled in sampling"
    assert first["compile/graph_breaks"] == second["compile/graph_breaks"] == 0
    # epoch 1: new prompts and noise, the same shapes: nothing compiles again
    assert (second["compile/graphs"], second["compile/recompiles"]) == (first["compile/graphs"], first["compile/recompiles"])

    for r in compiled:
        # log pi_old comes from the compiled rollout and training recomputes it eager: the compiled blocks'
        # velocities are eager's to float tolerance (tests/models/test_compile.py), and so is the ratio
        assert abs(r["train/ratio_first"] - 1.0) < 1e-4
