"""BatchNorm's training backward in thread-block clusters: a channel's parts of x and
dy on chip in the blocks of one cluster, both read once, no grid-wide barrier.

Pattern: ``bn_backward_grid_persistent``'s (``x, dy(SRR) -> parts on chip -> part (sum
dy, sum dy * xhat)(SS) | barrier | sums(S) -> coef(S) -> dx(SSS) from chip``, the
``dual_reduce_parts`` decomposition: parts of x and dy of at most 200 KB together), with
the barrier a cluster's: a block a (channel, part) task, a channel's P blocks one
cluster (``bn_forward_cluster`` says why). 64x256x56x56 fp16: P = 4, 1024 blocks.
Not yet run on a GPU: the tuner may pick it; dispatch does not prefer it until it is
measured.
"""

from __future__ import annotations

from tvm_fusion.registry import register

from .bn_backward_grid_persistent import BNBackwardGridPersistent
from .bn_forward_grid_persistent import ClusterParts


@register
class BNBackwardCluster(ClusterParts, BNBackwardGridPersistent):
    name = "bn_backward_cluster"
