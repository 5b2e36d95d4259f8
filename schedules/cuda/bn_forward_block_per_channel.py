"""BatchNorm's forward, one thread block per channel, in one kernel.

Pattern ``x(SRR) -> (sum, sumsq)(S) -> mean, var -> invstd, running, coef(S) ->
y(SSS)`` on the ``(N, C, L)`` view: the ``shifted`` statistics in training
(exact when |mean| >> std), the running ones in eval.

1. The output loops (``y``'s channel loop, reordered channel first, then
   ``save_mean``, ``save_invstd`` and the running statistics) are merged into one
   channel loop bound to ``blockIdx.x``.
2. Training: the shift ``K[c] = x[0, c, 0]`` goes to shared memory (thread 0);
   ``moments`` fuses (n, l) and splits it ``[threadIdx.x, serial, vector]``, 16-byte
   loads, float32 sums of ``d`` and ``d^2``, ``__shfl_down_sync`` plus one shared hop.
3. Thread 0 turns the sums into ``mean`` and ``var`` in shared memory (so the
   allreduce result's last readers are thread 0's: a block every thread ran there
   would race StorageRewrite's reuse of it, cross_entropy_grad's ``row_order``
   lesson); after the barrier every thread computes the map's coefficients.
4. ``y`` over the channel's planes: the same split, 16-byte loads and stores.
5. Thread 0 writes the per-channel outputs.

On the H200 (results/benchmarks.csv, 2026-12-01 at 32f74c8): 64x256x56x56 fp16 0.0977 ms
(split plane 0.0900), 32x64x112x112 0.0726 (split plane 0.0447), 256x2048x7x7 0.0737
(persistent 0.0600); the gpu suite checks it against float64.
"""

from __future__ import annotations

from tvm_fusion.compute.bn_forward import channel_outputs
from tvm_fusion.contracts import BNForwardProblem
from tvm_fusion.registry import register

from ..common import merge_rows, outputs_to, single_thread
from .common import ChannelBlockCandidate, plane_map, shifted_sums


class _ForwardBlockPerChannel(ChannelBlockCandidate):
    op = "bn_forward"

    def schedule(self, sch, problem: BNForwardProblem, knobs) -> None:
        # 1. One channel loop for the outputs, y's loops channel first.
        y = sch.get_sblock("y")
        n, c, plane = sch.get_loops(y)
        sch.reorder(c, n, plane)
        for name in ("bn_shift", "bn_scale"):
            sch.compute_at(sch.get_sblock(name), c, preserve_unit_loops=True)
        channel = merge_rows(sch, ["y", *channel_outputs(problem)])
        sch.bind(channel, "blockIdx.x")
        if problem.training:
            # 3. mean and var by thread 0 into shared memory.
            for name in ("var", "mean"):
                block = sch.get_sblock(name)
                sch.compute_at(block, channel, preserve_unit_loops=True)
                sch.set_scope(block, 0, "shared")
                single_thread(sch, block, knobs.threads)
            # 2. The shifted sums across the block.
            shifted_sums(sch, channel, knobs.threads, knobs.vector, knobs.unroll)
        # 3. The coefficients in every thread's registers.
        for name in ("bn_shift", "bn_scale"):
            outputs_to(sch, sch.get_sblock(name), "local")
        # 4. y over the channel's planes.
        plane_map(sch, sch.get_sblock("y"), knobs, ("x",))
        # 5. The per-channel outputs on thread 0.
        for name in channel_outputs(problem):
            single_thread(sch, sch.get_sblock(name), knobs.threads)


@register
class BNForwardBlockPerChannel(_ForwardBlockPerChannel):
    name = "bn_forward_block_per_channel"
    algorithm = "shifted"

    def applies(self, problem: BNForwardProblem) -> bool:
        return problem.op == self.op and problem.training and not problem.channels_last


@register
class BNForwardEvalBlockPerChannel(_ForwardBlockPerChannel):
    name = "bn_forward_eval_block_per_channel"
    algorithm = "running"

    def applies(self, problem: BNForwardProblem) -> bool:
        return problem.op == self.op and not problem.training and not problem.channels_last
