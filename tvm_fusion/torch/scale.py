"""The backward's one step: ``dlogits *= dloss`` in place, skipped on the device when
``dloss`` is exactly 1.

The fused forward wrote ``dlogits`` for an upstream gradient of 1. A loss that is
the end of the graph (``loss.backward()``) gets exactly 1, and scaling would
read and write the whole gradient again for nothing: twice the step's floor. The
host cannot look at ``dloss`` without a sync, so the kernel does: every thread
reads the scalar and leaves at once when it is 1 (a launch, no traffic);
otherwise it scales its 16-byte vectors in float32. One compiled function per
(dtype, vector width, target), for any length (the length is a symbolic shape).
"""

from __future__ import annotations

import threading
from typing import Any

import tvm
from tvm.script import tirx as T

from .. import targets

THREADS = 256
_CACHE: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def _cuda_func(dtype: str, vector: int, max_blocks: int):
    """At most ``max_blocks`` blocks striding over the tensor: a skipped scale costs
    one small launch whatever the length (a block per 16-byte vector of every thread
    cost 0.5 ms on 8192x128256 bf16, half a million blocks that only read ``g``)."""
    per_block = THREADS * vector

    @T.prim_func
    def main(x_handle: T.handle, g: T.Buffer((), "float32")):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(x_handle, (n,), dtype, align=16)
        for bx in T.thread_binding(T.min((n + per_block - 1) // per_block, max_blocks), thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                if g[()] != T.float32(1.0):
                    grid = T.min((n + per_block - 1) // per_block, max_blocks)
                    for step in T.serial((n + per_block * grid - 1) // (per_block * grid)):
                        if (step * grid + bx) * per_block + tx * vector < n:
                            # a 16-byte load and store, the products in float32 one by one
                            # (a float32x8 broadcast has no CUDA type TVM can print)
                            xl = T.alloc_buffer((vector,), dtype, scope="local")
                            for v in T.vectorized(vector):
                                xl[v] = x[(step * grid + bx) * per_block + tx * vector + v]
                            for v in T.unroll(vector):
                                xl[v] = T.Cast(dtype, T.Cast("float32", xl[v]) * g[()])
                            for v in T.vectorized(vector):
                                x[(step * grid + bx) * per_block + tx * vector + v] = xl[v]

    return main


def _cpu_func(dtype: str):
    """NaN tested on its own: TVM lowers a float ``!=`` (and ``not ==``) to LLVM's
    ordered compare, false for NaN, so a NaN upstream gradient was skipped as if it
    were 1 (torch's gradient is NaN). CUDA C's ``!=`` is true for NaN."""
    @T.prim_func
    def main(x_handle: T.handle, g: T.Buffer((), "float32")):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(x_handle, (n,), dtype, align=16)
        if g[()] != T.float32(1.0) or T.isnan(g[()]):
            for i in T.parallel(n):
                x[i] = T.Cast(dtype, T.Cast("float32", x[i]) * g[()])

    return main


def scale_function(dtype: str, device_type: str, numel: int):
    """The compiled in-place scaling for a flat ``dtype`` tensor of ``numel`` values."""
    vector = 1
    if device_type == "cuda":
        width = 16 // (4 if dtype == "float32" else 2)
        vector = width if numel % width == 0 else 1
    key = (dtype, device_type, vector)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    target = targets.for_device(device_type)
    func = _cuda_func(dtype, vector, 8 * targets.sm_count(target)) if device_type == "cuda" else _cpu_func(dtype)
    with target:
        executable = tvm.compile(tvm.IRModule({"main": func}), target=target)
    with _LOCK:
        return _CACHE.setdefault(key, executable["main"])


_BY_TENSOR: dict[tuple, Any] = {}  # (torch dtype, device type, numel % 8): no string work per call


def scale_in_place(x: Any, g: Any) -> Any:
    """``x *= g`` (a 0-d float32 tensor) unless ``g`` is 1; returns ``x``."""
    numel = x.numel()
    key = (x.dtype, x.device.type, numel % 8)  # the vector width follows numel % 8
    func = _BY_TENSOR.get(key)
    if func is None:
        func = _BY_TENSOR[key] = scale_function(str(x.dtype).removeprefix("torch."), key[1], numel)
    func(x.view(-1), g)
    return x
