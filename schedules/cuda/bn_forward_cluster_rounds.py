"""BatchNorm's training forward as a persistent kernel in thread-block clusters: a grid
of G blocks in clusters of P walks the (channel, part) tasks in rounds, a cluster
barrier a round, x read once.

Pattern: ``bn_forward_grid_persistent``'s (``x(SRR) -> part on chip -> part (sum,
sumsq)(SS) | barrier | (sum, sumsq)(S) -> coef(S) -> y(SSS) from chip``, rounds of G
tasks) on ``bn_forward_cluster_half``'s parts (``shifted_half_parts``: at most 100 KB,
two blocks an SM), with ``bn_forward_cluster``'s barrier: the P blocks of a channel are
one cluster and wait for each other only (``ClusterRounds``). 64x256x56x56 fp16: P = 4,
1024 tasks, by default G = 256 (64 clusters, two blocks on each of 128 SMs), 4 rounds.

Why: ``bn_forward_cluster_half`` launches 1024 blocks, a cluster of 4 at a time. Each
block's start and end cost (launch, the first loads' latency, the last stores), and
a cluster starts only when four blocks of one GPC are free at once, so slots idle
between clusters. Here each cluster starts once and walks its 4 channels back to back,
while the clusters go at their own pace (no grid-wide barrier: the reads of one overlap
the writes of another on the same SM). Predicted on the H100: 5-10% less than
``bn_forward_cluster_half`` (0.0892 ms at 448 lanes), if slot gaps are what it loses;
no gain if the loss is in the block's own phases. Written and CPU-tested, not yet run on
a GPU: tuner only, dispatch does not prefer it. ptxas keeps 64x256x56x56 fp32 at 448
lanes to 40 registers with 16 bytes of spills (its occupancy target: four blocks an SM,
though shared memory allows two); 896 lanes take 66 registers and none.
"""

from __future__ import annotations

from tvm_fusion.registry import register

from .bn_forward_grid_persistent import BNForwardGridPersistent, ClusterRounds


@register
class BNForwardClusterRounds(ClusterRounds, BNForwardGridPersistent):
    name = "bn_forward_cluster_rounds"
    algorithm = "shifted_half_parts"
    lane_share = 2
