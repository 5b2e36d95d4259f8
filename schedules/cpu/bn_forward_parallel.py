"""BatchNorm's forward with channels in parallel across cores (LLVM).

Pattern ``x(SRR) -> (sum, sumsq)(S) -> mean, var -> invstd, running, coef(S) ->
y(SSS)`` (training, the ``shifted_sampled`` statistics: a shift near the mean for
long float32 sums), or ``running(S) -> coef(S) -> y(SSS)`` (eval), any shape.

(N, C, L) view: one parallel channel loop (the per-channel outputs' loops merged
with ``y``'s channel loop, reordered channel first) computes the channel's
statistics (a partial a (plane, lane), vectorized, as ``bn_stats_parallel``'s:
``cpu.common.plane_partials``), its outputs and coefficients, then its ``y`` plane
after plane, so x comes back from the core's cache for the map; the plane's inner
loop is vectorized by ``lanes`` where a width divides L. The statistics were one
scalar float32 sum a channel before: y 1.4e-3 off on 16x2x256x256 (now 5e-7, torch
3e-7; the audit of 2026-12-05, tests/test_cpu.py checks it), and unvectorized.
(M, C) view: the statistics walk M in runs of rows in parallel, a vector of channels
inside (x read row by row), each run into a row of partials
(``rows_outside_a_channel_vector``); ``y`` runs rows in parallel with the channel loop
vectorized.

Below ``BN_SERIAL_BELOW`` values everything runs on one core (``parallel=0``).
"""

from __future__ import annotations

from tvm_fusion.compute.bn_forward import channel_outputs
from tvm_fusion.contracts import BNForwardProblem
from tvm_fusion.registry import register

from ..common import knob_value, merge_rows
from .common import (
    ChannelMapCandidate, channel_first_map, finish_plane_partials, plane_partials, rows_outside_a_channel_vector,
    rows_parallel_map,
)

STATISTICS = ["mean", "var", "moments", "shift", "shift_sum"]  # consumers first (compute_at order)


class _ForwardParallel(ChannelMapCandidate):
    op = "bn_forward"

    def schedule(self, sch, problem: BNForwardProblem, knobs) -> None:
        parallel = knob_value(sch, knobs.parallel)  # one choice per shape: safe to branch on
        y = sch.get_sblock("y")
        if problem.channels_last:
            if problem.training:  # the statistics
                rows_outside_a_channel_vector(sch, sch.get_sblock("moments"), knobs.lanes, parallel)
            rows_parallel_map(sch, y, knobs.lanes, parallel)
            return
        # (N, C, L): the shifted sums into partials first (rfactor wants the loop nest to
        # itself), as bn_stats_parallel's: a float32 sum over a whole channel drifted
        # (1.4e-3 off in y for 16x2x256x256, torch 3e-7: the audit of 2026-12-05).
        partials = plane_partials(sch, sch.get_sblock("moments"), problem, knobs.lanes) if problem.training else []
        # y's loops channel first, everything of a channel at that loop.
        channel_first_map(sch, y, knobs.lanes, ["bn_shift", "bn_scale"])
        channel = merge_rows(sch, ["y", *channel_outputs(problem)])
        if problem.training:
            mean, var, moments, *shifts = (sch.get_sblock(name) for name in STATISTICS)
            for block in (mean, var, moments, *partials, *shifts):  # consumers first
                sch.compute_at(block, channel, preserve_unit_loops=True)
            finish_plane_partials(sch, partials, problem)
        if parallel:
            sch.parallel(channel)


@register
class BNForwardParallel(_ForwardParallel):
    name = "bn_forward_parallel"
    algorithm = "shifted_sampled"  # partials of whole planes: a shift near the mean

    def applies(self, problem: BNForwardProblem) -> bool:
        return problem.op == self.op and problem.training


@register
class BNForwardEvalParallel(_ForwardParallel):
    name = "bn_forward_eval_parallel"
    algorithm = "running"

    def applies(self, problem: BNForwardProblem) -> bool:
        return problem.op == self.op and not problem.training
