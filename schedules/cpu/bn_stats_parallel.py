"""Channels in parallel across cores, shifted sums in vector lanes (LLVM).

Pattern ``x(SRR) -> (sum, sumsq)(S) -> mean, var``, the ``shifted``
decomposition, for any shape on the CPU.

(N, C, L) view:
1. The channel loop of the epilogue runs in parallel; the shift, the moments
   and the variance are computed at it.
2. ``moments`` reduces each plane into ``lanes`` float32 accumulator pairs
   (rfactor over the innermost split of L), vectorized, then across lanes.
(M, C) view:
1. Channels are split into ``lanes``-wide groups that run in parallel.
2. ``moments`` walks M in the outer loop and a vector of channels in the inner
   one, so each row of x is read contiguously.

Not used: parallel over N (C >= cores on every table shape); Welford (a divide
per element, and shifted sums are as exact here).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import BNStatsProblem
from tvm_fusion.registry import Candidate, Knobs, register

from .common import lane_choices, lane_partials, vectorize_partials


@dataclass(frozen=True)
class ChannelsParallelKnobs(Knobs):
    lanes: int = 16


@register
class BNStatsParallel(Candidate):
    name = "bn_stats_parallel"
    op = "bn_stats"
    target_kind = "llvm"
    algorithm = "shifted"
    knobs = ChannelsParallelKnobs

    def _contiguous(self, problem: BNStatsProblem) -> int:
        return problem.channels if problem.channels_last else problem.shape[2]

    def choices(self, problem: BNStatsProblem, target: Target) -> dict[str, list[int]]:
        return {"lanes": lane_choices(self._contiguous(problem))}

    def default_for(self, problem: BNStatsProblem, target: Target) -> ChannelsParallelKnobs:
        lanes = lane_choices(self._contiguous(problem))
        return ChannelsParallelKnobs(lanes=16 if 16 in lanes else max(lanes))

    def schedule(self, sch, problem: BNStatsProblem, knobs) -> None:
        mean, var = sch.get_sblock("mean"), sch.get_sblock("var")
        moments, shift = sch.get_sblock("moments"), sch.get_sblock("shift")
        channel = sch.merge(sch.get_loops(mean)[0], sch.get_loops(var)[0])
        if problem.channels_last:
            group, lane = sch.split(channel, [None, knobs.lanes])
            sch.parallel(group)
            sch.vectorize(lane)
            sch.compute_at(moments, group, preserve_unit_loops=True)
            lane_loop, row_loop = sch.get_loops(moments)[1:]
            sch.reorder(row_loop, lane_loop)
            sch.vectorize(lane_loop)
            sch.compute_at(shift, group, preserve_unit_loops=True)
            return
        partial = lane_partials(sch, moments, knobs.lanes)
        sch.parallel(channel)
        sch.compute_at(moments, channel, preserve_unit_loops=True)
        sch.compute_at(partial, channel, preserve_unit_loops=True)
        sch.compute_at(shift, channel, preserve_unit_loops=True)
        vectorize_partials(sch, partial, 1)
