"""A grid-wide barrier before a marked loop, and the cooperative launch it needs.

A schedule marks a loop with :func:`before` (an annotation: a traced primitive, so
MetaSchedule's records replay it). In :data:`launch_order.PIPELINE`, after TVM's
lowering and before its host/device split, :func:`with_barriers` puts
``T.cuda.grid_sync()`` (``cooperative_groups::this_grid().sync()``) before each marked
loop and gives the function the launch parameter ``tirx.use_cooperative_launch``,
which TVM's host/device split copies to every kernel of the function and its CUDA
runtime turns into ``cuLaunchCooperativeKernel``: all blocks of the grid are resident
at once (the launch fails with an error when the grid cannot be, instead of the
barrier hanging), so every block reaches the barrier.

The marked loop must be one every thread of every block runs: not under a thread
guard, nor under a loop whose trip count differs between blocks. Pipelines other than
``launch_order.PIPELINE`` keep the annotation as a pragma that code generation
ignores, and the kernel would race: ``launch_order.marked_loops`` is in every pipeline
that builds a scheduled module (the single-launch and aliased pipelines build on it).
"""

from __future__ import annotations

from typing import Any

from tvm import tirx
from tvm.backend.cuda import op as cuda_op

# ``pragma_`` keys survive TVM's block lowering as an attribute around the loop.
KEY = "pragma_tvm_fusion_grid_sync"
LAUNCH_PARAMS = "tirx.kernel_launch_params"
COOPERATIVE = "tirx.use_cooperative_launch"


def before(sch: Any, loop: Any) -> None:
    """Mark ``loop``: every block of the grid waits there until all blocks arrive."""
    sch.annotate(loop, KEY, 1)


def _walk(stmt: tirx.Stmt, found: list) -> tirx.Stmt:
    if isinstance(stmt, tirx.SeqStmt):
        return tirx.SeqStmt([_walk(s, found) for s in stmt.seq])
    if isinstance(stmt, tirx.AttrStmt):
        if stmt.attr_key == KEY:
            found.append(stmt)
            return tirx.SeqStmt([tirx.Evaluate(cuda_op.cuda_grid_sync()), _walk(stmt.body, found)])
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, _walk(stmt.body, found))
    if isinstance(stmt, tirx.For):
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, _walk(stmt.body, found),
                        stmt.thread_binding, stmt.annotations)
    if isinstance(stmt, tirx.IfThenElse):
        before = len(found)
        then_case = _walk(stmt.then_case, found)
        else_case = None if stmt.else_case is None else _walk(stmt.else_case, found)
        if len(found) != before:
            raise ValueError(f"{KEY}: a grid barrier under a condition ({stmt.condition}) would leave blocks waiting")
        return tirx.IfThenElse(stmt.condition, then_case, else_case)
    if isinstance(stmt, tirx.While):
        return tirx.While(stmt.condition, _walk(stmt.body, found))
    return stmt


def with_barriers(func: tirx.PrimFunc, marks: int | None = None) -> tirx.PrimFunc:
    """``func`` (lowered: launches as ``thread_extent`` attributes) with a grid barrier
    before each marked loop, launched cooperatively when it has any. ``marks``: how many
    the function has (counted in its printed form when not given)."""
    marks = func.script().count(KEY) if marks is None else marks
    if not marks:
        return func
    found: list = []
    new = func.with_body(_walk(func.body, found))
    if len(found) != marks:
        raise ValueError(f"{KEY}: a marked loop was left without its barrier in "
                         f"{func.attrs.get('global_symbol', 'a function')}")
    params = list(func.attrs.get(LAUNCH_PARAMS, [])) if func.attrs is not None else []
    return new.with_attr(LAUNCH_PARAMS, [*params, COOPERATIVE] if COOPERATIVE not in params else params)
