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

Prediction (not yet measured on a GPU): the map's reads hit L2 until its own writes
have evicted what kernel 1 left, about half of the L2's 60 MiB, so some 25-30 MB of
the 103 MB re-read of 64x256x56x56 fp16 comes from L2: 308 MB of HBM traffic down to
about 280, the forward 0.0815 ms down to about 0.075 (the issue's 1.5x floor is
0.0735). Not preferred over ``bn_forward_split_plane`` (listed after it in
``DISPATCH_ORDER``) until an H200 A/B says so; the tuner times it.
"""

from __future__ import annotations

from tvm_fusion.registry import register

from .bn_forward_split_plane import BNForwardSplitPlane
from .common import SplitPlaneRunsCandidate


@register
class BNForwardSplitPlaneRuns(SplitPlaneRunsCandidate, BNForwardSplitPlane):
    name = "bn_forward_split_plane_runs"
