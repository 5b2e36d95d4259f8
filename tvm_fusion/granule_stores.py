"""The ``fused_granules`` gradient's map stored a 16-byte granule at a time.

``compute.cross_entropy_grad``'s ``fused_granules`` computes the gradient of each row's
window, ``dlogits_granules[i, g, v]`` (B, W, c): position ``(g, v)`` of row i's window
is row element ``k = c g + v - a_i`` (``a_i = iV mod c``), whose flat offset ``iV + k =
c (floor(iV / c) + g) + v`` is lane v of 16-byte granule ``floor(iV / c) + g`` of the
flat gradient. A gather then writes ``dlogits[i, k]`` from it. TensorIR cannot lay a
map out by the granules of a row that starts off the grid (the row's own index space is
``(i, k)``; a block's layout takes no per-row shift), so a scheduled function keeps
that gather, and :func:`stores_in_place` rewrites the built function instead: the
map's one store into ``dlogits_granules`` becomes a store into ``dlogits`` itself,
``dlogits[i, c floor(iV / c) - iV + c g + v]`` (written so, TVM's codegen sees the flat
offset as a multiple of c plus the lane and emits one 16-byte store of a vectorized
granule), under ``1 <= g <= J`` (``J = floor(V / c) - 1``: the granules inside the row
for every ``a_i``) or, for the edge granules, under ``0 <= k < V`` element by element
(the vectorizer scalarizes that branch alone); the gather's block and its loops, and
the buffer, go.

It runs where a scheduled module is built: ``kernel.compiled_form`` (before the
global buffers it allocates become parameters) and ``launch_order.lowered`` (the
tuner's builds). A function without ``dlogits_granules`` is returned as it is, so
running it twice changes nothing. A build that skips it (TVM's own pipeline) runs
the gather: the same results, one more kernel.
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import s_tir, tirx

from .compute.cross_entropy_grad import GRANULES, GRANULES_ALGORITHM
from .stmts import map_children

OUTPUT = "dlogits"
DONE = "tvm_fusion.granules_stored"  # the attribute a rewritten function carries


def stores_in_place(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with the granule map's stores into ``dlogits`` and the gather gone
    (module docstring); ``func`` itself where it is no ``fused_granules`` function or
    has been rewritten."""
    attrs = func.attrs
    if attrs is None or attrs.get("tvm_fusion.algorithm") != GRANULES_ALGORITHM or attrs.get(DONE):
        return func
    output = next((b for b in func.params if isinstance(b, tirx.Buffer) and b.name == OUTPUT), None)
    if output is None:
        raise ValueError(f"granule_stores: the function has {GRANULES} but no {OUTPUT} parameter")
    found: list[str] = []
    body = _walk(func.body, output, found)
    if "store" not in found or "gather" not in found:
        raise ValueError(f"granule_stores: expected one store into {GRANULES} and the gather into {OUTPUT}, "
                         f"found {found}")
    return func.with_body(body).with_attr(DONE, True)


def module_stores_in_place(mod: tvm.IRModule) -> tvm.IRModule:
    """:func:`stores_in_place` on every function of ``mod``: ``mod`` itself where none
    changes, else a new module (``mod`` may be a kernel's scheduled module, kept as
    it is)."""
    functions = {gvar: stores_in_place(func) if isinstance(func, tirx.PrimFunc) else func
                 for gvar, func in mod.functions.items()}
    if all(functions[gvar].same_as(func) for gvar, func in mod.functions.items()):
        return mod
    return tvm.IRModule(functions, attrs=mod.attrs)


def _walk(stmt: tirx.Stmt, output: tirx.Buffer, found: list[str]) -> tirx.Stmt | None:
    """``stmt`` rewritten; None where nothing is left of it (the gather's block and the
    loops around it, which hold nothing else)."""
    if isinstance(stmt, tirx.SeqStmt):
        seq = [s for s in (_walk(s, output, found) for s in stmt.seq) if s is not None]
        return None if not seq else seq[0] if len(seq) == 1 else tirx.SeqStmt(seq)
    if isinstance(stmt, tirx.For):
        body = _walk(stmt.body, output, found)
        return None if body is None else tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body,
                                                  stmt.thread_binding, stmt.annotations)
    if isinstance(stmt, s_tir.SBlockRealize):
        block = stmt.block
        if any(r.source.same_as(output) for r in block.writes) and any(r.source.name == GRANULES for r in block.reads):
            found.append("gather")
            return None
        return s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, _block(block, output, found))
    if isinstance(stmt, tirx.BufferStore) and stmt.buffer.name == GRANULES:
        found.append("store")
        return _granule_store(stmt, output)
    return map_children(stmt, lambda child: _kept(child, output, found))


def _kept(stmt: tirx.Stmt, output: tirx.Buffer, found: list[str]) -> tirx.Stmt:
    """:func:`_walk` where the statement cannot go (a block's body, a branch)."""
    new = _walk(stmt, output, found)
    if new is None:
        raise ValueError(f"granule_stores: the gather into {OUTPUT} is not a loop nest of its own")
    return new


def _block(block: Any, output: tirx.Buffer, found: list[str]) -> Any:
    writes = [_output_region(r, output) if r.source.name == GRANULES else r for r in block.writes]
    allocs = [b for b in block.alloc_buffers if b.name != GRANULES]
    return s_tir.SBlock(block.iter_vars, block.reads, writes, block.name_hint, _kept(block.body, output, found),
                        block.init, allocs, block.match_buffers, block.annotations)


def _output_region(region: Any, output: tirx.Buffer) -> Any:
    """The row of ``dlogits`` a granule's store writes into."""
    row = region.region[0].min
    return tirx.BufferRegion(output, [tvm.ir.Range.from_min_extent(row, 1),
                                      tvm.ir.Range.from_min_extent(tirx.const(0, str(row.ty.dtype)), output.shape[1])])


def _granule_store(store: tirx.BufferStore, output: tirx.Buffer) -> tirx.Stmt:
    """``dlogits_granules[i, g, v] = value`` as the store of that position into ``dlogits``
    (module docstring)."""
    i, g, v = store.indices
    dtype = str(i.ty.dtype)
    classes = int(output.shape[1])
    c = int(store.buffer.shape[2])

    def const(n: int) -> tirx.PrimExpr:
        return tirx.const(n, dtype)

    def cast(e: tirx.PrimExpr) -> tirx.PrimExpr:
        return e if str(e.ty.dtype) == dtype else tirx.Cast(dtype, e)

    g, v = cast(g), cast(v)
    flat_row = i * const(classes)
    column = const(c) * tirx.floordiv(flat_row, const(c)) - flat_row + const(c) * g + v  # k, as said above
    into = tirx.BufferStore(output, store.value, [i, column])
    inside = tirx.And(const(1) <= g, g <= const(classes // c - 1))
    in_row = tirx.And(const(0) <= column, column < const(classes))
    return tirx.IfThenElse(inside, into, tirx.IfThenElse(in_row, into, None))
