"""One thread block per row, a single online pass over 16-byte chunks.

Pattern ``x(SRR) -> chunk (max, sumexp)(SS) -> (max, sumexp)(S) -> row_loss(S)``,
the ``online`` decomposition: each element is read once, from HBM. A lane loads a
16-byte chunk, takes its max and its exps in registers, and folds the chunk into
its running ``(m, s)`` with one rescale (``s' = s e^(m - m') + s_c e^(m_c - m')``);
lanes then combine their pairs by the same rule through ``__shfl_down_sync``.
For long rows (V = 32000 and up) where a second pass would miss L2: at 132 SMs x
a 256 KB row (V = 128256, bf16) the rows in flight outgrow the 60 MB L2.

1. The row epilogue is the anchor, its row bound to ``blockIdx.x``.
2. ``row_online`` walks the row's chunks split ``[threadIdx.x, serial]``; per chunk
   the logits are loaded with one 16-byte load into registers, and
   ``chunk_max`` / ``chunk_sumexp`` run there.
3. Thread 0 writes the row loss; the batch kernel follows.

Exp count: 1 + 2/8 per element for 16-bit inputs (MUFU: about 4.2e12 exp/s on an
H200 against 2.1e12 elements/s at full bandwidth).

Not used: the per-element online combine (two exp per element, MUFU-bound).

``batch`` (1: a chunk a step) takes a lane's chunks ``batch`` a step, the batch loop
unrolled, so that their 16-byte loads go out together. Why: with fewer rows than two
an SM each SM runs one block, and a lane's steps load one after the other, each step's
exps waiting on its load. CE 128x32000 fp16 at 1024 lanes is 4 steps a lane: four round
trips to HBM in a row, 8.11 us under graph replay on an H100 where the read alone at
copy speed is 2.7 us (rows "probe: split_row A/B" of results/benchmarks.csv,
2026-12-06). In the PTX as TVM compiles it (nvcc with fast math), batch 1's four steps
are unrolled but each load sits behind its own branch, after the previous step's exps,
so it cannot issue earlier; at batch 4 the first three steps' ``ld.global.nc.v4`` have
no branch between them and the fourth is behind its guard. Predicted: the load phase of
128x32000 from four round trips to two, about 6 us against 8.1.

Measured (H100, copy 3041 GB/s, rows "probe: online batch A/B" of results/benchmarks.csv,
2026-12-06T04:14-04:15Z, each kernel checked against float64 on NaN-poisoned outputs), us:

======================  ================  ==============  ==============  ===============
shape                   dispatch          default lanes   1024 lanes      best
                                          b1 / b4 / b8    b1 / b4 / b8
======================  ================  ==============  ==============  ===============
CE 128x32000 fp16       8.02              11.50 / 9.12    8.34 / 8.37     dispatch
                                          / 8.62 (256)    / 8.39
CE 512x32000 fp16       16.79             16.78 / 15.95   19.05 / 19.27   256, b8: 15.85
                                          / 15.85 (256)   / 19.29
CE 256x128256 bf16      27.80             29.32 / 27.03   27.61 / 27.63   512, b8: 26.76
                                          / 26.76 (512)   / 27.78
CE 4096x32000 fp16      91.31             91.31 / 89.36   105.77 / 101.46 256, b4: 89.36
                                          / 91.24 (256)   / 101.43
CE 16384x50257 bf16     635.03 (aligned)  577.14 / 601.23 643.45 / 819.86 512, b8: 572.35
                                          / 572.35 (512)  / 586.78
======================  ================  ==============  ==============  ===============

The prediction missed: at 1024 lanes, where 128x32000 has four steps a lane, batch 4 and
8 change nothing (8.37, 8.39 against 8.34), so the four loads one after the other are
not what holds it at 8 us. At 256 or 512 lanes (16 steps and more) batch 8 gains 1-25%
(128x32000 11.50 to 8.62, 256x128256 29.32 to 26.76), never past the best of the lanes'
choice; at 1024 lanes on 16384x50257 batch 4 was 27% slower (819.86 against 643.45).
So it stays a tuning knob, default 1, and the shipped cost model, trained before it, ranks
only batch 1 (``cost_model.knob_ranges``). On this H100, 16384x50257 bf16 at 512 lanes
(572 us, 94.6% of copy) beats dispatch's record (``cross_entropy_aligned_rows`` at 128
threads, 635 us), a record timed on an H200 (0.396 ms there, 98.7% of copy): the shipped
logs serve both cards (``cuda_sm_90``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import CrossEntropyProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, ladder, register
from tvm_fusion.targets import sm_count

from ..common import single_thread
from .common import MAX_THREADS, THREADS_BY_VECTORS, VECTOR_BYTES, online_chunks, schedule_ce_batch_stage

ONLINE_ROW_BYTES = 8192
BATCHES = [1, 2, 4, 8]


@dataclass(frozen=True)
class OnlineKnobs(Knobs):
    threads: int = 256
    unroll: int = 16
    batch: int = 1  # chunks a lane loads a step (module docstring)


@register
class CrossEntropyOnline(Candidate):
    name = "cross_entropy_online"
    op = "cross_entropy"
    target_kind = "cuda"
    algorithm = "online"
    knobs = OnlineKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def prefers(self, problem: CrossEntropyProblem, target: Target) -> bool:
        # One HBM read beats two passes once rows are long and fill the GPU. H200,
        # 2026-11-29 (results/benchmarks.csv): 4096x32000 fp16 0.0694 ms against
        # 0.0827 (row in shared memory) and 0.1153 (block per row); 16384x50257 bf16
        # 0.5227 against 0.6403. With fewer rows than two per SM it loses:
        # 128x32000 fp16 0.0123 against 0.0085 for a block per row.
        return (problem.classes * DTYPE_BYTES[problem.dtype] >= ONLINE_ROW_BYTES
                and problem.batch >= 2 * sm_count(target))

    def choices(self, problem: CrossEntropyProblem, target: Target) -> dict[str, list[int]]:
        return {"threads": [128, 256, 512, 1024], "unroll": [1, 4, 16], "batch": BATCHES}

    def default_for(self, problem: CrossEntropyProblem, target: Target) -> OnlineKnobs:
        chunk = VECTOR_BYTES // DTYPE_BYTES[problem.dtype]
        threads = max(128, ladder(problem.classes // chunk, THREADS_BY_VECTORS, MAX_THREADS))
        return OnlineKnobs(threads=threads, unroll=16)

    def schedule(self, sch, problem: CrossEntropyProblem, knobs) -> None:
        # 1. One block per row.
        epilogue = sch.get_sblock("loss" if problem.reduction == "none" else "row_loss")
        (row,) = sch.get_loops(epilogue)
        sch.bind(row, "blockIdx.x")
        # 2. Chunks across the lanes; each chunk reduced in registers.
        sch.compute_at(sch.get_sblock("row_online"), row, preserve_unit_loops=True)
        online_chunks(sch, knobs.threads, knobs.unroll, "shared", knobs.batch)  # batch 1: the CUDA as before it
        # 3. The scalar transform on one thread, then the batch kernel.
        single_thread(sch, epilogue, knobs.threads)
        schedule_ce_batch_stage(sch, problem, knobs.threads)
