"""Channels-last: lanes on consecutive channels, 16-byte loads, per-thread partials.

Pattern ``x(RS) -> (sum, sumsq)[p, c](SS) -> (sum, sumsq)(S) -> mean, var`` on
the ``(M, C)`` view (NHWC, (N, L, C), (N, C)), the ``shifted`` decomposition. For
every channels-last input: a row of x is C contiguous values, so a warp reading
one row with 16-byte loads is fully coalesced and no lane ever needs another's
value until the very end.

Kernel 1, grid (splits, channel groups), block (channel lanes, rows)
(``common.row_partials``, which also says why the partials are zeroed before the
row loop):
1. Rows are dealt out ``m = ((s J + j) R + r) U + b``: block ``s`` owns a run of rows,
   ``threadIdx.y = r`` takes every R-th batch of U consecutive rows (``unroll``,
   loaded together), so the R U rows of a step are contiguous.
   The partial index ``p = (s, r)`` is rfactored out (``moments_rf``, P x C float32
   pairs, partial-major: a lane's partials go out in 16-byte stores).
2. ``threadIdx.x`` owns ``vector`` consecutive channels (one 16-byte load per row,
   staged in registers) and accumulates ``d = x - K[c]`` and ``d^2`` in registers
   over its rows (``cache_write`` to ``local``), writing its partials once: with
   ``rows`` > 1 (and several blocks) to a shared tile, whose R rows one thread a
   channel sums into the block's partial (``common.rows_through_shared``), so the
   workspace holds ``splits`` partials a channel, not ``splits x rows``.
Kernel 2, grid (C,):
3. One block per channel sums its P partials across lanes (``__shfl_down_sync``)
   and thread 0 writes mean and var.

Not used: a cross-thread reduction over rows inside kernel 1 (rows sit on
``threadIdx.y``, so it would go through shared memory for every channel vector).
"""

from __future__ import annotations

from tvm_fusion.contracts import BNStatsProblem
from tvm_fusion.registry import register

from ..common import lanes_split, single_thread
from .common import FINALIZE_THREADS, MIN_ROWS, ChannelsLastCandidate, row_partials


@register
class BNStatsChannelsLast(ChannelsLastCandidate):
    name = "bn_stats_channels_last"
    op = "bn_stats"
    algorithm = "shifted"

    def applies(self, problem: BNStatsProblem) -> bool:
        # At least MIN_ROWS rows: two partials, each with a row loop of two steps
        # (see ``choices``); fewer rows go to bn_stats_block_per_channel.
        return problem.op == self.op and problem.channels_last and problem.shape[0] >= MIN_ROWS

    def schedule(self, sch, problem: BNStatsProblem, knobs) -> None:
        # 1-2. Kernel 1: per-thread partials, K[c] read apart from the staged rows.
        row_partials(sch, "moments", knobs, ("x",), inline=("shift",))
        # 3. Kernel 2: a block per channel sums its partials.
        mean, var = sch.get_sblock("mean"), sch.get_sblock("var")
        final = sch.merge(sch.get_loops(mean)[0], sch.get_loops(var)[0])
        sch.bind(final, "blockIdx.x")
        sch.compute_at(sch.get_sblock("moments"), final)
        lanes_split(sch, sch.get_sblock("moments"), 1, FINALIZE_THREADS, 1, 1)
        single_thread(sch, mean, FINALIZE_THREADS)
        single_thread(sch, var, FINALIZE_THREADS)
