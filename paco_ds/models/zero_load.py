"""Load a large model straight into ZeRO-3 partitions, one checkpoint tensor at a time.

Why: `from_pretrained` followed by `deepspeed.initialize` materialises the whole model on every
rank before DeepSpeed partitions it: for FLUX.1-dev's 12B transformer on an 8-GPU node that is
8 x 24 GB of host RAM (and a full copy per GPU). Here instead

1. the module is built from its config inside `deepspeed.zero.Init`, which partitions each
   parameter as soon as its submodule is constructed. The random initialisation is skipped (every
   parameter is overwritten from the checkpoint, and a missing one is an error) and the global RNG
   is left untouched, so what follows (the LoRA initialisation) draws the same numbers as after a
   plain `from_pretrained`;
2. the weights are streamed from the folder's safetensors (one file, or shards listed in a
   `*.safetensors.index.json`) in parameter order: rank 0 opens the file, reads one tensor and
   closes it again (so no mapping of the whole file stays resident), and
   `GatheredParameters([p], modifier_rank=0)` copies it in and broadcasts it; on leaving the
   context every rank keeps only its own partition. Buffers are copied whole on every rank.

Peak memory per rank: its 1/world share of the model plus about two copies of the parameter being
loaded (the gathered tensor and the all-gather's buffer; the largest of FLUX.1-dev is 56.6M
elements) and, on rank 0, the tensor just read (benchmarks/zero3_load.py measures it). The copy
is `param.copy_(tensor)`, the same cast `from_pretrained(torch_dtype=...)` does, so the gathered
weights are bit-identical to a plain load.

Peft can wrap the partitioned Linears afterwards as it is (it reads `in_features`/`out_features`,
not the weight's shape): the LoRA matrices are created as ordinary tensors and `deepspeed.initialize`
partitions them with the rest. Shared by every diffusers transformer the policies load (FLUX,
FLUX Kontext, Qwen-Image-Edit): `build_partitioned(FluxTransformer2DModel, folder, ds_config, dtype)`.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

log = logging.getLogger(__name__)

_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")


def is_zero3(ds_config: dict | None) -> bool:
    return bool(ds_config) and int(ds_config.get("zero_optimization", {}).get("stage", 0)) == 3


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Module constructors allocate but do not initialise (torch.nn.init is a no-op inside)."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS if hasattr(torch.nn.init, name)}
    try:
        for name in saved:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _init_config(ds_config: dict, dtype: torch.dtype) -> dict:
    """The engine config as zero.Init should read it. The parameter dtype is given through the
    config's bf16/fp16 switches: zero.Init's own `dtype=` argument is overridden by bf16 on an
    accelerator without fp16 support, the CPU one (DeepSpeed 0.19, an operator-precedence slip).
    zero.Init also parses the batch sizes, which must be present; a bare {"zero_optimization": ...}
    gets one that changes nothing about partitioning."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"ZeRO-3 parameters are fp32, bf16 or fp16, not {dtype}")
    conf = copy.deepcopy(ds_config)
    conf["bf16"] = {**conf.get("bf16", {}), "enabled": dtype == torch.bfloat16}
    conf["fp16"] = {**conf.get("fp16", {}), "enabled": dtype == torch.float16}
    if not any(k in conf for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        conf["train_micro_batch_size_per_gpu"] = 1
    return conf


@contextlib.contextmanager
def zero3_construct(ds_config: dict, dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside are partitioned at once, in `dtype`, uninitialised, RNG untouched.

    zero.Init also swaps `torch.nn.functional.linear` for DeepSpeed's ZeRO-3 linear for the rest of
    the process (its default); `deepspeed.initialize` does the same to a model built whole, so the
    forward computes the same either way."""
    import transformers  # noqa: F401  (imported first: importing it inside zero.Init fails with a signature mismatch)
    import deepspeed

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), skip_init(), \
            deepspeed.zero.Init(config_dict_or_path=_init_config(ds_config, dtype)):
        yield


def checkpoint_index(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: from a `*.safetensors.index.json`
    (sharded checkpoints) or from the headers of the folder's `*.safetensors` files."""
    from safetensors import safe_open

    folder = Path(folder)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise ValueError(f"{folder}: more than one safetensors index: {[p.name for p in indexes]}")
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in out:
                    raise ValueError(f"{folder}: tensor {name} is in both {out[name].name} and {file.name}")
                out[name] = file
    return out


def checkpoint_shapes(index: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(index.values())):
        with safe_open(str(file), framework="pt") as f:
            shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if index.get(n) == file})
    return shapes


def read_tensor(file: Path, name: str) -> torch.Tensor:
    """One tensor, in its stored dtype; the file is closed (and unmapped) before returning."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt", device="cpu") as f:
        return f.get_tensor(name)


def local_subfolder(path: str | Path, subfolder: str, revision: str | None = None) -> Path:
    """`path/subfolder` for a local model directory; for a hub id, that subfolder of the local
    snapshot (fetched where the hub is reachable, from the cache under HF_HUB_OFFLINE=1)."""
    if Path(path).is_dir():
        return Path(path) / subfolder
    from huggingface_hub import snapshot_download

    root = snapshot_download(str(path), revision=revision, allow_patterns=[f"{subfolder}/*"])
    return Path(root) / subfolder


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


@torch.no_grad()
def load_partitioned(module: nn.Module, folder: str | Path) -> None:
    """Stream the folder's weights into a module built under `zero3_construct` (strict: every
    parameter and persistent buffer must be in the checkpoint, and nothing else)."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    index = checkpoint_index(folder)
    params = dict(module.named_parameters(remove_duplicate=True))
    non_persistent = {f"{prefix}.{b}" if prefix else b for prefix, m in module.named_modules()
                      for b in getattr(m, "_non_persistent_buffers_set", ())}
    buffers = {n: b for n, b in module.named_buffers() if n not in non_persistent}
    missing = sorted((set(params) | set(buffers)) - set(index))
    unexpected = sorted(set(index) - set(params) - set(buffers))
    if missing or unexpected:  # every rank reads the same index, so every rank raises here
        raise ValueError(f"{folder}: checkpoint does not match {type(module).__name__}: "
                         f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    shapes = checkpoint_shapes(index)
    wrong = [f"{n}: checkpoint {shapes[n]} != model {tuple(getattr(t, 'ds_shape', t.shape))}"
             for n, t in [*params.items(), *buffers.items()] if shapes[n] != tuple(getattr(t, "ds_shape", t.shape))]
    if wrong:  # checked on every rank before the first collective
        raise ValueError(f"{folder}: shapes differ from {type(module).__name__}: {wrong[:8]}")
    plain = [n for n, t in params.items() if not hasattr(t, "ds_id")]
    if plain:
        raise ValueError(f"parameters {plain[:8]} are not partitioned: build the module under zero3_construct")
    main = _rank() == 0
    for name, param in params.items():  # same order on every rank (the collectives must match)
        with GatheredParameters([param], modifier_rank=0):
            if main:
                tensor = read_tensor(index[name], name)
                param.data.copy_(tensor)
                del tensor
    for name, buf in buffers.items():
        buf.copy_(read_tensor(index[name], name))


def build_partitioned(cls, folder: str | Path, ds_config: dict, dtype: torch.dtype, **config_overrides) -> nn.Module:
    """A diffusers model class (`ModelMixin`) from a folder holding its config.json and safetensors
    weights, partitioned under ZeRO-3 from the start. Returned in eval mode like `from_pretrained`."""
    folder = Path(folder)
    config = dict(cls.load_config(str(folder)))
    config.update(config_overrides)
    with zero3_construct(ds_config, dtype):
        module = cls.from_config(config)
    load_partitioned(module, folder)
    module.register_to_config(_name_or_path=str(folder))
    log.info("loaded %s partitioned from %s", cls.__name__, folder)
    return module.eval()


def load_transformer(model_cls, path: str, revision: str | None, dtype, ds_config: dict | None,
                     subfolder: str = "transformer"):
    """A family's transformer from the checkpoint's transformer/ folder (`subfolder`: another one,
    Wan2.2-A14B's second expert in transformer_2/): built partitioned from the start under a ZeRO-3
    `ds_config` (build_partitioned), else loaded whole by diffusers."""
    if is_zero3(ds_config):
        return build_partitioned(model_cls, local_subfolder(path, subfolder, revision), ds_config, dtype)
    kw = {"revision": revision} if revision else {}
    return model_cls.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype, **kw)
