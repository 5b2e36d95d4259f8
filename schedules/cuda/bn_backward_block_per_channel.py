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

Has run only through code generation so far: no GPU run, no timing, so dispatch has
nothing that prefers it (it is the only CUDA candidate of its op).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import BNBackwardProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, ladder, register

from ..common import lanes_split, outputs_to, single_thread, stage_in_registers
from .bn_stats_block_per_channel import THREADS_BY_COUNT
from .common import MAX_THREADS, vector_choices, widest_vector


@dataclass(frozen=True)
class BackwardBlockKnobs(Knobs):
    threads: int = 256
    vector: int = 8
    unroll: int = 8


def dx_coefficients(problem: BNBackwardProblem) -> list[str]:
    """The per-channel blocks dx reads."""
    return ["bn_dx_scale"] + (["bn_dx_mean", "bn_dx_xhat"] if problem.training else [])


@register
class BNBackwardBlockPerChannel(Candidate):
    name = "bn_backward_block_per_channel"
    op = "bn_backward"
    target_kind = "cuda"
    algorithm = "dual_reduce"
    knobs = BackwardBlockKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: BNBackwardProblem) -> bool:
        return problem.op == self.op and not problem.channels_last

    def choices(self, problem: BNBackwardProblem, target: Target) -> dict[str, list[int]]:
        return {
            "threads": [64, 128, 256, 512],
            "vector": vector_choices(DTYPE_BYTES[problem.dtype], problem.shape[2]),
            "unroll": [1, 4, 8],
        }

    def default_for(self, problem: BNBackwardProblem, target: Target) -> BackwardBlockKnobs:
        vector = widest_vector(problem.dtype, problem.shape[2])
        threads = min(512, ladder(problem.count // vector, THREADS_BY_COUNT, MAX_THREADS))
        return BackwardBlockKnobs(threads=threads, vector=vector, unroll=8)

    def schedule(self, sch, problem: BNBackwardProblem, knobs) -> None:
        # 1. One channel loop for the outputs, dx's loops channel first.
        dx = sch.get_sblock("dx")
        n, c, plane = sch.get_loops(dx)
        sch.reorder(c, n, plane)
        for name in dx_coefficients(problem):
            sch.compute_at(sch.get_sblock(name), c, preserve_unit_loops=True)
        outputs = [sch.get_loops(sch.get_sblock(name))[0] for name in ("dbias", "dweight")]
        # dx first: thread 0's outputs are the sums' last readers (the coefficients
        # would race StorageRewrite's reuse of the allreduce result: row_order's lesson)
        channel = sch.merge(c, *outputs)
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
        # 4. dx over the channel's planes.
        dx = sch.get_sblock("dx")
        _, dx_serial, _ = lanes_split(sch, dx, 1, knobs.threads, knobs.vector, knobs.unroll)
        for name in ("x", "dy") if problem.training else ("dy",):  # eval's dx reads no x
            stage_in_registers(sch, dx, name, dx_serial)
        out = sch.cache_write(dx, 0, "local")
        sch.reverse_compute_at(out, dx_serial, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(out)[-1])
