"""The cross entropy gradient from the saved log-sum-exp, one warp per row (short rows).

Pattern ``t(R) -> denom | w(R) -> W | coef(S) -> dlogits(SS)``, the ``from_lse``
decomposition (the backward kernel: one read of the logits, one write of dlogits).
For rows a warp sweeps in a few steps (V / vector <= 32 x 8, e.g. V = 1000), where a
block per row would leave most lanes idle.

Kernels 1 and 2, one block each, only when needed: the mean's denominator over the
targets; with weight and smoothing, the sum of the weights.
Kernel 3, grid (B / rows,):
1. The row loop of ``dlogits`` is split ``[blockIdx.x, threadIdx.y]``: ``rows`` warps
   per block, one row each; every lane computes its row's coefficients into its
   registers (no cross-lane step at all).
2. ``dlogits`` over the row, ``[threadIdx.x (32), serial, vector]``: a 16-byte load,
   the gradient in float32 in registers, a 16-byte store.

Not used: one thread per row (uncoalesced: lanes would stride by V).
"""

from __future__ import annotations

from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.registry import register

from ..common import coefficients_at
from .common import WARP, grad_map, schedule_grad_prologue
from .cross_entropy_grad_warp_per_row import CrossEntropyGradWarpPerRow
from .cross_entropy_warp_per_row import MAX_VECTORS_PER_LANE


@register
class CrossEntropyGradFromLseWarpPerRow(CrossEntropyGradWarpPerRow):
    """Knobs, their space, the default and ``prefers`` are the fused sibling's."""

    name = "cross_entropy_grad_from_lse_warp_per_row"
    algorithm = "from_lse"
    claims = {"shuffles": False, "vector_loads": True}

    def applies(self, problem: CrossEntropyGradProblem) -> bool:
        return (problem.op == self.op and problem.mode == "from_lse"
                and problem.classes <= WARP * MAX_VECTORS_PER_LANE * 8)

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        # Kernels 1-2: the denominator, the weights' sum.
        schedule_grad_prologue(sch, problem)
        # 1. Rows over (blockIdx.x, threadIdx.y), the coefficients in registers.
        row = sch.get_loops(sch.get_sblock("dlogits"))[0]
        coefficients_at(sch, problem, row, "local")
        block_rows, warp_row = sch.split(row, [None, knobs.rows])
        sch.bind(block_rows, "blockIdx.x")
        sch.bind(warp_row, "threadIdx.y")
        # 2. The gradient over the row.
        grad_map(sch, 2, WARP, knobs.vector, knobs.unroll)
