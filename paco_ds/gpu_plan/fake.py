"""Fake CUDA: run the real code path at full size with no GPU and no weights.

`FakeCuda` is a dispatch mode with three jobs:

1. Every op that touches a device tensor (or creates one) runs under torch's `FakeTensorMode`:
   tensors claim device "cuda", carry shapes, dtypes and strides, and hold no data. Host (CPU)
   tensors stay real, as on a GPU machine, so host-side math (schedules, tokenizers, image
   resizing) runs for real. An op that mixes a device tensor with a host tensor (other than a
   0-dim scalar) raises, as it would on a GPU; so does a dtype mismatch in a matmul.
2. Small device tensors keep a real shadow on the host (computed alongside, op by op), so code
   that reads a device value back (`.item()`, `int(mask.sum())`, boolean-mask indexing) gets the
   value a GPU would give. A data-dependent read of a large tensor (a loss, a statistic) gives NaN:
   a plan never looks at values.
3. It counts device memory: every device storage an op creates is live until Python drops it;
   bytes are summed per tag (what the code was doing when it allocated), and the peak of the total,
   with its split by tag, is kept per phase.
4. It counts the bytes of the collectives the code issues (sequence parallelism's all-to-alls and
   gathers, on an emulated process group whose collectives move nothing): each one's result.

Models are built on the meta device and turned into fake CUDA tensors (`to_fake_cuda`), so a 20B
transformer costs no host memory.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import (DynamicOutputShapeException, FakeTensor, FakeTensorMode,
                                          unset_fake_temporarily)
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import flop_registry
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

SHADOW_NUMEL = 1 << 16  # device tensors up to this size keep a real host copy
CUDA = torch.device("cuda", 0)


@dataclass
class PhaseMemory:
    """Peak of the live device bytes of one phase, and their split by tag at that peak."""

    peak: int = 0
    at_peak: dict[str, int] = field(default_factory=dict)


class FakeCuda(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        # The training pass runs on fake "meta" tensors: torch's autograd engine needs a CUDA
        # context for CUDA tensors, even fake ones; a host tensor mixed in still raises there.
        self.fake.allow_meta = True
        self.shadows = WeakTensorKeyDictionary()  # device tensor -> its host copy
        self.live: dict[str, int] = {}
        self.total = 0
        self.tag = "activations"
        self.phases: dict[str, PhaseMemory] = {}
        self.phase: PhaseMemory | None = None
        self._seen: dict[int, str] = {}  # id of a tracked storage -> its tag (until it is freed)
        self.ignored = 0  # data-dependent reads answered with NaN
        self.device = CUDA  # where new fake device tensors of data-dependent ops go
        # Model FLOPs (torch.utils.flop_counter's formulas) of every device op. Not FlopCounterMode:
        # its module tracking keeps activations alive, which undoes gradient checkpointing.
        self.flops = 0.0
        self.collective_bytes = 0  # the results of every collective (c10d ops) so far

    # ------------------------------------------------------------------ tags and phases
    @contextlib.contextmanager
    def tagged(self, tag: str) -> Iterator[None]:
        saved, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = saved

    @contextlib.contextmanager
    def measure(self, phase: str) -> Iterator[PhaseMemory]:
        """Peak live device bytes from here to the end of the block (bytes already live count)."""
        saved = self.phase
        self.phase = self.phases.setdefault(phase, PhaseMemory())
        self._bump()
        try:
            yield self.phase
        finally:
            self.phase = saved

    def retag(self, tensor: torch.Tensor, tag: str) -> None:
        """Count a tensor's storage under another tag from now on (e.g. gradients after backward)."""
        key = id(tensor.untyped_storage())
        old = self._seen.get(key)
        if old is None or old == tag:
            return
        n = tensor.untyped_storage().nbytes()
        self.live[old] -= n
        self.live[tag] = self.live.get(tag, 0) + n
        self._seen[key] = tag

    def _bump(self) -> None:
        if self.phase is not None and self.total > self.phase.peak:
            self.phase.peak = self.total
            self.phase.at_peak = {k: v for k, v in self.live.items() if v}

    def _track(self, t: torch.Tensor) -> None:
        if not isinstance(t, FakeTensor) or t.device.type not in ("cuda", "meta"):
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return
        n = storage.nbytes()
        tag = self.tag
        self._seen[key] = tag
        self.live[tag] = self.live.get(tag, 0) + n
        self.total += n
        weakref.finalize(storage, self._free, key, n)
        self._bump()

    def _free(self, key: int, n: int) -> None:
        tag = self._seen.pop(key, None)
        if tag is not None:
            self.live[tag] -= n
            self.total -= n

    def track_module(self, module: torch.nn.Module, tag: str) -> None:
        """Count a module's parameters and buffers (built with `to_fake_cuda`) under `tag`."""
        with self.tagged(tag):
            for t in [*module.parameters(), *module.buffers()]:
                self._track(t)

    # ------------------------------------------------------------------ dispatch
    # The fake mode stays entered underneath (so moving a host tensor to "cuda" never initialises
    # CUDA); this mode sees each op first and lets host-only ops run for real.
    def __enter__(self):
        self.fake.__enter__()
        self._host_first = _HostFirst().__enter__()
        self._flash = _FlashAttention().__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._flash.__exit__(*exc)
            self._host_first.__exit__(*exc)
            self.fake.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        on_device = any(isinstance(a, FakeTensor) for a in flat) or any(
            isinstance(a, torch.device) and a.type in ("cuda", "meta") for a in flat)
        if not on_device:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            return self._scalar(args[0])
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:
            out = self._data_dependent(func, flat, spec)
        packet = func._overloadpacket
        if packet in flop_registry:
            self.flops += flop_registry[packet](*args, **kwargs, out_val=out)
        if func.namespace in ("_c10d_functional", "c10d") and not func.__name__.startswith("wait"):
            self.collective_bytes += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                                         if isinstance(t, torch.Tensor))
        shadow = self._shadow_of(func, flat, spec, out)
        outs = tree_flatten(out)[0]
        for t in outs:
            if isinstance(t, torch.Tensor):
                self._track(t)
        if shadow is not None:
            for fake_t, real_t in zip(outs, tree_flatten(shadow)[0]):
                if isinstance(fake_t, FakeTensor) and isinstance(real_t, torch.Tensor):
                    self.shadows[fake_t] = real_t
        return out

    def _host(self, a):
        """The host value of an argument: a shadow for a device tensor, the arg itself otherwise."""
        if isinstance(a, FakeTensor):
            return self.shadows.get(a)
        if isinstance(a, torch.device) and a.type in ("cuda", "meta"):
            return torch.device("cpu")
        return a

    def _shadow_of(self, func, flat, spec, out):
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs or sum(t.numel() for t in outs) > SHADOW_NUMEL:
            return None
        host = [self._host(a) for a in flat]
        if any(isinstance(a, FakeTensor) and h is None for a, h in zip(flat, host)):
            return None  # an input without a host value: its result has none either
        args, kwargs = tree_unflatten(host, spec)
        try:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a shadow is a convenience; the fake result stands
            return None

    def _scalar(self, t: FakeTensor):
        real = self.shadows.get(t)
        if real is not None:
            with unset_fake_temporarily():
                return real.item()
        self.ignored += 1
        if t.dtype.is_floating_point or t.dtype.is_complex:
            return math.nan
        raise RuntimeError(f"the fake-CUDA pass reads a data-dependent {t.dtype} value of a device tensor of "
                           f"shape {list(t.shape)} with no host copy")

    def _data_dependent(self, func, flat, spec):
        """Ops whose output shape depends on data (nonzero, boolean-mask indexing): computed from
        the host copies of the small inputs, with the big ones taken as index targets."""
        if func in (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default) or not any(
                isinstance(a, FakeTensor) and a.dtype == torch.bool for a in flat):
            host = [self._host(a) for a in flat]
            if any(isinstance(a, FakeTensor) and h is None for a, h in zip(flat, host)):
                raise RuntimeError(f"{func}: output shape depends on device data with no host copy")
            args, kwargs = tree_unflatten(host, spec)
            with unset_fake_temporarily():
                real = func(*args, **kwargs)
            return tree_map(lambda r: self._to_fake(r) if isinstance(r, torch.Tensor) else r, real)
        # boolean masks as indices: replace each by the long indices of its true entries
        swapped = []
        for a in flat:
            if isinstance(a, FakeTensor) and a.dtype == torch.bool:
                h = self.shadows.get(a)
                if h is None:
                    raise RuntimeError(f"{func}: a boolean device mask with no host copy")
                if h.dim() != 1:
                    raise RuntimeError(f"{func}: {h.dim()}-d boolean masks are not supported here")
                with unset_fake_temporarily():
                    idx = h.nonzero(as_tuple=True)[0]
                swapped.append(self._to_fake(idx))
            else:
                swapped.append(a)
        args, kwargs = tree_unflatten(swapped, spec)
        return func(*args, **kwargs)

    def _to_fake(self, real: torch.Tensor) -> FakeTensor:
        t = fake_cuda_tensor(self, real, self.device)
        self.shadows[t] = real
        self._track(t)
        return t


class _HostFirst(TorchFunctionMode):
    """torch.tensor(<list holding device scalars>, device="cuda") initialises CUDA in C++ before any
    dispatch mode sees it; build such a tensor on the host from the scalars' values, then move it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor and kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu":
            device = kwargs.pop("device")
            data = tree_map(lambda x: x.item() if isinstance(x, torch.Tensor) else x, args[0])
            return func(data, *args[1:], **kwargs).to(device)
        return func(*args, **kwargs)


class _FlashAttention:
    """PyTorch's SDPA restricted to its flash kernel (`sdpa_kernel(FLASH_ATTENTION)`, what diffusers'
    `_native_flash` backend runs, `model.attention_backend: _native_flash`) picks its kernel from the
    GPU's properties before any dispatch mode sees the call, and finds none without a GPU. While the
    fake mode is entered, `torch.nn.functional.scaled_dot_product_attention` on fake tensors under that
    restriction is the flash kernel's own op instead, whose fake implementation keeps what the kernel
    keeps (the output and its log-sum-exp: memory linear in the sequence, not the math path's softmax
    matrices) and whose FLOPs the counter knows; backward is its flash backward. The function itself is
    swapped (not a thread-local function mode), so gradient checkpointing's recomputation, which may
    run on autograd's thread, takes the same path. Unrestricted SDPA stays the math path."""

    NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

    def __enter__(self):
        self.original = original = torch.nn.functional.scaled_dot_product_attention

        def sdpa(*args, **kwargs):
            call = dict(zip(self.NAMES, args)) | kwargs
            if isinstance(call.get("query"), FakeTensor) and torch.backends.cuda.flash_sdp_enabled() \
                    and not torch.backends.cuda.math_sdp_enabled() and call.get("attn_mask") is None \
                    and not call.get("enable_gqa"):
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    call["query"], call["key"], call["value"], call.get("dropout_p", 0.0), call.get("is_causal", False),
                    scale=call.get("scale"))[0]
            return original(*args, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = self.original


def fake_cuda_tensor(mode: FakeCuda, t: torch.Tensor, device: torch.device = CUDA) -> FakeTensor:
    """A fake device tensor with the shape, stride and dtype of `t` (meta or real)."""
    with unset_fake_temporarily():
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return FakeTensor(mode.fake, meta, device)


def move_fake(mode: FakeCuda, module: torch.nn.Module, device: torch.device) -> None:
    """Re-place a fake module's parameters and buffers on another fake device (same tags)."""
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                tag = mode._seen.get(id(p.untyped_storage()), "transformer")
                # under its tag from the start: nn.Parameter() dispatches an alias of the new storage,
                # which the mode counts at once, and counted under the default tag the moved weights
                # were training's activations (a whole transformer of them, every training pass)
                with mode.tagged(tag):
                    new = torch.nn.Parameter(fake_cuda_tensor(mode, p, device), requires_grad=p.requires_grad)
                    mode._track(new)
                mod._parameters[name] = new
        for name, b in list(mod._buffers.items()):
            if b is not None:
                new = fake_cuda_tensor(mode, b, device)
                if b in mode.shadows:
                    mode.shadows[new] = mode.shadows[b]
                mod._buffers[name] = new


def to_fake_cuda(mode: FakeCuda, module: torch.nn.Module, dtype: torch.dtype | None = None,
                 keep_fp32: tuple[str, ...] = ()) -> torch.nn.Module:
    """Replace a (meta) module's parameters and buffers by fake CUDA tensors, cast to `dtype`
    (floating tensors only; names containing one of `keep_fp32` stay in their own dtype)."""
    for mod_name, mod in module.named_modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            full = f"{mod_name}.{name}" if mod_name else name
            cast = dtype if dtype is not None and p.is_floating_point() and not any(k in full for k in keep_fp32) \
                else p.dtype
            mod._parameters[name] = torch.nn.Parameter(fake_cuda_tensor(mode, p.to(cast)),
                                                       requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            real = b if b.device.type != "meta" else None
            fake = fake_cuda_tensor(mode, b)
            if real is not None and real.numel() <= SHADOW_NUMEL:
                mode.shadows[fake] = real
            mod._buffers[name] = fake
    return module
