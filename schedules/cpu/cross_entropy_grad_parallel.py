"""Cross entropy and its gradient in one pass over the rows, rows in parallel (LLVM).

Pattern ``t(R) -> denom, first_bad | x(SR) -> max(S) -> exp, sum(S) -> lse, row_loss,
coef(S) -> dlogits(SS) | row_loss(R) -> loss``, the ``fused_poly_exp`` decomposition
(the gradient for ``dloss = 1`` written during the forward; exp as a polynomial that
LLVM vectorizes), for any shape on the CPU.

1. The targets pass (the mean's denominator, the first bad target) runs first,
   serially: B values, negligible next to B x V (in chunks of about sqrt(B) rows:
   ``cpu.common.chunked_batch_sums``).
2. Every per-row block (``row_max``, ``row_sumexp``, ``lse``, the row loss,
   ``dlogits``) shares one row loop (``merge_rows``), run in parallel: a row is read
   three times while it is in the core's cache (two statistics passes, the map).
3. ``row_max`` and ``row_sumexp`` reduce into ``lanes`` float32 partials (rfactor over
   the innermost split), vectorized, then across the lanes; the per-row gradient
   coefficients are computed once per row.
4. ``dlogits`` is the map over the row, ``lanes`` values a vector (a ragged row's
   body; its tail of V mod 16 after it, see ``poly_exp_body``).
5. The batch sum of the row losses runs serially, in float32 chunks of about sqrt(B)
   rows from ``CHUNKED_ROWS`` rows on (one accumulator over 4M row losses put a mean
   2.6e-3 off).

Below ``SERIAL_BELOW`` logits the rows run on one core (``parallel=0``).

Not used: the online statistics (two exp per element, which a CPU pays in full);
``expf`` (LLVM scalarizes a vector exp into one libm call per lane); a separate pass
for the gradient (the row would come back from DRAM instead of the core's cache).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.compute.cross_entropy import poly_exp_body
from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.registry import Candidate, Knobs, register

from ..common import coefficients_at, knob_value, merge_rows
from .common import (
    chunked_batch_sums, default_lanes, lane_partials, parallel_choices, row_lane_choices, row_passes, vectorize_partials,
)


@dataclass(frozen=True)
class GradRowsParallelKnobs(Knobs):
    lanes: int = 16
    parallel: int = 1  # 0: one core (small inputs)


def vectorized_map(sch, problem: CrossEntropyGradProblem, knobs):
    """Steps shared with the from_lse candidate: the coefficients at the ``dlogits``
    row, the row's map split by ``lanes`` and vectorized. Returns the row loop."""
    dlogits = sch.get_sblock("dlogits")
    row, col = sch.get_loops(dlogits)
    coefficients_at(sch, problem, row)
    body = poly_exp_body(problem.classes)
    if body < problem.classes:  # the row's body in vectors, its tail after it
        col, _ = sch.loop_partition(col, [body, None])
    _, lane = sch.split(col, [None, knobs.lanes])
    sch.vectorize(lane)
    return row


@register
class CrossEntropyGradParallel(Candidate):
    name = "cross_entropy_grad_parallel"
    op = "cross_entropy_grad"
    target_kind = "llvm"
    algorithm = "fused_poly_exp"
    knobs = GradRowsParallelKnobs

    def applies(self, problem: CrossEntropyGradProblem) -> bool:
        return problem.op == self.op and problem.mode == "fused"

    def choices(self, problem: CrossEntropyGradProblem, target: Target) -> dict[str, list[int]]:
        return {"lanes": row_lane_choices(problem.classes), "parallel": parallel_choices(problem.numel)}

    def default_for(self, problem: CrossEntropyGradProblem, target: Target) -> GradRowsParallelKnobs:
        lanes = row_lane_choices(problem.classes)
        return GradRowsParallelKnobs(lanes=default_lanes(lanes),
                                     parallel=parallel_choices(problem.numel)[0])

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        chunked_batch_sums(sch, problem)  # 4. the sums over rows in chunks (float32 drift)
        passes = row_passes(sch, problem)
        # 3a. Each statistics pass into vector-lane partials (before the loops move).
        partials = [lane_partials(sch, sch.get_sblock(name), knobs.lanes) for name, lanes in passes if lanes]
        # 4. The map and its coefficients.
        map_row = vectorized_map(sch, problem, knobs)
        # 2. One row loop for every per-row block (producers first).
        loss = "loss" if problem.reduction == "none" else "row_loss"
        row = merge_rows(sch, [name for name, _ in reversed(passes)] + ["lse", loss], then=map_row)
        if knob_value(sch, knobs.parallel):  # one choice per shape: safe to branch on
            sch.parallel(row)
        # 3b. The partials at the row.
        for partial in partials:
            sch.compute_at(partial, row, preserve_unit_loops=True)
            vectorize_partials(sch, partial, 1)
