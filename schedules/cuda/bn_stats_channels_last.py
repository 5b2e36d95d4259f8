"""Channels-last: lanes on consecutive channels, 16-byte loads, per-thread partials.

Pattern ``x(RS) -> (sum, sumsq)[p, c](SS) -> (sum, sumsq)(S) -> mean, var`` on
the ``(M, C)`` view (NHWC, (N, L, C), (N, C)), the ``shifted`` decomposition. For
every channels-last input: a row of x is C contiguous values, so a warp reading
one row with 16-byte loads is fully coalesced and no lane ever needs another's
value until the very end.

Kernel 1, grid (splits, channel groups), block (channel lanes, rows):
1. Rows are dealt out ``m = (s J + j) R + r``: block ``s`` owns a run of rows,
   ``threadIdx.y = r`` takes every R-th, so the R rows in flight are contiguous.
   The partial index ``p = (s, r)`` is rfactored out (``moments_rf``, C x P float32
   pairs, channel-major so kernel 2 reads each channel's partials contiguously).
2. ``threadIdx.x`` owns ``vector`` consecutive channels (one 16-byte load per row,
   staged in registers) and accumulates ``d = x - K[c]`` and ``d^2`` in registers
   over its rows (``cache_write`` to ``local``), writing its partials once.
   The accumulators are zeroed before the row loop (``decompose_reduction``), not
   under its bounds predicate: when ``splits * rows`` outruns the rows, the last
   blocks own no row at all, and an init that only ran with the first valid row
   left their registers unset. Their garbage partials made the variance of
   100352x64 fp16 (splits=528, rows=16) reach 3e31 on the H200.
Kernel 2, grid (C,):
3. One block per channel sums its P partials across lanes (``__shfl_down_sync``)
   and thread 0 writes mean and var.

Not used: a cross-thread reduction over rows inside kernel 1 (rows sit on
``threadIdx.y``, so it would go through shared memory for every channel vector).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import BNStatsProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, register
from tvm_fusion.targets import sm_count

from ..common import lanes_split, read_index, single_thread, unroll
from .common import BLOCKS_PER_SM, FINALIZE_THREADS, vector_choices, widest_vector


MIN_ROWS = 4  # two partials of two rows each: the smallest shape the schedule keeps whole


@dataclass(frozen=True)
class ChannelsLastKnobs(Knobs):
    splits: int = 132  # blocks along M (the default comes from the target's SMs)
    rows: int = 4  # threadIdx.y
    channel_lanes: int = 32  # threadIdx.x: channel vectors per block
    vector: int = 8
    unroll: int = 4


@register
class BNStatsChannelsLast(Candidate):
    name = "bn_stats_channels_last"
    op = "bn_stats"
    target_kind = "cuda"
    algorithm = "shifted"
    knobs = ChannelsLastKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: BNStatsProblem) -> bool:
        # At least MIN_ROWS rows: two partials, each with a row loop of two steps
        # (see ``choices``); fewer rows go to bn_stats_block_per_channel.
        return problem.op == self.op and problem.channels_last and problem.shape[0] >= MIN_ROWS

    def choices(self, problem: BNStatsProblem, target: Target) -> dict[str, list[int]]:
        vectors = vector_choices(DTYPE_BYTES[problem.dtype], problem.channels)
        # Every (splits, rows) pair leaves each lane at least two steps of rows
        # (splits * rows * 2 <= M). With one step the row loop vanishes, TVM hoists
        # the row guard over the write-back too, and the partials of lanes past the
        # last row are never written: the finalize kernel then read stale workspace
        # (the H200 sweep: (M, C) = (8, 32) fp16 gave means off by 2.95 from the
        # second call on, correct on the first).
        rows = [r for r in (1, 2, 4, 8, 16) if r * 2 <= problem.shape[0]]
        sms = sm_count(target)
        splits = [s for s in (sms // 4, sms // 2, sms, 2 * sms, 4 * sms)  # 33 .. 528 on 132 SMs
                  if s * max(rows) * 2 <= problem.shape[0]]
        if not splits:  # few rows: fewer blocks, and two partials at least (one block)
            splits = [max(1, problem.shape[0] // (2 * max(rows)))]
            rows = [r for r in rows if r * splits[0] >= 2]
        return {
            "splits": splits,
            "rows": rows,
            "channel_lanes": [8, 16, 32, 64, 128, 256],
            "vector": vectors,
            "unroll": [1, 2, 4, 8],
        }

    def default_for(self, problem: BNStatsProblem, target: Target) -> ChannelsLastKnobs:
        vector = widest_vector(problem.dtype, problem.channels)
        lanes = 1
        while lanes * vector < problem.channels and lanes < 256:
            lanes *= 2
        rows = max(1, min(16, 256 // lanes, problem.shape[0] // 2))  # two steps at least
        groups = -(-problem.channels // (lanes * vector))
        splits = max(1, min(BLOCKS_PER_SM * sm_count(target) // groups, problem.shape[0] // (rows * 8) or 1))
        if splits * rows < 2:  # wide rows (256 lanes x 1 row): two blocks, two partials
            splits = 2
        return ChannelsLastKnobs(splits=splits, rows=rows, channel_lanes=lanes, vector=vector, unroll=4)

    def schedule(self, sch, problem: BNStatsProblem, knobs) -> None:
        moments = sch.get_sblock("moments")
        stage = sch.cache_read(moments, read_index(sch, moments, "x"), "local", consumer_blocks=[moments])
        sch.compute_inline(sch.get_sblock("shift"))  # after the stage: K[c] is read apart
        # 1. Rows dealt out to (block s, lane r); p = (s, r) rfactored out.
        channel, row = sch.get_loops(moments)
        run, step, lane_row = sch.split(row, [knobs.splits, None, knobs.rows])
        sch.reorder(channel, run, lane_row, step)
        partial = sch.rfactor(sch.fuse(run, lane_row), factor_axis=1)
        write_backs = [sch.cache_write(partial, index, "local") for index in range(2)]
        channel, p, step = sch.get_loops(partial)
        run, lane_row = sch.split(p, [knobs.splits, knobs.rows])
        group, lane, vec = sch.split(channel, [None, knobs.channel_lanes, knobs.vector])
        sch.reorder(run, group, lane_row, lane, step, vec)
        sch.bind(run, "blockIdx.x")
        sch.bind(group, "blockIdx.y")
        sch.bind(lane_row, "threadIdx.y")
        sch.bind(lane, "threadIdx.x")
        # 2. Accumulate in registers, 16-byte loads of `vector` channels a row. The
        # arithmetic stays scalar: TVM's CUDA codegen has no float32x8 type.
        for write_back in write_backs:
            sch.reverse_compute_at(write_back, lane)
        sch.compute_at(stage, step, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(stage)[-1])
        unroll(sch, step, knobs.unroll)
        sch.decompose_reduction(partial, step)  # zero every partial, rows or not
        # 3. Kernel 2: a block per channel sums its partials.
        mean, var = sch.get_sblock("mean"), sch.get_sblock("var")
        final = sch.merge(sch.get_loops(mean)[0], sch.get_loops(var)[0])
        sch.bind(final, "blockIdx.x")
        sch.compute_at(moments, final)
        lanes_split(sch, moments, 1, FINALIZE_THREADS, 1, 1)
        single_thread(sch, mean, FINALIZE_THREADS)
        single_thread(sch, var, FINALIZE_THREADS)
