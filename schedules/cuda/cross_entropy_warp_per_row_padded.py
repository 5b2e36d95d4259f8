"""One warp per row over the row's 16-byte granules padded to 32 lanes (short rows).

Pattern ``x(SRR) -> max(S) -> exp, sum(S) -> row_loss(S) -> batch(R)``, the
``padded_three_pass`` decomposition: ``cross_entropy_warp_per_row``'s kernel on a
reduction domain that splits evenly over a warp.

Why (read before it was written): ``cross_entropy_warp_per_row`` on 65536x1000 fp16
took 0.0503 ms on the H200, 61% of the copy bandwidth ("padded A/B grid" rows, 2026-12-02). The row's 125 granules split
over 32 lanes as 4 steps, the last one partial, and TVM guards every statement of a
step with that bound. nvcc turned each guard into a branch around the step's load and
its arithmetic, so the SASS of both passes issues a lane's four LDG.E.128 one at a
time, each after the previous step's arithmetic. Per SM that leaves about 16 bytes
a lane in flight, 32 KB, at the edge of what HBM's latency asks for. Here the domain
is 128 granules (the last real one read again for the 3 pads and masked by a
select), so no statement has a guard and the loads of a pass can issue together.
Read in the PTX and SASS (nvcc 13, sm_90): the four LDG.E.128 of a lane issue back to
back, and for the plain mean or sum nvcc also keeps them in registers for the second
pass, so the row is read from memory once (40 registers with TVM's --use_fast_math, no spills). With a weight
and smoothing, or for reduction="none", the second pass loads the row again (from L1).

1. Rows are split ``[blockIdx.x, threadIdx.y]``: ``rows`` warps per block, one row each.
2. Each pass is split ``[threadIdx.x (32), serial, granule]`` and staged through
   registers with 16-byte loads (the ``granules`` map inlined into each stage); the
   cross-lane step is five ``__shfl_down_sync``. ``unroll`` 256 unrolls a whole pass.
3. Lane 0 of each warp writes the row loss; the batch kernel follows.

Dispatch prefers it on rows of at most ``PREFERRED_STEPS`` granules a lane. The H200
A/B grid at fc88131 (results/benchmarks.csv, "padded A/B grid", 6 configurations a
candidate, kernels under graph replay) against the best configuration of every other
candidate: 65536x1000 fp16 0.0420 ms against 0.0503 (warp per row, also dispatch's
pick before), bf16 0.0434 against 0.0521, fp32 0.0699 against 0.0725 (block per row;
dispatch's pick 0.0784), 512x1000 fp32 0.00485 against 0.00501, 12000x1024 fp16
0.01197 against 0.01206. On 24576x4096 bf16 (16 granules a lane) ``online`` won,
0.0576 against 0.0597, so longer rows keep the other candidates. The 0.035-0.040 ms
predicted for 65536x1000 fp16 from the single read was missed: 0.0420 is 74% of copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.compute.cross_entropy import granule, padded_granules
from tvm_fusion.contracts import CrossEntropyProblem
from tvm_fusion.registry import Candidate, Knobs, register

from ..common import single_thread
from .common import WARP, schedule_ce_batch_stage
from .cross_entropy_warp_per_row import warp_rows

MAX_STEPS = 16  # granules per lane, as cross_entropy_warp_per_row's MAX_VECTORS_PER_LANE
PREFERRED_STEPS = 8  # granules per lane on the rows dispatch gives it (the A/B above: 4 and 8 won, 16 lost)


@dataclass(frozen=True)
class PaddedWarpPerRowKnobs(Knobs):
    rows: int = 4  # warps (rows) per block
    unroll: int = 256  # TVM's auto-unroll steps: 256 unrolls a whole pass (<= 16 granules of <= 8 values)


@register
class CrossEntropyWarpPerRowPadded(Candidate):
    name = "cross_entropy_warp_per_row_padded"
    op = "cross_entropy"
    target_kind = "cuda"
    algorithm = "padded_three_pass"
    knobs = PaddedWarpPerRowKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyProblem) -> bool:
        if problem.op != self.op or problem.classes % granule(problem.dtype):
            return False
        return padded_granules(problem)[1] <= WARP * MAX_STEPS

    def prefers(self, problem: CrossEntropyProblem, target: Target) -> bool:
        return self.applies(problem) and padded_granules(problem)[1] <= WARP * PREFERRED_STEPS

    def choices(self, problem: CrossEntropyProblem, target: Target) -> dict[str, list[int]]:
        return {"rows": [1, 2, 4, 8, 16], "unroll": [1, 16, 64, 256]}

    def default_for(self, problem: CrossEntropyProblem, target: Target) -> PaddedWarpPerRowKnobs:
        # 4 rows, a whole pass unrolled: the best or within 1% of it on the six A/B shapes
        # (65536x1000 fp16 0.0420 ms, the A/B grid's best).
        return PaddedWarpPerRowKnobs(rows=4, unroll=256)

    def schedule(self, sch, problem: CrossEntropyProblem, knobs) -> None:
        # 1-2. cross_entropy_warp_per_row's rows and passes, a granule (16 bytes) a load.
        epilogue = warp_rows(sch, problem, knobs.rows, granule(problem.dtype), knobs.unroll, "granules")
        # The padded row's map into each register stage: a clamped 16-byte load.
        sch.compute_inline(sch.get_sblock("granules"))
        # 3. Lane 0 writes the row loss.
        single_thread(sch, epilogue, WARP)
        schedule_ce_batch_stage(sch, problem)
