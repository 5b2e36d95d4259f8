"""One thread block per channel over the channel's 16-byte granules padded to 1024 lanes.

Pattern ``x(SRR) -> (sum, sumsq)(S) -> mean, var`` on the ``(N, C, L)`` view, the
``padded_shifted`` decomposition: ``bn_stats_block_per_channel``'s kernel on a
reduction domain that splits evenly over any block.

Why (read before it was written): ``bn_stats_block_per_channel`` on 16x512x28x28
bf16 (its default, 128 threads) runs a channel's 1568 granules in 13 steps, the last
partial, and TVM guards every step with that bound; nvcc turns each guard into a
branch around the step's 16-byte load and its arithmetic, so a lane has one load in
flight. The held-out grid's best kernel for that shape took 0.00695 ms, 44% of the
copy bandwidth on 13 MB: latency, not bandwidth. Here the channel's granules are
padded to 2048 (the last real one read again for the pads, which a select zeroes),
so no step has a guard and an unrolled lane's loads can issue together. Read in the
SASS (nvcc 13, sm_90, default knobs: 256 threads, 8 steps): eight LDG.E.128 a lane
and no branch among them, issued in two groups (three before the shift's barrier,
the rest after); 32 registers, no spills. The granule's plane and offset cost an
integer division by G a load (a multiply-high: G is a constant).

1. One block per channel, anchored at the epilogue; the shift ``K[c] = x[0, c, 0]``
   once into shared memory.
2. ``moments`` over the padded granules, split ``[threadIdx.x, serial, granule]``,
   the ``granules`` map inlined into the register stage (a clamped 16-byte load); the
   cross-thread step is ``__shfl_down_sync`` plus a shared-memory hop.
3. Thread 0 writes mean and var.

Dispatch prefers it wherever it applies and ``bn_stats_block_per_channel`` would be
picked, and also over ``bn_stats_split_plane`` where the channels fill the SMs
(``SM_FILL``) and a lane has at most ``PREFERRED_STEPS`` granules at 1024 threads. The
H200 A/B grid at fc88131 (results/benchmarks.csv, "padded A/B grid", 6 configurations
a candidate, kernels under graph replay), best configuration of each candidate and
dispatch's pick before:

| shape | padded | block per channel | split plane | pick before |
|---|---|---|---|---|
| 16x512x28x28 bf16 | 0.00545 ms | 0.00616 | 0.01045 | 0.00917 (block, 128 threads) |
| 64x128x28x28 fp16 | 0.00555 | 0.00713 | 0.00764 | 0.00764 (split) |
| 24x192x20x20 fp32 | 0.00397 | 0.00431 | 0.00675 | 0.01141 (block, 128 threads) |
| 32x64x112x112 fp16 | 0.01979 | 0.01978 | 0.01657 | 0.01657 (split) |

The 0.004-0.005 ms predicted for 16x512x28x28 bf16 was near: 0.00545, 55% of copy.
On 32x64x112x112 half the SMs have no channel, and the split wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.compute.bn_stats import padded_granules
from tvm_fusion.compute.primitives import granule
from tvm_fusion.contracts import BNStatsProblem
from tvm_fusion.registry import Candidate, Knobs, register
from tvm_fusion.targets import sm_count

from ..common import single_thread
from .common import MAX_THREADS, prefers_split_plane, shifted_sums

MAX_STEPS = 64  # padded granules a lane at the most (more: bn_stats_split_plane's planes)
# Over bn_stats_split_plane: channels for at least this share of the SMs (128 of the
# H200's 132 won, 64 lost), and at most PREFERRED_STEPS granules a lane at 1024 threads.
SM_FILL = 0.9
PREFERRED_STEPS = 8


@dataclass(frozen=True)
class PaddedBlockPerChannelKnobs(Knobs):
    threads: int = 256
    unroll: int = 256  # TVM's auto-unroll steps: 256 unrolls a lane's steps of up to 8 granules x 8 values


@register
class BNStatsBlockPerChannelPadded(Candidate):
    name = "bn_stats_block_per_channel_padded"
    op = "bn_stats"
    target_kind = "cuda"
    algorithm = "padded_shifted"
    knobs = PaddedBlockPerChannelKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: BNStatsProblem) -> bool:
        if problem.op != self.op or problem.channels_last:
            return False
        return (problem.shape[2] % granule(problem.dtype) == 0
                and padded_granules(problem)[2] <= MAX_THREADS * MAX_STEPS)

    def prefers(self, problem: BNStatsProblem, target: Target) -> bool:
        if not self.applies(problem):
            return False
        if not prefers_split_plane(problem, target):
            return True  # block_per_channel's shapes: the same kernel without its guards
        return (problem.channels >= SM_FILL * sm_count(target)
                and padded_granules(problem)[2] <= MAX_THREADS * PREFERRED_STEPS)

    def choices(self, problem: BNStatsProblem, target: Target) -> dict[str, list[int]]:
        return {"threads": [128, 256, 512, 1024], "unroll": [1, 16, 64, 256]}

    def default_for(self, problem: BNStatsProblem, target: Target) -> PaddedBlockPerChannelKnobs:
        # The most threads (a power of two, so they divide the padding) that leave a lane
        # 8 granules or more: loads in flight, and few pads' work per lane.
        padded = padded_granules(problem)[2]
        threads = max([128] + [t for t in (256, 512, 1024) if padded // t >= 8])
        return PaddedBlockPerChannelKnobs(threads=threads, unroll=256)

    def schedule(self, sch, problem: BNStatsProblem, knobs) -> None:
        # 1. One block per channel, anchored at the epilogue.
        mean, var = sch.get_sblock("mean"), sch.get_sblock("var")
        channel = sch.merge(sch.get_loops(mean)[0], sch.get_loops(var)[0])
        sch.bind(channel, "blockIdx.x")
        # 2. The dual reduction across the block over the padded granules.
        shifted_sums(sch, channel, knobs.threads, padded_granules(problem)[0], knobs.unroll, "granules")
        sch.compute_inline(sch.get_sblock("granules"))
        # 3. The epilogue on one thread.
        single_thread(sch, mean, knobs.threads)
        single_thread(sch, var, knobs.threads)

