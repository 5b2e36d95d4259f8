"""BatchNorm's backward with channels in parallel across cores (LLVM).

Pattern ``x, dy(SRR) -> (sum dy, sum dy * xhat)(S) -> dbias, dweight, coef(S) ->
dx(SSS)``, the ``dual_reduce`` decomposition, for any shape on the CPU.

(N, C, L) view: one parallel channel loop (the output loops merged) runs the
channel's dual reduction, ``dbias``, ``dweight``, the coefficients and its ``dx``
plane after plane (``dx``'s loops reordered channel first), so x and dy come back
from the core's cache for the map; the plane's inner loop is vectorized by
``lanes`` where a width divides L. The dual reduction goes into vector partials first
(a pair a (plane, lane), as ``bn_stats_parallel``'s statistics: ``plane_partials``):
one scalar pair a channel was a chain of dependent adds, which LLVM cannot vectorize.
In eval dx reads no sum and runs in its own parallel channel loop.
(M, C) view: the dual reduction walks M in runs of rows in parallel, a vector of
channels inside (x and dy read row by row), each run into a row of partials
(``rows_outside_a_channel_vector``); ``dx`` runs rows in parallel with the channel
loop vectorized.

Below ``BN_SERIAL_BELOW`` values everything runs on one core (``parallel=0``).
"""

from __future__ import annotations

from tvm_fusion.compute.bn_backward import dx_coefficients
from tvm_fusion.contracts import BNBackwardProblem
from tvm_fusion.registry import register

from ..common import knob_value, merge_rows
from .common import (
    ChannelMapCandidate, channel_first_map, finish_plane_partials, plane_partials, rows_outside_a_channel_vector,
    rows_parallel_map,
)


@register
class BNBackwardParallel(ChannelMapCandidate):
    name = "bn_backward_parallel"
    op = "bn_backward"
    algorithm = "dual_reduce"

    def schedule(self, sch, problem: BNBackwardProblem, knobs) -> None:
        parallel = knob_value(sch, knobs.parallel)  # one choice per shape: safe to branch on
        sums, dx = sch.get_sblock("grad_sums"), sch.get_sblock("dx")
        if problem.channels_last:
            rows_outside_a_channel_vector(sch, sums, knobs.lanes, parallel)
            rows_parallel_map(sch, dx, knobs.lanes, parallel)
            return
        # (N, C, L): the dual sums into vector partials first (rfactor wants the loop
        # nest to itself).
        partials = plane_partials(sch, sums, problem, knobs.lanes)
        # dx's loops channel first, its coefficients at the channel.
        c = channel_first_map(sch, dx, knobs.lanes, dx_coefficients(problem))
        if problem.training:  # one channel loop: the sums, the plane's dx, dbias, dweight
            channel = merge_rows(sch, ["dx", "dbias", "dweight"])
        else:  # eval: dx reads no sum; the sums are their own channel loop
            channel = merge_rows(sch, ["dbias", "dweight"])
            if parallel:
                sch.parallel(c)
        for block in (sums, *partials):  # consumers first
            sch.compute_at(block, channel, preserve_unit_loops=True)
        finish_plane_partials(sch, partials, problem)
        if parallel:
            sch.parallel(channel)
