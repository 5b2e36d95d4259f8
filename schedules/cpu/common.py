"""CPU (LLVM) steps shared by the candidates."""

from __future__ import annotations

from typing import Any

from tvm import s_tir

from ..common import SBlockRV


# Work (elements read) under which a kernel runs on one core: TVM's thread pool costs
# about 6.5 us a parallel launch on the 2-core Xeon CI machine (a 4x10 float32 cross
# entropy: 7.5 us parallel, 1.0 us serial, 2026-12-01), and one core reads about
# 0.9 G elements/s here (cross_entropy_parallel, 4096x32000 float32: 74.5 ms on two
# cores, results/benchmarks.csv), so two cores win only past ~12k elements.
SERIAL_BELOW = 16384


def parallel_choices(elements: int) -> list[int]:
    """The ``parallel`` knob's space: one value, fixed by the work (a schedule cannot
    branch on a sampled knob, and the choice is a launch cost, not a search)."""
    return [0] if elements < SERIAL_BELOW else [1]


def lane_choices(contiguous: int, widest: int = 16) -> list[int]:
    """Vector lanes (float32 accumulators) that divide the contiguous run; 1 only
    when nothing wider does (a unit loop changes the loop structure, which a
    tuning trace replayed with another decision cannot follow)."""
    lanes = [w for w in (4, 8, 16, 32) if w <= widest * 2 and contiguous % w == 0]
    return lanes or [1]


def lane_partials(sch: s_tir.Schedule, block: SBlockRV, lanes: Any) -> SBlockRV:
    """Reduce the block's innermost loop into ``lanes`` independent float32 partials
    (rfactor over its inner split; ``lanes`` divides it, so no lane is predicated);
    the block then reduces across the lanes.

    Call it before any compute_at (rfactor wants the block's loop nest to itself)
    and finish with :func:`vectorize_partials` once the partials are in place."""
    innermost = sch.get_loops(block)[-1]
    _, lane = sch.split(innermost, [None, lanes])
    return sch.rfactor(lane, factor_axis=0)


def vectorize_partials(sch: s_tir.Schedule, partial: SBlockRV, depth: int) -> None:
    """Vectorize the lane loop of the partials once they sit ``depth`` loops deep.

    compute_at regenerates the partials' loops in block-iter order, lane first
    (rfactor's factor_axis=0); move it innermost and vectorize it."""
    loops = sch.get_loops(partial)
    lane, rest = loops[depth], loops[depth + 1 :]
    sch.reorder(*rest, lane)
    sch.vectorize(lane)
