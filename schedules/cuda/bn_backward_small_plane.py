"""BatchNorm's backward on NCHW with small planes, as channels-last over columns.

Pattern ``x, dy(SRR) -> (sum dy, sum dy * xhat)[p, j](SS) -> (sum dy, sum dy * xhat)[c](S)
-> dbias, dweight, coef(S) -> dx(SS)`` on the ``(N, C, L)`` view seen as the matrix
``(N, C * L)`` (column ``j = c * L + l``: ``bn_forward_small_plane`` says why 8
consecutive columns are one aligned 16-byte vector), the ``dual_reduce``
decomposition, scheduled (no compute of its own).

Kernel 1, grid (splits, column groups), block (column lanes, rows)
(``bn_forward_small_plane.column_partials``):
1. ``grad_sums``' row loop split as the channels-last partials', the partial index
   fused with l and rfactored into a (P, C * L) float32 workspace pair.
2. Per row one 16-byte load of x and one of dy (``unroll`` rows of each together);
   each thread's columns' mean and invstd copied into registers once;
   ``dy`` and ``dy * (x - mean) * invstd`` summed in float32 registers, written once.
Kernel 2, grid (C,), ``FINALIZE_THREADS`` lanes (``common.channel_finalize``):
3. The channel's ``P * L`` partials summed across the lanes (shuffles, one shared
   hop); thread 0 writes the coefficients that read the sums (training:
   ``bn_dx_mean``, ``bn_dx_xhat``, a (C,) workspace each), then ``dweight`` and
   ``dbias``: thread 0's blocks are the allreduce result's only readers.
Kernel 3, kernel 1's grid (``bn_forward_small_plane.column_map``):
4. Each thread copies its 8 columns' per-channel values into registers once
   (``bn_dx_scale = weight * invstd`` computed in that copy, mean, invstd and the
   finalize's coefficients loaded); per row one 16-byte load of x and dy (eval: dy
   only), ``dx`` in float32, one 16-byte store. In eval dx reads no sum, and the
   function (so the launch order) has it first.

Why: block per channel (``bn_backward_persistent``) reads 7x7 planes with 2-byte
loads: on the H200 256x2048x7x7 fp16 forward plus backward take 0.1482 ms against a
0.0607 ms floor (x read once by each, dy once, y and dx written once). Here every
access of x, dy and dx is 16 bytes, for a second read of x and dy and the partials'
workspace. Not timed yet.

Applies: NCHW, training and eval, on ``bn_forward_small_plane.small_plane``'s
shapes. Knobs: ``SmallPlaneCandidate`` (the channels-last space of the column view).

Not used: what ``bn_forward_small_plane`` does not use, for the same reasons; and
keeping x and dy on chip between the sums and the map (a block would own all N rows
of its columns).
"""

from __future__ import annotations

from tvm_fusion.contracts import BNBackwardProblem
from tvm_fusion.registry import register

from .bn_forward_small_plane import SmallPlaneCandidate, column_finalize, column_map, column_partials, small_plane


@register
class BNBackwardSmallPlane(SmallPlaneCandidate):
    name = "bn_backward_small_plane"
    op = "bn_backward"
    algorithm = "dual_reduce"

    def applies(self, problem: BNBackwardProblem) -> bool:
        return problem.op == self.op and small_plane(problem)

    def schedule(self, sch, problem: BNBackwardProblem, knobs) -> None:
        plane = problem.shape[2]
        # 1-2. Kernel 1: per-column partials of the two sums.
        column_partials(sch, "grad_sums", knobs, plane)
        # 3. Kernel 2: the coefficients that read the sums, then dweight and dbias.
        from_sums = ["bn_dx_mean", "bn_dx_xhat"] if problem.training else []
        column_finalize(sch, "grad_sums", plane, [*from_sums, "dweight", "dbias"])
        # 4. Kernel 3: dx (eval's reads no x), bn_dx_scale in each thread's registers.
        column_map(sch, "dx", knobs, plane, computed=("bn_dx_scale",))
