"""A judge started with what it cannot serve exits 2 with one line, before it serves: the hf engine's
process, started for real (its imports and the tiny judge's build, about 20 s a start). The runs tier
(`make test-runs`); the checks themselves are the fast tier's (tests/serving/test_vllm_args.py,
tests/models/test_attention_backend.py)."""
import pytest

from conftest import one_line_error, run_cli

pytestmark = pytest.mark.runs


def test_hf_engine_refuses_max_logprobs_above_the_vocabulary_at_start():
    out = run_cli("-m", "paco_ds.serving.hf_engine", "--tiny", "--served-model-name", "judge", "--port", "0",
                  "--max-logprobs", "268", timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "--max-logprobs=268 exceeds the vocabulary of judge 'judge' (267 tokens)" in out.stderr


def test_a_judge_started_with_what_cannot_run_exits_2_with_one_line():
    proc = run_cli("-m", "paco_ds.serving.hf_engine", "--tiny", "--served-model-name", "j", "--device", "cpu",
                   "--attn-implementation", "flash_attention_2")
    assert "config key 'reward_servers.attn_implementation': 'flash_attention_2' needs flash-attn 2" in one_line_error(proc)
