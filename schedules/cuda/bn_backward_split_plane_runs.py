"""BatchNorm's backward, each channel split across several blocks, the dx map laid out
as the partial dual sums and walked backwards.

Pattern and kernels 1-2 are ``bn_backward_split_plane``'s (``x, dy(SRR) -> (sum dy,
sum dy * xhat)[split, c](SS) -> (sum dy, sum dy * xhat)(S) -> dbias, dweight, coef(S)
-> dx(SSS)``, the ``dual_reduce`` decomposition). Kernel 3, the map ``dx``, takes
kernel 1's grid and runs (``schedules.cuda.common.run_map``): a block per (channel,
run) in kernel 1's launch order, each run ``[threadIdx.x, serial, batch, vector]`` as
kernel 1 read it, the grid and the serial loop from their ends; x and dy (dy alone in
eval) in 16-byte loads, dx in 16-byte stores, the channel's coefficients read once a
lane. Knobs: kernel 1's, which the map shares.

Why, and the prediction: ``bn_forward_split_plane_runs``' docstring. Kernel 1 reads two
tensors here, so half as much of each is left in L2; on 32x64x112x112 fp16 (two 51 MB
tensors, 14 splits of 128 lanes: 896 blocks, one wave) about 25 MB of the map's 103 MB
of reads would come from L2, some 10% of the backward's 257 MB of HBM traffic. Not
preferred over ``bn_backward_split_plane`` until an H200 A/B says so; the tuner times it.
"""

from __future__ import annotations

from tvm_fusion.registry import register

from .bn_backward_split_plane import BNBackwardSplitPlane
from .common import SplitPlaneRunsCandidate


@register
class BNBackwardSplitPlaneRuns(SplitPlaneRunsCandidate, BNBackwardSplitPlane):
    name = "bn_backward_split_plane_runs"
