"""BatchNorm's training backward as one grid-wide persistent kernel: x and dy read once.

Pattern ``x, dy(SRR) -> parts on chip -> part (sum dy, sum dy * xhat)(SS) | grid
barrier | sums(S) -> coef(S) -> dx(SSS) from chip`` on the ``(N, C, L)`` view, the
``dual_reduce_parts`` decomposition; then ``sums(S) -> dweight, dbias(S)``. The
forward's ``bn_forward_grid_persistent`` with two tensors kept: each channel is cut
into P parts along N (``bn_stats.parts`` for x and dy together: at most 200 KB for
both), a (channel, part) pair is a task, and a grid of G blocks walks the tasks in
rounds of G, one block an SM. In each round a block copies its part of x and of dy
into dynamic shared memory, sums ``dy`` and ``dy * xhat`` over the copies across its
lanes and writes the part's two sums, waits at the grid barrier
(:mod:`tvm_fusion.grid_barrier`, a cooperative launch), adds up its channel's P
partials and computes dx's coefficients in every thread's registers, then writes dx
from the copies. A second kernel, a thread a channel, adds the partials up again for
``dweight`` and ``dbias``.

Bytes: x and dy read once, dx written once: 3 of the input's size, against 5 for the
two-read backward (``bn_backward_block_per_channel``). Predicted: forward + backward
with ``bn_forward_grid_persistent`` on 64x256x56x56 fp16 about 0.14 ms against 0.2024
on the H200 (30% less). Measured on an H100 (2026-12-05, rows "probe: grid-wide
persistent BatchNorm" of results/benchmarks.csv, copy 3009 GB/s, against dispatch's
pair in the same run), forward + backward, both grid-wide: 64x256x56x56 fp16 0.2608
ms against 0.2794, bf16 0.2684 against 0.2877, 32x64x112x112 fp16 0.1344 against
0.1506, 64x256x56x56 fp32 0.4899 against 0.5644: 7-13% less, not 30%; 0.2608 ms is
1.53x the floor of five input sizes there. The forward's reason applies (read and
write phases). The default wherever its grid fills the SMs (``prefers``).
"""

from __future__ import annotations

from tvm_fusion.compute.bn_stats import parts
from tvm_fusion.contracts import BNBackwardProblem
from tvm_fusion.registry import register

from ..common import read_index
from .bn_forward_grid_persistent import (
    GridPersistentCandidate, after_barrier, copy_in, map_from, outputs_kernel, reduce_from, task_rounds,
)


@register
class BNBackwardGridPersistent(GridPersistentCandidate):
    name = "bn_backward_grid_persistent"
    op = "bn_backward"
    algorithm = "dual_reduce_parts"  # x's and dy's parts on chip

    def schedule(self, sch, problem: BNBackwardProblem, knobs) -> None:
        count = parts(problem, self.copies)
        partial, dx = sch.get_sblock("part_grad_sums"), sch.get_sblock("dx")
        # The parts' copies in shared memory, for both readers (placed below).
        copies = [sch.cache_read(partial, read_index(sch, partial, name), "shared.dyn", consumer_blocks=[partial, dx])
                  for name in ("x", "dy")]
        on_chip = [sch.get(copy).writes[0].source.name for copy in copies]
        round_loop = task_rounds(sch, partial, dx, count, self.grid(knobs))
        # The map's coefficients after the barrier, every thread in its registers.
        depth = self.depth(knobs)
        after_barrier(sch, round_loop, ("bn_dx_xhat", "bn_dx_mean", "grad_sums_map", "bn_dx_scale"), "grad_sums_map",
                      depth, self.cluster(problem))
        # The channel's mean and invstd in registers once a round, for the sums and dx.
        for name in ("mean", "invstd"):
            stat = sch.cache_read(partial, read_index(sch, partial, name), "local", consumer_blocks=[partial, dx])
            sch.compute_at(stat, round_loop, preserve_unit_loops=True)
        for copy in copies:
            copy_in(sch, copy, round_loop, knobs, depth, self.asynchronous_copies)
        reduce_from(sch, partial, on_chip, knobs, depth)
        map_from(sch, dx, on_chip, knobs, depth)
        # The second kernel: dweight and dbias, a thread a channel.
        outputs_kernel(sch, ["dweight", "dbias"], ("grad_sums",))
