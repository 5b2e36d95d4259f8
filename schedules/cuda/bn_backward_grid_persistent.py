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
two-read backward (``bn_backward_block_per_channel``). Predicted, not measured:
64x256x56x56 fp16 at P = 4 (2 x 100 KB a block, G = 128, 8 rounds) about 0.08 ms
against 0.1218 for dispatch's backward (its forward + backward 0.2024 less its
forward 0.0806), so forward + backward with ``bn_forward_grid_persistent`` about 0.14
ms, 1.15x the floor of 5 input sizes. The same risk as the forward's: one block an SM
makes each round a read phase then a write phase.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion import grid_barrier
from tvm_fusion.compute.bn_stats import PART_BYTES, parts
from tvm_fusion.contracts import BNBackwardProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, register
from tvm_fusion.targets import sm_count

from ..common import lanes_split, merge_rows, outputs_to, read_index, stage_in_registers
from .common import vector_choices, widest_vector

THREADS = [256, 512, 1024]
OUTPUT_THREADS = 128  # the second kernel's block: a thread a channel
COPIES = 2  # x and dy


def grid_choices(problem: BNBackwardProblem, target: Target) -> list[int]:
    """G: block counts, one block an SM at most, that are multiples of P and divide the
    tasks (the largest is the default)."""
    count = parts(problem, COPIES)
    tasks = count * problem.channels
    return [g for g in range(count, min(sm_count(target), tasks) + 1, count) if tasks % g == 0]


@dataclass(frozen=True)
class GridPersistentBackwardKnobs(Knobs):
    threads: int = 1024
    vector: int = 8
    grid: int = 128  # G, blocks (a multiple of P that divides the tasks)


@register
class BNBackwardGridPersistent(Candidate):
    name = "bn_backward_grid_persistent"
    op = "bn_backward"
    target_kind = "cuda"
    algorithm = "dual_reduce_parts"
    knobs = GridPersistentBackwardKnobs
    claims = {"shuffles": True, "vector_loads": True, "atomics": True}  # the grid barrier's

    def applies(self, problem: BNBackwardProblem) -> bool:
        if problem.op != self.op or not problem.training or problem.channels_last:
            return False
        count = parts(problem, COPIES)
        part_bytes = COPIES * problem.count // count * DTYPE_BYTES[problem.dtype]
        return count > 1 and part_bytes <= PART_BYTES

    def prefers(self, problem: BNBackwardProblem, target: Target) -> bool:
        return False  # unmeasured: the tuner may pick it, dispatch's heuristic does not

    def choices(self, problem: BNBackwardProblem, target: Target) -> dict[str, list[int]]:
        return {"threads": THREADS, "vector": vector_choices(DTYPE_BYTES[problem.dtype], problem.shape[2]),
                "grid": grid_choices(problem, target)}

    def default_for(self, problem: BNBackwardProblem, target: Target) -> GridPersistentBackwardKnobs:
        return GridPersistentBackwardKnobs(threads=1024, vector=widest_vector(problem.dtype, problem.shape[2]),
                                           grid=grid_choices(problem, target)[-1])

    def schedule(self, sch, problem: BNBackwardProblem, knobs) -> None:
        count = parts(problem, COPIES)
        partial, dx = sch.get_sblock("part_grad_sums"), sch.get_sblock("dx")
        # The parts' copies in shared memory, for both readers (placed below).
        copies = [sch.cache_read(partial, read_index(sch, partial, name), "shared.dyn", consumer_blocks=[partial, dx])
                  for name in ("x", "dy")]
        on_chip = [sch.get(copy).writes[0].source.name for copy in copies]
        # The tasks: (channel, part) fused, split [round, blockIdx.x], for the partial
        # sums and the map alike; one merge puts both under one (block, round) nest.
        p, c, *_ = sch.get_loops(partial)
        sch.reorder(c, p)
        rounds = []
        for task in (sch.fuse(c, p), None):
            if task is None:
                n, c, _ = sch.get_loops(dx)
                p, n_in = sch.split(n, [count, None])
                sch.reorder(c, p, n_in)
                task = sch.fuse(c, p)
            r, g = sch.split(task, [None, knobs.grid])
            sch.reorder(g, r)
            rounds.append(r)
        round_loop = sch.merge(*rounds)
        sch.bind(sch.get_loops(partial)[0], "blockIdx.x")
        # The map's coefficients after the barrier, every thread in its registers.
        for name in ("bn_dx_xhat", "bn_dx_mean", "grad_sums_map", "bn_dx_scale"):
            block = sch.get_sblock(name)
            sch.compute_at(block, round_loop, preserve_unit_loops=True)
            outputs_to(sch, block, "local")
        grid_barrier.before(sch, sch.get_loops(sch.get_sblock("grad_sums_map"))[2])
        # The channel's mean and invstd in registers once a round, for the sums and dx.
        for name in ("mean", "invstd"):
            stat = sch.cache_read(partial, read_index(sch, partial, name), "local", consumer_blocks=[partial, dx])
            sch.compute_at(stat, round_loop, preserve_unit_loops=True)
        for copy in copies:
            sch.compute_at(copy, round_loop, preserve_unit_loops=True)
            _, _, vec = lanes_split(sch, copy, 2, knobs.threads, knobs.vector, 1)
            sch.vectorize(vec)
        # The partial sums across the lanes, 16 bytes of each copy at a time.
        _, serial, _ = lanes_split(sch, partial, 2, knobs.threads, knobs.vector, 1)
        for name in on_chip:
            stage_in_registers(sch, partial, name, serial)
        # dx from the copies, 16-byte stores.
        _, serial, _ = lanes_split(sch, dx, 2, knobs.threads, knobs.vector, 1)
        for name in on_chip:
            stage_in_registers(sch, dx, name, serial)
        out = sch.cache_write(dx, 0, "local")
        sch.reverse_compute_at(out, serial, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(out)[-1])
        # The second kernel: dweight and dbias, a thread a channel.
        channel = merge_rows(sch, ["dweight", "dbias"])
        sch.compute_at(sch.get_sblock("grad_sums"), channel, preserve_unit_loops=True)
        outputs_to(sch, sch.get_sblock("grad_sums"), "local")
        blocks, lanes = sch.split(channel, [None, OUTPUT_THREADS])
        sch.bind(blocks, "blockIdx.x")
        sch.bind(lanes, "threadIdx.x")
