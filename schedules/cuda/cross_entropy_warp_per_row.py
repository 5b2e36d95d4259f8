"""One warp per row, several rows per block (short rows).

Pattern ``x(SR) -> max(S) -> exp, sum(S) -> row_loss(S) -> batch(R)``, the
``three_pass`` decomposition. For rows a warp can sweep in a few steps
(V / vector <= 32 * 16, e.g. V = 1000), where a whole block per row would leave
most lanes idle and pay a block-wide barrier per row.

1. Rows are split ``[blockIdx.x, threadIdx.y]``: ``rows`` warps per block, one row each.
2. Each pass over the row is split ``[threadIdx.x (32), serial, vector]`` and staged
   through registers with 16-byte loads; the cross-lane step is five
   ``__shfl_down_sync``, no shared memory and no block barrier. The second pass
   re-reads the row from L1 (a row of 1000 halves is 2 KB).
3. Lane 0 of each warp writes the row loss; the batch kernel follows.

Not used: one thread per row (uncoalesced: lanes would stride by V).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import CrossEntropyProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, register

from ..common import outputs_to, single_thread, thread_reduce
from .common import WARP, schedule_ce_batch_stage, spans_two_vectors, vector_choices, widest_vector

MAX_VECTORS_PER_LANE = 16  # past 16 vectors per lane a row wants more than a warp


@dataclass(frozen=True)
class WarpPerRowKnobs(Knobs):
    rows: int = 4  # warps (rows) per block
    vector: int = 8
    unroll: int = 16


@register
class CrossEntropyWarpPerRow(Candidate):
    name = "cross_entropy_warp_per_row"
    op = "cross_entropy"
    target_kind = "cuda"
    algorithm = "three_pass"
    knobs = WarpPerRowKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyProblem) -> bool:
        # One row of one vector leaves no loop for the syncs (spans_two_vectors);
        # with two rows or more the row loop is there.
        return (problem.op == self.op and problem.classes <= WARP * MAX_VECTORS_PER_LANE * 8
                and (problem.batch > 1 or spans_two_vectors(problem.classes, problem.dtype)))

    def prefers(self, problem: CrossEntropyProblem, target: Target) -> bool:
        vector = widest_vector(problem.dtype, problem.classes)
        return problem.classes // vector <= WARP * 8

    def choices(self, problem: CrossEntropyProblem, target: Target) -> dict[str, list[int]]:
        return {
            "rows": [1, 2, 4, 8, 16],
            "vector": vector_choices(DTYPE_BYTES[problem.dtype], problem.classes),
            "unroll": [1, 4, 16],
        }

    def default_for(self, problem: CrossEntropyProblem, target: Target) -> WarpPerRowKnobs:
        vector = widest_vector(problem.dtype, problem.classes)
        return WarpPerRowKnobs(rows=4, vector=vector, unroll=16)

    def schedule(self, sch, problem: CrossEntropyProblem, knobs) -> None:
        epilogue = warp_rows(sch, problem, knobs.rows, knobs.vector, knobs.unroll, "logits")
        # 3. Lane 0 writes the row loss.
        single_thread(sch, epilogue, WARP)
        schedule_ce_batch_stage(sch, problem)


def warp_rows(sch, problem: CrossEntropyProblem, rows, vector, unroll, staged: str):
    """Steps 1-2: the rows over ``(blockIdx.x, threadIdx.y)``, ``rows`` warps a block,
    and each row's two passes across its warp's 32 lanes, ``staged`` (the buffer the
    passes read) through registers ``vector`` values a load. Returns the row loss's
    block."""
    epilogue = sch.get_sblock("loss" if problem.reduction == "none" else "row_loss")
    (row,) = sch.get_loops(epilogue)
    block_rows, warp_row = sch.split(row, [None, rows])
    sch.bind(block_rows, "blockIdx.x")
    sch.bind(warp_row, "threadIdx.y")
    for name in ("row_sumexp", "row_max"):
        block = sch.get_sblock(name)
        sch.compute_at(block, warp_row, preserve_unit_loops=True)
        thread_reduce(sch, block, 2, WARP, vector, unroll, staged)
        # In registers: every lane holds the shuffled result. In shared memory,
        # lane 0's store raced the other lanes' reads (no __syncwarp between):
        # the GPU sweep saw rows lose their max, loss off by ~40 at logits ~38.
        outputs_to(sch, block, "local")
    return epilogue
