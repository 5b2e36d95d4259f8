"""BatchNorm's training forward in thread-block clusters of parts of half the bytes: up
to two blocks an SM, x read once.

Pattern: ``bn_forward_cluster``'s (``x(SRR) -> part on chip -> part (sum, sumsq)(SS) |
cluster barrier | (sum, sumsq)(S) -> coef(S) -> y(SSS) from chip``) on the
``shifted_half_parts`` decomposition: parts of at most 100 KB, so P twice
``bn_forward_cluster``'s (64x256x56x56 fp16: P = 4, 1024 blocks; fp32: P = 8). Default
lanes half of its (448 on that shape: ``ClusterParts.lane_share``), the same bytes a lane.

Why: ``bn_forward_cluster`` (P = 2, 200 KB a block, one block an SM) missed its
prediction (about 0.075 ms on an H100 for 64x256x56x56 fp16): 0.0959 ms against the
grid-wide kernel's 0.1017 (results/benchmarks.csv, rows "probe: cluster BatchNorm
against grid-wide and dispatch", 2026-12-05). With one block an SM, each SM reads its
part, waits for its cluster and then writes, and a block's start and end (its reduction
and barrier) leave the memory system idle; smaller blocks let a second block of the SM,
or the next one, read while one reduces or writes. Predicted: about 10% less. The
same build as the pipelined kernels' (``compute.ASYNC_ROUNDS``), without the pipeline.

Measured (H100, 2026-12-05T18:48Z, rows "probe: cluster BatchNorm, smaller parts", copy
3039 GB/s, each kernel checked against float64 on poisoned outputs first; the probe
registered this schedule under the name ``probe_bn_forward_cluster_half``), ms, 448 and
896 lanes against ``bn_forward_grid_persistent``'s default in the same run:

=====================  ======  ======  =========  ======================================
shape                  448     896     grid-wide  forward + backward (448, grid-wide bwd)
=====================  ======  ======  =========  ======================================
64x256x56x56 fp16      0.0892  0.0878  0.0996     0.2443 against 0.2555 (grid-wide pair)
64x256x56x56 bf16      0.0921  0.0911  0.0982     0.2588 against 0.2643
32x64x112x112 fp16     0.0547  0.0521  0.0525     0.1337 against 0.1329
64x256x56x56 fp32      0.1736  0.2140  0.1809     0.4753 against 0.4824
=====================  ======  ======  =========  ======================================

So 4-10% less where a channel has four tasks an SM or more, and 4% more on
32x64x112x112 (512 tasks, 3.9 an SM) at 448 lanes: preferred where the grid-wide
kernel is and each SM gets at least ``MIN_TASKS_AN_SM`` tasks (``prefers``). Still 1.3x
the forward's floor on the H100 (0.0892 ms against 0.0676); what the rest is, a profiler
would have to say (no profiler on the host). Since 2026-12-06 dispatch takes
``bn_forward_cluster_half_one_launch`` ahead of it (faster on all four shapes above).
"""

from __future__ import annotations

from tvm.target import Target

from tvm_fusion.compute.bn_stats import parts
from tvm_fusion.registry import register
from tvm_fusion.targets import sm_count

from .bn_forward_cluster import BNForwardCluster
from .bn_forward_grid_persistent import fills_the_sms

MIN_TASKS_AN_SM = 4  # (channel, part) tasks; the table above: 7.8 and 15.5 won, 3.9 lost


@register
class BNForwardClusterHalf(BNForwardCluster):
    name = "bn_forward_cluster_half"
    algorithm = "shifted_half_parts"
    lane_share = 2

    min_tasks_an_sm = MIN_TASKS_AN_SM

    def prefers(self, problem, target: Target) -> bool:
        tasks = problem.channels * parts(problem, self.copies)
        return (not self.unsupported(target) and self.applies(problem) and fills_the_sms(problem, target, self.copies)
                and tasks >= self.min_tasks_an_sm * sm_count(target))
