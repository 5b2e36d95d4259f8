"""BatchNorm's input gradient from given sums (SyncBatchNorm's ``dx``) across cores (LLVM).

Pattern ``x, dy(SSS), mean_dy, mean_dy_xhat(S) -> coef(S) -> dx(SSS)``, the ``map``
decomposition, for any shape on the CPU.

(N, C, L) view: ``dx``'s loops reordered channel first, the channel's coefficients
computed at the channel, channels in parallel; the plane's inner loop is vectorized
by ``lanes`` where a width divides L.
(M, C) view: rows in parallel with the channel loop vectorized (x, dy and dx read and
written row by row).

Below ``BN_SERIAL_BELOW`` values everything runs on one core (``parallel=0``).

Not used: a reduction (the sums come summed over every rank, from the caller).
"""

from __future__ import annotations

from tvm_fusion.compute.bn_backward_dx import COEFFICIENTS
from tvm_fusion.contracts import BNBackwardDxProblem
from tvm_fusion.registry import register

from ..common import knob_value
from .common import ChannelMapCandidate, channel_first_map, rows_parallel_map


@register
class BNBackwardDxParallel(ChannelMapCandidate):
    name = "bn_backward_dx_parallel"
    op = "bn_backward_dx"
    algorithm = "map"

    def schedule(self, sch, problem: BNBackwardDxProblem, knobs) -> None:
        parallel = knob_value(sch, knobs.parallel)  # one choice per shape: safe to branch on
        dx = sch.get_sblock("dx")
        if problem.channels_last:
            rows_parallel_map(sch, dx, knobs.lanes, parallel)
            return
        channel = channel_first_map(sch, dx, knobs.lanes, COEFFICIENTS)
        if parallel:
            sch.parallel(channel)
