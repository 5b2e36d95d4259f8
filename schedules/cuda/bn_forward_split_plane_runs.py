"""BatchNorm's forward (training), each channel split across several blocks, the map
laid out as the partial sums and walked backwards.

Pattern and kernels 1-2 are ``bn_forward_split_plane``'s (``x(SRR) -> (sum,
sumsq)[split, c](SS) -> (sum, sumsq)(S) -> mean, var -> invstd, running, coef(S) ->
y(SSS)``, the ``shifted`` decomposition). Kernel 3, the map ``y``, takes kernel 1's
grid and runs instead of the flat walk over the tensor (``schedules.cuda.common.run_map``):
1. a block per (channel, run), channels fastest as in kernel 1, the grid from its end;
2. each run ``[threadIdx.x, serial, batch, vector]`` as kernel 1 reads it (16-byte
   loads of x and stores of y, a lane's ``unroll`` vectors issued together), the serial
   loop from its end;
3. the channel's coefficients ``bn_shift``, ``bn_scale`` (and ``bias``) read once a
   lane: the channel is the block's.
Knobs: kernel 1's, which the map shares (:class:`~schedules.cuda.common.SplitPlaneRunsKnobs`).

Why: a re-read that starts where the first pass ended finds it in L2 only if the
first pass ended there. ``bn_forward_split_plane``'s flat map, started from the
tensor's end (``launch_order``), gained 0.9% on 64x256x56x56 fp16 (0.0822 -> 0.0815 ms,
H200, 2026-12-05, rows "probe: launch_order A/B" of results/benchmarks.csv) where the
channels-last map, whose first pass does end at the tensor's end, gained 6-8%.
Kernel 1 there is one wave: 7 splits of 128 lanes is 1792 blocks, 16 an SM, every
block walking its run for the whole kernel, so its last reads are the last part of
every run, spread over the tensor. Walked as kernel 1 walked, backwards, the map
reads those first.

Predicted (2026-12-05): the map's reads hit L2 until its own writes have evicted what
kernel 1 left, about half of the L2's 60 MiB, the forward 0.0815 ms down to about 0.075.
Measured the same day on the H200 (rows "probe: split-plane maps A/B" of
results/benchmarks.csv, each kernel checked against float64 first), forward alone, flat
map -> runs (:func:`~schedules.cuda.common.wider_step`'s knobs):

| shape | flat | runs |
|---|---|---|
| 64x256x56x56 fp16 | 0.0820 ms | 0.0812 |
| 64x256x56x56 bf16 | 0.0821 | 0.0816 |
| 32x64x112x112 fp16 | 0.0449 | 0.0434 |
| 32x64x112x112 fp32 | 0.0821 | 0.0814 |
| 8x3x224x224 fp16 | 0.0078 | 0.0073 |

So the prediction missed on 64x256x56x56: 1%, not 8%. What kernel 1 leaves in L2 is
not read back from it, or not enough to show; without a profiler on the GPU host the L2
hit rate stayed unmeasured. The gain is where the grid is less than a wave (3% on
32x64x112x112, 6% on 8x3x224x224): there the map's block owns a channel, and its
coefficients are read once a lane, not once a vector. Preferred over
``bn_forward_split_plane`` where it applies (listed first in ``DISPATCH_ORDER``); the
backward gains more (``bn_backward_split_plane_runs``).
"""

from __future__ import annotations

from tvm_fusion.registry import register

from .bn_forward_split_plane import BNForwardSplitPlane
from .common import SplitPlaneRunsCandidate


@register
class BNForwardSplitPlaneRuns(SplitPlaneRunsCandidate, BNForwardSplitPlane):
    name = "bn_forward_split_plane_runs"
