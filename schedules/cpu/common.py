"""CPU (LLVM) steps shared by the candidates."""

from __future__ import annotations

from typing import Any

from tvm import s_tir

from ..common import SBlockRV


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
