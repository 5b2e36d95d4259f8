"""The caller's arrays: numpy, torch (CPU or CUDA) or TVM tensors, passed through DLPack.

Inputs are wrapped without copying when they are contiguous and 64-byte aligned
(the compiled kernels assume both); otherwise one aligned contiguous copy is made.
Outputs are allocated in the caller's kind on the input's device, so results come
back as the caller gave them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
import tvm_ffi

ALIGNMENT = 64


@dataclass(frozen=True)
class ArrayArg:
    """An argument as the contracts see it: shape, dtype, kind and device."""

    obj: Any
    kind: str  # "numpy" | "torch" | "tvm"
    shape: tuple[int, ...]
    dtype: str
    device_type: str  # "cpu" | "cuda"
    device_id: int = 0


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "__dlpack__")


def inspect(x: Any, op: str, name: str) -> ArrayArg:
    """Describe ``x`` or raise a TypeError naming the argument."""
    if isinstance(x, np.ndarray):
        return ArrayArg(x, "numpy", tuple(x.shape), np.dtype(x.dtype).name, "cpu")
    if _is_torch(x):
        dev = x.device
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


def _aligned_numpy(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = max(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, 1)
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + nbytes].view(dtype)[: int(np.prod(shape))].reshape(shape)


def _numpy_to_tvm(a: np.ndarray) -> tvm_ffi.Tensor:
    if not a.flags.c_contiguous or a.ctypes.data % ALIGNMENT:
        copy = _aligned_numpy(a.shape, a.dtype)
        copy[...] = a
        a = copy
    if a.dtype.name == "bfloat16":  # numpy's DLPack knows no bfloat16: pass the bits
        bits = tvm_ffi.from_dlpack(a.view(np.uint16), require_contiguous=True)
        return bits._create_view(a.shape, "bfloat16")
    return tvm_ffi.from_dlpack(a, require_contiguous=True)


def _torch_to_tvm(t: Any) -> tvm_ffi.Tensor:
    if not t.is_contiguous() or t.data_ptr() % ALIGNMENT:
        t = t.clone(memory_format=__import__("torch").contiguous_format)
    return tvm_ffi.from_dlpack(t, require_alignment=ALIGNMENT, require_contiguous=True)


def to_tvm(arg: ArrayArg) -> tvm_ffi.Tensor:
    """A TVM view of ``arg`` (a copy only to fix alignment or contiguity)."""
    if arg.kind == "numpy":
        return _numpy_to_tvm(arg.obj)
    if arg.kind == "torch":
        return _torch_to_tvm(arg.obj)
    return arg.obj


def tvm_device(arg: ArrayArg) -> tvm.runtime.Device:
    return tvm.cuda(arg.device_id) if arg.device_type == "cuda" else tvm.cpu(0)


def empty(like: ArrayArg, shape: tuple[int, ...], dtype: str) -> tuple[Any, tvm_ffi.Tensor]:
    """A new array of the caller's kind on ``like``'s device, and its TVM view."""
    if like.kind == "numpy":
        out = _aligned_numpy(shape, np.dtype(dtype))
        return out, tvm_ffi.from_dlpack(out)
    if like.kind == "torch":
        import torch

        out = torch.empty(shape, dtype=getattr(torch, dtype), device=like.obj.device)
        return out, tvm_ffi.from_dlpack(out)
    out = tvm.runtime.empty(shape, dtype, tvm_device(like))
    return out, out


def scalar_view(kind: str, array: Any) -> Any:
    """A (1,) result as a 0-d array of the caller's kind (no copy for numpy / torch)."""
    if kind in ("numpy", "torch"):
        return array.reshape(())
    return array


def read_int(kind: str, array: Any) -> int:
    """First element of a small integer result, on the host."""
    if kind == "numpy":
        return int(array[0])
    if kind == "torch":
        return int(array[0].item())
    return int(array.numpy()[0])


def stream_context(arg: ArrayArg):
    """Launch on torch's current stream when the caller is torch on CUDA."""
    if arg.kind == "torch" and arg.device_type == "cuda":
        return tvm_ffi.use_torch_stream()
    return contextlib.nullcontext()
