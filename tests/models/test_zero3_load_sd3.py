"""SD3.5's transformer from a sharded folder, loaded partitioned under ZeRO-3 on 2 ranks, equals the plain
load. `make test-runs-more` (outside CI's time); CI holds FLUX's partitioned load against the naive one
(tests/models/test_zero3_load.py)."""
import pytest

from distributed_runs import rank_launcher
from paco_ds.models.tiny.sd3 import save_sd3_folder

pytestmark = pytest.mark.runs_more


def test_zero3_partitioned_load_equals_the_plain_one_on_two_ranks(tmp_path):
    import json
    import subprocess

    from distributed_runs import REPO, cpu_env, free_port

    folder = save_sd3_folder(tmp_path / "sd3", max_shard_size="50KB")
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()  # sharded
    cmd = [*rank_launcher(2, free_port()), str(REPO / "tests" / "scripts" / "sd3_zero3_probe.py"), "--folder",
           str(folder), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + "\n---\n" + proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"sd3_zero3_rank{r}.json").read_text()) for r in range(2)]
    for rep in reports:
        assert rep["world_size"] == 2 and rep["partitioned"] and rep["unequal"] == []
        assert abs(rep["local"] / rep["full"] - 0.5) < 0.01  # half of every tensor per rank
        assert rep["forward_equal"] and rep["forward_abs_mean"] > 0
    assert reports[0]["forward_abs_mean"] == reports[1]["forward_abs_mean"]
