"""One thread block per row, two passes over the row (max, then sum of exp).

Pattern ``x(SR) -> max(S) -> exp, sum(S) -> row_loss(S) -> batch(R)``, the
``three_pass`` decomposition. For rows long enough to keep a block busy
(V / vector >= threads), e.g. V = 32000 and up.

1. ``row_loss`` (the per-row epilogue) is the anchor: its row loop is bound to
   ``blockIdx.x``; ``row_sumexp`` and ``row_max`` are computed at it.
2. Each row reduction is split ``[threadIdx.x, serial, vector]``: lanes read
   consecutive 16-byte vectors through registers, accumulate in float32, and TVM
   lowers the cross-thread step to ``__shfl_down_sync`` plus one shared-memory hop
   across warps. The row max lives in shared memory for the second pass.
3. Thread 0 turns (max, sum of exp, target logit) into the row loss.
4. A second one-block kernel sums the row losses (mean, sum) and finds the first
   target out of range.

Not used: keeping the row in registers between the passes (the second pass
re-reads it, mostly from L2; ``cross_entropy_row_in_registers`` avoids that),
atomics for the batch sum (non-deterministic order).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import CrossEntropyProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, ladder, register

from ..common import outputs_to, single_thread, thread_reduce
from .common import (
    MAX_THREADS, THREADS_BY_VECTORS, schedule_ce_batch_stage, spans_two_vectors, vector_choices, widest_vector,
)


@dataclass(frozen=True)
class BlockPerRowKnobs(Knobs):
    threads: int = 256
    vector: int = 8
    unroll: int = 16


@register
class CrossEntropyBlockPerRow(Candidate):
    name = "cross_entropy_block_per_row"
    op = "cross_entropy"
    target_kind = "cuda"
    algorithm = "three_pass"
    knobs = BlockPerRowKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyProblem) -> bool:
        return problem.op == self.op and spans_two_vectors(problem.classes, problem.dtype)

    def choices(self, problem: CrossEntropyProblem, target: Target) -> dict[str, list[int]]:
        return {
            "threads": [64, 128, 256, 512, 1024],
            "vector": vector_choices(DTYPE_BYTES[problem.dtype], problem.classes),
            "unroll": [1, 4, 16, 64],
        }

    def default_for(self, problem: CrossEntropyProblem, target: Target) -> BlockPerRowKnobs:
        vector = widest_vector(problem.dtype, problem.classes)
        threads = ladder(problem.classes // vector, THREADS_BY_VECTORS, MAX_THREADS)
        return BlockPerRowKnobs(threads=threads, vector=vector, unroll=16)

    def schedule(self, sch, problem: CrossEntropyProblem, knobs) -> None:
        # 1. One block per row, anchored at the per-row epilogue.
        epilogue = sch.get_sblock("loss" if problem.reduction == "none" else "row_loss")
        (row,) = sch.get_loops(epilogue)
        sch.bind(row, "blockIdx.x")
        # 2. Both passes over the row, consumers first.
        for name in ("row_sumexp", "row_max"):
            block = sch.get_sblock(name)
            sch.compute_at(block, row, preserve_unit_loops=True)
            thread_reduce(sch, block, 1, knobs.threads, knobs.vector, knobs.unroll, "logits")
            # The row statistic in every thread's registers (the allreduce hands it
            # to all). In shared memory, TVM's ThreadSync put a __syncthreads inside
            # the guarded tail of the next pass (V = 724, 64 threads x 4): the GPU hung.
            outputs_to(sch, block, "local")
        # 3. The scalar transform on one thread.
        single_thread(sch, epilogue, knobs.threads)
        # 4. The batch reduction kernel.
        schedule_ce_batch_stage(sch, problem, knobs.threads)
