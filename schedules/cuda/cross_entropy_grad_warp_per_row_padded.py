"""Cross entropy and its gradient, one warp per row over the row's granules padded to 32 lanes.

Pattern ``t(R) -> denom, first_bad | x(SRR) -> max(S) -> exp, sum(S) -> lse, row_loss,
coef(S) -> dlogits(SS) | row_loss(R) -> loss``, the ``fused_padded`` decomposition:
``cross_entropy_grad_warp_per_row`` with the statistics of
``cross_entropy_warp_per_row_padded`` (whose docstring says why: no load of the two
passes behind a guard, so a lane's 16-byte loads issue together). ``dlogits`` is
``cross_entropy_grad_warp_per_row``'s map over the row itself, its steps guarded by
the row's end (its stores must stay inside the row). Read in the SASS (nvcc 13,
sm_90, 65536x1000 fp16): the statistics' four LDG.E.128 of a lane issue back to back,
the map reuses three of them from registers and reloads only the last, partial
granule, and stores with STG.E.128: the row is read from memory once and dlogits
written once, the bytes floor's traffic (48 registers with TVM's --use_fast_math, no spills).

Dispatch prefers it where the forward's padded candidate is preferred (rows of at most
8 granules a lane). The H200 A/B grid at fc88131 (results/benchmarks.csv, "padded A/B
grid"), 65536x1000: fp16 0.0830 ms against 0.0859 for the best other configuration
(block per row; ``row_in_shared``, dispatch's pick before, 0.0871 at its default in an
earlier run), bf16 0.0820 against 0.0919. That is 74% of copy, 1.35x the read + write
floor of 0.0614 ms: the 0.065-0.072 predicted from the single read and write was
missed, as the forward's was.
"""

from __future__ import annotations

from tvm_fusion.compute.cross_entropy import granule
from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.registry import Candidate, register

from .cross_entropy_grad_warp_per_row import grad_warp_rows
from .cross_entropy_warp_per_row_padded import CrossEntropyWarpPerRowPadded, PaddedWarpPerRowKnobs


@register
class CrossEntropyGradWarpPerRowPadded(Candidate):
    name = "cross_entropy_grad_warp_per_row_padded"
    op = "cross_entropy_grad"
    target_kind = "cuda"
    algorithm = "fused_padded"
    knobs = PaddedWarpPerRowKnobs  # the forward's knobs: the same launch shape
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyGradProblem) -> bool:
        # Not in place, as cross_entropy_grad_warp_per_row: a warp's shuffles order no
        # memory, so a lane could store its gradient over a logit another lane reads.
        return (problem.mode == "fused" and not problem.in_place
                and CrossEntropyWarpPerRowPadded.applies(self, problem))

    prefers = CrossEntropyWarpPerRowPadded.prefers  # with this class's applies
    choices = CrossEntropyWarpPerRowPadded.choices
    default_for = CrossEntropyWarpPerRowPadded.default_for

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        # The statistics over the padded granules, a granule a load.
        grad_warp_rows(sch, problem, knobs.rows, granule(problem.dtype), knobs.unroll, "granules")
        # The padded row's map into each register stage: a clamped 16-byte load.
        sch.compute_inline(sch.get_sblock("granules"))
