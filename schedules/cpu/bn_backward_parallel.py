"""BatchNorm's backward with channels in parallel across cores (LLVM).

Pattern ``x, dy(SRR) -> (sum dy, sum dy * xhat)(S) -> dbias, dweight, coef(S) ->
dx(SSS)``, the ``dual_reduce`` decomposition, for any shape on the CPU.

(N, C, L) view: one parallel channel loop (the output loops merged) runs the
channel's dual reduction, ``dbias``, ``dweight``, the coefficients and its ``dx``
plane after plane (``dx``'s loops reordered channel first), so x and dy come back
from the core's cache for the map; the plane's inner loop is vectorized by
``lanes`` where a width divides L. In eval dx reads no sum and runs in its own
parallel channel loop.
(M, C) view: the dual reduction walks M in the outer loop with a vector of channels
inside (x and dy read row by row), channel groups in parallel; ``dx`` runs rows in
parallel with the channel loop vectorized.

Below ``SERIAL_BELOW`` values everything runs on one core (``parallel=0``).

Not used: partial sums (the float32 sums of ``dy`` and ``dy * xhat`` have mixed
signs and do not drift the way bn_stats's same-sign sums do).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import BNBackwardProblem
from tvm_fusion.registry import Candidate, Knobs, register

from ..common import knob_value
from .common import lane_choices, parallel_choices


@dataclass(frozen=True)
class BackwardParallelKnobs(Knobs):
    lanes: int = 16  # the vector of the contiguous axis (L, or C channels-last)
    parallel: int = 1  # 0: one core (small inputs)


def dx_coefficients(problem: BNBackwardProblem) -> list[str]:
    """The per-channel blocks dx reads."""
    return ["bn_dx_scale"] + (["bn_dx_mean", "bn_dx_xhat"] if problem.training else [])


@register
class BNBackwardParallel(Candidate):
    name = "bn_backward_parallel"
    op = "bn_backward"
    target_kind = "llvm"
    algorithm = "dual_reduce"
    knobs = BackwardParallelKnobs

    def _contiguous(self, problem: BNBackwardProblem) -> int:
        return problem.channels if problem.channels_last else problem.shape[2]

    def choices(self, problem: BNBackwardProblem, target: Target) -> dict[str, list[int]]:
        return {"lanes": lane_choices(self._contiguous(problem)), "parallel": parallel_choices(problem.numel)}

    def default_for(self, problem: BNBackwardProblem, target: Target) -> BackwardParallelKnobs:
        lanes = lane_choices(self._contiguous(problem))
        return BackwardParallelKnobs(lanes=16 if 16 in lanes else max(lanes),
                                     parallel=parallel_choices(problem.numel)[0])

    def schedule(self, sch, problem: BNBackwardProblem, knobs) -> None:
        parallel = knob_value(sch, knobs.parallel)  # one choice per shape: safe to branch on
        sums, dx = sch.get_sblock("grad_sums"), sch.get_sblock("dx")
        if problem.channels_last:
            # The dual reduction: channel groups in parallel, rows outside a channel vector.
            channel, row = sch.get_loops(sums)
            group, lane = sch.split(channel, [None, knobs.lanes])
            sch.reorder(group, row, lane)
            if parallel:
                sch.parallel(group)
            sch.vectorize(lane)
            # dx: rows in parallel, the channel loop vectorized.
            rows, channels = sch.get_loops(dx)
            if parallel:
                sch.parallel(rows)
            _, dx_lane = sch.split(channels, [None, knobs.lanes])
            sch.vectorize(dx_lane)
            return
        # (N, C, L): dx's loops channel first, its coefficients at the channel.
        n, c, plane = sch.get_loops(dx)
        sch.reorder(c, n, plane)
        _, dx_lane = sch.split(plane, [None, knobs.lanes])
        sch.vectorize(dx_lane)
        for name in dx_coefficients(problem):
            sch.compute_at(sch.get_sblock(name), c, preserve_unit_loops=True)
        outputs = [sch.get_loops(sch.get_sblock(name))[0] for name in ("dbias", "dweight")]
        if problem.training:  # one channel loop: the sums, the plane's dx, dbias, dweight
            channel = sch.merge(c, *outputs)
        else:  # eval: dx reads no sum; the sums are their own channel loop
            channel = sch.merge(*outputs)
            if parallel:
                sch.parallel(c)
        sch.compute_at(sums, channel, preserve_unit_loops=True)
        if parallel:
            sch.parallel(channel)
