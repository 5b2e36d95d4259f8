"""Rows in parallel across cores, each row reduced in vector lanes (LLVM).

Pattern ``x(SR) -> max(S) -> exp, sum(S) -> row_loss(S) -> batch(R)``, the
``three_pass_poly_exp`` decomposition (three_pass with a polynomial exp that
LLVM vectorizes), for any shape on the CPU.

1. The per-row epilogue is the anchor; its row loop runs in parallel.
2. ``row_max`` and ``row_sumexp`` are computed per row into ``lanes`` float32
   accumulators (rfactor over the innermost split), vectorized, then summed
   across lanes. A row of V not a multiple of 4 does this over its body (the
   first V - V mod 16 classes) and reduces its tail apart (``poly_exp_body``).
3. The batch sum runs serially over rows (B values, negligible next to B*V), in
   float32 chunks of about sqrt(B) rows from ``CHUNKED_ROWS`` rows on
   (``cpu.common.chunked_batch_sums``: one accumulator over 4M row losses put a mean
   2.6e-3 off, the audit of 2026-12-05).

Below ``SERIAL_BELOW`` logits the rows run on one core (``parallel=0``): the
thread pool's launch would cost more than the work.

Not used: the online decomposition (its combine costs two exp per element, which
a CPU pays in full); ``expf`` (LLVM scalarizes a vector exp into one libm call per
lane, and the candidate was then slower than numpy). With ``poly_exp``: 74.5 ms
against numpy's 400.6 ms on 4096x32000 float32, two Xeon cores
(results/benchmarks.csv, 2026-11-29).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import CrossEntropyProblem
from tvm_fusion.registry import Candidate, Knobs, register

from ..common import knob_value

from .common import (
    chunked_batch_sums, default_lanes, lane_partials, parallel_choices, row_lane_choices, row_passes, vectorize_partials,
)


@dataclass(frozen=True)
class RowsParallelKnobs(Knobs):
    lanes: int = 16
    parallel: int = 1  # 0: one core (small inputs)


@register
class CrossEntropyParallel(Candidate):
    name = "cross_entropy_parallel"
    op = "cross_entropy"
    target_kind = "llvm"
    algorithm = "three_pass_poly_exp"
    knobs = RowsParallelKnobs

    def choices(self, problem: CrossEntropyProblem, target: Target) -> dict[str, list[int]]:
        return {"lanes": row_lane_choices(problem.classes), "parallel": parallel_choices(problem.numel)}

    def default_for(self, problem: CrossEntropyProblem, target: Target) -> RowsParallelKnobs:
        lanes = row_lane_choices(problem.classes)
        return RowsParallelKnobs(lanes=default_lanes(lanes),
                                 parallel=parallel_choices(problem.numel)[0])

    def schedule(self, sch, problem: CrossEntropyProblem, knobs) -> None:
        chunked_batch_sums(sch, problem)  # 4. the sums over rows in chunks (float32 drift)
        passes = row_passes(sch, problem)
        # 2a. Each row pass into vector-lane partials (before the loop nests move).
        partials = {name: lane_partials(sch, sch.get_sblock(name), knobs.lanes) for name, lanes in passes if lanes}
        # 1. Rows in parallel, anchored at the per-row epilogue.
        epilogue = sch.get_sblock("loss" if problem.reduction == "none" else "row_loss")
        (row,) = sch.get_loops(epilogue)
        if knob_value(sch, knobs.parallel):  # one choice per shape: safe to branch on
            sch.parallel(row)
        # 2b. Both passes (a ragged row's body, tail and join) and their partials at
        # the row, consumers first.
        for name, _ in passes:
            sch.compute_at(sch.get_sblock(name), row, preserve_unit_loops=True)
            if name in partials:
                sch.compute_at(partials[name], row, preserve_unit_loops=True)
                vectorize_partials(sch, partials[name], 1)
