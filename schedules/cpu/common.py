"""CPU (LLVM) steps shared by the candidates."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tvm import s_tir
from tvm.target import Target

from tvm_fusion.compute.cross_entropy import poly_exp_body, poly_exp_joins
from tvm_fusion.registry import Candidate, Knobs

from ..common import LoopRV, SBlockRV


# Work (elements read) under which a kernel runs on one core. With a thread a core and
# workers that sleep between kernels (tvm_fusion.cpu_threads), a parallel kernel pays
# their wake-up: on the 2-core CI machine (rows "probe: CPU serial threshold",
# 2026-12-07, the user's call on numpy arrays) a cross entropy over 64x1000 float32
# took 53-61 us on two threads and 50-54 on one, over 256x1000 103-123 on two and
# 132-133 on one; bn_stats over 4x64x32x32 took 37-40 us on two and 27-28 on one, over
# 8x64x32x32 49-58 and 43-47, over 32x64x32x32 116-134 and 153-168. So two cores win
# from about 2^17 elements for cross entropy (an exp an element) and from about 2^19
# for BatchNorm (a few adds an element).
SERIAL_BELOW = 1 << 17
BN_SERIAL_BELOW = 1 << 19


def parallel_choices(elements: int, serial_below: int = SERIAL_BELOW) -> list[int]:
    """The ``parallel`` knob's space: one value, fixed by the work (a schedule cannot
    branch on a sampled knob, and the choice is a launch cost, not a search)."""
    return [0] if elements < serial_below else [1]


def lane_choices(contiguous: int, widest: int = 16) -> list[int]:
    """Vector lanes (float32 accumulators) that divide the contiguous run; 1 only
    when nothing wider does (a unit loop changes the loop structure, which a
    tuning trace replayed with another decision cannot follow)."""
    lanes = [w for w in (4, 8, 16, 32) if w <= widest * 2 and contiguous % w == 0]
    return lanes or [1]


def default_lanes(lanes: list[int]) -> int:
    """A candidate's default ``lanes`` from its choices: 16 where it divides, else the
    widest that does."""
    return 16 if 16 in lanes else max(lanes)


def row_lane_choices(classes: int) -> list[int]:
    """A cross entropy row's ``lanes`` choices: those that split its body
    (``poly_exp_body``: all of it, or its first V - V mod 16 classes)."""
    return lane_choices(poly_exp_body(classes))


def row_passes(sch: s_tir.Schedule, problem: Any) -> list[tuple[str, bool]]:
    """The row statistics' blocks of ``three_pass_poly_exp`` (and the fused gradient's),
    consumers first, so that each can move under the row after those that read it;
    True for the reductions that go into lane partials (:func:`lane_partials`).
    A ragged row's joins of its body and tail sums are inlined into their readers
    first."""
    if poly_exp_body(problem.classes) == problem.classes:
        return [("row_sumexp", True), ("row_max", True)]
    for name in poly_exp_joins(problem):
        sch.compute_inline(sch.get_sblock(name))
    return [("row_sumexp_tail", False), ("row_sumexp_body", True), ("row_max", False), ("row_max_body", True)]


def lane_partials(sch: s_tir.Schedule, block: SBlockRV, lanes: Any) -> SBlockRV:
    """Reduce the block's innermost loop into ``lanes`` independent float32 partials
    (rfactor over its inner split; ``lanes`` divides it, so no lane is predicated);
    the block then reduces across the lanes.

    Call it before any compute_at (rfactor wants the block's loop nest to itself)
    and finish with :func:`vectorize_partials` once the partials are in place."""
    innermost = sch.get_loops(block)[-1]
    _, lane = sch.split(innermost, [None, lanes])
    return sch.rfactor(lane, factor_axis=0)


def by_plane(problem: Any) -> bool:
    """(N, C, L) with no vector width dividing L: one partial a plane instead of lanes."""
    return not problem.channels_last and problem.shape[2] % 4 != 0


def plane_partials(sch: s_tir.Schedule, moments: SBlockRV, problem: Any, lanes: Any) -> list[SBlockRV]:
    """The (N, C, L) shifted sums ``moments`` into partials (before any compute_at),
    producers last: each plane into ``lanes`` vector partials (a partial a (plane,
    lane): L / lanes values each), those summed over the planes a lane; or one partial
    a plane where no width divides L (:func:`by_plane`). :func:`finish_plane_partials`
    once they are at the channel.

    Why a partial a plane: one float32 accumulator a lane over the whole channel
    drifted with the channel's length (same-sign squares: 16x2x256x256's variance
    1e-5 off, 160x1x256x256's 2.8e-4, the audit of 2026-12-05; torch's cascade sums
    stay near 1e-7)."""
    if by_plane(problem):
        return [sch.rfactor(sch.get_loops(moments)[1], factor_axis=0)]
    lane = lane_partials(sch, moments, lanes)
    plane = next(loop for loop in sch.get_loops(lane) if sch.get(loop).loop_var.name == "n")
    return [lane, sch.rfactor(plane, factor_axis=0)]


def finish_plane_partials(sch: s_tir.Schedule, partials: list[SBlockRV], problem: Any) -> None:
    """The (plane, lane) partials vectorized over their lanes (at the channel loop)."""
    if not by_plane(problem):  # its loops: the channel's, then (plane, lane, channel, step)
        vectorize_partials(sch, partials[-1], 2)


# A batch sum over rows (a cross entropy's loss and its denominator) in float32 chunks
# from this many rows on: one accumulator over 4M row losses put a mean 2.6e-3 off,
# over 1M 1.1e-4 (the audit of 2026-12-05); chunks of about sqrt(B) rows keep both
# levels short.
CHUNKED_ROWS = 4096


def row_chunks(rows: int) -> int:
    """How many chunks a batch sum over ``rows`` takes: about its square root (the last
    chunk guarded where it does not divide: no compute_at moves these sums, so the
    guard stays), 1 below :data:`CHUNKED_ROWS`."""
    return 1 if rows < CHUNKED_ROWS else math.isqrt(rows)


def batch_sums(problem: Any) -> list[str]:
    """A cross entropy's sums over its rows: the loss's (``batch``, for a sum or mean)
    and, for the fused gradient of a mean, the denominator's pass over the targets
    (``target_stats``)."""
    if problem.reduction == "none" or getattr(problem, "mode", "fused") != "fused":
        return []
    return ["batch", *(["target_stats"] if problem.op == "cross_entropy_grad" and problem.reduction == "mean" else [])]


def chunked_batch_sums(sch: s_tir.Schedule, problem: Any) -> None:
    """Each of the problem's sums over rows (:func:`batch_sums`) as a sum of
    :func:`row_chunks` float32 partials (rfactor over the chunk loop): no accumulator
    adds more than about sqrt(B) values."""
    count = row_chunks(problem.shape[0])
    for name in batch_sums(problem) if count > 1 else []:
        chunk, _ = sch.split(sch.get_loops(sch.get_sblock(name))[-1], [count, None])
        sch.rfactor(chunk, factor_axis=0)


def vectorize_partials(sch: s_tir.Schedule, partial: SBlockRV, depth: int) -> None:
    """Vectorize the lane loop of the partials once they sit ``depth`` loops deep.

    compute_at regenerates the partials' loops in block-iter order, lane first
    (rfactor's factor_axis=0); move it innermost and vectorize it."""
    loops = sch.get_loops(partial)
    lane, rest = loops[depth], loops[depth + 1 :]
    sch.reorder(*rest, lane)
    sch.vectorize(lane)


@dataclass(frozen=True)
class ChannelMapKnobs(Knobs):
    lanes: int = 16  # the vector of the contiguous axis (L, or C channels-last)
    parallel: int = 1  # 0: one core (small inputs)


class ChannelMapCandidate(Candidate):
    """The space and steps of a CPU BatchNorm candidate (forward, backward): per
    channel reductions, then a map over x's shape. ``lanes`` vectorizes the contiguous
    axis; ``parallel`` is fixed by the work."""

    target_kind = "llvm"
    knobs = ChannelMapKnobs

    @staticmethod
    def contiguous(problem: Any) -> int:
        return problem.channels if problem.channels_last else problem.shape[2]

    def choices(self, problem: Any, target: Target) -> dict[str, list[int]]:
        return {"lanes": lane_choices(self.contiguous(problem)),
                "parallel": parallel_choices(problem.numel, BN_SERIAL_BELOW)}

    def default_for(self, problem: Any, target: Target) -> ChannelMapKnobs:
        space = self.choices(problem, target)
        return ChannelMapKnobs(lanes=default_lanes(space["lanes"]), parallel=space["parallel"][0])


# (M, C) reductions cut M into 4 to 64 parts (bn_stats' partial sums, the row runs
# below), a count that divides M: a guarded split of M loses its guard in compute_at
# (TVM 0.27 then reads past the rows).
ROW_PARTS = (4, 64)


def row_part_counts(rows: int) -> list[int]:
    """The counts in :data:`ROW_PARTS` that divide ``rows``, ascending."""
    return [count for count in range(ROW_PARTS[0], ROW_PARTS[1] + 1) if rows % count == 0]


def row_runs(rows: int) -> int:
    """How many runs of rows an (M, C) reduction takes, each summed by one task into a
    row of C partials: the most :func:`row_part_counts` allows; 1 where none divides."""
    return max(row_part_counts(rows), default=1)


def rows_outside_a_channel_vector(sch: s_tir.Schedule, block: SBlockRV, lanes: Any, parallel: int) -> None:
    """A per-channel reduction over the (M, C) view's rows, x read row by row
    (contiguously) outside a vector of channels.

    Where :func:`row_runs` gives runs, the runs go in parallel, each into its own row
    of C float32 partials (rfactor over the run loop), then the partials are summed a
    channel. Else channel groups go in parallel, each walking every row (before: a
    task a group of ``lanes`` channels, 4 for 64 channels, each reading a quarter of
    every row's cache lines)."""
    runs = row_runs(sch.get(sch.get_loops(block)[1]).extent.value)
    if runs > 1:
        run, _ = sch.split(sch.get_loops(block)[1], [runs, None])
        partial = sch.rfactor(run, factor_axis=0)
        channel, run, row = sch.get_loops(partial)
        sch.reorder(run, row, channel)
        if parallel:
            sch.parallel(run)
        _, lane = sch.split(channel, [None, lanes])
        sch.vectorize(lane)
        return
    channel, row = sch.get_loops(block)
    group, lane = sch.split(channel, [None, lanes])
    sch.reorder(group, row, lane)
    if parallel:
        sch.parallel(group)
    sch.vectorize(lane)


def rows_parallel_map(sch: s_tir.Schedule, block: SBlockRV, lanes: Any, parallel: int) -> None:
    """A map over the (M, C) view: rows in parallel, the channel loop vectorized."""
    rows, channels = sch.get_loops(block)
    if parallel:
        sch.parallel(rows)
    _, lane = sch.split(channels, [None, lanes])
    sch.vectorize(lane)


def channel_first_map(sch: s_tir.Schedule, block: SBlockRV, lanes: Any, coefficients: list[str]) -> LoopRV:
    """A map over the (N, C, L) view with its loops channel first, the plane's inner
    loop vectorized, the named per-channel blocks it reads at the channel. Returns
    the channel loop."""
    n, c, plane = sch.get_loops(block)
    sch.reorder(c, n, plane)
    _, lane = sch.split(plane, [None, lanes])
    sch.vectorize(lane)
    for name in coefficients:
        sch.compute_at(sch.get_sblock(name), c, preserve_unit_loops=True)
    return c
