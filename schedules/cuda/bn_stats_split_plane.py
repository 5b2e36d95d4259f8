"""Each channel split across several blocks: partial sums, then a finalize kernel.

Pattern ``x(SRR) -> (sum, sumsq)[split, c](SS) -> (sum, sumsq)(S) -> mean, var``:
the ``shifted`` decomposition with the (n, l) reduction rfactored over ``splits``
blocks per channel. For few channels with large planes (C < 2 x SMs), e.g.
8x3x224x224 (3 channels: a block per channel would use 3 of 132 SMs) and
32x64x112x112 (64 channels).

Kernel 1, grid (C, splits): Stage 1 of Triton's layer-norm backward, here forward.
1. L is split by ``vector``, (n, l_outer) fused and cut into ``splits`` equal runs,
   the run index rfactored out (``moments_rf``, a (splits, C) pair of float32
   partials in global memory: the workspace).
2. Each block reduces its run ``[threadIdx.x, serial, batch, vector]``, x staged
   through registers with 16-byte loads (a batch of ``unroll`` of them issued
   together), ``d = x - K[c]`` accumulated in float32, then ``__shfl_down_sync`` and
   one shared-memory hop. The default knobs deal the run out evenly
   (``even_partials``): no bounds guard in the loop.
Kernel 2, grid (C,): Stage 2.
3. One block per channel sums the ``splits`` partials across its lanes (shuffles)
   and thread 0 writes mean and var. The shift K[c] = x[0, c, 0] is read where used.

Not used: atomicAdd of the partials into (sum, sumsq) (order-dependent results and a
zeroing pass); a single persistent kernel with a grid barrier (TVM 0.27 can launch one
cooperatively, bn_forward_grid_persistent; for the statistics alone it saves a launch, not
bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import BNStatsProblem
from tvm_fusion.registry import Candidate, Knobs, register

from ..common import lanes_split, single_thread
from .common import (FINALIZE_THREADS, PARTIAL_BATCHES, PARTIAL_THREADS, even_partials, lowers, plane_splits,
                     prefers_split_plane, split_plane_partials, widest_vector)


@dataclass(frozen=True)
class SplitPlaneKnobs(Knobs):
    splits: int = 8
    threads: int = 256
    vector: int = 8
    unroll: int = 4  # vectors a lane loads before it sums them


@register
class BNStatsSplitPlane(Candidate):
    name = "bn_stats_split_plane"
    op = "bn_stats"
    target_kind = "cuda"
    algorithm = "shifted"
    knobs = SplitPlaneKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: BNStatsProblem) -> bool:
        return problem.op == self.op and not problem.channels_last and bool(plane_splits(problem))

    def prefers(self, problem: BNStatsProblem, target: Target) -> bool:
        # Fewer channels than two an SM (SplitPlaneMapCandidate's rule): a block per
        # channel leaves SMs idle or lightly loaded. H200 bench of 2026-11-29
        # (results/benchmarks.csv): 32x64x112x112 fp16 0.0166 ms against 0.0317 for a
        # block per channel; 8x3x224x224 0.0045 against 0.0303. 64x256x56x56 (256
        # channels) took 0.0400 against 0.0350 with a guarded kernel 1, and 0.0280
        # against 0.0349 once its run was dealt out evenly (even_partials, A/B of
        # 2026-12-02).
        return prefers_split_plane(problem, target)

    def choices(self, problem: BNStatsProblem, target: Target) -> dict[str, list[int]]:
        return {
            "splits": plane_splits(problem),
            "threads": list(PARTIAL_THREADS),
            "vector": [widest_vector(problem.dtype, problem.shape[2])],
            "unroll": list(PARTIAL_BATCHES),
        }

    def builds(self, problem: BNStatsProblem, knobs) -> bool:
        return lowers(problem, knobs)

    def default_for(self, problem: BNStatsProblem, target: Target) -> SplitPlaneKnobs:
        splits, threads, batch = even_partials(problem, target)
        return SplitPlaneKnobs(splits=splits, threads=threads, vector=widest_vector(problem.dtype, problem.shape[2]),
                               unroll=batch)

    def schedule(self, sch, problem: BNStatsProblem, knobs) -> None:
        # 1-2. Kernel 1: (n, l / vector) cut into `splits` runs, the run index
        # rfactored out, a block per (channel, run).
        split_plane_partials(sch, "moments", ("x",), knobs)
        moments = sch.get_sblock("moments")
        # 3. Kernel 2: a block per channel sums the partials and writes mean, var.
        mean, var = sch.get_sblock("mean"), sch.get_sblock("var")
        final = sch.merge(sch.get_loops(mean)[0], sch.get_loops(var)[0])
        sch.bind(final, "blockIdx.x")
        sch.compute_at(moments, final)  # no unit loop left below the partials' loop
        lanes_split(sch, moments, 1, FINALIZE_THREADS, 1, 1)
        sch.compute_inline(sch.get_sblock("shift"))
        single_thread(sch, mean, FINALIZE_THREADS)
        single_thread(sch, var, FINALIZE_THREADS)
