"""BatchNorm's training backward as a persistent kernel in thread-block clusters: a grid
of G blocks in clusters of P walks the (channel, part) tasks in rounds, a cluster
barrier a round, x and dy read once.

Pattern: ``bn_backward_grid_persistent``'s (``x, dy(SRR) -> parts on chip -> part (sum
dy, sum dy * xhat)(SS) | barrier | sums(S) -> coef(S) -> dx(SSS) from chip``, rounds
of G tasks) on its ``dual_reduce_parts`` (x and dy parts of at most 200 KB together, one
block an SM), with the cluster barrier of ``bn_backward_cluster`` (``ClusterRounds``).
64x256x56x56 fp16: P = 4, 1024 tasks, by default G = 132 rounded down to 128 (32
clusters), 8 rounds.

Why: on the H100 the grid-wide backward (a grid barrier each round) beat the cluster one
(a block a task, no rounds) on every shape timed (``bn_backward_cluster``'s docstring),
so neither the rounds nor the grid barrier alone explains the backward's 65% of the
copy rate. This keeps the rounds and takes the grid barrier out: the clusters go at
their own pace, so one's reads overlap another's writes. Predicted: 5-10% less than the
grid-wide backward if the grid barrier's wait is what it loses. Written and CPU-tested,
not yet run on a GPU: tuner only, dispatch does not prefer it.
"""

from __future__ import annotations

from tvm_fusion.registry import register

from .bn_backward_grid_persistent import BNBackwardGridPersistent
from .bn_forward_grid_persistent import ClusterRounds


@register
class BNBackwardClusterRounds(ClusterRounds, BNBackwardGridPersistent):
    name = "bn_backward_cluster_rounds"
    tensors = 2  # x's and dy's parts
