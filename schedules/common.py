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


def fuse_inner(sch: s_tir.Schedule, block: SBlockRV, keep_outer: int) -> LoopRV:
    """Fuse the block's loops below the first ``keep_outer`` ones into one loop."""
    loops = sch.get_loops(block)[keep_outer:]
    return loops[0] if len(loops) == 1 else sch.fuse(*loops)


def unroll(sch: s_tir.Schedule, loop: LoopRV, max_step: Any) -> None:
    sch.annotate(loop, UNROLL_KEY, max_step)
    sch.annotate(loop, "pragma_unroll_explicit", 1)


def read_index(sch: s_tir.Schedule, block: SBlockRV, buffer_name: str) -> int:
    """Position of ``buffer_name`` among the block's reads (for cache_read)."""
    names = [region.source.name for region in sch.get(block).reads]
    return names.index(buffer_name)


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

    The innermost loop is split by ``vector`` (which divides it, so a vector never
    straddles a row or plane), the rest fused and split ``[serial, threadIdx]``, and
    the loops ordered ``[threadIdx, serial, vector]``: in each serial step consecutive
    lanes read consecutive ``vector``-wide chunks (coalesced 16-byte loads when
    ``vector * bytes == 16``, at constant offsets in registers); the input is staged through registers
    (``cache_read`` of buffer ``staged`` to ``local``, vectorized), and the cross-thread step is lowered by
    TVM to ``__shfl_down_sync`` within a warp and shared memory across warps.
    Returns ``(thread_loop, serial_loop)``.
    """
    *outer, inner = sch.get_loops(block)[keep_outer:]
    inner, vec = sch.split(inner, [None, vector])
    fused = sch.fuse(*outer, inner) if outer else inner
    serial, lane = sch.split(fused, [None, threads])
    sch.reorder(lane, serial, vec)
    sch.bind(lane, thread_axis)
    stage = sch.cache_read(block, read_index(sch, block, staged), "local", consumer_blocks=[block])
    sch.compute_at(stage, serial, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(stage)[-1])
    unroll(sch, serial, unroll_step)
    return lane, serial


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
