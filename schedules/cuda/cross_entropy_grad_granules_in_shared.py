"""Cross entropy and its gradient for rows off the 16-byte grid: the row's window in shared
memory, the gradient stored a 16-byte granule at a time.

Pattern ``t(R) -> denom, first_bad | x -> window(SSS) -> max(S) -> exp, sum(S) -> lse,
row_loss, coef(S) -> dlogits by granules(SSS) | row_loss(R) -> loss``, the
``fused_granules`` decomposition: ``cross_entropy_grad_window_in_shared``'s window (the
row's 16-byte granules of the *flat* logits, each one aligned load, copied into dynamic
shared memory) and statistics, with the map laid out as the window: lane ``t`` of step
``s`` takes window granule ``s threads + t``, one 16-byte shared load, computes its c
gradients in float32 and stores them into granule ``floor(iV / c) + g`` of the flat
gradient with one 16-byte store (:mod:`tvm_fusion.granule_stores` turns the map's
store into that one, under the test that the granule lies inside the row; the edge
granules, the first and the last one or two, store the row's own elements one at a
time).

Kernel 1, one block: the targets pass. Kernel 2, grid (B,):
1. Every per-row block shares one row loop bound to ``blockIdx.x``.
2. The window into shared memory, a 16-byte load and store per granule.
3. ``row_max`` then ``row_sumexp`` over the window, 16 bytes at a time; the elements
   outside the row masked, but the test is granule-wise first and ``likely``, so the
   build's loop partition leaves the steps whose granules all lie inside the row
   unmasked (on 16384x50257 at 512 threads, 11 of 13); the sum reads the max from a
   register (``sum_shift``), not from the allreduce's shared result; both statistics
   in every thread's registers.
4. ``dlogits_granules``: the map by granules as above.
5. Thread 0 writes ``lse`` and the row loss.
Kernel 3, one block: the loss.

Why: the window candidate reads the logits once, but its map takes one element a lane
a step (index arithmetic, a 2-byte shared load and a 2-byte store an element) and it
was bound by issue, about 35 instructions an element over its three sweeps
(``cross_entropy_grad_window_in_shared``'s docstring: 16384x50257 bf16 1.5282 ms on
the H200 against 1.4152 for the online candidate). By granules the map is a 16-byte
load, c exps and one 16-byte store per c elements, a third of the instructions.

Measured (H100, 2026-12-06T13:20Z, rows "probe: granules_in_shared A/B" of
results/benchmarks.csv, copy 3015 GB/s; each kernel checked against float64 autograd on
poisoned outputs, then timed under graph replay), ms, against the floor of one read and
one write of the logits:

| shape | online (dispatch's pick before) | window | granules, 512 threads | 256 | 1024 |
|---|---|---|---|---|---|
| 16384x50257 bf16 | 1.3543 | 1.5725 | 1.2573 (1.15x) | 1.2541 | 1.4674 |
| 3000x50257 fp16 | 0.3198 | 0.3031 | 0.2404 (1.20x) | 0.2404 | 0.2540 |
| 2048x32001 bf16 | 0.1654 | 0.1235 | 0.1029 (1.18x) | 0.1043 | 0.1457 |
| 8192x50257 fp16, smoothing 0.1 | 0.7867 | 0.8733 | 0.6386 (1.17x) | 0.6349 | 0.8278 |
| 4096x20001 fp32 (block per row before) | 0.3313 | 0.2332 | 0.2292 (1.05x) | 0.2420 | 0.2343 |

The statistics still sweep the window twice and the map once (shared memory, not HBM),
and the edges' elements go one at a time; 16-bit rows stay at 1.15-1.20x their floor.
At 1024 threads it is slower (the last column); that was not examined further.

Applies where the window candidate does (rows off the 16-byte grid, ``B V`` a
multiple of a granule, the window within ``ROW_BYTES_MAX``), not in place; dispatch's
default there once the batch fills the GPU with two rows an SM (``prefers``), ahead
of the online candidate.
"""

from __future__ import annotations

from tvm.target import Target

from tvm_fusion.compute.cross_entropy_grad import GRANULES, GRANULES_ALGORITHM
from tvm_fusion.compute.primitives import granule
from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.registry import register
from tvm_fusion.targets import sm_count

from ..common import coefficients_at, merge_rows, outputs_to, row_loss_name, single_thread
from .common import MAX_THREADS, grad_map, schedule_grad_batch_stage, schedule_grad_prologue
from .cross_entropy_grad_window_in_shared import CrossEntropyGradWindowInShared, window_and_statistics

ALGORITHM = GRANULES_ALGORITHM


@register
class CrossEntropyGradGranulesInShared(CrossEntropyGradWindowInShared):
    name = "cross_entropy_grad_granules_in_shared"
    algorithm = ALGORITHM

    def prefers(self, problem: CrossEntropyGradProblem, target: Target) -> bool:
        # Faster than the online and window candidates on all five shapes timed (the
        # docstring's table), each a batch of two rows an SM and more.
        return self.applies(problem) and problem.batch >= 2 * sm_count(target)

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        # Kernel 1: the targets pass.
        schedule_grad_prologue(sch, problem)
        granules = sch.get_sblock(GRANULES)
        coefficients_at(sch, problem, sch.get_loops(granules)[0], "local")
        # 1. One row loop, one block per row.
        loss = row_loss_name(problem)
        row = merge_rows(sch, ["window", "row_max", "sum_shift", "row_sumexp", GRANULES, "lse", loss])
        sch.bind(row, "blockIdx.x")
        # 2-3. The window into shared memory, both statistics over it (the window
        # candidate's), the max the sum reads in every thread's registers.
        staged = window_and_statistics(sch, problem, knobs)
        outputs_to(sch, sch.get_sblock("sum_shift"), "local")
        # 4. The gradient by granules: a 16-byte shared load, a 16-byte store.
        grad_map(sch, 1, knobs.threads, granule(problem.dtype), knobs.unroll, staged=staged, block=granules)
        # 5. lse and the row loss on thread 0.
        for name in ("lse", loss):
            single_thread(sch, sch.get_sblock(name), knobs.threads)
        # The gather into dlogits, which the build drops (granule_stores): bound like
        # any map, so that a build without that step still runs it.
        gather = sch.get_sblock("dlogits")
        outer, lane = sch.split(sch.fuse(*sch.get_loops(gather)), [None, MAX_THREADS])
        sch.bind(outer, "blockIdx.x")
        sch.bind(lane, "threadIdx.x")
        # Kernel 3: the loss.
        schedule_grad_batch_stage(sch, problem, knobs.threads)
