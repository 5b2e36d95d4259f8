"""BatchNorm's backward, each channel split across several blocks: partial dual sums,
a finalize kernel, then the dx map over the whole tensor.

Pattern ``x, dy(SRR) -> (sum dy, sum dy * xhat)[split, c](SS) -> (sum dy, sum dy *
xhat)(S) -> dbias, dweight, coef(S) -> dx(SSS)``, the ``dual_reduce`` decomposition
on the ``(N, C, L)`` view with the (n, l) reduction rfactored over ``splits`` blocks
per channel. For few channels with large planes, where a block per channel leaves
the GPU under two waves of lightly loaded SMs: 64x256x56x56 (256 blocks on 132 SMs,
200704 values each) and 32x64x112x112 (64 blocks, 401408 values each). Preferred
below 2 x SMs channels and from 16384 values a channel (``SplitPlaneMapCandidate.
prefers``; the evidence is bn_stats_split_plane's, written with the rule in
cuda/common.py), in training and eval alike: eval's dx needs no sums, but dweight
and dbias do.

Kernel 1, grid (C, splits): bn_stats_split_plane's kernel 1 on two inputs.
1. L is split by ``vector``, (n, l_outer) fused and cut into ``splits`` equal runs,
   the run index rfactored out (``grad_sums_rf``, a (splits, C) pair of float32
   partials in global memory).
2. Each block reduces its run ``[threadIdx.x, serial, batch, vector]``: x and dy
   staged through registers with 16-byte loads (``unroll`` of each a lane, issued
   together), ``dy`` and ``dy * xhat`` accumulated in float32, then
   ``__shfl_down_sync`` and one shared-memory hop (as in bn_forward_split_plane: the
   default knobs leave no guard; where one remains, the accumulators are zeroed
   before the guarded loop by the cross-thread lowering).
Kernel 2, grid (C,), FINALIZE_THREADS lanes:
3. The block sums the channel's ``splits`` partials across its lanes (shuffles).
4. Thread 0 writes ``dweight`` and ``dbias`` and, in training, the coefficients
   ``bn_dx_mean``, ``bn_dx_xhat`` (two (C,) float32 buffers in global memory). Only
   thread 0 reads the allreduce result, so StorageRewrite's reuse of its buffer
   cannot race (cross_entropy_grad's ``row_order`` lesson).
Kernel 3, many blocks:
5. ``dx`` over the whole tensor: (n, c, l / vector) fused and cut ``[blockIdx.x,
   serial, threadIdx.x]``, consecutive lanes on consecutive vectors, 16-byte loads of
   x and dy and stores of dx; ``c`` once per vector (``vector`` divides L).
   ``bn_dx_scale = invstd * weight`` is computed there (it needs no sums). Eval's dx
   is ``bn_dx_scale * dy``: it reads no x and no sums, and its kernel launches first
   (kernel 2 then writes only dweight and dbias).

Not used: blocks on runs of one plane for the map (bn_forward_split_plane's reason);
the map in kernel 2 (C blocks again); a grid barrier between the sums and
the map (a cooperative kernel: ``bn_backward_grid_persistent``); atomicAdd of the partials
(order-dependent results and a zeroing pass).

On the H200 (results/benchmarks.csv), behind dispatch's forward pick: forward + backward
kernels 0.2246 ms on 64x256x56x56 fp16, 0.1125 on 32x64x112x112 (2026-12-01 at 32f74c8).
The backward alone on 64x256x56x56 is at 92-93% of the copy bandwidth for its five passes
(0.1318 ms guarded, 0.1336 with the even, batched kernel 1: A/B of 2026-12-02), so only
fewer passes would make it faster.
"""

from __future__ import annotations

from tvm_fusion.contracts import BNBackwardProblem
from tvm_fusion.registry import register

from .common import SplitPlaneMapCandidate, finalize_channels, plane_splits, split_plane_partials


@register
class BNBackwardSplitPlane(SplitPlaneMapCandidate):
    name = "bn_backward_split_plane"
    op = "bn_backward"
    algorithm = "dual_reduce"

    def applies(self, problem: BNBackwardProblem) -> bool:
        return problem.op == self.op and not problem.channels_last and bool(plane_splits(problem))

    def schedule(self, sch, problem: BNBackwardProblem, knobs) -> None:
        # 1-2. Kernel 1: the partial dual sums, a block per (channel, run).
        split_plane_partials(sch, "grad_sums", ("x", "dy"), knobs)
        # 3-4. Kernel 2: a block per channel; thread 0 runs every per-channel step
        # (the coefficients last: their place is before dx's).
        coefficients = ["bn_dx_mean", "bn_dx_xhat"] if problem.training else []
        finalize_channels(sch, "grad_sums", ["dweight", "dbias", *coefficients])
        # 5. Kernel 3: dx over the whole tensor, the scale in the map.
        sch.compute_inline(sch.get_sblock("bn_dx_scale"))
        self.map_step(sch, "dx", ("x", "dy") if problem.training else ("dy",), knobs)
