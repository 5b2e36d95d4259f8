"""Cross entropy and its gradient for rows too long for one block's shared memory: a
row's P parts on chip in the P blocks of one thread-block cluster, the logits read once.

Pattern ``t(R) -> denom, first_bad | x -> part(SS) -> chunk (max, sumexp)(SS) -> part
(max, sumexp)(S) | cluster barrier | (max, sumexp)(S) -> coef(S) -> dlogits(SS) from chip,
lse, row_loss | row_loss(R) -> loss``, the ``fused_parts`` decomposition: each row cut
into P equal parts of whole 16-byte chunks (``compute.cross_entropy_grad.row_parts``: the
fewest of at most 75 KB, three blocks an SM; 128256 bf16 in 4 of 62.6 KB, 256000 bf16 in 8),
the statistics and the map over the (B P, L) view whose rows are the parts.

Kernel 1, one block: the targets pass. Kernel 2, grid (B P,), clusters of P (a row's
parts are consecutive blocks, one cluster), ``threads`` lanes a block:
1. One loop over the parts (the view's rows) for every per-part and per-row block,
   bound to ``blockIdx.x``.
2. The part is copied into dynamic shared memory 16 bytes a lane (``logits_parts``), as
   ``cp.async`` (:mod:`tvm_fusion.async_copy`).
3. ``part_online``: the part's online (sum of exp, max) over its 16-byte chunks, each
   staged from the copy into registers, the lanes combined through shuffles; thread 0
   stores the pair (global memory).
4. A cluster barrier (:mod:`tvm_fusion.grid_barrier`: release and acquire at cluster
   scope): the row's P pairs are stored.
5. ``row_online_map``: every thread folds the row's P pairs in registers; the gradient's
   coefficients from it; ``dlogits`` from the copy, the gradient in float32, 16-byte
   stores.
6. Thread 0 of the row's first block (part 0) folds the pairs again (``row_online``)
   and writes ``lse`` and the row loss.
Kernel 3, one block: the loss.

Why: a row of more than 112 KB does not fit beside a second block in one SM's shared
memory, so ``cross_entropy_grad_row_in_shared`` does not take it, and
``cross_entropy_grad_head_in_shared`` keeps 192 KB of it on chip, one block an SM, and
reads the rest twice: 8192x128256 bf16 at 1.18x the read + write floor on an H100
(1.6463 ms, 2026-12-06T13:21Z, rows of results/benchmarks.csv), 1.56x on an H200
(1.5432 ms, 2026-12-04). Cut across a cluster, the row is read from HBM once, and three
blocks an SM overlap one part's reads with another's stores, as
``cross_entropy_grad_row_in_shared`` does at 1.07x on 4096x32000 fp16 (H100).

Why the (B P, L) view: with the parts cut by the schedule from the (B, V) row, a step
that only some lanes take (128256 / 4 / 8 = 4008 vectors a part: no lane count of whole
warps divides it) left TVM bounding the register stages and the gradient's
write-back by the row, not the part (seen in the generated CUDA of a first draft, never
run): the last lanes of each part but the last would have stored unwritten registers
over the next part's gradient. Over the view every stage's bounds are its part's.

Measured on an H100 (2026-12-06T15:10-15:11Z, rows "probe: row_in_cluster A/B" of
results/benchmarks.csv, tree of 7417566, copy 3017 GB/s; forward + backward, mean, under
graph replay; each kernel checked against float64 first), ms, with the floor of one read
and one write:

=====================  ======  ====================  ====================  ======
shape                  floor   row_in_cluster        head_in_shared        online
                               (P, 512 lanes)        (the pick before)
=====================  ======  ====================  ====================  ======
8192x128256 bf16       1.3931  1.6550 (4; 1.19x)     1.6518 (1.19x)        2.4325
4096x151936 bf16       0.8252  0.9872 (4; 1.20x)     1.1304 (1.37x)        1.2286
2048x256000 bf16       0.6952  0.9049 (8; 1.30x)     1.0973 (1.58x)        1.2202
1024x128256 fp32       0.3483  0.4063 (8; 1.17x)     0.5118 (1.47x)        0.5382
16384x65536 fp16       1.4237  1.6378 (2; 1.15x)     1.4672 (1.03x)        2.1188
=====================  ======  ====================  ====================  ======

The parts' rule was the best P of 2, 4 and 8 on the first four shapes (8192x128256: 2
parts 1.8973 at 1024 lanes, 8 parts 1.6551 at 256); 512 lanes the best or within 1%
everywhere but 16384x65536 (256 lanes 1.5834, 4 parts at 256 lanes 1.5328), 1024 lanes
12-24% slower. There it tied with head_in_shared on 128256 bf16 (250.5 KiB) and was
13-21% faster on the longer rows.

Since the cluster barrier lost its two fences (:mod:`tvm_fusion.grid_barrier`; H100,
2026-12-06T17:42Z, rows "probe: barrier A/B", both built in one process, each checked
against float64 first), ms:

=========================  ======  ======  ==============
shape                      fenced  now     now / floor
=========================  ======  ======  ==============
8192x128256 bf16           1.6607  1.5660  1.13x (1.3839)
4096x151936 bf16           0.9828  0.9626  1.17x (0.8197)
2048x256000 bf16           0.9012  0.8520  1.23x (0.6906)
1024x128256 fp32           0.4015  0.3739  1.08x (0.3460)
2048x256000 bf16 in place  0.9059  0.8599  1.25x
=========================  ======  ======  ==============

So 128256 bf16 no longer ties: 1.5660 against head_in_shared's 1.6518-1.6981 on this card
(the table above; rows "probe: phases 2" at 17:10Z). Dispatch's pick (``prefers``) is
rows of more than 240 KiB (``PREFERRED_ROW_BYTES``), in place too. On an H200
(2026-12-06T20:22Z, rows "probe: exchange A/B") it took 1.3144 ms on 8192x128256 bf16
against 1.4375 for head_in_shared, that shape's shipped record then; the record is now
this candidate at [threads=256, vector=8, unroll=4] (a 16-trial tune there: 1.2872 ms,
rows "tuner pick" of 20:25Z). Where it loses (a 128 KiB row of which the head re-reads
half, from L2) it is the tuner's to pick. Why it stays above the 1.01-1.06x of one block's row
on chip: the probes below.

Applies to the fused gradient with rows of more than 112 KB that ``row_parts`` cuts, on
sm_90 and later (thread-block clusters), and to shorter rows in batches of fewer than 256
rows, which ``row_parts`` cuts into the fewest parts that make 512 blocks (128x32000 fp16:
4 parts of 16 KB). A block or a warp a row leaves most of the GPU idle there (128 rows on
132 SMs, each block walking 64 KB): the parts spread the batch over about four blocks an
SM. Untimed: only the tuner picks it on such rows. In place (``inplace_backward``, the gradient over
the logits) as well: a block reads the logits only before the cluster barrier (its part,
and the row loss's target logit, read first into registers), and every store of the
gradient comes after it, so no block reads what another has written. In place on an H100
(2026-12-06T16:49Z, rows "probe: in place", tree of 8e2cf27, copy 3030 GB/s; each kernel
checked against float64 first), ms, against the in-place kernel of dispatch's pick before
(head_in_shared, through the out-of-place record): 8192x128256 bf16 1.6847 against 1.7748,
4096x151936 bf16 1.0805 against 1.0912, 2048x256000 bf16 0.9063 against 1.1368, 1024x128256
fp32 0.4126 against 0.5247. So ``prefers`` takes it in place on the same rows as out of
place.

Where the 1.17-1.30x goes (H100, 2026-12-06T16:48Z and 17:10Z, rows "probe: phases" and
"probe: phases 2"; the kernel's CUDA changed before compile through TVM's
``tvm_callback_cuda_postproc``, wrong results by design, each against the kernel as built
in the same run):

- Not the read-all, barrier, write-all structure: the kernel's own copy into shared memory,
  then its chunks stored straight back (no statistics, no map), runs at 1.02x the floor on
  8192x128256 bf16 and fp16 (1.4063 and 1.4056 ms), 1.01x with the cluster barrier between
  (1.3964, 1.3977), against 1.6539 and 1.7200 as built.
- Not the barrier's wait: without it 1.6837 (bf16) and 1.6259 (fp16).
- Not the exps: each ``expf`` changed to an add, 1.6324 against 1.6666.
- Not bf16: fp16 is no faster (1.7200 against 1.6539).
- The parts: on 4096x32000 fp16, whose 62.5 KB row ``cross_entropy_grad_row_in_shared``
  keeps in one block at 1.06x (0.1826 ms; 1.01x on 32768x32000, 1.3920 ms), this kernel at
  2 parts takes 0.2095 (1.21x) and at 4 parts 0.2755 (1.60x). With the same work an element,
  the cost grows with the blocks a row: a block's serial steps past its copy (statistics,
  two block reductions, the pair's store, the barrier, the P pairs read back from L2, the
  coefficients) look like a fixed latency a part, hidden only while other blocks' copies
  are in flight, with shared memory capping those at three 62.6 KB parts: a hypothesis.
- Two parts of that latency, timed apart (rows "probe: phases 3", 17:23Z, CUDA changed):
  the fences around the barrier, now gone (the table above), and the pairs' round trip
  through L2: read from the cluster's shared memory instead (``mapa`` and
  ``ld.shared::cluster``, a second barrier before exit), without the fences, the kernel
  took 1.5015 ms on 8192x128256 bf16 (1.08x), 0.9656 on 4096x151936 and 0.8576 on
  2048x256000, checked against float64; with the fences kept, distributed shared memory
  gained nothing (1.6438). Against the fence-free global exchange built in (the table
  above, another process) that is the same on the two longer rows and 4% less on
  128256.
- Built as a lowering pass (rows "probe: exchange A/B", each kernel checked against
  float64 first), it was not a reliable win, so it is kept off main: at 18:59Z, with a
  whole cluster barrier closing the kernel, 1.4981 against 1.5668 ms on 8192x128256 bf16
  and 0.8394 against 0.8597 in place on 2048x256000, but 0.9667 against 0.9615 on
  4096x151936 and 0.3807 against 0.3740 on 1024x128256 fp32; at 19:32Z, the closing
  barrier split (arrive after the reads, wait at the end), 1.5657 against 1.5734, and
  0.8814 against 0.8573 on 2048x256000.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion import async_copy, grid_barrier
from tvm_fusion.compute.cross_entropy_grad import PARTS, PARTS_ALGORITHM, SPREAD_BLOCKS, row_parts
from tvm_fusion.contracts import CrossEntropyGradProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, register
from tvm_fusion.targets import has_clusters, sm_count

from ..common import (
    coefficients_at, first_part_only, lane_steps, lanes_split, merge_rows, outputs_to, row_loss_name, single_thread,
    stage_in_registers, unroll,
)
from .common import chunks_at, schedule_grad_batch_stage, schedule_grad_prologue, widest_vector
from .cross_entropy_row_in_shared import ROW_BYTES_MAX

PREFERRED_ROW_BYTES = 240 * 1024  # dispatch's pick on longer rows (module docstring)


@dataclass(frozen=True)
class RowInClusterKnobs(Knobs):
    threads: int = 512
    vector: int = 8  # values a 16-byte vector holds (fixed by the dtype)
    unroll: int = 16


@register
class CrossEntropyGradRowInCluster(Candidate):
    name = "cross_entropy_grad_row_in_cluster"
    op = "cross_entropy_grad"
    target_kind = "cuda"
    algorithm = PARTS_ALGORITHM
    knobs = RowInClusterKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: CrossEntropyGradProblem) -> bool:
        few = problem.batch < SPREAD_BLOCKS // 2  # rows cut to spread a small batch (row_parts)
        if not (problem.op == self.op and problem.mode == "fused"
                and (problem.classes * DTYPE_BYTES[problem.dtype] > ROW_BYTES_MAX or few)):
            return False
        try:
            row_parts(problem)
        except ValueError:
            return False
        return True

    def unsupported(self, target: Target) -> str:
        return "" if has_clusters(target) else f"its thread-block clusters need sm_90 or later, the target is {target}"

    def prefers(self, problem: CrossEntropyGradProblem, target: Target) -> bool:
        # H100, 2026-12-06 (module docstring): faster than head_in_shared on rows of
        # 250.5-501 KiB and 1024 rows or more, out of place and in place.
        return (problem.classes * DTYPE_BYTES[problem.dtype] > PREFERRED_ROW_BYTES
                and problem.batch >= sm_count(target))

    def choices(self, problem: CrossEntropyGradProblem, target: Target) -> dict[str, list[int]]:
        return {"threads": [256, 512, 1024], "vector": [widest_vector(problem.dtype, problem.classes)],
                "unroll": [4, 16]}

    def default_for(self, problem: CrossEntropyGradProblem, target: Target) -> RowInClusterKnobs:
        return RowInClusterKnobs(vector=widest_vector(problem.dtype, problem.classes))

    def schedule(self, sch, problem: CrossEntropyGradProblem, knobs) -> None:
        parts, threads, vector, step = row_parts(problem), knobs.threads, knobs.vector, knobs.unroll
        loss = row_loss_name(problem)
        # Kernel 1: the targets pass.
        schedule_grad_prologue(sch, problem)
        # The part's copy (the view) in shared memory, read by the statistics' chunks and the map.
        chunk_max, chunk_sum, mapped = (sch.get_sblock(n) for n in ("chunk_max", "chunk_sumexp", PARTS))
        copy = sch.get_sblock("logits_parts")
        sch.set_scope(copy, 0, "shared.dyn")
        shared = sch.get(copy).writes[0].source.name
        # The map's values in registers, stored straight into dlogits (the gather inlined).
        store = sch.cache_write(mapped, 0, "local")
        self.annotate_choice(sch, store, knobs)  # dlogits, the annotated block, is inlined
        sch.reverse_compute_inline(sch.get_sblock("dlogits"))
        # Kernel 2, a block a part (a row of the view), a row's P parts one cluster.
        map_task = sch.get_loops(mapped)[0]
        coefficients_at(sch, problem, map_task, "local")
        # After the cluster barrier (below), each block folds its row's P parts in registers.
        online = sch.get_sblock("row_online_map")
        sch.compute_at(online, map_task, preserve_unit_loops=True)
        outputs_to(sch, online, "local")
        # lse and the row loss written by each row's first block, from their own fold of
        # the row's parts: their row loop as the parts' (a unit loop split by P: a predicate).
        outputs = merge_rows(sch, ["lse", loss])
        online = sch.get_sblock("row_online")
        sch.compute_at(online, outputs, preserve_unit_loops=True)
        outputs_to(sch, online, "local")
        tasks = [sch.get_loops(sch.get_sblock("part_online"))[0], map_task,
                 first_part_only(sch, outputs, parts, sch.get_sblock("lse"))]
        if problem.in_place:
            # The row loss's one logit, read first by the row's first block, in every
            # thread's registers: before the barrier, after which every block of the row
            # stores its part's gradient over the logits.
            target_logit = sch.get_sblock("target_logit")
            outputs_to(sch, target_logit, "local")
            tasks.insert(0, first_part_only(sch, sch.get_loops(target_logit)[0], parts, target_logit))
        task = sch.merge(*tasks)
        sch.bind(task, "blockIdx.x")
        grid_barrier.before_cluster(sch, sch.get_loops(sch.get_sblock("row_online_map"))[1], parts)
        # The part's chunks across the lanes, each staged from the copy into registers.
        serial, at, _ = lane_steps(sch, sch.get_loops(sch.get_sblock("part_online"))[1], threads)
        unroll(sch, serial, step)
        chunks_at(sch, at, staged=shared)
        # The part's copy, 16 bytes a lane, cp.async.
        sch.compute_at(copy, task, preserve_unit_loops=True)
        _, copies, vec = lanes_split(sch, copy, 1, threads, vector, step)
        sch.vectorize(vec)
        async_copy.mark(sch, copies)
        # The gradient of the part from the copy, 16-byte stores.
        _, serial, vec = lanes_split(sch, mapped, 1, threads, vector, step)
        sch.unroll(vec)
        stage_in_registers(sch, mapped, shared, serial)
        sch.reverse_compute_at(store, serial, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(store)[-1])
        for name in ("lse", loss):
            single_thread(sch, sch.get_sblock(name), threads)
        # Kernel 3: the loss.
        schedule_grad_batch_stage(sch, problem, threads)
