"""Scheduling idioms the candidates share.

Each helper is one named step of a schedule, so that a candidate reads as a list
of steps. Knob arguments are ints or sampled ExprRVs; no helper branches on them.
"""

from __future__ import annotations

from typing import Any

from tvm import s_tir

SBlockRV = s_tir.schedule.SBlockRV
LoopRV = s_tir.schedule.LoopRV

UNROLL_KEY = "pragma_auto_unroll_max_step"


def outputs_to(sch: s_tir.Schedule, block: SBlockRV, scope: str) -> None:
    """Keep every buffer the block writes in ``scope`` (``local`` or ``shared``)."""
    for index in range(len(sch.get(block).writes)):
        sch.set_scope(block, index, scope)


def unroll(sch: s_tir.Schedule, loop: LoopRV, max_step: Any) -> None:
    sch.annotate(loop, UNROLL_KEY, max_step)
    sch.annotate(loop, "pragma_unroll_explicit", 1)


def read_index(sch: s_tir.Schedule, block: SBlockRV, buffer_name: str) -> int:
    """Position of ``buffer_name`` among the block's reads (for cache_read)."""
    names = [region.source.name for region in sch.get(block).reads]
    return names.index(buffer_name)


def lanes_split(
    sch: s_tir.Schedule,
    block: SBlockRV,
    keep_outer: int,
    threads: Any,
    vector: Any,
    unroll_step: Any,
    thread_axis: str = "threadIdx.x",
    batch: Any = None,
) -> tuple[LoopRV, LoopRV, LoopRV]:
    """Lay the block's inner loops out as ``[threadIdx, serial, vector]``.

    The innermost loop is split by ``vector`` (which divides it, so a vector never
    straddles a row or plane), the rest fused and split ``[serial, threadIdx]``: in
    each serial step consecutive lanes touch consecutive ``vector``-wide chunks
    (coalesced 16-byte accesses when ``vector * bytes == 16``). With ``batch`` the
    serial loop's steps are ``batch`` vectors a lane, ``[threadIdx, serial, batch,
    vector]`` (:func:`lane_steps`). Returns the lane, serial and vector loops."""
    *outer, inner = sch.get_loops(block)[keep_outer:]
    inner, vec = sch.split(inner, [None, vector])
    serial, _, lane = lane_steps(sch, sch.fuse(*outer, inner) if outer else inner, threads, batch, thread_axis)
    unroll(sch, serial, unroll_step)
    return lane, serial, vec


def lane_steps(sch: s_tir.Schedule, loop: LoopRV, threads: Any, batch: Any = None,
               thread_axis: str = "threadIdx.x") -> tuple[LoopRV, LoopRV, LoopRV]:
    """``loop`` split ``[serial, threadIdx]`` (consecutive lanes on consecutive
    iterations), or with ``batch`` ``[serial, batch, threadIdx]``: a lane's ``batch``
    iterations of a step ``threads`` apart, the batch loop unrolled so that their loads
    can issue together. The lane loop goes outermost and is bound. Returns
    ``(serial, at, lane)``, ``at`` the batch loop or, without one, the serial loop."""
    if batch is None:
        serial, lane = sch.split(loop, [None, threads])
        sch.reorder(lane, serial)
        at = serial
    else:
        serial, at, lane = sch.split(loop, [None, batch, threads])
        sch.reorder(lane, serial, at)
        sch.unroll(at)
    sch.bind(lane, thread_axis)
    return serial, at, lane


def stage_in_registers(sch: s_tir.Schedule, block: SBlockRV, buffer_name: str, at: LoopRV) -> SBlockRV:
    """Load the block's reads of ``buffer_name`` for one step of loop ``at`` into
    registers first (``cache_read`` to ``local``), with vector loads."""
    stage = sch.cache_read(block, read_index(sch, block, buffer_name), "local", consumer_blocks=[block])
    sch.compute_at(stage, at, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(stage)[-1])
    return stage


def thread_reduce(
    sch: s_tir.Schedule,
    block: SBlockRV,
    keep_outer: int,
    threads: Any,
    vector: Any,
    unroll_step: Any,
    staged: str,
    thread_axis: str = "threadIdx.x",
) -> tuple[LoopRV, LoopRV]:
    """Reduce the block's inner loops across ``threads`` lanes, ``vector`` values a load.

    :func:`lanes_split`, then the input ``staged`` goes through registers with vector
    loads (:func:`stage_in_registers`); TVM lowers the cross-thread step to
    ``__shfl_down_sync`` within a warp and shared memory across warps.
    Returns ``(thread_loop, serial_loop)``."""
    lane, serial, _ = lanes_split(sch, block, keep_outer, threads, vector, unroll_step, thread_axis)
    stage_in_registers(sch, block, staged, serial)
    return lane, serial


def knob_value(sch: s_tir.Schedule, knob: Any) -> int:
    """The value of a knob: an int, or a sampled ExprRV of a concrete schedule."""
    return knob if isinstance(knob, int) else int(sch.get(knob))


def single_thread(
    sch: s_tir.Schedule, block: SBlockRV, threads: Any, thread_axis: str = "threadIdx.x"
) -> None:
    """Run a per-block scalar step on thread 0 of a ``threads``-wide block.

    The unit loop is split by ``threads`` and the inner part bound, so the kernel
    keeps one thread extent (TVM launches with the first extent it meets: a bare
    unit binding would shrink the block to one thread) and the step is guarded by
    ``threadIdx.x < 1``."""
    loop = sch.add_unit_loop(block)
    _, lane = sch.split(loop, [None, threads])
    sch.bind(lane, thread_axis)


def row_loss_name(problem: Any) -> str:
    """The block of a cross entropy's per-row losses: ``loss`` itself for reduction
    "none", else ``row_loss`` (the batch stage reduces it)."""
    return "loss" if problem.reduction == "none" else "row_loss"


def grad_coefficients(problem: Any) -> tuple[str, ...]:
    """The per-row coefficient blocks of a cross entropy gradient (``compute.
    cross_entropy_grad``): each one value per row, read by ``dlogits`` only."""
    names = ("grad_shift", "grad_a", "grad_b", "grad_t")
    return names + (("grad_c",) if problem.label_smoothing > 0.0 else ())


def coefficients_at(sch: s_tir.Schedule, problem: Any, row: LoopRV, scope: str | None = None) -> None:
    """Compute the gradient's per-row coefficients at ``row`` (the ``dlogits`` row loop),
    in ``scope`` when given (``local``: every thread keeps its own copy)."""
    for name in grad_coefficients(problem):
        block = sch.get_sblock(name)
        sch.compute_at(block, row, preserve_unit_loops=True)
        if scope is not None:
            outputs_to(sch, block, scope)


def merge_rows(sch: s_tir.Schedule, names: list[str], then: LoopRV | None = None) -> LoopRV:
    """One row loop for the named blocks (each with the row as its outer loop) and the
    row loop ``then`` when given, at the last one's place, bodies in the given order
    (TVM's merge checks no dependence).

    Why not compute_at into one anchor: the fused gradient's per-row outputs (``lse``,
    the row loss) consume the row statistics and cannot move (output blocks), the
    statistics cannot move under ``dlogits`` while those consumers stay outside, and
    ``dlogits`` cannot move under the statistics' row because its coefficients read
    the mean's denominator, a block outside. Merging the sibling row loops needs none
    of that."""
    loops = [sch.get_loops(sch.get_sblock(name))[0] for name in names]
    if then is not None:
        loops.append(then)
    return sch.merge(*loops)


def first_part_only(sch: s_tir.Schedule, row: LoopRV, parts: int, block: SBlockRV) -> LoopRV:
    """A loop over rows (``row``, the outer loop of ``block`` and of the blocks merged
    with it) as a loop over the rows' ``parts`` parts whose body only each row's first
    part runs: a unit loop split by ``parts``, a predicate. Returns it, for a loop over
    the parts to merge (a row's outputs written once, by its first part's block)."""
    _, unit = sch.split(row, [None, 1])
    sch.split(unit, [1, parts])
    return sch.fuse(*sch.get_loops(block)[:3])
