"""Cross entropy and its gradient, one warp per row, several rows per block (short rows).

Pattern ``t(R) -> denom, first_bad | x(SR) -> max(S) -> exp, sum(S) -> lse, row_loss,
coef(S) -> dlogits(SS) | row_loss(R) -> loss``, the ``fused`` decomposition (the
gradient for ``dloss = 1`` written during the forward). For rows a warp sweeps in a
few steps (V / vector <= 32 x 8, e.g. V = 1000), where a block per row would leave
most lanes idle and pay a block-wide barrier per row.

Kernel 1, one block: the targets pass (the first bad target; for the mean its
denominator).
Kernel 2, grid (B / rows,):
1. Every per-row block shares one row loop (``merge_rows``), split ``[blockIdx.x,
   threadIdx.y]``: ``rows`` warps per block, one row each.
2. ``row_max`` then ``row_sumexp``, each split ``[threadIdx.x (32), serial, vector]``
   and staged through registers with 16-byte loads; the cross-lane step is five
   ``__shfl_down_sync`` and a broadcast shuffle: every lane holds the statistics in
   registers, no shared memory and no block barrier. The second pass re-reads the
   row from L1 (a row of 1000 halves is 2 KB).
3. Each lane computes the row's gradient coefficients in its registers; lane 0 writes
   ``lse`` and the row loss.
4. ``dlogits``: the third pass over the row, the same split, a 16-byte load, the
   gradient in float32 in registers, a 16-byte store.
Kernel 3, one block: the sum of the row losses (mean, sum) and ``loss``.

Not used: one thread per row (uncoalesced: lanes would stride by V); the statistics
in shared memory (lane 0's store raced the other lanes' reads, no ``__syncwarp``
between: the forward candidate's lesson from the GPU sweep).
"""

from __future__ import annotations

from tvm_fusion import folded_prologue
from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.registry import Candidate, register

from ..common import coefficients_at, outputs_to, row_loss_name, single_thread, thread_reduce
from .cross_entropy_warp_per_row import CrossEntropyWarpPerRow, WarpPerRowKnobs
from .common import WARP, grad_map, knobs_value, merge_grad_rows, schedule_grad_batch_stage, schedule_grad_prologue

@register
class CrossEntropyGradWarpPerRow(Candidate):
    name = "cross_entropy_grad_warp_per_row"
    op = "cross_entropy_grad"
    target_kind = "cuda"
    algorithm = "fused"
    knobs = WarpPerRowKnobs  # the forward's knobs: the same launch shape
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyGradProblem) -> bool:
        # Not in place: a warp's shuffles order no memory, so a lane could store its
        # gradient before another lane has read the logit under it.
        return problem.mode == "fused" and not problem.in_place and CrossEntropyWarpPerRow.applies(self, problem)

    # The forward's preference, space and default: the same launch shape over the same row.
    prefers = CrossEntropyWarpPerRow.prefers
    choices = CrossEntropyWarpPerRow.choices
    default_for = CrossEntropyWarpPerRow.default_for

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        grad_warp_rows(sch, problem, knobs.rows, knobs.vector, knobs.unroll)


def grad_warp_rows(sch, problem: CrossEntropyGradProblem, rows, vector, unroll, staged: str = "logits") -> None:
    """The three kernels above: ``rows`` warps a block, each row's statistics over
    ``staged`` (the buffer they read) and its ``dlogits`` map, ``vector`` values a load."""
    # Kernel 1: the targets pass (on the row kernel's lanes where it is folded into it).
    schedule_grad_prologue(sch, problem, WARP * knobs_value(sch, rows) if folded_prologue.ENABLED else None)
    # 1. One row loop over (blockIdx.x, threadIdx.y).
    dlogits_row = sch.get_loops(sch.get_sblock("dlogits"))[0]
    coefficients_at(sch, problem, dlogits_row, "local")
    loss = row_loss_name(problem)
    row = merge_grad_rows(sch, problem)
    block_rows, warp_row = sch.split(row, [None, rows])
    sch.bind(block_rows, "blockIdx.x")
    sch.bind(warp_row, "threadIdx.y")
    # 2. Both statistics across the 32 lanes of the row's warp, in registers.
    for name in ("row_max", "row_sumexp"):
        block = sch.get_sblock(name)
        thread_reduce(sch, block, 2, WARP, vector, unroll, staged)
        outputs_to(sch, block, "local")
    # 4. The gradient over the row.
    grad_map(sch, 2, WARP, vector, unroll)
    # 3. lse and the row loss on lane 0.
    for name in ("lse", loss):
        single_thread(sch, sch.get_sblock(name), WARP)
    # Kernel 3: the loss.
    schedule_grad_batch_stage(sch, problem)
