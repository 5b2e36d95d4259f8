"""Cross entropy and its gradient, one block per row, the row read from HBM once.

Pattern ``t(R) -> denom, first_bad | x(SR) -> max(S) -> exp, sum(S) -> lse, row_loss,
coef(S) -> dlogits(SS) | row_loss(R) -> loss``, the ``fused`` decomposition with the
row copied into dynamic shared memory first: the two statistics and the gradient
then sweep shared memory, so a training step reads the logits once and writes the
gradient once (``cross_entropy_grad_block_per_row`` sweeps the row three times, the
later sweeps from L2 at best). For rows that fit beside a second block on an SM
(V * bytes <= 112 KB), e.g. V = 32000 fp16 (64 KB) or V = 50257 bf16 (100 KB).

Kernel 1, one block: the targets pass. Kernel 2, grid (B,):
1. Every per-row block shares one row loop (``merge_rows``) bound to ``blockIdx.x``.
2. The row is copied in 16 bytes a lane, ``[threadIdx.x, serial, vector]``, as ``cp.async``
   (:mod:`tvm_fusion.async_copy`: every copy of a thread in flight at once).
3. ``row_max`` then ``row_sumexp`` over shared memory, 16-byte chunks into registers,
   shuffles plus one shared hop; both statistics stay in every thread's registers.
4. ``dlogits`` over shared memory, the gradient in float32, 16-byte global stores.
5. Thread 0 writes ``lse`` and the row loss (``row_order``).
Kernel 3, one block: the loss.

Not used: the row in registers (a local buffer written under one threadIdx loop and
read under others cannot be compacted per thread: the forward candidate's 268 MB
workspace); rows over 112 KB (one block per SM would hide no latency: those go to
``cross_entropy_grad_online``).

Dispatched for rows of 1000 values to 112 KB read with 16-byte vectors once the batch
fills the GPU (``prefers``: H200 measurements there), and for fp16 and bf16 rows of
32000 values and more on fewer rows than three quarters of the SMs (H100 measurements
there). With a scalar row (V odd in
fp16/bf16) it is slow: 16384x50257 bf16 took 2.47-8.0 ms, 3.2x the floor and more
(knob sweep at 7f25795).
"""

from __future__ import annotations

from tvm.target import Target

from tvm_fusion import async_copy
from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, register
from tvm_fusion.targets import sm_count

from ..common import (
    LoopRV, coefficients_at, lanes_split, outputs_to, read_index, row_loss_name, single_thread, thread_reduce,
)
from .common import grad_map, merge_grad_rows, reads_16_bytes, schedule_grad_batch_stage, schedule_grad_prologue
from .cross_entropy_row_in_shared import CrossEntropyRowInShared, RowInSharedKnobs

# Few rows: at most this fraction of the SMs' count, rows of fp16 or bf16 values of at
# least FEW_ROW_BYTES (32000 values), the rows timed (``prefers``).
FEW_ROWS = 0.75
FEW_ROW_BYTES = 64000


@register
class CrossEntropyGradRowInShared(Candidate):
    name = "cross_entropy_grad_row_in_shared"
    op = "cross_entropy_grad"
    target_kind = "cuda"
    algorithm = "fused"
    knobs = RowInSharedKnobs  # the forward's knobs: the same launch shape
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyGradProblem) -> bool:
        return problem.mode == "fused" and CrossEntropyRowInShared.applies(self, problem)

    def prefers(self, problem: CrossEntropyGradProblem, target: Target) -> bool:
        # H200, run at 921bec8 (results/benchmarks.csv), kernels alone under graph
        # replay, against the read + write floor: 4096x32000 fp16 0.1384 ms (1.11x;
        # online 0.2044 with its default knobs, block per row 0.2574); 65536x1000 fp16
        # 0.0867 (1.39x; warp per row 0.0950). Rows read as scalars lose (docstring).
        # Few rows (fewer than the SMs, a block each): the row's reads all in flight at
        # once decide. H100, rows "probe: row targets A/B" (2026-12-07T09:05-09:08Z),
        # one-launch twins under graph replay, row_in_shared's against block_per_row's,
        # us: 1x32000 fp16 6.90 / 7.95, 8x32000 fp16 9.25 / 10.65, 32x32000 bf16
        # 10.68 / 16.82, 64x32000 fp16 11.50 / 12.01, 64x32000 bf16 11.81 / 17.55,
        # 96x32000 fp16 12.91 / 13.47, 16x50304 bf16 12.83 / 16.67, 64x50304 bf16
        # 15.20 / 18.18; but 128x32000 fp16 14.10 / 13.54. Shorter rows and float32
        # rows untimed: left as they were.
        sms = sm_count(target)
        few = (problem.batch <= FEW_ROWS * sms and DTYPE_BYTES[problem.dtype] == 2
               and problem.classes * DTYPE_BYTES[problem.dtype] >= FEW_ROW_BYTES)
        return (reads_16_bytes(problem.dtype, problem.classes) and problem.classes >= 1000
                and (problem.batch >= 2 * sms or few))

    # The forward's space: the same launch shape over the same row.
    choices = CrossEntropyRowInShared.choices

    def default_for(self, problem: CrossEntropyGradProblem, target: Target) -> RowInSharedKnobs:
        # The forward's, with 512 threads on rows of 2048 vectors and more: the
        # gradient's third sweep and its stores want more lanes in flight (H200 knob
        # sweep at 7f25795, 4096x32000 fp16: 0.1386 ms at 512 threads, 0.1522 at the
        # forward's 256).
        knobs = CrossEntropyRowInShared.default_for(self, problem, target)
        if problem.classes // knobs.vector >= 2048:
            knobs = RowInSharedKnobs(threads=512, vector=knobs.vector, unroll=knobs.unroll)
        return knobs

    def at_dlogits_row(self, sch, problem: CrossEntropyGradProblem, dlogits_row: LoopRV) -> None:
        """What each row computes before its gradient: the coefficients, in registers."""
        coefficients_at(sch, problem, dlogits_row, "local")

    def schedule_rows(self, sch, problem: CrossEntropyGradProblem, knobs) -> LoopRV:
        """Kernel 2, steps 1-5; returns the row loop (bound to ``blockIdx.x``)."""
        self.at_dlogits_row(sch, problem, sch.get_loops(sch.get_sblock("dlogits"))[0])
        # 2. The copy of the row that the statistics and the gradient read. Each
        # consumer's random variable is used again below: TVM 0.27's Trace.simplified,
        # which MetaSchedule's search replays, drops a GetSBlock whose output only a
        # list input (consumer_blocks) uses, and the replay then stopped with "Random
        # variable is not defined" (H200 tune of 4096x32000 fp16, c1333ff).
        row_max, row_sum, dlogits = (sch.get_sblock(n) for n in ("row_max", "row_sumexp", "dlogits"))
        copy = sch.cache_read(row_max, read_index(sch, row_max, "logits"), "shared.dyn",
                              consumer_blocks=[row_max, row_sum, dlogits])
        shared = sch.get(copy).writes[0].source.name
        # 1. One row loop, one block per row.
        loss = row_loss_name(problem)
        row = merge_grad_rows(sch, problem)
        sch.bind(row, "blockIdx.x")
        sch.compute_at(copy, row, preserve_unit_loops=True)
        _, serial, vec = lanes_split(sch, copy, 1, knobs.threads, knobs.vector, knobs.unroll)
        sch.vectorize(vec)
        async_copy.mark(sch, serial)
        # 3. Both statistics over shared memory, kept in registers.
        for block in (row_max, row_sum):
            thread_reduce(sch, block, 1, knobs.threads, knobs.vector, knobs.unroll, shared)
            outputs_to(sch, block, "local")
        # 4. The gradient from shared memory.
        grad_map(sch, 1, knobs.threads, knobs.vector, knobs.unroll, staged=shared, block=dlogits)
        # 5. lse and the row loss on thread 0.
        for name in ("lse", loss):
            single_thread(sch, sch.get_sblock(name), knobs.threads)
        return row

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        # Kernel 1: the targets pass.
        schedule_grad_prologue(sch, problem)
        # Kernel 2: the rows.
        self.schedule_rows(sch, problem, knobs)
        # Kernel 3: the loss.
        schedule_grad_batch_stage(sch, problem, knobs.threads)
