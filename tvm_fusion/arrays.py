"""The caller's arrays: numpy, torch (CPU or CUDA) or TVM tensors.

Two speeds. :func:`inspect` describes an argument for the contracts (slow path,
once per call signature). :func:`signature` is what the hot path hashes: the
kind, shape, dtype, device and layout facts that decide the kernel, read in well
under a microsecond. :class:`Kind` holds, per kind of array, the few steps a
launch takes: a view of the kernel's shape, an output of the caller's kind, and
whether the data pointer meets the kernels' 16-byte alignment
(``kernel.PARAM_ALIGNMENT``). Torch tensors go to the TVM function as they are
(tvm-ffi's DLPack exchange, which also launches on torch's current stream);
numpy arrays too, except bfloat16, which numpy's DLPack does not know.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
import tvm_ffi

from . import single_launch
from .kernel import PARAM_ALIGNMENT

try:  # torch is optional; without it no argument is a torch tensor
    import torch

    TORCH_TENSOR: type | None = torch.Tensor
except ImportError:  # pragma: no cover - torch ships with the test extras
    torch = None
    TORCH_TENSOR = None

_MISALIGNED = PARAM_ALIGNMENT - 1


@dataclass(frozen=True)
class ArrayArg:
    """An argument as the contracts see it: shape, dtype, kind and device."""

    obj: Any
    kind: str  # "numpy" | "torch" | "tvm"
    shape: tuple[int, ...]
    dtype: str
    device_type: str  # "cpu" | "cuda"
    device_id: int = 0


def check_same_place(op: str, first: ArrayArg, **others: ArrayArg | None) -> None:
    """Raise a ValueError naming the argument that is not of ``first``'s kind on
    ``first``'s device."""
    for name, other in others.items():
        if other is not None and (other.kind, other.device_type, other.device_id) != (
                first.kind, first.device_type, first.device_id):
            raise ValueError(
                f"{op}: {name} must be of the same kind and on the same device as logits "
                f"({first.kind} on {first.device_type}:{first.device_id}), got {other.kind} on "
                f"{other.device_type}:{other.device_id}"
            )


def is_torch(x: Any) -> bool:
    return TORCH_TENSOR is not None and isinstance(x, TORCH_TENSOR)


def inspect(x: Any, op: str, name: str) -> ArrayArg:
    """Describe ``x`` or raise a TypeError naming the argument."""
    if isinstance(x, np.ma.MaskedArray):  # the kernels would read the masked values too
        raise TypeError(f"{op}: {name} is a masked array, whose mask the kernels cannot honour; "
                        f"pass {name}.filled(value) or {name}.compressed() instead")
    if isinstance(x, np.ndarray):
        return ArrayArg(x, "numpy", tuple(x.shape), np.dtype(x.dtype).name, "cpu")
    if is_torch(x):
        dev = x.device
        if dev.type == "meta" or x.layout != torch.strided or x.is_nested:
            what = ("a meta tensor (no data)" if dev.type == "meta" else "a nested tensor" if x.is_nested
                    else f"a {x.layout} tensor")
            raise TypeError(f"{op}: {name} is {what}; the kernels take dense (strided) tensors with data "
                            "(tvm_fusion.torch's ops also take meta tensors, for shapes)")
        return ArrayArg(
            x, "torch", tuple(x.shape), str(x.dtype).removeprefix("torch."), dev.type,
            dev.index or 0,
        )
    if isinstance(x, tvm_ffi.Tensor):
        dev = x.device
        kind = "cuda" if dev.dlpack_device_type() == 2 else "cpu"
        return ArrayArg(x, "tvm", tuple(int(d) for d in x.shape), str(x.dtype), kind, dev.index)
    raise TypeError(
        f"{op}: {name} must be a numpy array, a torch tensor or a TVM tensor, "
        f"got {type(x).__name__}"
    )


def signature(x: Any) -> tuple:
    """What decides the kernel for ``x``, cheaply: hashed by the hot path's lookup.

    Equal signatures mean equal shape, dtype, device and contiguity, so a contract
    check passed once holds for every later argument with that signature."""
    kind = type(x)
    if x is None:
        return (None,)
    # The exact types first (the hot path's), then their subclasses (np.memmap,
    # nn.Parameter) by the same properties, never by id: a later object of another
    # shape may reuse a freed one's id.
    if kind is np.ndarray or (kind is not TORCH_TENSOR and isinstance(x, np.ndarray)):
        return (kind, x.shape, x.dtype, x.flags.c_contiguous)
    if kind is TORCH_TENSOR or is_torch(x):
        return (kind, x.shape, x.dtype, x.device, x.is_contiguous())
    if isinstance(x, tvm_ffi.Tensor):
        return (kind, tuple(x.shape), str(x.dtype), str(x.device))
    return (kind, id(x))  # a foreign object: the slow path refuses it


class Kind:
    """How a launch handles one kind of array (numpy, torch or TVM) on one device."""

    def __init__(self, like: ArrayArg):
        self.name = like.kind
        self.cuda = like.device_type == "cuda"
        self.device = like.obj.device if like.kind == "torch" else tvm_device(like)

    def allocator(self, shape: tuple[int, ...], dtype: str, memory_format: Any = None) -> Callable[[], Any]:
        """A function that allocates one output: everything about it resolved once
        (``torch.empty`` with sizes as arguments costs 1.0 us here, with a shape
        tuple 1.5); ``memory_format`` (torch only) as torch.empty takes it."""
        if self.name == "torch":
            dt, dev = getattr(torch, dtype), self.device
            if not shape:
                return lambda: torch.empty((), dtype=dt, device=dev)
            if memory_format is not None:
                return lambda: torch.empty(*shape, dtype=dt, device=dev, memory_format=memory_format)
            return lambda: torch.empty(*shape, dtype=dt, device=dev)
        if self.name == "numpy":
            dt = np.dtype(dtype)
            return lambda: np.empty(shape, dt)
        return lambda: tvm.runtime.empty(shape, dtype, self.device)

    def scratch(self, specs: list[tuple[tuple[int, ...], str]], counter: bool = False) -> Callable[[], list[Any]]:
        """A function that gives the kernel arguments the caller never sees (row losses
        before the batch reduction, a gradient's lse), one per (shape, dtype) spec,
        and with ``counter`` a merged kernel's zeroed launch counter last
        (``single_launch``).

        CUDA torch tensors: one set per stream, reused by every later call on that
        stream (stream order keeps the calls apart, and a merged kernel leaves its
        counter at 0), held as TVM tensors, which tvm-ffi passes without the DLPack
        exchange a torch tensor costs per call; under CUDA graph capture each call
        gets a set of its own (a counter zeroed by a memset the graph records). An
        allocation costs 2.8-4.3 us of host time on the H200's host. CPU torch tensors
        and numpy arrays: one set per host thread, since a CPU kernel is done when
        its call returns (the four of the fused gradient cost 6.2 us a call fresh on
        the CI machine's host). TVM tensors: the scratch fresh per call, the counter
        the one of their device and TVM stream."""
        allocators = [self.allocator(shape, dtype) for shape, dtype in specs]
        if counter:
            if self.name == "torch":
                device = self.device
                allocators.append(lambda: single_launch.zeroed_counter(device))
            else:
                device = self.device
                allocators.append(lambda: single_launch.tvm_counter(device))

        def fresh() -> list[Any]:
            return [allocate() for allocate in allocators]

        if self.name == "tvm":
            return fresh
        if not self.cuda:
            local = threading.local()

            def per_thread() -> list[Any]:
                buffers = getattr(local, "buffers", None)
                if buffers is None:
                    buffers = local.buffers = fresh()
                return buffers

            return per_thread
        index, per_stream = self.device.index or 0, {}
        current_stream, capturing = torch._C._cuda_getCurrentRawStream, torch._C._cuda_isCurrentStreamCapturing

        def get() -> list[Any]:
            if capturing():
                return fresh()
            stream = current_stream(index)
            buffers = per_stream.get(stream)
            if buffers is None:
                buffers = per_stream[stream] = [tvm_ffi.from_dlpack(t) for t in fresh()]
            return buffers

        return get

    # -- inputs -----------------------------------------------------------------
    def takes_as_called(self, like: ArrayArg, shape: tuple[int, ...]) -> bool:
        """Whether a kernel of parameter ``shape`` should take arguments like ``like``
        in their own shape (``kernel.build_kernel``'s input_shapes): contiguous torch
        tensors of another rank, which would otherwise need a view each call."""
        return self.name == "torch" and like.obj.is_contiguous() and tuple(like.shape) != tuple(shape)

    def adapter(self, like: ArrayArg, shape: tuple[int, ...]) -> Callable[[Any], Any]:
        """:meth:`as_input` for every later argument with ``like``'s signature,
        with what the signature already fixes (rank, contiguity) decided once:
        a torch tensor of the kernel's rank costs one alignment test per call."""
        if self.name == "torch" and like.obj.is_contiguous():
            if len(like.shape) == len(shape):
                def torch_input(x: Any) -> Any:
                    return _aligned_torch_copy(x) if x.data_ptr() & _MISALIGNED else x

                return torch_input

            def torch_view(x: Any) -> Any:  # view(*sizes): 0.9 us, view(tuple) 1.4
                return (_aligned_torch_copy(x) if x.data_ptr() & _MISALIGNED else x).view(*shape)

            return torch_view
        return lambda x: self.as_input(x, shape)

    def as_input(self, x: Any, shape: tuple[int, ...]) -> Any:
        """``x`` as the kernel's ``shape`` parameter: a view, or one aligned
        contiguous copy when ``x`` is not 16-byte aligned or not contiguous."""
        if self.name == "torch":  # tvm-ffi takes it as it is, requires_grad or not
            if x.data_ptr() & _MISALIGNED or not x.is_contiguous():
                x = _aligned_torch_copy(x)
            return x if x.dim() == len(shape) else x.view(shape)  # equal rank: equal shape
        if self.name == "numpy":
            if not x.dtype.isnative:  # DLPack takes native byte order only
                x = x.astype(x.dtype.newbyteorder("="))
            # DLPack cannot export a read-only array (np.load(mmap_mode="r"),
            # np.frombuffer), although the kernels only read it: one copy.
            if not x.flags.c_contiguous or x.ctypes.data & _MISALIGNED or not x.flags.writeable:
                x = aligned_numpy_copy(x)
            x = x.reshape(shape)
            if x.dtype.name == "bfloat16":  # numpy's DLPack knows no bfloat16: pass the bits
                return tvm_ffi.from_dlpack(x.view(np.uint16))._create_view(shape, "bfloat16")
            return x
        return x if tuple(x.shape) == shape else x._create_view(shape)

    # -- outputs ----------------------------------------------------------------
    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        """A new array of the caller's kind on the caller's device (numpy's
        allocations are 16-byte aligned, torch's at least 64)."""
        return self.allocator(shape, dtype)()

    def read_int(self, array: Any) -> int:
        """First element of a small integer result, on the host (a sync on a GPU)."""
        if self.name == "numpy":
            return int(array[0])
        if self.name == "torch":
            return array.item()
        return int(array.numpy()[0])


def aligned_numpy_copy(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``a`` whose data starts on a 64-byte boundary."""
    nbytes = max(a.size * a.dtype.itemsize, 1)
    raw = np.empty(nbytes + 64, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64
    out = raw[start : start + nbytes].view(a.dtype)[: a.size].reshape(a.shape)
    out[...] = a
    return out


def _aligned_torch_copy(t: Any) -> Any:
    return t.clone(memory_format=torch.contiguous_format)  # a fresh allocation: aligned


def tvm_device(arg: ArrayArg) -> tvm.runtime.Device:
    return tvm.cuda(arg.device_id) if arg.device_type == "cuda" else tvm.cpu(0)


def to_tvm(arg: ArrayArg) -> tvm_ffi.Tensor:
    """A TVM tensor of ``arg``'s data (a copy only to fix alignment or contiguity)."""
    x = Kind(arg).as_input(arg.obj, arg.shape)
    return x if isinstance(x, tvm_ffi.Tensor) else tvm_ffi.from_dlpack(x)
