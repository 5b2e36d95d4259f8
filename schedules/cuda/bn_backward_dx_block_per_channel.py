"""BatchNorm's input gradient from given sums (SyncBatchNorm's ``dx``), a block per channel.

Pattern ``x, dy(SSS), mean_dy, mean_dy_xhat(S) -> coef(S) -> dx(SSS)``, the ``map``
decomposition on the ``(N, C, L)`` view: bn_backward_block_per_channel's step 4
alone (the sums come summed over every rank, from the caller).

1. ``dx``'s loops reordered channel first; the channel loop is bound to
   ``blockIdx.x``.
2. Every thread computes the channel's coefficients (``weight * invstd``, the two
   global means) in registers.
3. ``dx`` over the channel's planes: ``(n, l)`` fused and split ``[serial,
   threadIdx.x]`` over ``vector`` values, 16-byte loads of x and dy and a 16-byte
   store per step.

Not used: a split of each plane across blocks (split_plane's partials serve a
reduction; a map with few channels would want its own grid split, not measured).
Not timed on a GPU yet; the gpu suite checks it against float64.
"""

from __future__ import annotations

from tvm_fusion.compute.bn_backward_dx import COEFFICIENTS
from tvm_fusion.contracts import BNBackwardDxProblem
from tvm_fusion.registry import register

from ..common import outputs_to
from .common import ChannelBlockCandidate, plane_map


@register
class BNBackwardDxBlockPerChannel(ChannelBlockCandidate):
    name = "bn_backward_dx_block_per_channel"
    op = "bn_backward_dx"
    algorithm = "map"
    claims = {"shuffles": False, "vector_loads": True}

    def applies(self, problem: BNBackwardDxProblem) -> bool:
        return problem.op == self.op and not problem.channels_last

    def schedule(self, sch, problem: BNBackwardDxProblem, knobs) -> None:
        # 1. dx's loops channel first, the channel on blockIdx.x.
        dx = sch.get_sblock("dx")
        n, c, plane = sch.get_loops(dx)
        sch.reorder(c, n, plane)
        for name in COEFFICIENTS:
            sch.compute_at(sch.get_sblock(name), c, preserve_unit_loops=True)
        sch.bind(c, "blockIdx.x")
        # 2. The coefficients in every thread's registers.
        for name in COEFFICIENTS:
            outputs_to(sch, sch.get_sblock(name), "local")
        # 3. dx over the channel's planes.
        plane_map(sch, sch.get_sblock("dx"), knobs, ("x", "dy"))
