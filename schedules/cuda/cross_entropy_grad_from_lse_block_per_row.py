"""The cross entropy gradient from the saved log-sum-exp, one thread block per row.

Pattern ``t(R) -> denom | w(R) -> W | coef(S) -> dlogits(SS)``, the ``from_lse``
decomposition (the backward kernel, as Quack's: one read of the logits, one write of
dlogits). For rows long enough to keep a block busy (V / vector >= threads), e.g.
V = 32000 and up.

Kernels 1 and 2, one block each, only when needed: the mean's denominator over the
targets; with weight and smoothing, the sum of the weights.
Kernel 3, grid (B,):
1. The row loop of ``dlogits`` is bound to ``blockIdx.x``; every thread reads the
   row's lse, target, weight and upstream gradient and computes the row's
   coefficients into its own registers (no shared memory, no barrier: the row
   kernel has no cross-thread step at all).
2. ``dlogits`` over the row, ``[threadIdx.x, serial, vector]``: consecutive lanes on
   consecutive vectors, a 16-byte load of the logits, ``e^(x - lse)`` and the
   gradient in float32 in registers, a 16-byte store.

Not used: a flat grid over B x V (each vector would look its row's coefficients up
again, and V need not split evenly); recomputing the lse (the forward saved it: one
pass instead of three).
"""

from __future__ import annotations

from tvm.target import Target

from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import register

from ..common import coefficients_at
from .common import grad_map, schedule_grad_prologue, vector_choices
from .cross_entropy_grad_block_per_row import CrossEntropyGradBlockPerRow


@register
class CrossEntropyGradFromLseBlockPerRow(CrossEntropyGradBlockPerRow):
    """Knobs and the default are the fused sibling's; the unroll space is shorter (one
    pass over the row, no statistics to unroll)."""

    name = "cross_entropy_grad_from_lse_block_per_row"
    algorithm = "from_lse"
    claims = {"shuffles": False, "vector_loads": True}

    def applies(self, problem: CrossEntropyGradProblem) -> bool:
        return problem.op == self.op and problem.mode == "from_lse"

    def choices(self, problem: CrossEntropyGradProblem, target: Target) -> dict[str, list[int]]:
        return {
            "threads": [64, 128, 256, 512, 1024],
            "vector": vector_choices(DTYPE_BYTES[problem.dtype], problem.classes),
            "unroll": [1, 4, 16],
        }

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        # Kernels 1-2: the denominator, the weights' sum.
        schedule_grad_prologue(sch, problem)
        # 1. One block per row, the coefficients in every thread's registers.
        row = sch.get_loops(sch.get_sblock("dlogits"))[0]
        coefficients_at(sch, problem, row, "local")
        sch.bind(row, "blockIdx.x")
        # 2. The gradient over the row.
        grad_map(sch, 1, knobs.threads, knobs.vector, knobs.unroll)
