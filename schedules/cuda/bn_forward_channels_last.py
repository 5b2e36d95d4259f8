"""BatchNorm's forward on the channels-last view: partials, a finalize per channel, the map.

Pattern ``x(RS) -> (sum, sumsq)[p, c](SS) -> (sum, sumsq)(S) -> mean, var -> invstd,
running, coef(S) -> y(SS)`` on the ``(M, C)`` view (NHWC, and every (N, C) input:
BatchNorm1d), the ``shifted`` statistics in training; ``running(S) -> coef -> y(SS)``
in eval. A row of x is C contiguous values: lanes on consecutive channels read and
write 16 bytes each, coalesced, and no lane needs another's value before the finalize.

Training, three kernels (TVM splits the function at its blockIdx bindings):
Kernel 1, grid (splits, channel groups), block (channel lanes, rows):
1. bn_stats_channels_last's partials (``common.row_partials``): rows dealt out
   ``m = ((s J + j) R + r) U + b``, the partial index ``p = (s, r)`` rfactored out, the
   block's rows summed through shared memory, into a (splits, C) float32 workspace;
   ``threadIdx.x`` owns ``vector`` consecutive channels (one 16-byte load of x a row)
   and sums ``d = x - K[c]``, ``d^2`` in registers.
Kernel 2, grid (C,), ``FINALIZE_THREADS`` lanes (``common.channel_finalize``):
2. The channel's P partials summed across the lanes (shuffles, one shared hop).
3. Thread 0: ``mean`` and ``var`` into shared memory, then ``bn_scale`` and
   ``bn_shift`` (a (C,) float32 workspace each, for kernel 3), ``save_mean``,
   ``save_invstd`` and the running statistics' update (each running value read,
   then written, by that one thread: the caller may pass the buffers as outputs).
Kernel 3, kernel 1's grid (``common.channels_last_map``):
4. Each thread loads its channels' ``bn_scale`` and ``bn_shift`` (and ``bias``, when
   the map reads it) into registers once; per row one 16-byte load of x, ``y`` in
   float32, one 16-byte store.

Eval, two kernels:
Kernel 1: kernel 3 above, the coefficients computed in each thread's registers from
the running statistics, weight and bias (no workspace).
Kernel 2, grid (ceil(C / FINALIZE_THREADS),): ``save_mean``, ``save_invstd``, a thread
a channel.

Any M: below ``MIN_ROWS`` rows (BatchNorm1d on (2, C) or (3, C)) training's kernel 1
keeps one partial of all M rows (``ChannelsLastCandidate.choices``); eval reduces
nothing and takes one row as well.

Not used: a block per channel walking its column (loads strided by C); one kernel
that keeps each channel group's rows on chip from the statistics to the map (a block
would own all M rows of its group, C / (lanes * vector) blocks: too few for the SMs
unless C is large; split over many blocks with a grid barrier, every row of every
group would have to stay on chip at once: 64x256x56x56 bf16 is 103 MB, the H200's
shared memory 30 MB, 132 SMs of 228 KB).

On the H200 (results/benchmarks.csv, 2026-12-01 at 32f74c8): 64x256x56x56 bf16 channels-last
0.1294 ms, 56% of the copy bandwidth for its three passes; not tuned yet.
"""

from __future__ import annotations

from tvm_fusion.compute.bn_forward import channel_outputs
from tvm_fusion.contracts import BNForwardProblem
from tvm_fusion.registry import register

from ..common import merge_rows
from .common import FINALIZE_THREADS, ChannelsLastCandidate, channel_finalize, channels_last_map, row_partials


@register
class BNForwardChannelsLast(ChannelsLastCandidate):
    name = "bn_forward_channels_last"
    op = "bn_forward"
    algorithm = "shifted"

    def applies(self, problem: BNForwardProblem) -> bool:
        return problem.op == self.op and problem.training and problem.channels_last

    def schedule(self, sch, problem: BNForwardProblem, knobs) -> None:
        # 1. Kernel 1: per-thread partials, K[c] read apart from the staged rows.
        row_partials(sch, "moments", knobs, ("x",), inline=("shift",))
        # 2-3. Kernel 2: the finalize, mean and var in shared memory.
        channel_finalize(sch, "moments", ["mean", "var", "bn_scale", "bn_shift", *channel_outputs(problem)])
        for name in ("mean", "var"):
            sch.set_scope(sch.get_sblock(name), 0, "shared")
        # 4. Kernel 3: the map, the coefficients from the workspace.
        channels_last_map(sch, "y", knobs, ("x",))


@register
class BNForwardEvalChannelsLast(ChannelsLastCandidate):
    name = "bn_forward_eval_channels_last"
    op = "bn_forward"
    algorithm = "running"
    claims = {"shuffles": False, "vector_loads": True}

    def applies(self, problem: BNForwardProblem) -> bool:
        return problem.op == self.op and not problem.training and problem.channels_last

    def schedule(self, sch, problem: BNForwardProblem, knobs) -> None:
        # Kernel 1: the map, each thread's coefficients in its registers.
        channels_last_map(sch, "y", knobs, ("x",), computed=("bn_shift", "bn_scale"))
        # Kernel 2: the per-channel outputs, a thread a channel.
        group, thread = sch.split(merge_rows(sch, channel_outputs(problem)), [None, FINALIZE_THREADS])
        sch.bind(group, "blockIdx.x")
        sch.bind(thread, "threadIdx.x")
