"""One thread block per row, the row kept in shared memory between the two passes.

Pattern ``x(SR) -> max(S) -> exp, sum(S) -> row_loss(S) -> batch(R)``, the
``three_pass`` decomposition with one read of the row from HBM and both passes
over shared memory: one exp per element and no second trip through L2. For rows
that fit beside a second block on an SM (V * bytes <= 112 KB of the 227 KB), e.g.
V = 32000 fp16 (64 KB) or V = 50257 bf16 (100 KB).

1. The row epilogue is the anchor, its row bound to ``blockIdx.x``.
2. The row is copied once into dynamic shared memory, ``[threadIdx.x, serial,
   vector]`` with 16-byte global loads and 16-byte shared stores.
3. ``row_max`` then ``row_sumexp`` sweep shared memory with the same split, each
   lane reading 16-byte chunks (consecutive lanes, consecutive chunks: no bank
   conflicts) into registers; cross-thread steps are ``__shfl_down_sync`` plus
   one shared-memory hop.
4. Thread 0 writes the row loss; the batch kernel follows.

Not used: registers for the row (the local buffer is written under one
threadIdx loop and read under two others, so TVM cannot compact it per thread:
it became a 268 MB global workspace on 4096x32000).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion import async_copy
from tvm_fusion.contracts import CrossEntropyProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, ladder, register

from ..common import lanes_split, outputs_to, read_index, single_thread, thread_reduce
from .common import (
    MAX_THREADS, THREADS_BY_VECTORS, schedule_ce_batch_stage, spans_two_vectors, vector_choices, widest_vector,
)

ROW_BYTES_MAX = 112 * 1024  # two blocks per SM (227 KB of shared memory on sm_90)


@dataclass(frozen=True)
class RowInSharedKnobs(Knobs):
    threads: int = 256
    vector: int = 8
    unroll: int = 8


@register
class CrossEntropyRowInShared(Candidate):
    name = "cross_entropy_row_in_shared"
    op = "cross_entropy"
    target_kind = "cuda"
    algorithm = "three_pass"
    knobs = RowInSharedKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyProblem) -> bool:
        return (problem.op == self.op and problem.classes * DTYPE_BYTES[problem.dtype] <= ROW_BYTES_MAX
                and spans_two_vectors(problem.classes, problem.dtype))

    def prefers(self, problem: CrossEntropyProblem, target: Target) -> bool:
        return False  # until a bench or tuning record says where it wins

    def choices(self, problem: CrossEntropyProblem, target: Target) -> dict[str, list[int]]:
        return {
            "threads": [128, 256, 512],  # 1024 caps registers at 64: spills with smoothing
            "vector": vector_choices(DTYPE_BYTES[problem.dtype], problem.classes),
            "unroll": [1, 4, 8, 16],
        }

    def default_for(self, problem: CrossEntropyProblem, target: Target) -> RowInSharedKnobs:
        vector = widest_vector(problem.dtype, problem.classes)
        threads = min(512, ladder(problem.classes // vector, THREADS_BY_VECTORS, MAX_THREADS))
        return RowInSharedKnobs(threads=threads, vector=vector, unroll=8)

    def schedule(self, sch, problem: CrossEntropyProblem, knobs) -> None:
        # 1. One block per row.
        epilogue = sch.get_sblock("loss" if problem.reduction == "none" else "row_loss")
        (row,) = sch.get_loops(epilogue)
        sch.bind(row, "blockIdx.x")
        row_sum, row_max = sch.get_sblock("row_sumexp"), sch.get_sblock("row_max")
        copy = sch.cache_read(row_max, read_index(sch, row_max, "logits"), "shared.dyn",
                              consumer_blocks=[row_max, row_sum])
        shared_name = sch.get(copy).writes[0].source.name
        # 3. Both passes over shared memory (consumers first).
        for block in (row_sum, row_max):
            sch.compute_at(block, row, preserve_unit_loops=True)
            thread_reduce(sch, block, 1, knobs.threads, knobs.vector, knobs.unroll, shared_name)
            # The row statistic in every thread's registers (the allreduce hands it
            # to all). In shared memory, TVM's ThreadSync put a __syncthreads inside
            # the guarded tail of the next pass (V = 724, 64 threads x 4): the GPU hung.
            outputs_to(sch, block, "local")
        # 2. The row copied in once.
        sch.compute_at(copy, row, preserve_unit_loops=True)
        _, serial, vec = lanes_split(sch, copy, 1, knobs.threads, knobs.vector, knobs.unroll)
        sch.vectorize(vec)
        async_copy.mark(sch, serial)
        # 4. The scalar transform on one thread, then the batch kernel.
        single_thread(sch, epilogue, knobs.threads)
        schedule_ce_batch_stage(sch, problem, knobs.threads)
