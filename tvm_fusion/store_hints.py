"""The cross entropy gradient's scalar stores made evict-first (CUDA's ``__stcs``, PTX ``st.global.cs``).

Why: the fused gradient with rows off the 16-byte grid (V odd in fp16/bf16:
``cross_entropy_grad_online`` at 1024 lanes, rows read as scalars) reads each row
twice, the statistics pass then the gradient pass, and the second read was meant to
come from L2. At 16384x50257 bf16 it did not: the kernel moved two reads and a write
at the copy rate. The rows in flight (two 1024-lane blocks an SM, 26 MB) fit the L2;
the gradient's own stream of writes, kept in L2 as any store, pushed them out before
their re-read. Stored evict-first, the gradient leaves the L2 first and the rows stay.

Measured (H100, forward + backward under graph replay, each kernel checked against
float64 autograd on poisoned outputs first). First with the stores rewritten in the
generated CUDA into the ``__stcs`` calls this pass emits (2026-12-06, rows "probe:
evict-first dlogits stores A/B" of results/benchmarks.csv): 16384x50257 bf16 1.3544 ms
against 1.5010 (72.7% -> 80.6% of copy for one read and one write), 3000x50257 fp16
0.3202 against 0.3225. The 16-byte stores of rows on the grid gained little or nothing
and are left as they are: 8192x128256 bf16 ``cross_entropy_grad_head_in_shared`` 1.6263
against 1.6281, ``cross_entropy_grad_online`` 1.9641 against 2.0303; 2048x151936 bf16
0.5426 against 0.5485; 4096x32000 fp16 0.1850 against 0.1848; 65536x1000 fp16 0.0998
against 0.0996. Then this pass, switched in one process (rows "probe: store_hints A/B
as committed"): 16384x50257 bf16 1.3535 against 1.5003, 32768x50257 bf16 2.6898
against 2.9861, 8192x50257 fp16 with smoothing 0.7880 against 0.8171, float32 rows
(``cross_entropy_grad_block_per_row``) 1-2% faster; the user's call (``tvm_fusion.torch``
forward and backward, back to back) 1.3746 against 1.5217 on 16384x50257 bf16. Still
1.24x that card's floor of one read and one write; the other knobs did not do better
with the hint (512 lanes 1.8340 ms, a block per row's three sweeps 1.5941; "probe:
odd-row gradient knobs with evict-first stores" rows).

Where: CUDA functions only, stores of a scalar into a global buffer named ``dlogits``
(the gradient output of every ``cross_entropy_grad`` decomposition) of at least
:data:`MIN_BYTES`, in the fused mode only. The backward from the saved lse (a function
with a ``dloss`` input, ``dloss_0d`` where it is a scalar) reads each row once, and the hint only cost it (16384x50257
bf16 ``cross_entropy_grad_from_lse_block_per_row`` 1.4899 ms against 1.4845, both
rounds). A smaller gradient could stay in L2 for the op that reads it next (the
backward of the layer before), which evict-first would spoil, and its rows fit the L2
with their writes anyway.

How: a pass over the lowered function (after vectorization, buffers flat), run by
every pipeline that builds a scheduled module (``launch_order.lowered``): each such
``BufferStore`` becomes ``__stcs(&dlogits[i], value)``, the CUDA intrinsic (overloads
for float, ``__half`` and ``__nv_bfloat16``) that nvcc compiles to ``st.global.cs``.
Not TVM's table-driven PTX op of the same instruction (``tvm.backend.cuda.ptx``): it
prints an ``asm volatile`` with a memory clobber, a barrier nvcc may not move the
unrolled loop's next loads across. ``TVM_FUSION_EVICT_FIRST=0`` builds plain stores
(an A/B switch, in the kernel cache's key).

Not done: BatchNorm's maps, which re-read their input after the statistics (walking
back over it, :mod:`tvm_fusion.launch_order`), storing ``y`` and ``dx`` evict-first in
the same way, so that the map's writes would leave the L2 before the input it has still
to read. Timed on an H100 with dispatch's kernels, the hint switched in one process
(rows "probe: evict-first maps A/B", 2026-12-07T07:23Z, each checked against float64
first), ms, plain -> evict-first: 64x256x56x56 bf16 channels-last forward 0.1078 ->
0.1076, forward + backward 0.2880 -> 0.2853; 64x256x56x56 fp16 forward + backward (the
backward's map) 0.2489 -> 0.2476; 64x64x112x112 fp16 channels-last forward 0.1186 ->
0.1209, forward + backward 0.3060 -> 0.3104. Within 1% or slower: the L2's part in those
maps is not lost to their own writes.
"""

from __future__ import annotations

import os
from typing import Any

import tvm
from tvm import tirx

from .stmts import map_children

ENABLED = os.environ.get("TVM_FUSION_EVICT_FIRST", "1") != "0"
BUFFERS = ("dlogits",)
# The gradients this applies to: larger than the H100's and H200's 50 MB L2.
MIN_BYTES = 64 << 20


def _hinted(buffer: tirx.Buffer) -> bool:
    if buffer.name not in BUFFERS or buffer.scope() != "global":
        return False
    numel = 1
    for extent in buffer.shape:
        if not isinstance(extent, tirx.IntImm):
            return False
        numel *= int(extent)
    return numel * tvm.DataType(buffer.dtype).bits // 8 >= MIN_BYTES


def evict_first(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` (lowered, before the host/device split) with its scalar stores into a
    large ``dlogits`` made evict-first; unchanged off CUDA or where it has none."""
    target = func.attrs.get("target") if func.attrs is not None else None
    names = [param.name for param in func.params]
    # Only a gradient's function is walked (every other build passes through here too).
    if not ENABLED or target is None or target.kind.name != "cuda" or not set(BUFFERS) & set(names) or \
            any(name.startswith("dloss") for name in names):
        return func
    body = _walk(func.body)
    return func if body.same_as(func.body) else func.with_body(body)


def _walk(stmt: tirx.Stmt) -> tirx.Stmt:
    """``stmt`` with each hinted store rewritten."""
    if isinstance(stmt, tirx.BufferStore):
        # A scalar store (a vector one is left as it is; so is a value that is no
        # scalar expression, such as a tensor load)
        ty = getattr(stmt.value, "ty", None)
        scalar = isinstance(ty, tvm.ir.PrimType) and tvm.DataType(str(ty.dtype)).lanes == 1
        if scalar and _hinted(stmt.buffer):
            address = tirx.address_of(tirx.BufferLoad(stmt.buffer, stmt.indices))
            return tirx.Evaluate(tirx.call_extern("void", "__stcs", address, stmt.value))
        return stmt
    return map_children(stmt, _walk)


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.EvictFirstStores")
def evict_first_stores(mod: tvm.IRModule, _ctx: Any) -> tvm.IRModule:
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, tirx.PrimFunc):
            mod[gvar] = evict_first(func)
    return mod
