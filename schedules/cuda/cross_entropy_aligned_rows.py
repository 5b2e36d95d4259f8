"""One thread block per row, an online pass over the row's 16-byte aligned granules.

Pattern ``x(SRR) -> granule (max, sumexp)(SS) -> (max, sumexp)(S) + edges(S) ->
row_loss(S)``, the ``aligned_online`` decomposition of ``compute.cross_entropy``. For
rows whose byte length is not a multiple of 16 (V odd in fp16/bf16, V % 4 != 0 in
float32): row ``i`` starts at element ``i V``, off a 16-byte boundary for all rows
but one in ``c`` (``c = 16 / bytes``). Its elements are cut at the *global*
boundaries, not at the row's start:

* head: the row's elements before its first boundary, ``(-(i V)) mod c`` of them;
* body: ``floor(V / c) - 1`` granules of ``c`` elements, each one aligned 16-byte
  load. With ``a_i = (i V) mod c`` granule ``j`` holds row elements
  ``c (j + 1) - a_i + v``; the count is the same for every row (the fewest any
  residue leaves inside the row), so the index space is rectangular;
* tail: what is left after the body, at most ``2c - 2`` elements (``V mod c + a_i``).

1. The row epilogue is the anchor, its row bound to ``blockIdx.x``.
2. ``row_online`` walks the body granules split ``[step, threadIdx.x, batch]``
   (consecutive lanes, consecutive granules), the ``batch`` loop unrolled (but each
   granule's guard is a branch, so nvcc still issues one LDG.E.128 per granule after
   the previous granule's compute: one load in flight a lane); each granule's register stage
   is laid out by the flat logits' granules, so its ``c`` values sit at constant
   register indices; ``chunk_max`` / ``chunk_sumexp`` run there, one rescale per
   granule, the lanes' ragged bound tested once per granule (the chunk blocks
   blockized), a granule index clamped to the body so the load needs no bound; lanes
   combine through ``__shfl_down_sync`` plus one shared hop (as ``cross_entropy_online``).
3. Thread 0 reduces head and tail (``edge_max``, ``edge_sumexp``: ``c + 2c - 2``
   guarded scalar loads, 22 for 16-bit), combines them with the body's pair
   (``m = max(m_b, m_e)``, ``s = s_b e^(m_b - m) + s_e e^(m_e - m)``) and writes the
   row loss (target gather, weight, ignore_index, smoothing as every candidate);
   the batch kernel follows.

Why: with an unaligned row every existing candidate falls back to 2-byte loads (a
warp's load spans 512 B for 64 useful bytes). H200 (results/benchmarks.csv,
2026-12-01): 16384x50257 bf16 0.506 ms, 77% of copy bandwidth; 3000x50257 fp16
0.0992 ms, 72%. Same float32 numerics as ``cross_entropy_online`` (online
max / sum of exp per 16-byte chunk, 1 + 2/c exp per element).

Why a decomposition of its own: ``online`` and ``three_pass`` group a row's elements from the
row's start (``online``'s chunk ``j`` is elements ``8j .. 8j+7``; ``three_pass``
reduces ``k`` from 0), and schedule primitives keep a block's meaning, so in an
unaligned row every such chunk straddles two granules: a register stage of it needs
a row-dependent index into registers (local memory), and ``transform_block_layout``
cannot shift a reduction by a function of the row. The granules above are a compute
over a padded index space with a per-row offset ``a_i``: a TE compute, scheduled with
ordinary (traced) primitives, so MetaSchedule can tune it and records replay.
Two details make the 16-byte load appear: the column is written
``c floor(iV / c) - iV + c (j + 1) + v`` (TVM's CUDA codegen emits a vector load only
when a modular-set check sees the flat base is a multiple of c; ``- (iV mod c)``
simplifies to ``- (i mod 8)`` and fails it), and the register stage's layout is
transformed to ``((iV + k) / c, (iV + k) mod c)``.

Knobs: ``threads`` (lanes per row) and ``batch`` (granules a lane loads per step).

Not used: a vector load for the head's granule (possible, it lies in the buffer; 8
scalar loads on one thread per row are cheap), the ``unroll`` pragma of
``cross_entropy_online`` (TVM's auto-unroll leaves that loop rolled: one LDG.E.128 in
its SASS loop), one 16-byte load per row-relative chunk from two granules (twice the L1
traffic and a funnel shift by the row's residue), the row staged in shared memory
(``cross_entropy_row_in_shared``'s two passes: 1.86 ms on 16384x50257 bf16), the
per-element online combine (MUFU-bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.target import Target

from tvm_fusion.compute.cross_entropy import granule
from tvm_fusion.contracts import CrossEntropyProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, ladder, register

from ..common import outputs_to, single_thread, unroll
from .common import MAX_THREADS, THREADS_BY_VECTORS, VECTOR_BYTES, chunks_at, schedule_ce_batch_stage

ALGORITHM = "aligned_online"
# Rows shorter than this go to the warp and block candidates: the 22 scalar edge
# loads on one thread are a large share of a short row.
MIN_CLASSES = 256
# Where the aligned body wins: 16-bit rows of 4096 classes and more. H200 A/B of
# 2026-12-02 (results/benchmarks.csv), kernels under graph replay, against
# cross_entropy_online: 16384x50257 bf16 0.4328 ms (90% of copy) against 0.5226,
# 3000x50257 fp16 0.0867 against 0.1043, 2048x32001 bf16 0.0389 against 0.0483; fp32
# rows load 16 bytes every 4 values either way and tie (4096x50257: 0.2011 against
# 0.2010), so fp32 keeps the online kernel.
PREFERRED_CLASSES = 4096
# Granules a lane loads per step, the step unrolled so that nvcc issues their 16-byte
# loads together: with one a step (``cross_entropy_online``'s serial loop, which TVM's
# auto-unroll leaves rolled: one LDG.E.128 in the SASS loop) 4 blocks of 512 lanes
# keep 32 KB in flight per SM, about what HBM's latency asks for at full bandwidth.
# 512 threads at most by default. The SASS still issues a batch's loads one granule at
# a time (each after the previous granule's bound check), yet 8 a step measured best:
# 16384x50257 bf16 0.4187 ms against 0.4328 with 4, 0.4271 with 1, and 0.4940 at 1024
# threads (H200, 2026-12-02).
DEFAULT_BATCH = 8
DEFAULT_MAX_THREADS = 512


def unaligned_rows(problem) -> bool:
    """Rows whose byte length is not a multiple of 16: all but one row in ``c`` start
    off a 16-byte boundary."""
    return problem.classes * DTYPE_BYTES[problem.dtype] % VECTOR_BYTES != 0


# -- the candidate -------------------------------------------------------------------
@dataclass(frozen=True)
class AlignedRowsKnobs(Knobs):
    threads: int = 256
    batch: int = 4


@register
class CrossEntropyAlignedRows(Candidate):
    name = "cross_entropy_aligned_rows"
    op = "cross_entropy"
    target_kind = "cuda"
    algorithm = ALGORITHM
    knobs = AlignedRowsKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyProblem) -> bool:
        """The shapes this kernel is for: rows off the 16-byte grid, long enough."""
        return problem.op == self.op and unaligned_rows(problem) and problem.classes >= MIN_CLASSES

    def prefers(self, problem: CrossEntropyProblem, target: Target) -> bool:
        # 16-bit rows of PREFERRED_CLASSES and more (its comment has the H200 A/B).
        return self.applies(problem) and problem.classes >= PREFERRED_CLASSES and DTYPE_BYTES[problem.dtype] == 2

    def choices(self, problem: CrossEntropyProblem, target: Target) -> dict[str, list[int]]:
        return {"threads": [128, 256, 512, 1024], "batch": [1, 2, 4, 8]}

    def default_for(self, problem: CrossEntropyProblem, target: Target) -> AlignedRowsKnobs:
        threads = max(128, ladder(problem.classes // granule(problem.dtype), THREADS_BY_VECTORS, MAX_THREADS))
        return AlignedRowsKnobs(threads=min(threads, DEFAULT_MAX_THREADS), batch=DEFAULT_BATCH)

    def schedule(self, sch, problem: CrossEntropyProblem, knobs) -> None:
        # 1. One block per row.
        epilogue = sch.get_sblock("loss" if problem.reduction == "none" else "row_loss")
        (row,) = sch.get_loops(epilogue)
        sch.bind(row, "blockIdx.x")
        # 2. The join of body and edges inlined into the row loss (so the row loss is
        #    the body's and the edges' only consumer).
        n_extra = (2 if problem.has_weight else 1) if problem.label_smoothing > 0.0 else 0
        for name in ["row_sumexp", "row_max"] + [f"row_extra{n}" for n in range(n_extra)]:
            sch.compute_inline(sch.get_sblock(name))
        # 3. The body granules across the lanes, each one 16-byte load into registers.
        sch.compute_at(sch.get_sblock("row_online"), row, preserve_unit_loops=True)
        aligned_granules(sch, problem, knobs.threads, knobs.batch)
        # 4. The row loss on thread 0, which reduces the head and the tail itself
        #    (consumers first).
        single_thread(sch, epilogue, knobs.threads)
        for name in ("edge_sumexp", "edge_max"):
            block = sch.get_sblock(name)
            sch.compute_at(block, row, preserve_unit_loops=True)
            outputs_to(sch, block, "local")
            unroll(sch, sch.get_loops(block)[-1], 64)
            # Under the guard: compute_at into the row loss's thread loop would run
            # the edges on every thread (the guard is the row loss's own predicate).
            single_thread(sch, block, knobs.threads)
        # 5. The batch kernel.
        schedule_ce_batch_stage(sch, problem, knobs.threads)


def aligned_granules(sch, problem: CrossEntropyProblem, threads, batch) -> None:
    """``online_chunks`` over the body granules, ``batch`` granules a lane a step.

    ``row_online``'s granule loop split ``[step, threadIdx.x, batch]`` as
    ``j = (step * batch + b) * threads + lane`` (consecutive lanes, consecutive
    granules: each warp load is 512 contiguous bytes), the batch loop unrolled; per
    granule one 16-byte load into registers and ``chunk_max`` / ``chunk_sumexp``
    there; the lanes' pairs combined into ``row_online`` in shared memory.

    The register stage is laid out by the 16-byte granules of the flat logits
    (``(i V + k) / c, (i V + k) mod c``): in the row's layout its origin is
    row-dependent, a dynamic register index that nvcc puts in local memory; in the
    granule layout its ``c`` values sit at constant indices."""
    online = sch.get_sblock("row_online")
    serial, lane = sch.split(sch.get_loops(online)[-1], [None, threads])
    sch.reorder(lane, serial)
    sch.bind(lane, "threadIdx.x")
    step, inner = sch.split(serial, [None, batch])
    sch.unroll(inner)
    outputs_to(sch, online, "shared")
    chunk_sum, chunk_max, stage = chunks_at(sch, inner)
    # The lanes' bound (a ragged split of the body) once per granule, not on each of
    # the 2c element steps: the chunk blocks wrapped in a block each (their loops
    # under ``inner``), which carries the predicate.
    depth = len(sch.get_loops(stage)) - 2  # the loops down to ``inner``
    for block in (chunk_max, chunk_sum):
        sch.blockize(sch.get_loops(block)[depth])
    c, classes = granule(problem.dtype), problem.classes
    sch.transform_layout(
        stage, ("write", 0),
        lambda i, k: (tirx.floordiv(i * classes + k, c), tirx.floormod(i * classes + k, c)),
        assume_injective_transform=True)
