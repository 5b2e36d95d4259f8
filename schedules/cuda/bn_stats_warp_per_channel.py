"""One warp per channel, several channels per block (many small planes).

Pattern ``x(SRR) -> (sum, sumsq)(S) -> mean, var`` on the ``(N, C, L)`` view, the
``shifted`` decomposition. For many channels with few values each (C >= 4 x SMs,
count <= 32 K), e.g. 256x2048x7x7: 2048 channels of 12544 values, where a block
per channel spends much of its time in block-wide barriers.

1. Channels are split ``[blockIdx.x, threadIdx.y]``: ``channels`` warps per block.
2. Each warp sweeps its channel's (n, l) values ``[32 lanes, serial, vector]``,
   x staged through registers (16-byte loads when ``vector`` divides L), and
   reduces across lanes with five ``__shfl_down_sync``: no shared memory, no
   block barrier.
3. Lane 0 writes mean and var.

Not used: a vector wider than L allows (a 7x7 plane is 98 bytes: 2-byte loads).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import BNStatsProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, register

from ..common import outputs_to, single_thread, thread_reduce
from .common import WARP, vector_choices, widest_vector

COUNT_MAX = 65536


@dataclass(frozen=True)
class WarpPerChannelKnobs(Knobs):
    channels: int = 4  # warps per block
    vector: int = 1
    unroll: int = 16


@register
class BNStatsWarpPerChannel(Candidate):
    name = "bn_stats_warp_per_channel"
    op = "bn_stats"
    target_kind = "cuda"
    algorithm = "shifted"
    knobs = WarpPerChannelKnobs
    claims = {"shuffles": True}

    def applies(self, problem: BNStatsProblem) -> bool:
        # A lane adds count / 32 values one after another in float32: past 64 K
        # values a channel the error reaches 1e-4 (64x256x56x56 on the H200).
        return problem.op == self.op and not problem.channels_last and problem.count <= COUNT_MAX

    def prefers(self, problem: BNStatsProblem, target: Target) -> bool:
        # 256x2048x7x7 fp16 on the H200 (2026-11-29, results/benchmarks.csv): 0.0335 ms
        # against 0.0236 for a block per channel, so it waits for a tuning record.
        return False

    def choices(self, problem: BNStatsProblem, target: Target) -> dict[str, list[int]]:
        return {
            "channels": [1, 2, 4, 8, 16],
            "vector": vector_choices(DTYPE_BYTES[problem.dtype], problem.shape[2]),
            "unroll": [1, 4, 16, 64],
        }

    def default_for(self, problem: BNStatsProblem, target: Target) -> WarpPerChannelKnobs:
        vector = widest_vector(problem.dtype, problem.shape[2])
        return WarpPerChannelKnobs(channels=4, vector=vector, unroll=16)

    def schedule(self, sch, problem: BNStatsProblem, knobs) -> None:
        # 1. Channels over (blockIdx.x, threadIdx.y).
        mean, var = sch.get_sblock("mean"), sch.get_sblock("var")
        channel = sch.merge(sch.get_loops(mean)[0], sch.get_loops(var)[0])
        block_channels, warp_channel = sch.split(channel, [None, knobs.channels])
        sch.bind(block_channels, "blockIdx.x")
        sch.bind(warp_channel, "threadIdx.y")
        # 2. One warp per channel.
        moments = sch.get_sblock("moments")
        sch.compute_at(moments, warp_channel, preserve_unit_loops=True)
        thread_reduce(sch, moments, 2, WARP, knobs.vector, knobs.unroll, "x")
        outputs_to(sch, moments, "local")
        # The shift K[c] in each lane's registers: a broadcast load per lane. Kept in
        # shared memory by lane 0, it raced the other lanes' reads (no __syncwarp
        # between; the H200 sweep: every mean off with channels=4, vector=1).
        shift = sch.get_sblock("shift")
        sch.compute_at(shift, warp_channel, preserve_unit_loops=True)
        sch.set_scope(shift, 0, "local")
        # 3. Lane 0 writes the statistics.
        single_thread(sch, mean, WARP)
        single_thread(sch, var, WARP)
