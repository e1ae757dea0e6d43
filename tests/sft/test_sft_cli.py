"""`launch/sft.py` on bad input: one line naming the record and path, exit code 2, no traceback."""
import json

import pytest
from PIL import Image

from conftest import REPO, run_cli

pytestmark = pytest.mark.runs  # each case launches launch/sft.py (about 10 s of imports apiece): make test-runs

TINY = str(REPO / "configs" / "tiny" / "reward_sft.yaml")


def pair(images, question="<image><image>Same?", answer="Yes. Both match."):
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            "images": images}


# Through the command line: a record refused as it is read (tests/sft/test_sft_data.py checks each of
# those errors in-process, in the fast tier) and a prompt refused once the processor counts its tokens.
CASES = {
    "missing_image": (pair(["a.png", "gone.png"]), "record 1: image file not found: {dir}/gone.png"),
    "cutoff": (pair(["a.png", "b.png"], question="<image><image>" + "Same? " * 100),
               "record 1: the prompt is"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_is_one_line_and_exit_code_2(tmp_path, case):
    record, expected = CASES[case]
    for name in ("a.png", "b.png"):
        Image.new("RGB", (64, 64), "blue").save(tmp_path / name)
    data = tmp_path / "train.json"
    data.write_text(json.dumps([pair(["a.png", "b.png"]), record]))
    out = run_cli("launch/sft.py", "--config", TINY, "--set", f"output_dir={tmp_path / 'runs'}",
                  "--set", "data.synthetic=null", "--set", f"data.train_files=[{data}]",
                  "--set", "data.cutoff_len=400", timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"sft: error: {data}: ") and expected.format(dir=tmp_path) in lines[0], lines[0]
    if case == "cutoff":
        assert "data.cutoff_len is 400" in lines[0]
    assert not (tmp_path / "runs" / "tiny_reward_sft" / "checkpoints").exists()  # stopped before training


def test_bad_command_lines(tmp_path):
    out = run_cli("launch/sft.py", "--config", TINY, "--set", "train.batch_sise=2")
    assert out.returncode == 2
    assert "unknown config key 'train.batch_sise' (did you mean 'train.batch_size'?)" in out.stderr
    out = run_cli("launch/sft.py", "export", "--config", TINY, "--set", f"output_dir={tmp_path}")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"sft: error: export: no checkpoint in {tmp_path / 'tiny_reward_sft' / 'checkpoints'} "
        "(train first, or pass --checkpoint DIR or --adapter DIR)"]
    out = run_cli("launch/sft.py", "export", "--config", TINY, "--adapter", str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip() == f"sft: error: no peft adapter (adapter_config.json) in {tmp_path}"
