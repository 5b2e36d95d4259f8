"""BatchNorm's backward on the channels-last view: partials, a finalize per channel, the map.

Pattern ``x, dy(RS) -> (sum dy, sum dy * xhat)[p, c](SS) -> (sum dy, sum dy * xhat)(S)
-> dbias, dweight, coef(S) -> dx(SS)``, the ``dual_reduce`` decomposition on the
``(M, C)`` view (NHWC, and every (N, C) input: BatchNorm1d). A row of x and dy is C
contiguous values: lanes on consecutive channels read and write 16 bytes each,
coalesced, and no lane needs another's value before the finalize.

Three kernels (TVM splits the function at its blockIdx bindings):
Kernel 1, grid (splits, channel groups), block (channel lanes, rows)
(``common.row_partials``, bn_stats_channels_last's kernel 1):
1. Rows dealt out ``m = ((s J + j) R + r) U + b``, the partial index ``p = (s, r)``
   rfactored out, the block's rows summed through shared memory, into a (splits, C)
   float32 workspace pair.
2. ``threadIdx.x`` owns ``vector`` consecutive channels: per row one 16-byte load of
   x and one of dy; ``dy`` and ``dy * (x - mean) * invstd`` summed in float32
   registers (mean and invstd loaded once per thread), the partials written once.
Kernel 2, grid (C,), ``FINALIZE_THREADS`` lanes (``common.channel_finalize``):
3. The channel's P partials summed across the lanes (shuffles, one shared hop);
   thread 0 writes the coefficients that read the sums (training: ``bn_dx_mean``,
   ``bn_dx_xhat``, a (C,) float32 workspace each), then ``dweight`` and ``dbias``:
   thread 0's blocks are the allreduce result's only readers.
Kernel 3, kernel 1's grid (``common.channels_last_map``):
4. Each thread computes ``bn_dx_scale`` (weight * invstd) for its channels in
   registers and loads the rest of its per-channel values once; per row one 16-byte
   load of x and dy (eval: dy only), ``dx`` in float32, one 16-byte store. In eval
   dx reads no sum, and the function (so the launch order) has it first.

Any M: below ``MIN_ROWS`` rows (BatchNorm1d on (2, C) or (3, C) in training, M = 1 in
eval) kernel 1 keeps one partial of all M rows (``ChannelsLastCandidate.choices``).

Not used: a block per channel walking its column (loads strided by C, what
bn_backward_block_per_channel would do on this view); keeping x and dy on chip
between the sums and the map (a block would own all M rows of its channel group:
C / (lanes * vector) blocks, too few for the SMs unless C is large; split over many
blocks with a grid barrier, all of x and dy would have to stay on chip at once: 206 MB
on 64x256x56x56 bf16, against 30 MB of shared memory).

On the H200 (results/benchmarks.csv, 2026-12-01 at 32f74c8), behind the channels-last
forward: forward + backward kernels 0.2995 ms on 64x256x56x56 bf16; not tuned yet.
"""

from __future__ import annotations

from tvm_fusion.contracts import BNBackwardProblem
from tvm_fusion.registry import register

from .common import ChannelsLastCandidate, channel_finalize, channels_last_map, row_partials


@register
class BNBackwardChannelsLast(ChannelsLastCandidate):
    name = "bn_backward_channels_last"
    op = "bn_backward"
    algorithm = "dual_reduce"

    def applies(self, problem: BNBackwardProblem) -> bool:
        return problem.op == self.op and problem.channels_last

    def schedule(self, sch, problem: BNBackwardProblem, knobs) -> None:
        # 1-2. Kernel 1: per-thread partials of the two sums.
        row_partials(sch, "grad_sums", knobs, ("x", "dy"))
        # 3. Kernel 2: the coefficients that read the sums, then dweight and dbias.
        from_sums = ["bn_dx_mean", "bn_dx_xhat"] if problem.training else []
        channel_finalize(sch, "grad_sums", [*from_sums, "dweight", "dbias"])
        # 4. Kernel 3: dx (eval's reads no x), bn_dx_scale in each thread's registers.
        channels_last_map(sch, "dx", knobs, ("x", "dy") if problem.training else ("dy",), computed=("bn_dx_scale",))
