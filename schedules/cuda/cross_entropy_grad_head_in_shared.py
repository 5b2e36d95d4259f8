"""Cross entropy and its gradient for rows too long for shared memory, the row's head kept there.

Pattern ``t(R) -> denom, first_bad | x -> head(SS) -> (max, sum exp)(S) -> lse, row_loss,
coef(S) -> dlogits(SS) | row_loss(R) -> loss``, the ``fused_head`` decomposition: the
first H values of each row (``compute.cross_entropy_grad.head_length``: 192 KB, 98304
values in fp16/bf16) are copied into dynamic shared memory, and the statistics and the
gradient read them from there, the rest of the row (the tail) from the logits.

Kernel 1, one block: the targets pass. Kernel 2, grid (B,), one block of ``threads``
lanes a row (one an SM: the copy takes 192 KB of the SM's 228):
1. Every per-row block shares one row loop (``merge_grad_rows``) bound to ``blockIdx.x``.
2. The head is copied in, ``[threadIdx.x, serial, batch, vector]``: 16-byte global loads,
   16-byte shared stores.
3. ``row_online`` over the row's 16-byte chunks as ``cross_entropy_grad_online``'s
   (``online_chunks``): each chunk staged into registers (``row_src``) from the copy below
   H and from the logits after; the build's loop partition splits the chunk loop at H,
   so each part loads one source with no test (``compute.PARTITION_LIKELY``).
4. ``dlogits`` ``[threadIdx.x, serial, batch, vector]``: each vector staged into registers
   (``map_src``) from the copy or the logits, split the same way; the gradient in float32;
   16-byte stores.
5. Thread 0 writes ``lse`` and the row loss (``row_order``).
Kernel 3, one block: the loss.

Why: ``cross_entropy_grad_online`` reads a long row twice, the statistics pass and the
gradient pass, and the second read comes back from HBM where the rows in flight do not
fit the L2: 8192x128256 bf16 took 1.4396 ms at its best default-kind knobs and 1.4228 at
32 rows a block (H200, 2026-12-05, rows "probe: online gradient rows and batch knobs" of
results/benchmarks.csv), 1.43x the 0.9919 ms floor of one read and one write (H200 row of
2026-12-04T18:42Z). Here the head is
read from HBM once; only the tail (29952 of 128256 values) is read twice.

Predicted: 8192x128256 bf16 moves 2.10 GB read, 0.49 GB re-read (the tail) and 2.10 GB
written, 4.69 GB against the online candidate's 6.30, about 1.1 ms on the H200 against
1.4228 (0.77x). Measured on an H100 (2026-12-05, rows "probe:
cross_entropy_grad_head_in_shared against cross_entropy_grad_online's best knobs" of
results/benchmarks.csv, copy 3001 GB/s, forward + backward under graph replay, the
online candidate's best knobs in the same run): 8192x128256 bf16 1.5142 ms against
2.3017 (0.66x; dispatch's record 2.4468), 2048x151936 bf16 0.5434 against 0.6253,
4096x256000 bf16 2.1621 against 2.4266, 8192x65536 fp16 0.7418 against 1.0023,
4096x50000 fp32 0.6512 against 0.7966. Batch 4 is the best of 1, 2 and 4 (1.7442 and
1.7469 at 1 and 2), 512 lanes lose (1.8628), unroll 4 and 16 tie (1.5130, 1.5142).
8192x128256 is then 2.10 GB x 2 / 3001 GB/s = 1.40 ms of floor: 1.08x. So it is the
default wherever it applies below ``cross_entropy_grad_row_in_cluster``'s rows (more
than 240 KiB). The shipped record of 8192x128256 bf16 named it from a 16-trial re-tune on
the H100 (2026-12-05) until an H200 tune (2026-12-06, tuning_logs/README.md) picked
row_in_cluster there.

Not used: the head copied by the statistics' own chunk loads (TensorIR's ``compute_at``
needs every consumer of a staged block under the loop, and the map reads the copy after
it); the row split in the schedule (``loop_partition`` leaves a loop that starts at H,
which ``split`` refuses), hence the ``likely`` test and the build's partition.

Applies to the fused gradient, 16-byte rows (V a multiple of a 16-byte chunk's values)
over ``ROW_BYTES_MAX`` (shorter rows fit whole: ``cross_entropy_grad_row_in_shared``)
and over one ``HEAD_GRAIN``. It has no ``prefers``, so where it applies it is the
heuristic's pick too (it comes before ``cross_entropy_grad_online`` in dispatch order).

In place (``inplace_backward``, the gradient over the logits) as well since ee99dad:
the row's reads all come before the statistics' block-wide barriers, and after them
each lane re-reads (from the copy or the logits) exactly the vectors it then
overwrites, so no lane reads what another has written. Dispatch reapplies the
out-of-place record there (``dispatch._stand_ins``). H100, 2026-12-06 (rows "probe:
in-place fused gradient, head_in_shared in place" of results/benchmarks.csv, graph
replay): 8192x128256 bf16 in place 1.7712 ms at batch 4 (1.8031 at 2) against
``cross_entropy_grad_online``'s 1.9328 at its best in-place knobs, 1.6189 out of place;
4096x151936 bf16 1.0952 against 1.1787, 1.1362 out of place. The 9% in place loses on
8192x128256 is likely the tail: without ``__restrict__`` nvcc keeps each tail load
behind the previous vector's store (the row kernel's PTX alternates ``ld.global.v4``
and ``st.global.v4`` there; out of place the tail's ``ld.global.nc.v4`` are hoisted
above the stores), so a lane's tail vectors are no longer in flight together. Not
yet timed apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion import async_copy
from tvm_fusion.compute.cross_entropy_grad import HEAD_GRAIN, head_length
from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, register

from ..common import coefficients_at, lanes_split, row_loss_name, single_thread
from .common import (
    grad_map, merge_grad_rows, online_chunks, reads_16_bytes, schedule_grad_batch_stage, schedule_grad_prologue,
    widest_vector,
)
from .cross_entropy_row_in_shared import ROW_BYTES_MAX


@dataclass(frozen=True)
class HeadInSharedKnobs(Knobs):
    threads: int = 1024
    vector: int = 8  # values a 16-byte vector holds (fixed by the dtype)
    unroll: int = 16
    batch: int = 4  # vectors a lane loads a step, in the copy, the statistics and the map


@register
class CrossEntropyGradHeadInShared(Candidate):
    name = "cross_entropy_grad_head_in_shared"
    op = "cross_entropy_grad"
    target_kind = "cuda"
    algorithm = "fused_head"
    knobs = HeadInSharedKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyGradProblem) -> bool:
        return (problem.op == self.op and problem.mode == "fused"
                and reads_16_bytes(problem.dtype, problem.classes)
                and problem.classes * DTYPE_BYTES[problem.dtype] > ROW_BYTES_MAX and problem.classes > HEAD_GRAIN)

    def choices(self, problem: CrossEntropyGradProblem, target: Target) -> dict[str, list[int]]:
        # threads x vector x batch divides HEAD_GRAIN for all of these, so the head is
        # a whole number of steps and the loop partition splits at a step.
        return {"threads": [256, 512, 1024], "vector": [widest_vector(problem.dtype, problem.classes)],
                "unroll": [1, 4, 16], "batch": [1, 2, 4]}

    def default_for(self, problem: CrossEntropyGradProblem, target: Target) -> HeadInSharedKnobs:
        return HeadInSharedKnobs(vector=widest_vector(problem.dtype, problem.classes))

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        threads, vector, step, batch = knobs.threads, knobs.vector, knobs.unroll, knobs.batch
        # Kernel 1: the targets pass.
        schedule_grad_prologue(sch, problem)
        dlogits_row = sch.get_loops(sch.get_sblock("dlogits"))[0]
        coefficients_at(sch, problem, dlogits_row, "local")
        # Each row's blocks laid out under their own row loops first: the staged sources
        # (row_src, map_src) must be under their readers before the row loops merge, or
        # the merge leaves them behind their readers (TVM's merge checks no dependence).
        # 2. The head into shared memory, 16 bytes a lane a load.
        copy = sch.get_sblock("row_head")
        sch.set_scope(copy, 0, "shared.dyn")
        _, serial, vec = lanes_split(sch, copy, 1, threads, vector, step, batch=batch)
        sch.vectorize(vec)
        async_copy.mark(sch, serial)  # cp.async (tvm_fusion.async_copy)
        # 3. The statistics over 16-byte chunks, each staged from the copy or the logits.
        online_chunks(sch, threads, step, "local", batch, source="row_src")
        # 4. The gradient, each vector staged from the copy or the logits, stored whole.
        grad_map(sch, 1, threads, vector, step, batch=batch, source="map_src")
        # 1. One row loop, one block per row: the copy, the statistics, the gradient.
        row = merge_grad_rows(sch, problem, ("row_head", "row_online"))
        sch.bind(row, "blockIdx.x")
        # 5. lse and the row loss on thread 0.
        for name in ("lse", row_loss_name(problem)):
            single_thread(sch, sch.get_sblock(name), threads)
        # Kernel 3: the loss.
        schedule_grad_batch_stage(sch, problem, threads)


__all__ = ["CrossEntropyGradHeadInShared", "HeadInSharedKnobs", "head_length"]
