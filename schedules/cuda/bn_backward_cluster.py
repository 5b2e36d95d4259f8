"""BatchNorm's training backward in thread-block clusters: a channel's parts of x and
dy on chip in the blocks of one cluster, both read once, no grid-wide barrier.

Pattern: ``bn_backward_grid_persistent``'s (``x, dy(SRR) -> parts on chip -> part (sum
dy, sum dy * xhat)(SS) | barrier | sums(S) -> coef(S) -> dx(SSS) from chip``, the
``dual_reduce_parts`` decomposition: parts of x and dy of at most 200 KB together), with
the barrier a cluster's: a block a (channel, part) task, a channel's P blocks one
cluster (``bn_forward_cluster`` says why). 64x256x56x56 fp16: P = 4, 1024 blocks.
Measured (H100, 2026-12-05, rows "probe: cluster BatchNorm ..." of
results/benchmarks.csv, each pair checked against float64 first), forward + backward
with ``bn_forward_cluster``, ms, this backward against ``bn_backward_grid_persistent``:
64x256x56x56 fp16 0.2628 against 0.2522, bf16 0.2732 against 0.2675, fp32 0.4952
against 0.4878, 32x64x112x112 fp16 0.1505 against 0.1400: slower on every shape, and so
was a probe of it with parts of half the bytes (P = 8) at 224 lanes (fp16 0.2756 against
0.2493); at 448 lanes that probe came within 0.5% (0.2504). The tuner may pick it;
dispatch does not prefer it.
"""

from __future__ import annotations

from tvm_fusion.registry import register

from .bn_backward_grid_persistent import BNBackwardGridPersistent
from .bn_forward_grid_persistent import ClusterParts


@register
class BNBackwardCluster(ClusterParts, BNBackwardGridPersistent):
    name = "bn_backward_cluster"
