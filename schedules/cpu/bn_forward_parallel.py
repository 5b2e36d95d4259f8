"""BatchNorm's forward with channels in parallel across cores (LLVM).

Pattern ``x(SRR) -> (sum, sumsq)(S) -> mean, var -> invstd, running, coef(S) ->
y(SSS)`` (training, the ``shifted_sampled`` statistics: a shift near the mean for
long float32 sums), or ``running(S) -> coef(S) -> y(SSS)`` (eval), any shape.

(N, C, L) view: one parallel channel loop (the per-channel outputs' loops merged
with ``y``'s channel loop, reordered channel first) computes the channel's
statistics, its outputs and coefficients, then its ``y`` plane after plane, so x
comes back from the core's cache for the map; the plane's inner loop is vectorized
by ``lanes`` where a width divides L.
(M, C) view: the statistics walk M in the outer loop with a vector of channels
inside (x read row by row), channel groups in parallel; ``y`` runs rows in parallel
with the channel loop vectorized.

Below ``SERIAL_BELOW`` values everything runs on one core (``parallel=0``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import BNForwardProblem
from tvm_fusion.registry import Candidate, Knobs, register

from ..common import knob_value
from .common import lane_choices, parallel_choices

STATISTICS = ["mean", "var", "moments", "shift", "shift_sum"]  # consumers first (compute_at order)


@dataclass(frozen=True)
class ForwardParallelKnobs(Knobs):
    lanes: int = 16  # the vector of the contiguous axis (L, or C channels-last)
    parallel: int = 1  # 0: one core (small inputs)


def channel_outputs(problem: BNForwardProblem) -> list[str]:
    return ["save_mean", "save_invstd"] + (["running_mean_out", "running_var_out"] if problem.updates_running else [])


class _ForwardParallel(Candidate):
    op = "bn_forward"
    target_kind = "llvm"
    knobs = ForwardParallelKnobs

    def _contiguous(self, problem: BNForwardProblem) -> int:
        return problem.channels if problem.channels_last else problem.shape[2]

    def choices(self, problem: BNForwardProblem, target: Target) -> dict[str, list[int]]:
        return {"lanes": lane_choices(self._contiguous(problem)), "parallel": parallel_choices(problem.numel)}

    def default_for(self, problem: BNForwardProblem, target: Target) -> ForwardParallelKnobs:
        lanes = lane_choices(self._contiguous(problem))
        return ForwardParallelKnobs(lanes=16 if 16 in lanes else max(lanes), parallel=parallel_choices(problem.numel)[0])

    def schedule(self, sch, problem: BNForwardProblem, knobs) -> None:
        parallel = knob_value(sch, knobs.parallel)  # one choice per shape: safe to branch on
        y = sch.get_sblock("y")
        if problem.channels_last:
            if problem.training:  # the statistics: channel groups in parallel, rows outside a channel vector
                moments = sch.get_sblock("moments")
                channel, row = sch.get_loops(moments)
                group, lane = sch.split(channel, [None, knobs.lanes])
                sch.reorder(group, row, lane)
                if parallel:
                    sch.parallel(group)
                sch.vectorize(lane)
            rows, channels = sch.get_loops(y)
            if parallel:
                sch.parallel(rows)
            _, y_lane = sch.split(channels, [None, knobs.lanes])
            sch.vectorize(y_lane)
            return
        # (N, C, L): y's loops channel first, everything of a channel at that loop.
        n, c, plane = sch.get_loops(y)
        sch.reorder(c, n, plane)
        _, y_lane = sch.split(plane, [None, knobs.lanes])
        sch.vectorize(y_lane)
        for name in ("bn_shift", "bn_scale"):
            sch.compute_at(sch.get_sblock(name), c, preserve_unit_loops=True)
        outputs = [sch.get_loops(sch.get_sblock(name))[0] for name in channel_outputs(problem)]
        channel = sch.merge(c, *outputs)
        if problem.training:
            for name in STATISTICS:
                sch.compute_at(sch.get_sblock(name), channel, preserve_unit_loops=True)
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
