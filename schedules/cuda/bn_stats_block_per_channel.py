"""One thread block per channel, shifted sums reduced across the block.

Pattern ``x(SRR) -> (sum, sumsq)(S) -> mean, var`` on the ``(N, C, L)`` view, the
``shifted`` decomposition (exact when |mean| >> std). For many channels with
planes of moderate size (C >= number of SMs), e.g. 256x2048x7x7.

1. The channel loop of ``mean`` is the anchor, bound to ``blockIdx.x``; the
   shift ``K[c] = x[0, c, 0]`` is loaded once into shared memory.
2. ``moments`` fuses (n, l) and splits it ``[threadIdx.x, serial, vector]``:
   lanes read consecutive vectors of a plane (``vector`` divides L, so no vector
   crosses a plane), accumulate ``d`` and ``d^2`` with ``d = x - K`` in float32;
   the cross-thread step is ``__shfl_down_sync`` plus a shared-memory hop.
3. Thread 0 writes mean and var.

Also correct for the channels-last view ``(M, C)`` (reads stride by C, slow):
the fallback when no channels-last candidate applies.

Not used: one warp per channel (too few loads in flight per SM for big planes);
Welford updates (a division per element; shifted sums are as exact here).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import BNStatsProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, ladder, register

from ..common import single_thread
from .common import MAX_THREADS, THREADS_BY_COUNT, shifted_sums, vector_choices, widest_vector


@dataclass(frozen=True)
class BlockPerChannelKnobs(Knobs):
    threads: int = 256
    vector: int = 8
    unroll: int = 16


@register
class BNStatsBlockPerChannel(Candidate):
    name = "bn_stats_block_per_channel"
    op = "bn_stats"
    target_kind = "cuda"
    algorithm = "shifted"
    knobs = BlockPerChannelKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def _contiguous(self, problem: BNStatsProblem) -> int:
        return 1 if problem.channels_last else problem.shape[2]

    def choices(self, problem: BNStatsProblem, target: Target) -> dict[str, list[int]]:
        return {
            "threads": [64, 128, 256, 512, 1024],
            "vector": vector_choices(DTYPE_BYTES[problem.dtype], self._contiguous(problem)),
            "unroll": [1, 4, 16, 64],
        }

    def default_for(self, problem: BNStatsProblem, target: Target) -> BlockPerChannelKnobs:
        vector = widest_vector(problem.dtype, self._contiguous(problem))
        threads = ladder(problem.count // vector, THREADS_BY_COUNT, MAX_THREADS)
        return BlockPerChannelKnobs(threads=threads, vector=vector, unroll=16)

    def schedule(self, sch, problem: BNStatsProblem, knobs) -> None:
        # 1. One block per channel, anchored at the epilogue.
        mean, var = sch.get_sblock("mean"), sch.get_sblock("var")
        channel = sch.merge(sch.get_loops(mean)[0], sch.get_loops(var)[0])
        sch.bind(channel, "blockIdx.x")
        # 2. The dual reduction across the block, the shift in shared memory.
        shifted_sums(sch, channel, knobs.threads, knobs.vector, knobs.unroll)
        # 3. The epilogue on one thread.
        single_thread(sch, mean, knobs.threads)
        single_thread(sch, var, knobs.threads)
