"""A block's copy of its row (or part) from global into shared memory issued as
``cp.async`` (16 bytes a lane, global to shared with no register in between), every
copy of a thread in flight at once, then one ``cp.async.wait_all`` before the block's
barrier.

Why: as TVM prints it, such a copy is a 16-byte global load into registers and a
16-byte shared store, one pair a step of the copy loop. In the PTX of the gradient's
row_in_cluster (8192x128256 bf16, nvcc 13) each pair sits under its own bounds check,
so a thread has one load in flight; row_in_shared's 4096x32000 fp16 copy has its eight
pairs interleaved and 22 registers, too few to hold them all. A block then has about
``threads`` x 16 bytes in flight, against the tens of kilobytes an SM needs in flight to
draw its share of the H200's bandwidth. With ``cp.async`` the loads go straight to shared
memory: nothing waits for a register, and the bounds checks only predicate issue.

Measured (H100, 2026-12-06T23:38Z, rows "probe: async copy, TIR" of
results/benchmarks.csv, kernels under CUDA-graph replay, each checked against float64
first, synchronous -> cp.async, ms): the BatchNorm forward 64x256x56x56 fp16
(bn_forward_cluster_half_one_launch) 0.0857 -> 0.0808, 1.26x -> 1.18x its floor; the
cross entropy gradients within 0.4% (8192x128256 bf16 row_in_cluster 1.5705 -> 1.5645,
4096x32000 fp16 row_in_shared 0.1845 -> 0.1851, 32768x32000 fp16 1.4097 -> 1.4124), at
1.01-1.13x their floor on that card already. Not yet timed on an H200, where before
it (rows of 2026-12-06T20:22Z) 4096x32000 fp16's row_in_shared ran at 0.885 of the copy
bandwidth and 8192x128256 bf16's row_in_cluster at 0.754.

A schedule marks the copy's serial loop with :func:`mark` (an annotation: a traced
primitive, so MetaSchedule's records replay it; made whatever the knobs, so that a
design space's trace, replayed with other knobs, stays the schedule those knobs build).
It lowers to a pragma around the loop; :func:`inject` (in ``launch_order.lowered``,
after TVM's pipeline) turns that into TVM's ``async_scope``, with one
``cp.async.wait_all`` after the marked loops that follow one another (a block's copies
of x and dy), and TVM's ``InjectPTXAsyncCopy`` then rewrites the copies inside. A copy
of other widths than cp.async's 4, 8 or 16 bytes a lane (2-byte scalars of a row off the
16-byte grid) stays synchronous, its mark dropped; a marked loop with no global-to-shared
copy, or one left synchronous after the rewrite, is an error.

Past 2^31 elements: TVM 0.27 prints each copy as a call to a helper that takes the
source's element offset as a C ``int`` (``ptx_cp_async_legacy_cg_16_2_2(void* dst, int
dst_off, void* src, int src_off)``), so a 64-bit offset is truncated and the copy reads
far outside the input (an illegal address on an H100, 2026-12-07, row_in_cluster on
32768x151936 bf16). :func:`wide_sources` (after every lowering, TVM's pipelined copies
too) therefore hands such a copy its source already offset, ``&src[offset]`` in 64-bit
arithmetic, with an offset of 0; a copy whose offsets are 32-bit is printed as TVM
prints it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad

from .stmts import collect, map_children

KEY = "pragma_tvm_fusion_async_copy"
SCOPE = "async_scope"
COPY_BYTES = (4, 8, 16)  # what one cp.async copies
# TVM_FUSION_ASYNC_COPY=0 builds marked copies synchronously, as before (an A/B switch,
# in the kernel cache's key).
ENABLED = os.environ.get("TVM_FUSION_ASYNC_COPY", "1") != "0"


def mark(sch: Any, loop: Any) -> None:
    """Mark the serial loop ``loop`` (its body a copy from global into shared memory)
    to issue its copies asynchronously, waited for before the next barrier."""
    node = sch.get(loop)
    if node.kind not in (tirx.ForKind.SERIAL, tirx.ForKind.UNROLLED) or node.thread_binding is not None:
        raise ValueError(f"async_copy.mark: marks a serial copy loop, not {node.loop_var.name} "
                         f"({tirx.ForKind(node.kind).name.lower()})")
    sch.annotate(loop, KEY, 1)


def wanted(mod: tvm.IRModule) -> bool:
    """Whether a function of ``mod`` (scheduled, not lowered) marks a copy loop."""
    return ENABLED and any(isinstance(f, tirx.PrimFunc) and KEY in f.script() for f in mod.functions.values())


def lowering_config(config: dict) -> dict:
    """The pass context's config for a module whose marked copies go ``cp.async``
    (:func:`copyable`): TVM's storage rewrite off. It retypes a shared buffer read whole
    in 16-byte vectors as ``float16x8``, and ``InjectPTXAsyncCopy`` then refuses the copy
    (its load and store differ in lanes). Only there: with scalar copies (a plane of 225
    fp16 values, BatchNorm's backward) the build without storage rewrite failed in TVM
    ("Load memory in places other than store")."""
    return {**config, "tirx.disable_storage_rewrite": True}


def _copy_width(stmt: tirx.Stmt) -> int | None:
    """The bytes a lane of ``stmt``, a store into shared memory of a global load; None
    for any other statement."""
    if isinstance(stmt, tirx.BufferStore) and stmt.buffer.scope().startswith("shared") \
            and isinstance(stmt.value, TensorLoad) and stmt.value.source.scope() == "global":
        dtype = tvm.DataType(str(stmt.value.ty))
        return dtype.bits * dtype.lanes // 8
    return None


def _copies(stmt: tirx.Stmt) -> list[int]:
    """The bytes a lane of each store into shared memory of a global load under ``stmt``."""
    return collect(stmt, _copy_width)


def _attr(key: str) -> Callable[[tirx.Stmt], tirx.AttrStmt | None]:
    return lambda stmt: stmt if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == key else None


def copyable(mod: tvm.IRModule) -> bool:
    """Whether ``mod`` (lowered by TVM's pipeline) has a marked loop whose copies are all
    of cp.async's widths."""
    for func in mod.functions.values():
        if isinstance(func, tirx.PrimFunc):
            for marked in collect(func.body, _attr(KEY)):
                widths = _copies(marked.body)
                if widths and all(w in COPY_BYTES for w in widths):
                    return True
    return False


def _wait_all() -> tirx.Stmt:
    # TVM 0.27's PTX table builds the call (its arguments are the instruction's tokens).
    from tvm.backend.cuda.ptx import PTXNamespace
    return tirx.Evaluate(PTXNamespace().cp.async_.wait_all())


def _scope(marked: tirx.AttrStmt, found: list) -> tuple[tirx.Stmt, bool]:
    """The marked loop in TVM's async scope, or left synchronous where its copies are
    not cp.async's widths (or the switch is off); and whether it went asynchronous."""
    found.append(marked)
    body = _walk(marked.body, found)
    widths = _copies(body)
    if not widths:
        raise ValueError("async_copy: a marked loop copies nothing from global into shared memory")
    if not ENABLED or any(w not in COPY_BYTES for w in widths):
        return body, False
    return tirx.AttrStmt(marked.node, SCOPE, 1, body), True


def _walk(stmt: tirx.Stmt, found: list) -> tirx.Stmt:
    """``stmt`` with its marked copies made asynchronous. Marked copies that follow one
    another share one wait, after the last of them."""
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == KEY:
        scoped, pending = _scope(stmt, found)
        return tirx.SeqStmt([scoped, _wait_all()]) if pending else scoped
    if isinstance(stmt, tirx.SeqStmt):
        out, pending = [], False
        for child in stmt.seq:
            if isinstance(child, tirx.AttrStmt) and child.attr_key == KEY:
                scoped, asynchronous = _scope(child, found)
                out.append(scoped)
                pending = pending or asynchronous
                continue
            if pending:
                out.append(_wait_all())
                pending = False
            out.append(_walk(child, found))
        if pending:
            out.append(_wait_all())
        return tirx.SeqStmt(out)
    return map_children(stmt, lambda child: _walk(child, found))


def _check(stmt: tirx.Stmt, name: str) -> None:
    """Raise where an async scope still holds a synchronous copy."""
    if any(_copies(scope.body) for scope in collect(stmt, _attr(SCOPE))):
        raise ValueError(f"async_copy: a marked copy in {name} stayed synchronous")


RAW_COPY = "tirx.s_tir.cp_async_raw"  # the op InjectPTXAsyncCopy emits


def _is_raw_copy(call: tvm.ir.Call) -> bool:
    return isinstance(call.op, tvm.ir.Op) and call.op.name == RAW_COPY


def _raw_copy(stmt: tirx.Stmt) -> tvm.ir.Call | None:
    if isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tvm.ir.Call) and _is_raw_copy(stmt.value):
        return stmt.value
    return None


def _copies_anywhere(func: tirx.PrimFunc) -> int:
    """How many raw copies ``func`` holds, wherever they sit."""
    found: list = []
    tvm_ffi.structural_walk(func.body, [(tvm.ir.Call, lambda call: found.append(_is_raw_copy(call)))])
    return sum(found)


def _wide(call: tvm.ir.Call) -> bool:
    """Whether a raw copy's source offset is 64-bit (truncated by TVM's helper)."""
    return str(call.args[3].ty) == "int64"


def _offset_source(stmt: tirx.Stmt) -> tirx.Stmt:
    """``stmt`` with each raw copy of a 64-bit source offset given ``&src[offset]`` and
    an offset of 0 (module docstring)."""
    call = _raw_copy(stmt)
    if call is None:
        return map_children(stmt, _offset_source)
    if not _wide(call):
        return stmt
    dst, dst_offset, src, src_offset, *rest = call.args
    from tvm.backend.cuda.op import tvm_access_ptr
    source = tvm_access_ptr(str(src.ty.element_type.dtype), src, src_offset, 1, 1)  # read
    return tirx.Evaluate(tvm.ir.Call(call.op, [dst, dst_offset, source, tirx.IntImm("int32", 0), *rest],
                                     ret_ty=call.ty))


def wide_sources(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` (lowered: its copies ``cp.async``, by :func:`inject` or by TVM's software
    pipeline) with each copy of a 64-bit source offset given its source already offset
    (module docstring). Raises where a copy sits where the rewrite cannot reach it."""
    for gvar, func in list(mod.functions.items()):
        if not isinstance(func, tirx.PrimFunc):
            continue
        copies = _copies_anywhere(func)
        if not copies:
            continue
        func = func.with_body(_offset_source(func.body))
        found = collect(func.body, _raw_copy)
        if len(found) != copies or any(_wide(call) for call in found):
            raise ValueError(f"async_copy: {gvar.name_hint} has {copies} cp.async copies, "
                             f"{len(found)} of them where the 64-bit offset rewrite reaches")
        mod[gvar] = func
    return mod


def inject(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` (after TVM's pipeline, barriers placed; :func:`wanted`) with each marked
    copy loop's copies made ``cp.async`` and waited for (module docstring)."""
    found: list = []
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, tirx.PrimFunc):
            mod[gvar] = func.with_body(_walk(func.body, found))
    if not found or not ENABLED:
        return mod
    mod = s_tir.transform.InjectPTXAsyncCopy()(mod)
    for gvar, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            _check(func.body, gvar.name_hint)
    return mod
