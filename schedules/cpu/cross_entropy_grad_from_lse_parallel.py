"""The cross entropy gradient from the saved log-sum-exp, rows in parallel (LLVM).

Pattern ``t(R) -> denom | w(R) -> W | coef(S) -> dlogits(SS)``, the
``from_lse_poly_exp`` decomposition (the backward kernel: one read of the logits, one
write of dlogits; exp as a polynomial that LLVM vectorizes), for any shape on the CPU.

1. The mean's denominator (over the targets) and, with weight and smoothing, the sum
   of the weights run first, serially (B and V values).
2. The rows run in parallel; each computes its gradient coefficients once.
3. ``dlogits`` is the map over the row, ``lanes`` values a vector.

Below ``SERIAL_BELOW`` logits the rows run on one core (``parallel=0``).

Not used: ``expf`` (LLVM scalarizes a vector exp into one libm call per lane); a
flat loop over B x V (the row's coefficients would be looked up per element).
"""

from __future__ import annotations

from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.registry import register

from ..common import knob_value
from .cross_entropy_grad_parallel import CrossEntropyGradParallel, vectorized_map


@register
class CrossEntropyGradFromLseParallel(CrossEntropyGradParallel):
    """Knobs, space and default are the fused sibling's (the same rows, the same map)."""

    name = "cross_entropy_grad_from_lse_parallel"
    algorithm = "from_lse_poly_exp"

    def applies(self, problem: CrossEntropyGradProblem) -> bool:
        return problem.op == self.op and problem.mode == "from_lse"

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        # 2-3. Rows in parallel, the coefficients at the row, the map vectorized.
        row = vectorized_map(sch, problem, knobs)
        if knob_value(sch, knobs.parallel):  # one choice per shape: safe to branch on
            sch.parallel(row)
