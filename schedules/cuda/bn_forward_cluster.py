"""BatchNorm's training forward in thread-block clusters: a channel's parts on chip in
the blocks of one cluster, x read once, no grid-wide barrier.

Pattern: ``bn_forward_grid_persistent``'s (``x(SRR) -> part on chip -> part (sum,
sumsq)(SS) | barrier | (sum, sumsq)(S) -> coef(S) -> y(SSS) from chip``, the
``shifted_parts`` decomposition: parts of at most 200 KB along N), with the barrier a
cluster's instead of the grid's. A block a (channel, part) task: it copies its part into
dynamic shared memory, writes the part's two sums, waits at a cluster barrier (Hopper's
``barrier.cluster``, :mod:`tvm_fusion.grid_barrier`) for the other P - 1 blocks of its
channel, which are its cluster, adds up the P partials and writes y from the copy. A
second kernel writes the per-channel outputs, as the grid-wide candidate's does.

Why: the grid-wide kernel's rounds pay a fixed cost each, which the H100 numbers put at
3.5-4.5 us a round (``bn_forward_grid_pipelined``'s docstring): every block waits for
the slowest block of the grid at every round. Here a block waits for its channel's
other P - 1 blocks only, once; blocks start and end at their own times, so while some
SMs read their parts others write theirs, and no cooperative launch limits the grid to
one wave. The cost: a tail wave (64x256x56x56 fp16: P = 2, 512 blocks of 200 KB, one an
SM, 3.9 waves over 132 SMs). Predicted there: near the copy rate, about 0.075 ms on an
H100 against 0.1004 for the grid-wide kernel.

Measured (H100, 2026-12-05T18:29Z, rows "probe: cluster BatchNorm against grid-wide and
dispatch" of results/benchmarks.csv, copy 3015 GB/s, each kernel checked against float64
on poisoned outputs first), ms, against ``bn_forward_grid_persistent`` in the same run:
64x256x56x56 fp16 0.0959 against 0.1017, bf16 0.0979 against 0.0993, fp32 0.1801 against
0.1815, 32x64x112x112 fp16 0.0598 against 0.0532. **The prediction missed**: 6% less at
best, 12% more on 32x64x112x112 (P = 4, 256 blocks of 200 KB: under two waves). Smaller
parts did better (``bn_forward_cluster_half``, ``bn_forward_cluster_quarter``). The
tuner may pick it; dispatch does not prefer it.
"""

from __future__ import annotations

from tvm_fusion.registry import register

from .bn_forward_grid_persistent import BNForwardGridPersistent, ClusterParts


@register
class BNForwardCluster(ClusterParts, BNForwardGridPersistent):
    name = "bn_forward_cluster"
