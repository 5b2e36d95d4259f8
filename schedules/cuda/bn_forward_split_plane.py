"""BatchNorm's forward (training), each channel split across several blocks: partial
sums, a finalize kernel, then the map over the whole tensor.

Pattern ``x(SRR) -> (sum, sumsq)[split, c](SS) -> (sum, sumsq)(S) -> mean, var ->
invstd, running, coef(S) -> y(SSS)`` on the ``(N, C, L)`` view, the ``shifted``
decomposition with the (n, l) reduction rfactored over ``splits`` blocks per channel.
For few channels with large planes, where a block per channel leaves the GPU under
two waves of lightly loaded SMs: 64x256x56x56 (256 blocks on 132 SMs, 200704 values
each) and 32x64x112x112 (64 blocks, 401408 values each). Preferred below 2 x SMs
channels and from 16384 values a channel (``SplitPlaneMapCandidate.prefers``; the
evidence is bn_stats_split_plane's, written with the rule in cuda/common.py).

Kernel 1, grid (C, splits): bn_stats_split_plane's kernel 1.
1. L is split by ``vector``, (n, l_outer) fused and cut into ``splits`` equal runs,
   the run index rfactored out (``moments_rf``, a (splits, C) pair of float32
   partials in global memory).
2. Each block reduces its run ``[threadIdx.x, serial, batch, vector]``, x staged
   through registers with 16-byte loads (``unroll`` of them a lane, issued together),
   ``d = x - K[c]`` accumulated in float32, then ``__shfl_down_sync`` and one
   shared-memory hop. K[c] = x[0, c, 0] is read where used; the default knobs
   (``even_partials``) leave the loop unguarded, so nvcc loads it once. Where a guard
   remains, the cross-thread lowering zeroes the accumulators before the guarded
   loop, and with a serial loop of one step (2x3x1000) the guard stays on the
   accumulation, off the barriers and the write-back (tests/test_bn_split_plane.py
   checks the code).
Kernel 2, grid (C,), FINALIZE_THREADS lanes:
3. The block sums the channel's ``splits`` partials across its lanes (shuffles).
4. Thread 0 runs every per-channel step: ``mean`` and ``var`` (``local``, which
   StorageRewrite may fold into the allreduce result's slots), ``save_mean``,
   ``save_invstd``, the running statistics and the map's coefficients ``bn_scale``,
   ``bn_shift`` (two (C,) float32 buffers in global memory). Only thread 0 reads the
   allreduce result, so StorageRewrite's reuse of its buffer cannot race
   (cross_entropy_grad's ``row_order`` lesson).
Kernel 3, many blocks:
5. y, compute.bn_forward's map of x and the coefficients (``(x - bn_shift[c]) *
   bn_scale[c] + bias[c]``), over the whole tensor: (n, c, l / vector) fused and cut
   ``[blockIdx.x, serial, threadIdx.x]``, so consecutive lanes take consecutive
   vectors (16-byte loads of x and stores of y); ``vector`` divides L, so each
   vector lies in one plane and ``c`` is computed once per vector.

Not used: blocks on runs of one plane for the map (one channel a block, but a
56x56 fp16 plane is 392 vectors, so most blocks would end with idle lanes); the map
in kernel 2 (C blocks again); a grid barrier between the sums and the map
(a cooperative kernel: ``bn_forward_grid_persistent``); atomicAdd of the partials (order-dependent results
and a zeroing pass).

On the H200 (results/benchmarks.csv): 64x256x56x56 fp16 0.0826 ms, 89% of the copy
bandwidth for its three passes (2 reads and a write of x), against 0.0910 with kernel 1
guarded and one load in flight (A/B of 2026-12-02); 32x64x112x112 0.0450 (its old split
was even already: 0.0452); 256x2048x7x7 0.0960 (not preferred there: persistent 0.0600,
2026-12-01 at 32f74c8).
"""

from __future__ import annotations

from tvm_fusion.compute.bn_forward import channel_outputs
from tvm_fusion.contracts import BNForwardProblem
from tvm_fusion.registry import register

from ..common import outputs_to
from .common import SplitPlaneMapCandidate, finalize_channels, plane_splits, split_plane_partials


@register
class BNForwardSplitPlane(SplitPlaneMapCandidate):
    name = "bn_forward_split_plane"
    op = "bn_forward"
    algorithm = "shifted"

    def applies(self, problem: BNForwardProblem) -> bool:
        return (problem.op == self.op and problem.training and not problem.channels_last
                and bool(plane_splits(problem)))

    def schedule(self, sch, problem: BNForwardProblem, knobs) -> None:
        # 1-2. Kernel 1: the shifted partial sums, a block per (channel, run).
        split_plane_partials(sch, "moments", ("x",), knobs)
        # 3-4. Kernel 2: a block per channel, thread 0 runs every per-channel step
        # (the map's coefficients last: their place is before y's).
        for name in ("mean", "var"):
            outputs_to(sch, sch.get_sblock(name), "local")
        finalize_channels(sch, "moments", ["var", "mean", *channel_outputs(problem), "bn_scale", "bn_shift"])
        sch.compute_inline(sch.get_sblock("shift"))
        # 5. Kernel 3: y over the whole tensor.
        self.map_step(sch, "y", ("x",), knobs)
