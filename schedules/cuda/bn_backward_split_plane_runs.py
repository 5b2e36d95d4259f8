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

Why: ``bn_forward_split_plane_runs``' docstring. The prediction there, kernel 1's last
reads served from L2, missed; what the A/B of 2026-12-05 on the H200 found is in
:func:`~schedules.cuda.common.wider_step`: at a batch of 4 this map takes 40
registers (two inputs), and 256 lanes at a batch of 2 keep it at 32. Forward +
backward, each pair of one kind (rows "probe: split-plane maps A/B" of
results/benchmarks.csv), flat pair -> runs pair at ``wider_step``'s knobs:

| shape | flat | runs |
|---|---|---|
| 64x256x56x56 fp16 | 0.2159 ms | 0.2103 |
| 64x256x56x56 bf16 | 0.2189 | 0.2108 |
| 32x64x112x112 fp16 | 0.1132 | 0.1075 |
| 32x64x112x112 fp32 | 0.2103 | 0.2122 (256 lanes already; within the 1% noise) |
| 8x3x224x224 fp16 | 0.0155 | 0.0145 |

Preferred over ``bn_backward_split_plane`` where it applies (listed first in
``DISPATCH_ORDER``). On 64x256x56x56 fp16 the tuned record (``bn_backward`` at 512
lanes, 0.2024 ms with the forward) still wins, and dispatch keeps it.
"""

from __future__ import annotations

from tvm_fusion.registry import register

from .bn_backward_split_plane import BNBackwardSplitPlane
from .common import SplitPlaneRunsCandidate


@register
class BNBackwardSplitPlaneRuns(SplitPlaneRunsCandidate, BNBackwardSplitPlane):
    name = "bn_backward_split_plane_runs"
