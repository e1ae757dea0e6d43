"""GPU-path details checked without a GPU: the wheel bundle's requirement check against the GPU
image, NCCL bound to the rank's device at init, and the CUDA RNG restore across GPU counts."""
import sys
import zipfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import bundle  # noqa: E402

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

    import paco_ds.distributed as d

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
    from paco_ds import checkpoint

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
