"""A persistent kernel's rounds pipelined: the next round's part copied into shared
memory with ``cp.async`` while this round reduces its part, waits at the grid barrier
and writes its map.

Why: with one copy of a part on chip, each round of ``bn_forward_grid_persistent`` is a
read phase, then the block's reduction and the grid barrier, then a write phase; the
memory system idles in between, and the kernels ran at 1.5x their floor on an H100
(their docstrings). With two copies, the reads of round r + 1 are in flight during
round r's barrier and writes. On the H100 the pipelined kernels were 3-6% slower than
the unpipelined ones (``bn_forward_grid_pipelined`` says what that points to).

Schedule side, :func:`pipeline`: TVM's software pipeline on the round loop, the part's
copies in stage 0 (asynchronous), everything else in stage 1. TVM's
``InjectSoftwarePipeline`` double-buffers the copies' shared memory and emits a
prologue (round 0's copy), the loop (round r + 1's copy, then round r) and an epilogue
(the last round); ``InjectPTXAsyncCopy`` turns the 16-byte copies into
``cp.async.cg`` with commit and wait groups.

Lowering side, for functions whose decomposition carries
:data:`~tvm_fusion.compute.ASYNC_ROUNDS_ATTR` (:func:`lowering_config`,
:func:`lower_allreduce`, called by ``launch_order.lowered``):

- ``tirx.use_async_copy`` on, or the copies stay synchronous;
- TVM's storage rewrite off: it retyped the copy's shared buffer as ``float16x8`` (every
  access a 16-byte vector), and ``InjectPTXAsyncCopy`` then refused the copy (its load
  and store had different lanes);
- the epilogue repeats stage 1, so the block's cross-thread reduction appears twice with
  one destination buffer, and TVM's ``LowerThreadAllreduce`` allocated the shared
  result of the first only (the build failed: "variables (red_result, red_result) are
  used, but are not passed in as API arguments"). :func:`lower_allreduce` allocates the
  destination again before each later use, has ``ConvertSSA`` rename it, then runs
  ``LowerThreadAllreduce`` (disabled in TVM's pipeline for these functions).
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import s_tir, tirx

from .compute import ASYNC_ROUNDS_ATTR
from .stmts import statements

STAGE = "software_pipeline_stage"
ORDER = "software_pipeline_order"
ASYNC_STAGES = "software_pipeline_async_stages"
LOWER_ALLREDUCE = "s_tir.LowerThreadAllreduce"
# The next round's copies go after the grid barrier (the combine's statement, ``after``),
# not at the round's start. Why it was tried: the barrier fences memory in one thread a
# block, and that fence may wait for the thread's copies in flight, holding the block
# there until the next round's reads are done. Measured on an H100 (2026-12-05T16:51Z,
# bn_forward_grid_pipelined's docstring) against the first version (copies at the
# round's start, dcb3eb4's ISSUE_AFTER_THE_BARRIER switch off): the same time on fp16
# (0.1035 ms against 0.1040 on 64x256x56x56), 7% less on fp32 (0.1917 against 0.2059).
# LowerCrossThreadReduction turns a cross-thread reduction into four statements (the
# in-thread init and loop, the cross-thread step, the write-back), and the pipeline's
# annotation counts the loop body's statements after it.
REDUCTION_STATEMENTS = 4


def pipeline(sch: Any, loop: Any, copies: list[Any], reductions: list[Any], after: Any) -> None:
    """Pipeline the round ``loop``: the blocks ``copies`` (global to shared memory,
    each under its own loop nest in the round) in stage 0, asynchronous; the rest,
    ``reductions`` (cross-thread reductions) among it, in stage 1, in their order. The
    next round's copies are issued right after the round's statement that holds the
    block ``after`` (a grid barrier's combine: see the comment above)."""
    body = sch.get(loop).body
    children = statements(body)

    def root(block):  # the round's child that holds ``block``
        inner = sch.get_loops(block)
        index = [i for i, l in enumerate(inner) if sch.get(l).same_as(sch.get(loop))][0]
        return sch.get(inner[index + 1]) if index + 1 < len(inner) else sch.get(block)

    copy_roots, reduction_roots = [root(b) for b in copies], [root(b) for b in reductions]
    after_root = root(after)
    stages, first = [], 0  # ``first``: how many stage-1 statements come before the copies
    for child in children:
        if any(child.same_as(r) for r in copy_roots):
            stages.append(0)
            continue
        stages.extend([1] * (REDUCTION_STATEMENTS if any(child.same_as(r) for r in reduction_roots) else 1))
        if child.same_as(after_root):
            first = stages.count(1)
    copies_at = [i for i, s in enumerate(stages) if s == 0]
    rest = [i for i, s in enumerate(stages) if s == 1]
    order = [0] * len(stages)
    for place, i in enumerate(rest[:first] + copies_at + rest[first:]):
        order[i] = place
    sch.annotate(loop, STAGE, stages)
    sch.annotate(loop, ORDER, order)
    sch.annotate(loop, ASYNC_STAGES, [0])


def wanted(mod: tvm.IRModule) -> bool:
    """Whether a function of ``mod`` pipelines its rounds (its decomposition's tag)."""
    return any(isinstance(f, tirx.PrimFunc) and f.attrs is not None and f.attrs.get(ASYNC_ROUNDS_ATTR)
               for f in mod.functions.values())


def lowering_config(config: dict, disabled: list[str]) -> tuple[dict, list[str]]:
    """The pass context's config and disabled passes for such a module."""
    return ({**config, "tirx.use_async_copy": True, "tirx.disable_storage_rewrite": True},
            [*disabled, LOWER_ALLREDUCE])


def _destinations(stmt: tirx.Stmt) -> list | None:
    """The destination buffers of the ``tvm_thread_allreduce`` at ``stmt``, or None."""
    while isinstance(stmt, tirx.AttrStmt):
        stmt = stmt.body
    call = stmt.value if isinstance(stmt, tirx.Evaluate) else None
    if isinstance(call, tvm.ir.Call) and call.op.name == "tirx.tvm_thread_allreduce":
        count = int(call.args[0])
        return [load.source for load in call.args[2 + count:2 + 2 * count]]
    return None


def _walk(stmt: tirx.Stmt, seen: list, allocated: list) -> tirx.Stmt:
    if isinstance(stmt, tirx.SeqStmt):
        out = []
        for s in stmt.seq:
            if isinstance(s, tirx.AllocBuffer):
                allocated.append(s.buffer)
            dests = _destinations(s)
            if dests is None:
                out.append(_walk(s, seen, allocated))
                continue
            if any(d.same_as(v) for d in dests for v in seen):
                out.extend(tirx.AllocBuffer(next(b for b in allocated if b.same_as(d))) for d in dests)
            seen.extend(dests)
            out.append(s)
        return tirx.SeqStmt(out)
    if isinstance(stmt, tirx.AttrStmt):
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, _walk(stmt.body, seen, allocated))
    if isinstance(stmt, tirx.For):
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, _walk(stmt.body, seen, allocated),
                        stmt.thread_binding, stmt.annotations)
    if isinstance(stmt, tirx.IfThenElse):
        else_case = None if stmt.else_case is None else _walk(stmt.else_case, seen, allocated)
        return tirx.IfThenElse(stmt.condition, _walk(stmt.then_case, seen, allocated), else_case)
    return stmt


def lower_allreduce(mod: tvm.IRModule) -> tvm.IRModule:
    """``LowerThreadAllreduce`` after each reduction's later sites got their own
    destination (module docstring)."""
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, tirx.PrimFunc):
            mod[gvar] = func.with_body(_walk(func.body, [], []))
    return s_tir.transform.LowerThreadAllreduce()(tirx.transform.ConvertSSA()(mod))
