"""``bn_forward_cluster_half`` in one launch: each channel's first block writes the
channel's outputs, no second kernel.

Pattern: ``bn_forward_cluster_half``'s (``x(SRR) -> part on chip -> part (sum,
sumsq)(SS) | cluster barrier | (sum, sumsq)(S) -> coef(S) -> y(SSS) from chip``), then,
in the same kernel, ``(sum, sumsq)(S) -> mean, invstd, running(S)`` by thread 0 of the
channel's part-0 block (the cluster's first), after its map
(``bn_forward_grid_persistent.outputs_in_tasks``). The other candidates of the family
launch a second kernel, a thread a channel, for ``save_mean``, ``save_invstd`` and the
running statistics.

Why: that second kernel waits for the whole first one, then reads the partials again:
on the H200 the split-plane forward's finalize kernel took 2.19 us of 82 on
64x256x56x56 fp16 (rows "probe: per-kernel time" of results/benchmarks.csv), plus its
launch under graph replay. Here only each channel's first block does more: after the
barrier its thread 0 already holds the channel's sums (nvcc keeps them: 40 registers
against 32, no spill, still three blocks' registers an SM), and reads the running
statistics and the momentum, one memory round trip, before it ends. The in-place
update of the running statistics keeps its contract: one thread reads, then writes,
each element. Predicted: 2-3% less than ``bn_forward_cluster_half`` (about 2 us of
0.0892 ms on the H100, 64x256x56x56 fp16).

Measured (H100, 2026-12-06T00:04Z, rows "probe: cluster rounds BatchNorm" of
results/benchmarks.csv, copy 3017 GB/s, default knobs, each forward and pair checked
against float64 on NaN-poisoned outputs first), ms under graph replay:

=====================  ==========  ============  =========  ================  =====================
shape                  one launch  cluster_half  grid-wide  dispatch then     fwd + grid-wide bwd:
                                                            (split plane)     one launch / half
=====================  ==========  ============  =========  ================  =====================
64x256x56x56 fp16      0.0881      0.0892        0.1003     0.1092 (record)   0.2440 / 0.2463
64x256x56x56 bf16      0.0898      0.0927        0.0989     0.0927 (half)     0.2585 / 0.2618
32x64x112x112 fp16     0.0502      0.0547        0.0527     0.0585 (record)   0.1301 / 0.1350
64x256x56x56 fp32      0.1690      0.1753        0.1817     0.1753 (half)     0.4762 / 0.4828
=====================  ==========  ============  =========  ================  =====================

1-8% less than ``cluster_half`` (the prediction was 2-3%), and on 32x64x112x112 (3.9
tasks an SM, where ``cluster_half`` lost to the grid-wide kernel) 5% less than the
grid-wide one. So it is the default ahead of ``cluster_half`` wherever an SM gets
``MIN_TASKS_AN_SM`` tasks (``prefers``), and the shipped split-plane records of the two
fp16 shapes (H200, 0.0822 and 0.0436 ms) were dropped: on the H100 this kernel took 19%
and 14% less time than that pick. It has no H200 number yet.

Not used: every block of the channel writing the outputs (the running statistics are
updated in place: a block could read a value another had already written); the outputs
right after the barrier, before the map (TVM's ``merge`` appends the outputs' loop
body after the map, and ``compute_at`` could place the blocks earlier only under a
consumer, which output blocks lack).
"""

from __future__ import annotations

from tvm_fusion.registry import register

from .bn_forward_cluster_half import BNForwardClusterHalf

MIN_TASKS_AN_SM = 3  # (channel, part) tasks: the table's 3.9 an SM won here, where cluster_half's lost


@register
class BNForwardClusterHalfOneLaunch(BNForwardClusterHalf):
    name = "bn_forward_cluster_half_one_launch"
    one_launch = True
    min_tasks_an_sm = MIN_TASKS_AN_SM
