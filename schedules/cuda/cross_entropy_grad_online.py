"""Cross entropy and its gradient, one thread block per row, online statistics.

Pattern ``t(R) -> denom, first_bad | x(SRR) -> chunk (max, sumexp)(SS) -> (max,
sumexp)(S) -> lse, row_loss, coef(S) -> dlogits(SS) | row_loss(R) -> loss``, the
``fused_online`` decomposition: the row's statistics in one pass over 16-byte chunks
(the forward's ``online``), then the gradient pass: two reads of the row, the first
from HBM, instead of three. For long rows (V = 32000 and up) whose second read hits
L2 while the third would not.

Kernel 1, one block: the targets pass (the first bad target; for the mean its
denominator).
Kernel 2, grid (B,):
1. Every per-row block shares one row loop (``merge_rows``) bound to ``blockIdx.x``.
2. ``row_online`` walks the row's chunks split ``[threadIdx.x, serial]``; per chunk
   the logits come in with one 16-byte load, ``chunk_max`` / ``chunk_sumexp`` run in
   registers and fold into the lane's running (max, sum) with one rescale; lanes
   combine their pairs by the same rule through ``__shfl_down_sync`` and one
   shared-memory hop. The statistics stay in every thread's registers.
3. Every thread computes the row's gradient coefficients in registers; thread 0
   writes ``lse`` and the row loss after step 4 (``row_order``).
4. ``dlogits``: the second pass, ``[threadIdx.x, serial, vector]``, a 16-byte load,
   the gradient in float32 in registers and a 16-byte store per step.
Kernel 3, one block: the sum of the row losses (mean, sum) and ``loss``.

Exp count: 1 + 2/8 per element for the statistics (16-bit inputs), 1 for the map.

``unroll`` is TVM's ``pragma_auto_unroll_max_step``: a loop is unrolled only when its
trip count times its body's statements stays under it, so 1, 4 and 16 leave both row
loops rolled (one 16-byte load, or one chunk's eight 2-byte loads, in flight a lane,
then the exps that wait on it; ``ptxas`` keeps 32 registers). ``FULL_UNROLL`` (1024)
unrolls them, and ``ptxas`` then issues a lane's next loads before the exps of the
last. That pays where the rows are read as scalars (V odd in fp16/bf16): H200,
2026-12-04, rows "probe: fused gradient knobs" of results/benchmarks.csv, 1024
threads, 16 against 1024: 16384x50257 bf16 1.4185 ms against 1.1625 (1.2101 in
place, 1.4401 before), 3000x50257 fp16 0.2768 against 0.2243, 32768x50257 bf16
2.8166 against 2.5012, 1024x151937 bf16 0.3411 against 0.2950, 2048x32001 bf16
0.1069 against 0.1015; at 512 threads it gains less (1.3810, 0.2686, 0.1092). Most
of it is the gradient pass's unroll (1.1883 with only that loop unrolled, 1.3991 with
only the statistics'). 16384x50257 at 1.16 ms moves 2 reads and a write of the logits
at 99% of the copy rate: the two-read schedule's own limit. So it is the default for
scalar rows and in their knob space. Not for 16-byte rows: with both loops unrolled
at 1024 threads nvcc keeps the row's first read for the second in registers and
spills 792 bytes a thread (8192x128256 bf16 4.1084 ms against 1.5176); at 512
threads it gains nothing there (1.5218).

``batch`` (1: a lane's rolled loops as above) splits both row loops ``[step, batch]``,
a lane's ``batch`` chunks of a step ``threads`` apart and unrolled, so that nvcc issues
their 16-byte loads before the exps of the first (ptxas: the statistics pass starts
with three LDG.E.128 at batch 4, against one at batch 1; 30-32 registers either way).
H200, 2026-12-05, rows "probe: launch_order A/B" of results/benchmarks.csv, gradient
pass from the row's end: 8192x128256 bf16 1.4378 ms at 1024 threads and batch 4 against
1.5025 for the default (512, batch 1), 1.4984 at 512 and batch 4, 1.4533 at 501 and
batch 8 (an even split, no guard: not faster than the guarded 1024); 2048x151936 bf16
0.4394 against 0.4445. A tuning knob, not a default yet: the shipped records tuned
without it keep batch 1, and the gain (4%) leaves the two-read schedule at 1.45x the
floor.

``rows`` (1: a block a row) gives each block ``rows`` consecutive rows, run one after
the other (the row loop split ``[blockIdx.x, rows]``; at 1 the CUDA is as before), the
choices dealing B out evenly to one or two blocks an SM (:func:`rows_per_block`). Why:
a block a row at 1024 threads and 32 registers is two blocks an SM, 264 rows of
8192x128256 bf16 (67 MB) read by the statistics pass before their gradient passes
start, more than the 60 MiB L2 holds, and the gradient pass then re-reads from HBM
(16384x50257 moves two reads and a write at 99% of the copy rate, above). At 64 rows a
block on 128 blocks, 32 MB are in flight. The probe below found such blocks slower, but
with one 16-byte load in flight a lane; with ``batch`` 4 or 8 a 1024-lane block has 64
or 128 KB in flight, which the copy rate needs of an SM (4.2 TB/s over 132 SMs at about
1.5 us under load is some 48 KB). Predicted: 8192x128256 bf16 at 1024 threads, batch 8,
64 rows a block under 1.2 ms against 1.4378 at batch 4 (a block per row). Measured
(H200, 2026-12-05, rows "probe: online gradient rows and batch knobs" of
results/benchmarks.csv, forward + backward under graph replay), 8192x128256 bf16 at
1024 threads: batch 4 a block a row 1.4396 ms, batch 8 1.4763; batch 8 at 64 rows
1.4261, at 32 rows 1.4228; batch 4 at 64 rows 1.4855, batch 2 1.6929. The prediction
missed: 1%, not 17%. Other shapes lost: 2048x151936 bf16 0.4377 ms a block a row
against 0.4649 at 8 rows and 0.4972 at 16; 16384x50257 bf16 1.1653 against 1.5255 at
128 rows; 4096x32000 fp16 0.1377 (dispatch) against 0.1918 at 16 rows. Why, as far as
the timings tell: at one 1024-lane block an SM each row ends its two passes with a drain
(the last loads, then the block's reduction and barrier), which a second block an SM
would overlap; at two blocks an SM (32 rows, 256 blocks) two rows of 256 KB an SM, 67
MB, no longer fit the L2 with the writes. The two needs meet at about 1.8 rows of this
length an SM (60 MiB over 132 SMs), too near to pay. A tuning knob, dispatch keeps 1.

Not used: persistent row blocks (a grid of one or two blocks an SM, each walking
consecutive rows, so that the rows in flight fit in L2 for the gradient pass's
re-read) with one load in flight a lane: slower on every shape tried, the row kernel
was short of loads in flight, not of L2 hits (H200, 2026-12-03, rows "probe: uncommitted rows_per_block knob" in
results/benchmarks.csv: 8192x128256 bf16 1.5172 ms a block per row at 1024 threads,
1.5609 at 256 blocks, 1.8794 at 131; 16384x50257 bf16 1.4286 against 1.6601), and
still with the statistics loop unrolled (2026-12-04, the "probe_grad_rows" rows:
8192x128256 bf16 1.7336 ms at 128 blocks, 1.7058 at 256; in place, where the gradient's
stores land on the lines just read, 1.4759 at 128 blocks against 1.6764 a block per
row, still 1.5x the floor); the
per-element online combine (two exp per element, MUFU-bound); the
running statistics in shared memory (the forward's ``cross_entropy_online`` keeps
them there for thread 0 alone; here every thread reads them, which is the race the
GPU sweep found in the warp and block candidates).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, ladder, register
from tvm_fusion.targets import sm_count

from ..common import coefficients_at, row_loss_name, single_thread
from .common import (
    MAX_THREADS, THREADS_BY_VECTORS, VECTOR_BYTES, grad_map, merge_grad_rows, online_chunks, reads_16_bytes,
    schedule_grad_batch_stage, schedule_grad_prologue, vector_choices, widest_vector,
)
from .cross_entropy_online import CrossEntropyOnline

# ``unroll`` that unrolls the row loops of a scalar-read row (module docstring).
FULL_UNROLL = 1024
# ``batch``: chunks a lane loads a step in both passes (module docstring).
BATCHES = [1, 2, 4, 8]


def rows_per_block(problem: CrossEntropyGradProblem, target: Target) -> list[int]:
    """``rows`` choices: 1 (a block a row), and the counts that deal the rows out evenly
    to one or two blocks an SM (B / rows between the SMs and twice as many, or just
    under: 8192 rows on 132 SMs take 64 a block on 128 blocks), so that at most one or
    two rows an SM are in flight (module docstring). Only divisors of B: a remainder
    would put the block's barriers under a row guard."""
    sms = sm_count(target)
    return [1] + [r for r in range(2, int(problem.batch / (0.9 * sms)) + 1)
                  if problem.batch % r == 0 and 0.9 * sms <= problem.batch // r <= 2 * sms]


@dataclass(frozen=True)
class GradOnlineKnobs(Knobs):
    threads: int = 256
    vector: int = 8  # of the gradient pass (the statistics read 16-byte chunks)
    unroll: int = 16
    batch: int = 1  # chunks (vectors) a lane loads a step, in both passes
    rows: int = 1  # consecutive rows a block takes, one after the other


@register
class CrossEntropyGradOnline(Candidate):
    name = "cross_entropy_grad_online"
    op = "cross_entropy_grad"
    target_kind = "cuda"
    algorithm = "fused_online"
    knobs = GradOnlineKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyGradProblem) -> bool:
        return problem.op == self.op and problem.mode == "fused"

    def prefers(self, problem: CrossEntropyGradProblem, target: Target) -> bool:
        # The forward's threshold (one HBM read of the row for the statistics pays once
        # rows are long and fill the GPU). 8192x128256 bf16: 1.5451 ms against 2.2139 a
        # block per row (H200, results/benchmarks.csv). Rows read as scalars (V odd in
        # fp16/bf16) too, at 1024 threads (``default_for``): against a block per row's
        # three sweeps, 16384x50257 bf16 1.4152 ms against 1.5342, 3000x50257 fp16
        # 0.2771 against 0.2954, 2048x32001 bf16 0.1069 against 0.1283 (H200, 2026-12-03,
        # "window knob probe" rows); at its old 512 threads it lost (1.6268 against 1.5252).
        return ((reads_16_bytes(problem.dtype, problem.classes) or DTYPE_BYTES[problem.dtype] == 2)
                and CrossEntropyOnline.prefers(self, problem, target))

    def choices(self, problem: CrossEntropyGradProblem, target: Target) -> dict[str, list[int]]:
        return {
            "threads": [128, 256, 512, 1024],
            "vector": vector_choices(DTYPE_BYTES[problem.dtype], problem.classes),
            "unroll": [1, 4, 16] if reads_16_bytes(problem.dtype, problem.classes) else [1, 4, 16, FULL_UNROLL],
            # Scalar rows get their loads together from FULL_UNROLL.
            "batch": BATCHES if reads_16_bytes(problem.dtype, problem.classes) else [1],
            "rows": rows_per_block(problem, target),
        }

    def default_for(self, problem: CrossEntropyGradProblem, target: Target) -> GradOnlineKnobs:
        chunk = VECTOR_BYTES // DTYPE_BYTES[problem.dtype]
        threads = max(128, ladder(problem.classes // chunk, THREADS_BY_VECTORS, MAX_THREADS))
        unroll = 16
        if not reads_16_bytes(problem.dtype, problem.classes):
            unroll = FULL_UNROLL  # scalar rows: the loads of unrolled steps in flight together (module docstring)
            if problem.classes >= 4096:
                threads = MAX_THREADS  # scalar rows: the most loads in flight (``prefers`` has the H200 figures)
        return GradOnlineKnobs(threads=threads, vector=widest_vector(problem.dtype, problem.classes), unroll=unroll)

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        # Kernel 1: the targets pass.
        schedule_grad_prologue(sch, problem)
        # 1. One row loop, one block per row.
        dlogits_row = sch.get_loops(sch.get_sblock("dlogits"))[0]
        coefficients_at(sch, problem, dlogits_row, "local")
        loss = row_loss_name(problem)
        row = merge_grad_rows(sch, problem, ("row_online",))
        grid, _ = sch.split(row, [None, knobs.rows])  # a block's rows one after the other
        sch.bind(grid, "blockIdx.x")
        # 2. Chunks across the lanes; each chunk reduced in registers.
        online_chunks(sch, knobs.threads, knobs.unroll, "local", knobs.batch)
        # 4. The gradient over the row.
        grad_map(sch, 2, knobs.threads, knobs.vector, knobs.unroll, batch=knobs.batch)
        # 3. lse and the row loss on thread 0.
        for name in ("lse", loss):
            single_thread(sch, sch.get_sblock(name), knobs.threads)
        # Kernel 3: the loss.
        schedule_grad_batch_stage(sch, problem, knobs.threads)
