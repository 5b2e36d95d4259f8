"""BatchNorm's training backward as one grid-wide persistent kernel with pipelined
rounds: the next round's parts of x and dy copied in (``cp.async``) while this round's
are reduced, wait at the grid barrier and are mapped.

Pattern: ``bn_backward_grid_persistent``'s (``x, dy(SRR) -> parts on chip -> part (sum
dy, sum dy * xhat)(SS) | grid barrier | sums(S) -> coef(S) -> dx(SSS) from chip``) on
the ``dual_reduce_half_parts`` decomposition: parts of x and dy of at most 100 KB
together, so that two rounds' fit a block's shared memory. Round r of a block: round
r + 1's parts copied into the other half of shared memory (``cp.async``), then wait for
round r's, its partial sums, the grid barrier, dx's coefficients and dx from the
copies; :mod:`tvm_fusion.async_rounds` pipelines the round loop.

Why: ``bn_backward_grid_persistent``'s rounds are a read phase, then a reduction and a
barrier, then a write phase. The cost: twice the rounds and barriers (16 on
64x256x56x56 fp16, P = 8 and G = 128), and 448 lanes there (the whole warps that split
a 50 KB part).

Measured (H100, 2026-12-05T16:51Z, rows "probe: pipelined grid-wide BatchNorm" of
results/benchmarks.csv), forward + backward, ms: ``bn_forward_grid_persistent`` with
this candidate against with ``bn_backward_grid_persistent``: 64x256x56x56 fp16 0.2781
against 0.2584, bf16 0.2791 against 0.2679, 32x64x112x112 fp16 0.1482 against 0.1340,
64x256x56x56 fp32 0.5065 against 0.4908. Slower everywhere, for the reason
``bn_forward_grid_pipelined`` gives; dispatch does not prefer it.
"""

from __future__ import annotations

from tvm_fusion.registry import register

from .bn_backward_grid_persistent import BNBackwardGridPersistent
from .bn_forward_grid_persistent import PipelinedRounds


@register
class BNBackwardGridPipelined(PipelinedRounds, BNBackwardGridPersistent):
    name = "bn_backward_grid_pipelined"
    algorithm = "dual_reduce_half_parts"  # this round's parts of x and dy and the next one's
    on_chip, partial, combine = ("x_shared.dyn", "dy_shared.dyn"), "part_grad_sums", "grad_sums_map"
