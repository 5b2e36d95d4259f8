"""BatchNorm's training forward as one grid-wide persistent kernel with pipelined
rounds: the next round's part of x copied in (``cp.async``) while this round's part is
reduced, waits at the grid barrier and is mapped.

Pattern: ``bn_forward_grid_persistent``'s (``x(SRR) -> part on chip -> part (sum,
sumsq)(SS) | grid barrier | (sum, sumsq)(S) -> coef(S) -> y(SSS) from chip``) on the
``shifted_half_parts`` decomposition: parts of at most 100 KB, so that two fit a
block's shared memory. Round r of a block: round r + 1's part copied into the other
half of shared memory (``cp.async``, 16 bytes a lane, no registers held), then wait for
round r's copy, its partial sums, the grid barrier, the map's coefficients and y from
the copy; :mod:`tvm_fusion.async_rounds` pipelines the round loop and says how the
build lowers it.

Why: ``bn_forward_grid_persistent`` was 1.50x its floor (read x + write y at the copy
rate) on an H100 with 64x256x56x56 fp16 (0.1022 ms), and fewer lanes took much longer
(448 lanes 0.1135 ms, 256 lanes 0.1647): one part on chip makes each round a read phase,
then a reduction and a barrier, then a write phase, and the memory system idles in
between. Here the reads of the next round overlap the barrier and the writes. The cost:
twice the rounds (8 on that shape, P = 4 and G = 128) and twice the barriers.
Predicted on that shape: close to the copy rate, about 0.075 ms on the H100.
Rejected: holding the next part in registers (100 KB a block is 28 registers a lane at
896 lanes, past the 73 a lane that many lanes leave).

Measured (H100, 2026-12-05T16:51Z, rows "probe: pipelined grid-wide BatchNorm" of
results/benchmarks.csv, copy 2992 GB/s, each kernel checked against float64 first),
ms, this candidate's default against ``bn_forward_grid_persistent``'s in the same run:
64x256x56x56 fp16 0.1035 against 0.1004, bf16 0.1047 against 0.0992, 32x64x112x112
fp16 0.0559 against 0.0528, 64x256x56x56 fp32 0.1917 against 0.1831; forward +
backward with ``bn_backward_grid_pipelined`` 0.2807 against 0.2584 (fp16). **Slower
everywhere: the prediction missed.** The copies issued at the round's start (the first
version, at dcb3eb4 with ``async_rounds.ISSUE_AFTER_THE_BARRIER`` off) took the same on fp16 (0.1040)
and longer on fp32 (0.2059). What the numbers fit: a fixed cost a round of about 3.5-4.5
us (the grid barrier, the block's reduction, the partials' loads after it), which the
doubled rounds pay twice while the overlap saves about as much; with 8 and 16 rounds
against 4 and 8, fp16 and fp32 give 4.4 and 3.4 us if the pipelined kernel streams at
the copy rate. Unconfirmed (no profiler on the host). Where that points: a cheaper
synchronisation a round (the P blocks of a channel waiting on each other, not the whole
grid), not more overlap. So dispatch does not prefer it; the tuner may pick it.
"""

from __future__ import annotations

from tvm_fusion.registry import register

from .bn_forward_grid_persistent import BNForwardGridPersistent, PipelinedRounds


@register
class BNForwardGridPipelined(PipelinedRounds, BNForwardGridPersistent):
    name = "bn_forward_grid_pipelined"
    algorithm = "shifted_half_parts"  # this round's part and the next one's on chip
    on_chip, partial, combine = ("x_shared.dyn",), "part_moments", "moments_map"
