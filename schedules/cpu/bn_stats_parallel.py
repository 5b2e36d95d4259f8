"""Channels in parallel across cores, shifted sums in vector lanes (LLVM).

Pattern ``x(SRR) -> (sum, sumsq)(S) -> mean, var``, the ``shifted_sampled``
decomposition (the shift is the mean of a channel's first 8 values), for any
shape on the CPU.

(N, C, L) view:
1. The channel loop of the epilogue runs in parallel; the shift, the moments
   and the variance are computed at it.
2. ``moments`` reduces each plane into ``lanes`` float32 accumulator pairs
   (rfactor over the innermost split of L, then over N: a partial a (plane, lane),
   ``cpu.common.plane_partials``), vectorized, then over the planes and across the
   lanes; when no vector width divides L, into one partial per plane (rfactor over
   N). One pair a lane over the whole channel put 160x1x256x256's variance 2.8e-4
   off (16x2x256x256: 1e-5, now 1e-7, torch's level; the audit of 2026-12-05).
(M, C) view:
1. Channels are split into ``lanes``-wide groups that run in parallel.
2. ``moments`` keeps ``partials`` partial sums along M (rfactor over a split of
   M by a divisor from 4 to 64; fewer float32 roundings per sum) and walks M in
   the outer loop with a vector of channels inside, so each row of x is read
   contiguously; with fewer than 4 channels and M a multiple of 4 the partials are
   the vector lanes instead. A prime M keeps one partial: its variance carries the
   drift of float32 sums over M rows (1.9e-3 relative at 1M bf16 rows).

Below ``BN_SERIAL_BELOW`` values the same schedule runs on one core (``parallel=0``):
the thread pool's launch would cost more than the work.

Not used: parallel over N (C >= cores on every table shape); Welford (a divide
per element, and shifted sums are as exact here).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import BNStatsProblem
from tvm_fusion.registry import Candidate, Knobs, ladder, register

from ..common import knob_value

from .common import (
    BN_SERIAL_BELOW, ROW_PARTS, default_lanes, finish_plane_partials, lane_choices, lane_partials, parallel_choices,
    plane_partials, row_part_counts,
)


# (M, C) partial sums along M: float32 sums of same-sign d^2 drift like the rows each
# partial adds. One partial over 1M bf16 rows (C = 24) put the variance 1.9e-3 off
# (relative), 16 partials 3.1e-4, at the same speed (2 Xeon cores, 2026-12-01).
ROWS_PER_PARTIAL = [(1024, 4), (16384, 16)]  # (rows up to, partials wanted); more rows: 64


@dataclass(frozen=True)
class ChannelsParallelKnobs(Knobs):
    lanes: int = 16  # (N, C, L): partials along L; (M, C): channels per vector
    partials: int = 1  # (M, C): partial sums along M (accuracy, and lanes when C is small)
    parallel: int = 1  # 0: one core (small inputs)


@register
class BNStatsParallel(Candidate):
    name = "bn_stats_parallel"
    op = "bn_stats"
    target_kind = "llvm"
    algorithm = "shifted_sampled"  # partials of up to 16k rows: a shift near the mean
    knobs = ChannelsParallelKnobs

    def _contiguous(self, problem: BNStatsProblem) -> int:
        return problem.channels if problem.channels_last else problem.shape[2]

    @staticmethod
    def _vector_partials(problem: BNStatsProblem) -> bool:
        """(M, C) with fewer than 4 channels: the partials are the vector lanes, so
        they must divide M (a predicated vector would read past the rows)."""
        return problem.channels_last and problem.channels < 4 and lane_choices(problem.shape[0]) != [1]

    def choices(self, problem: BNStatsProblem, target: Target) -> dict[str, list[int]]:
        if not problem.channels_last:
            partials = [1]
        elif self._vector_partials(problem):
            partials = lane_choices(problem.shape[0])
        else:  # scalar partials: any count that divides M
            partials = row_part_counts(problem.shape[0])[-5:] or [1]
        return {"lanes": lane_choices(self._contiguous(problem)), "partials": partials,
                "parallel": parallel_choices(problem.count * problem.channels, BN_SERIAL_BELOW)}

    def default_for(self, problem: BNStatsProblem, target: Target) -> ChannelsParallelKnobs:
        space = self.choices(problem, target)
        lanes, partials = space["lanes"], space["partials"]
        wanted = ladder(problem.shape[0], ROWS_PER_PARTIAL, ROW_PARTS[1])
        fits = [p for p in partials if p <= wanted]
        return ChannelsParallelKnobs(
            lanes=default_lanes(lanes), partials=max(fits) if fits else min(partials),
            parallel=space["parallel"][0],
        )

    def schedule(self, sch, problem: BNStatsProblem, knobs) -> None:
        mean, var = sch.get_sblock("mean"), sch.get_sblock("var")
        moments, shift = sch.get_sblock("moments"), sch.get_sblock("shift")
        shift_sum = sch.get_sblock("shift_sum")
        # 2a. Partial sums first: rfactor wants the loop nest to itself.
        if problem.channels_last:
            partials = [lane_partials(sch, moments, knobs.partials)]
        else:  # each plane into vector-lane partials, or one partial a plane
            partials = plane_partials(sch, moments, problem, knobs.lanes)
        partial = partials[0]
        channel = sch.merge(sch.get_loops(mean)[0], sch.get_loops(var)[0])
        if problem.channels_last:
            # 1. Channel groups in parallel, a vector of channels each.
            group, lane = sch.split(channel, [None, knobs.lanes])
            if knob_value(sch, knobs.parallel):  # one choice per shape: safe to branch on
                sch.parallel(group)
            sch.vectorize(lane)
            for block in (moments, partial, shift, shift_sum):
                sch.compute_at(block, group, preserve_unit_loops=True)
            # 2b. Rows outermost, then the partials, then the channel vector: x is
            # read row by row, contiguously.
            row_partial, channel_lane, row = sch.get_loops(partial)[1:]
            sch.reorder(row, row_partial, channel_lane)
            sch.vectorize(row_partial if self._vector_partials(problem) else channel_lane)
            return
        # 1. Channels in parallel; 2b. each plane into vector-lane partials.
        if knob_value(sch, knobs.parallel):  # one choice per shape: safe to branch on
            sch.parallel(channel)
        for block in (moments, *partials, shift, shift_sum):
            sch.compute_at(block, channel, preserve_unit_loops=True)
        finish_plane_partials(sch, partials, problem)
