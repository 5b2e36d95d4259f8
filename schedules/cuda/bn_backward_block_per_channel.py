"""BatchNorm's backward, one thread block per channel, in one kernel.

Pattern ``x, dy(SRR) -> (sum dy, sum dy * xhat)(S) -> dbias, dweight, coef(S) ->
dx(SSS)``, the ``dual_reduce`` decomposition on the ``(N, C, L)`` view.

1. The output loops (``dx``'s channel loop, reordered channel first, then ``dbias``
   and ``dweight``) are merged into one channel loop bound to ``blockIdx.x``.
2. ``grad_sums`` fuses (n, l) and splits it ``[threadIdx.x, serial, vector]``:
   lanes read consecutive vectors of x and dy (``vector`` divides L: no vector
   crosses a plane), accumulate ``dy`` and ``dy * xhat`` in float32; the
   cross-thread step is ``__shfl_down_sync`` plus one shared-memory hop, and both
   sums stay in every thread's registers.
3. Every thread computes the channel's coefficients in registers from the sums.
4. ``dx``: the channel's planes again, the same split, 16-byte loads of x and dy
   and a 16-byte store per step (the second read comes from L2 when the channel's
   values fit there next to the other blocks').
5. Thread 0 writes ``dbias`` and ``dweight``, the sums' last readers.

Not scheduled for the channels-last view (M, C): its reads would stride by C.

The fallback of its op on the (N, C, L) view (split plane first where it is preferred);
the gpu suite checks it against float64, and it has not been timed alone.
"""

from __future__ import annotations

from tvm_fusion.compute.bn_backward import dx_coefficients
from tvm_fusion.contracts import BNBackwardProblem
from tvm_fusion.registry import register

from ..common import lanes_split, merge_rows, outputs_to, single_thread, stage_in_registers
from .common import ChannelBlockCandidate, plane_map


@register
class BNBackwardBlockPerChannel(ChannelBlockCandidate):
    name = "bn_backward_block_per_channel"
    op = "bn_backward"
    algorithm = "dual_reduce"

    def applies(self, problem: BNBackwardProblem) -> bool:
        return problem.op == self.op and not problem.channels_last

    def schedule(self, sch, problem: BNBackwardProblem, knobs) -> None:
        # 1. One channel loop for the outputs, dx's loops channel first.
        dx = sch.get_sblock("dx")
        n, c, plane = sch.get_loops(dx)
        sch.reorder(c, n, plane)
        for name in dx_coefficients(problem):
            sch.compute_at(sch.get_sblock(name), c, preserve_unit_loops=True)
        # dx first: thread 0's outputs are the sums' last readers (the coefficients
        # would race StorageRewrite's reuse of the allreduce result: row_order's lesson)
        channel = merge_rows(sch, ["dx", "dbias", "dweight"])
        sch.bind(channel, "blockIdx.x")
        # 2. The dual reduction across the block, x and dy through registers.
        sums = sch.get_sblock("grad_sums")
        sch.compute_at(sums, channel, preserve_unit_loops=True)
        _, serial, _ = lanes_split(sch, sums, 1, knobs.threads, knobs.vector, knobs.unroll)
        for name in ("x", "dy"):
            stage_in_registers(sch, sums, name, serial)
        outputs_to(sch, sums, "local")
        # 3. The coefficients in every thread's registers; 5. the outputs on thread 0.
        for name in dx_coefficients(problem):
            outputs_to(sch, sch.get_sblock(name), "local")
        for name in ("dbias", "dweight"):
            single_thread(sch, sch.get_sblock(name), knobs.threads)
        # 4. dx over the channel's planes (eval's dx reads no x).
        plane_map(sch, sch.get_sblock("dx"), knobs, ("x", "dy") if problem.training else ("dy",))
