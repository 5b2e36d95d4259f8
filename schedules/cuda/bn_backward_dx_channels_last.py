"""BatchNorm's input gradient from given sums (SyncBatchNorm's ``dx``) on the channels-last view.

Pattern ``x, dy(SS), mean_dy, mean_dy_xhat(S) -> coef(S) -> dx(SS)``, the ``map``
decomposition on the ``(M, C)`` view (NHWC, and every (N, C) input): kernel 3 of
bn_backward_channels_last alone (``common.channels_last_map``), one kernel.

1. Grid (splits, channel groups), block (channel lanes, rows); rows dealt out
   ``m = (s J + j) R + r``, ``threadIdx.x`` on ``vector`` consecutive channels.
2. Each thread computes its channels' coefficients in registers and loads ``mean``
   and ``invstd`` once.
3. Per row one 16-byte load of x and of dy, ``dx`` in float32, one 16-byte store.

Any M (one row too: the map has no row guard over a write-back to keep apart).
Not used: a block per channel walking its column (loads strided by C).
Not timed on a GPU yet; the gpu suite checks it against float64.
"""

from __future__ import annotations

from tvm_fusion.compute.bn_backward_dx import COEFFICIENTS
from tvm_fusion.contracts import BNBackwardDxProblem
from tvm_fusion.registry import register

from .common import ChannelsLastCandidate, channels_last_map


@register
class BNBackwardDxChannelsLast(ChannelsLastCandidate):
    name = "bn_backward_dx_channels_last"
    op = "bn_backward_dx"
    algorithm = "map"
    claims = {"shuffles": False, "vector_loads": True}

    def applies(self, problem: BNBackwardDxProblem) -> bool:
        return problem.op == self.op and problem.channels_last

    def schedule(self, sch, problem: BNBackwardDxProblem, knobs) -> None:
        channels_last_map(sch, "dx", knobs, ("x", "dy"), computed=tuple(reversed(COEFFICIENTS)))
