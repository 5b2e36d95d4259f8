"""Cross entropy and its gradient for small batches, in one launch: every row block
sums the mean's denominator over the targets itself.

Pattern ``x(SR), t(SR) -> max(S), denom_i(S) -> exp, sum(S) -> lse, row_loss,
coef(S) -> dlogits(SS) | row_loss, t(R) -> loss, denom, first_bad``, the
``fused_row_targets`` decomposition. ``cross_entropy_grad_block_per_row`` runs a
first kernel over the targets (the first bad row and the mean's denominator: every
row's scale needs the denominator before it stores a gradient), then the row kernel.
On a small batch that first kernel is a launch and a DRAM round trip in front of the
rows: the H200's "launch parts" probe (results/benchmarks.csv, 2026-12-06T20:22Z)
timed 128x32000 fp16 at 0.0151 ms as built and 0.0132 with the small kernels'
bodies emptied: an eighth of the kernel time is the small launches.

Here there is no first kernel:
1. One block per row (``blockIdx.x``), the row loop of ``block_per_row``.
2. ``row_denom``: the block's lanes stride over the B targets (at most ``MAX_BATCH``:
   8 KB of int64 targets a block, from L2 after the first blocks) and reduce across
   the block; thread 0 keeps the sum in shared memory, behind a barrier. The same
   value in every block, so the rows' scales agree.
3. The statistics, coefficients and ``dlogits`` as ``block_per_row``.
4. The batch stage (one block on the row kernel's lanes, whatever the batch: the sum
   of the row losses, the denominator and the first bad row in one pass, then
   ``loss``, ``denom``, ``first_bad_row``), which the single-launch pass runs in the
   row kernel's last block.

Two candidates, one row kernel each (the ``RowTargets`` mixin over the base
candidate's ``schedule_rows``): ``cross_entropy_grad_row_targets`` keeps
``block_per_row``'s (the row swept three times, from L2 after the first);
``cross_entropy_grad_row_in_shared_targets`` keeps ``row_in_shared``'s (the row copied
into shared memory by ``cp.async``, every copy of a thread in flight at once, then
read from there), for rows that fit beside a second block (112 KB). On 128 rows of
32000 the GPU has one block per SM, so what a block has in flight sets its time.

The mean and the sum (reduction "none" has no batch stage to carry the first bad
row). Not in place. Each is its base candidate's one-launch twin (``twin_of``): dispatch
order puts it first, and a tuning record of the base takes the twin at the record's
knobs (``dispatch._twin``). Measured on an H100 (rows "probe: row targets A/B",
2026-12-07T07:45Z, kernels under graph replay, each checked against float64 first, us):

===================  ==============  ===========  ===============  ==============  ===========
shape                block_per_row   row_targets  row_in_shared    row_in_shared   dispatch
                                                                   _targets        before
===================  ==============  ===========  ===============  ==============  ===========
128x32000 fp16       14.74           13.61        15.88            14.15           14.73
64x32000 bf16        19.49           17.56        13.51            11.83           19.47
1x32000 fp16         9.41            8.05         8.66             6.97            9.42
512x32000 bf16       48.11           46.09        33.59            31.54           33.59
1024x32000 fp16      94.74           92.24        56.49            54.26           56.27
200x1000 fp16        7.66            6.50         7.62             6.91            6.65
===================  ==============  ===========  ===============  ==============  ===========

One launch fewer is 0.7-2.5 us on every shape. Which twin: ``row_in_shared``'s
preference (its ``prefers``) takes fp16 and bf16 rows of 32000 values and more on batches up to three
quarters of the SMs, where its twin was the fastest on every shape timed (rows of
2026-12-07T09:05-09:08Z, 1 to 96 rows of 32000 and 16 to 64 of 50304: 64x32000 bf16
11.81 us against ``row_targets``' 17.55, 96x32000 fp16 12.91 against 13.47), and
batches of twice the SMs and more; ``row_targets`` keeps the rest (128x32000 fp16
13.54 against 14.10).

Not used: the denominator summed once, by the first block, with the others waiting on
a flag in global memory (a block may wait on one the GPU has not scheduled: only a
cooperative launch, all blocks resident, is safe, ``tvm_fusion.grid_barrier``); float atomics
of the row losses into ``loss`` (they add in no fixed order, so the loss would differ
from run to run); the row's denominator in registers (TVM's allreduce leaves it in a
shared buffer that StorageRewrite then gave to the coefficient every thread computed
from it: all threads stored there while others still read it, caught by
``test_cross_entropy_grad``'s shared-store check), so it is copied into a shared
buffer by thread 0, behind a barrier.
"""

from __future__ import annotations

from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.registry import register

from ..common import lane_steps, outputs_to
from .common import one_block_reduce
from .cross_entropy_grad_block_per_row import CrossEntropyGradBlockPerRow
from .cross_entropy_grad_row_in_shared import CrossEntropyGradRowInShared

# Rows whose targets every row block reads: 8 KB of int64 targets, four loads a lane at
# 256 lanes, against 64 KB and more of logits a block on the rows it is for (V = 32000
# fp16). A first guess: the GPU A/B against block_per_row should set it.
MAX_BATCH = 1024


class RowTargets:
    """The one-launch form of a one-block-per-row gradient candidate (mixed in before
    it): no targets pass, each row block sums the denominator (step 2), the batch
    stage writes what the targets pass wrote. The candidate gives ``schedule_rows``
    (its row kernel; returns the row loop) and ``at_dlogits_row`` (what a row computes
    before its gradient)."""

    algorithm = "fused_row_targets"

    def applies(self, problem: CrossEntropyGradProblem) -> bool:
        return (problem.reduction != "none" and not problem.in_place and problem.batch <= MAX_BATCH
                and super().applies(problem))

    def at_dlogits_row(self, sch, problem: CrossEntropyGradProblem, dlogits_row) -> None:
        super().at_dlogits_row(sch, problem, dlogits_row)
        if problem.reduction == "mean":  # the row's denominator, before its coefficients
            sch.compute_at(sch.get_sblock("row_denom"), dlogits_row, preserve_unit_loops=True)

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        mean = problem.reduction == "mean"
        # 1, 3. The candidate's row kernel: statistics, coefficients, map, per-row outputs.
        self.schedule_rows(sch, problem, knobs)
        # 2. The row's denominator across the block's lanes.
        if mean:
            row_denom = sch.get_sblock("row_denom")
            lane_steps(sch, sch.get_loops(row_denom)[-1], knobs.threads)
            outputs_to(sch, row_denom, "shared")
        # 4. The batch stage and the outputs the targets pass wrote, on the row kernel's
        # lanes whatever the batch (at most MAX_BATCH rows: 16 a lane at 64 lanes), so that
        # single_launch always runs it in the row kernel's last block.
        epilogues = ("loss", "first_bad_row") + (("denom",) if mean else ())
        one_block_reduce(sch, "batch", knobs.threads, epilogues=epilogues)


@register
class CrossEntropyGradRowTargets(RowTargets, CrossEntropyGradBlockPerRow):
    """block_per_row's row kernel, its knobs and space; no targets pass."""

    name = "cross_entropy_grad_row_targets"
    twin_of = "cross_entropy_grad_block_per_row"


@register
class CrossEntropyGradRowInSharedTargets(RowTargets, CrossEntropyGradRowInShared):
    """row_in_shared's row kernel (the row copied into shared memory by ``cp.async``,
    read from HBM once), its knobs and space; no targets pass."""

    name = "cross_entropy_grad_row_in_shared_targets"
    twin_of = "cross_entropy_grad_row_in_shared"
