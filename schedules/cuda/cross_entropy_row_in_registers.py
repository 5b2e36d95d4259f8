"""One thread block per row, the row held in registers between the two passes.

Pattern ``x(SR) -> max(S) -> exp, sum(S) -> row_loss(S) -> batch(R)``, the
``three_pass`` decomposition with one read of the row from HBM and both passes
over registers: one exp per element and no second trip through L2. For rows that
fit the block's registers: V * bytes <= 256 lanes x 256 bytes (V = 32000 fp16 is
64 KB).

1. The row epilogue is the anchor, its row bound to ``blockIdx.x``.
2. The row is loaded once, ``[threadIdx.x, serial, vector]`` with 16-byte loads,
   into a local buffer laid out ``[serial, lane, vector]`` (``transform_layout``),
   so each lane's part compacts to ``serial x vector`` registers; the serial loop
   is unrolled so every register index is a constant.
3. ``row_max`` then ``row_sumexp`` sweep the registers with the same split; the
   cross-thread steps are ``__shfl_down_sync`` plus one shared-memory hop.
4. Thread 0 writes the row loss; the batch kernel follows.

Not used: shared memory for the row (a 64 KB row per block caps residency at 3
blocks per SM and adds a store and a load per element).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.target import Target

from tvm_fusion.contracts import CrossEntropyProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, register

from ..common import knob_value, lanes_split, outputs_to, read_index, single_thread
from .common import schedule_ce_batch_stage, vector_choices

# 64 registers of row per lane. ptxas then uses about 176 registers (V = 32000 fp16,
# sm_90), so blocks stay at 256 threads or fewer: a 512-thread block is capped at
# 128 registers and spills (seen with V = 32000 float32).
BYTES_PER_LANE = 256
THREAD_CHOICES = (128, 256)
FULL_UNROLL = 1024


def _zero_pad(dtype: str):
    """Value of the padded tail of the last serial step (never read: the reductions
    are predicated). bfloat16 needs it as a function of the indices, in bits: a
    constant bf16 store trips TVM's bf16 storage legalization."""
    if dtype == "bfloat16":
        return lambda *_: tirx.reinterpret("bfloat16", tirx.const(0, "uint16"))
    return tirx.const(0, dtype)


@dataclass(frozen=True)
class RowInRegistersKnobs(Knobs):
    threads: int = 256
    vector: int = 8


@register
class CrossEntropyRowInRegisters(Candidate):
    name = "cross_entropy_row_in_registers"
    op = "cross_entropy"
    target_kind = "cuda"
    algorithm = "three_pass"
    knobs = RowInRegistersKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyProblem) -> bool:
        row_bytes = problem.classes * DTYPE_BYTES[problem.dtype]
        return problem.op == self.op and row_bytes <= BYTES_PER_LANE * THREAD_CHOICES[-1]

    def prefers(self, problem: CrossEntropyProblem) -> bool:
        row_bytes = problem.classes * DTYPE_BYTES[problem.dtype]
        return 8192 < row_bytes <= BYTES_PER_LANE * THREAD_CHOICES[-1]

    def choices(self, problem: CrossEntropyProblem, target: Target) -> dict[str, list[int]]:
        row_bytes = problem.classes * DTYPE_BYTES[problem.dtype]
        threads = [t for t in THREAD_CHOICES if row_bytes <= BYTES_PER_LANE * t]
        return {"threads": threads, "vector": vector_choices(DTYPE_BYTES[problem.dtype], problem.classes)}

    def default_for(self, problem: CrossEntropyProblem, target: Target) -> RowInRegistersKnobs:
        space = self.choices(problem, target)
        return RowInRegistersKnobs(threads=space["threads"][0], vector=max(space["vector"]))

    def schedule(self, sch, problem: CrossEntropyProblem, knobs) -> None:
        # 1. One block per row.
        epilogue = sch.get_sblock("loss" if problem.reduction == "none" else "row_loss")
        (row,) = sch.get_loops(epilogue)
        sch.bind(row, "blockIdx.x")
        row_sum, row_max = sch.get_sblock("row_sumexp"), sch.get_sblock("row_max")
        stage = sch.cache_read(row_max, read_index(sch, row_max, "logits"), "local",
                               consumer_blocks=[row_max, row_sum])
        # 2-3. Load once, then both passes, all with the same lane split.
        for block in (row_sum, row_max, stage):
            sch.compute_at(block, row, preserve_unit_loops=True)
            lanes_split(sch, block, 1, knobs.threads, knobs.vector, FULL_UNROLL)
        sch.vectorize(sch.get_loops(stage)[-1])
        for block in (row_sum, row_max):
            outputs_to(sch, block, "shared")
        threads, vector = knob_value(sch, knobs.threads), knob_value(sch, knobs.vector)
        span = threads * vector
        sch.transform_layout(
            stage, ("write", 0),
            lambda i, k: (i, k // span, (k % span) // vector, k % vector),
            pad_value=_zero_pad(problem.dtype),
        )
        # 4. The scalar transform on one thread, then the batch kernel.
        single_thread(sch, epilogue, knobs.threads)
        schedule_ce_batch_stage(sch, problem.reduction)
