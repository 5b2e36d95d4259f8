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
0.0892 ms on the H100, 64x256x56x56 fp16). Not yet run on a GPU: tuner-only until an
A/B against ``bn_forward_cluster_half``.

Not used: every block of the channel writing the outputs (the running statistics are
updated in place: a block could read a value another had already written); the outputs
right after the barrier, before the map (TVM's ``merge`` appends the outputs' loop
body after the map, and ``compute_at`` could place the blocks earlier only under a
consumer, which output blocks lack).
"""

from __future__ import annotations

from tvm.target import Target

from tvm_fusion.registry import register

from .bn_forward_cluster_half import BNForwardClusterHalf


@register
class BNForwardClusterHalfOneLaunch(BNForwardClusterHalf):
    name = "bn_forward_cluster_half_one_launch"
    one_launch = True

    def prefers(self, problem, target: Target) -> bool:
        return False
