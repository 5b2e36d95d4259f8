"""Cross entropy and its gradient, one thread block per row, in one row kernel.

Pattern ``t(R) -> denom, first_bad | x(SR) -> max(S) -> exp, sum(S) -> lse, row_loss,
coef(S) -> dlogits(SS) | row_loss(R) -> loss``, the ``fused`` decomposition (the
gradient for ``dloss = 1`` written during the forward, as Liger's kernel does). For
rows long enough to keep a block busy (V / vector >= threads), e.g. V = 32000 and up.

Kernel 1, one block: the targets pass (the first bad target; for the mean its
denominator), each thread striding over rows, then shuffles.
Kernel 2, grid (B,):
1. Every per-row block shares one row loop (``merge_rows``) bound to ``blockIdx.x``.
2. ``row_max`` then ``row_sumexp``, each split ``[threadIdx.x, serial, vector]``:
   lanes read consecutive 16-byte vectors through registers, accumulate in float32,
   and TVM lowers the cross-thread step to ``__shfl_down_sync`` plus one shared-memory
   hop. Both statistics stay in every thread's registers (the allreduce hands them
   to all).
3. Every thread computes the row's gradient coefficients into its own registers (a
   handful of flops, no barrier); thread 0 writes ``lse`` and the row loss after
   step 4, so that they are the statistics' last readers (``row_order``).
4. ``dlogits``: the third pass over the row, the same split, a 16-byte load, the
   gradient in float32 in registers and a 16-byte store per step.
Kernel 3, one block: the sum of the row losses (mean, sum) and ``loss``.

Not used: persistent row blocks, each walking consecutive rows so that fewer rows
are in flight and the later sweeps hit L2 (16384x50257 bf16 at 1024 threads: 1.5489
ms a block per row, 1.8412 at 261 blocks, 2.0277 at 132; H200, 2026-12-03, rows
"probe: uncommitted rows_per_block knob" in results/benchmarks.csv); the row
statistics in shared memory (written by one lane and read by the
others it raced; in multi-warp blocks TVM's ThreadSync put a ``__syncthreads``
under the tail guard and the GPU hung: the forward candidates' lesson); the mean's
denominator on the host (a sync per step and no graph capture) or applied by a
second pass over ``dlogits`` (two more passes over B x V).
"""

from __future__ import annotations

from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.registry import Candidate, register

from ..common import LoopRV, coefficients_at, outputs_to, row_loss_name, single_thread, thread_reduce
from .cross_entropy_block_per_row import BlockPerRowKnobs, CrossEntropyBlockPerRow
from .common import grad_map, merge_grad_rows, schedule_grad_batch_stage, schedule_grad_prologue


@register
class CrossEntropyGradBlockPerRow(Candidate):
    name = "cross_entropy_grad_block_per_row"
    op = "cross_entropy_grad"
    target_kind = "cuda"
    algorithm = "fused"
    knobs = BlockPerRowKnobs  # the forward's knobs: the same launch shape
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyGradProblem) -> bool:
        return problem.mode == "fused" and CrossEntropyBlockPerRow.applies(self, problem)

    # The forward's space and default: the same launch shape over the same row.
    choices = CrossEntropyBlockPerRow.choices
    default_for = CrossEntropyBlockPerRow.default_for

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        # Kernel 1: the targets pass.
        schedule_grad_prologue(sch, problem)
        self.schedule_rows(sch, problem, knobs)
        # Kernel 3: the loss.
        schedule_grad_batch_stage(sch, problem, knobs.threads)

    def at_dlogits_row(self, sch, problem: CrossEntropyGradProblem, dlogits_row: LoopRV) -> None:
        """What each row computes before its gradient: the coefficients, in registers."""
        coefficients_at(sch, problem, dlogits_row, "local")

    def schedule_rows(self, sch, problem: CrossEntropyGradProblem, knobs) -> LoopRV:
        """Kernel 2, steps 1-4; returns the row loop (bound to ``blockIdx.x``)."""
        # 1. One row loop, one block per row (the coefficients at dlogits' row first).
        self.at_dlogits_row(sch, problem, sch.get_loops(sch.get_sblock("dlogits"))[0])
        loss = row_loss_name(problem)
        row = merge_grad_rows(sch, problem)
        sch.bind(row, "blockIdx.x")
        # 2. Both statistics across the block, kept in registers.
        for name in ("row_max", "row_sumexp"):
            block = sch.get_sblock(name)
            thread_reduce(sch, block, 1, knobs.threads, knobs.vector, knobs.unroll, "logits")
            outputs_to(sch, block, "local")
        # 4. The gradient over the row.
        grad_map(sch, 1, knobs.threads, knobs.vector, knobs.unroll)
        # 3. lse and the row loss on thread 0 (after the map: row_order says why).
        for name in ("lse", loss):
            single_thread(sch, sch.get_sblock(name), knobs.threads)
        return row
