"""BatchNorm's training forward as one grid-wide persistent kernel: x read once.

Pattern ``x(SRR) -> part on chip -> part (sum, sumsq)(SS) | grid barrier | (sum,
sumsq)(S) -> coef(S) -> y(SSS) from chip`` on the ``(N, C, L)`` view, the
``shifted_parts`` decomposition; then ``(sum, sumsq)(S) -> mean, invstd, running(S)``.
For channels too large for one block (``bn_forward_persistent`` keeps a channel of up
to 96 KB): each channel is cut into P parts along N (``bn_stats.parts``: the fewest,
of at most 200 KB each), a (channel, part) pair is a task, and a grid of G blocks
walks the tasks in rounds of G, one block an SM. In each round a block
1. copies its part of x into dynamic shared memory (a vector a lane, as ``cp.async``
   where that is 4, 8 or 16 bytes: :mod:`tvm_fusion.async_copy`);
2. sums ``d = x - K[c]`` and ``d^2`` over the copy across its lanes and writes the
   part's two sums (``part_moments``);
3. waits at a grid barrier (:mod:`tvm_fusion.grid_barrier`: the kernel is launched
   cooperatively, so every block is resident and reaches it);
4. adds up its channel's P partials (``moments_map``) and computes the map's
   coefficients, every thread in its registers;
5. writes y from the shared copy (16-byte stores).
G is a multiple of P that divides the C * P tasks, so the P blocks of a channel run in
the same round and every block meets every barrier. A second kernel, one thread a
channel, adds the partials up again (``moments``) for ``save_mean``, ``save_invstd``
and the running statistics: written once, after every block read the old running
values, so the in-place update has no race between a channel's blocks.

Lanes: whole warps that split a part's chunks evenly (``thread_choices``: 896 on
64x256x56x56 fp16); with a step only some lanes take, TVM bounded the map's write-back
by the tensor, not the part, and the lanes past it wrote over the next part.

Bytes: x read once, y written once (``bn_forward_block_per_channel`` and the split
plane read x twice). Predicted: 64x256x56x56 fp16 at P = 2 (200 KB a block, G = 128,
4 rounds) about 0.060 ms against 0.0806 on the H200 (25% less). Measured on an H100
(2026-12-05, rows "probe: grid-wide persistent BatchNorm" of results/benchmarks.csv,
copy 3009 GB/s, against dispatch's kernels in the same run), forward alone:
64x256x56x56 fp16 0.1022 ms against 0.1103, bf16 0.0993 against 0.1099, 32x64x112x112
fp16 0.0534 against 0.0586, 64x256x56x56 fp32 0.1820 against 0.2130: 7-15% less, not
25%. 0.1022 ms is 1.50x the forward's floor there (two input sizes at the copy rate).
Why it missed, as far as the knobs tell: one block an SM makes each round a read phase
then a write phase, no overlap inside an SM; fewer lanes take longer (448: 0.1135, 256:
0.1647, 128: 0.2483), and half the grid (64 blocks) 0.1395. That reading was tested by
``bn_forward_grid_pipelined`` (the next round's part copied in meanwhile, cp.async): it
was 3-6% slower, so the phases are not what limits this kernel; its docstring says what
the numbers fit instead (a fixed cost of 3.5-4.5 us a round). The default wherever its
grid fills the SMs (``prefers``); the shipped records still decide their shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion import async_copy, async_rounds, grid_barrier
from tvm_fusion.compute import PART_COPIES
from tvm_fusion.compute.bn_forward import channel_outputs
from tvm_fusion.compute.bn_stats import PART_BYTES, parts
from tvm_fusion.contracts import BNForwardProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, register
from tvm_fusion.targets import has_clusters, sm_count

from ..common import (
    first_part_only, lanes_split, merge_rows, outputs_to, read_index, single_thread, stage_in_registers,
    thread_reduce,
)
from .common import reads_16_bytes, store_vectors, vector_choices, widest_vector

LANES = range(128, 1025, 32)  # threads a block may have: whole warps, up to 1024
OUTPUT_THREADS = 128  # the second kernel's block: a thread a channel


def grid_choices(problem, target: Target, copies: int = 1) -> list[int]:
    """G: block counts, one block an SM at most, that are multiples of P and divide the
    tasks (the largest is the default); ``copies`` tensors kept a part."""
    count = parts(problem, copies)
    tasks = count * problem.channels
    return [g for g in range(count, min(sm_count(target), tasks) + 1, count) if tasks % g == 0]


def thread_choices(problem, copies: int) -> list[int]:
    """Lane counts that split a part's chunks (of the widest vector, so of every
    narrower one too) evenly, none left over. Why: with a last step that only some
    lanes take, TVM bounds the map's 16-byte write-back by the tensor, not the part, and
    the lanes past the part stored over the next part's values (H100, 2026-12-05:
    64x256x56x56 fp16 at 1024 lanes, 12.25 steps, y off by 11.6; right at 256 lanes),
    and the copies' regions grow by the last step (the backward asked for 238 KB of
    shared memory)."""
    chunks = problem.count // parts(problem, copies) // widest_vector(problem.dtype, problem.shape[2])
    return [t for t in LANES if chunks % t == 0]


# The default where a grid of at least this share of the SMs divides the tasks: faster
# than dispatch's kernels on every shape timed (module docstring), all at 128 of 132.
GRID_SHARE_MIN = 0.9


def fills_the_sms(problem, target: Target, copies: int) -> bool:
    """The largest grid takes at least ``GRID_SHARE_MIN`` of the SMs (8x3x224x224 has
    12 tasks: 12 blocks would leave 120 SMs idle)."""
    return max(grid_choices(problem, target, copies)) >= GRID_SHARE_MIN * sm_count(target)


def fits_in_parts(problem, copies: int) -> bool:
    """NCHW training, channels of more than one part, each part's ``copies`` tensors
    within ``PART_BYTES``, and lanes that split a part evenly."""
    if not problem.training or problem.channels_last:
        return False
    count = parts(problem, copies)
    return (count > 1 and copies * problem.count // count * DTYPE_BYTES[problem.dtype] <= PART_BYTES
            and bool(thread_choices(problem, copies)))


def task_rounds(sch, partial, mapped, count, grid, tail=None):
    """The (channel, part) tasks of the partial sums (loops ``(part, channel, ...)``)
    and of the map (``(n, channel, l)``, n cut in ``count`` parts), each fused (a
    channel's parts consecutive) and split ``[round, blockIdx.x]`` by ``grid``, merged
    into one nest; returns its round loop. ``grid`` None: a block a task, no rounds
    (returns the block loop), and ``tail``, a loop over the same tasks
    (:func:`outputs_in_tasks`), merged in after the map."""
    if tail is not None and grid is not None:
        raise ValueError("task_rounds: a tail loop merges into a block a task, not into rounds")

    def rounds(c, p):
        fused = sch.fuse(c, p)
        if grid is None:
            return fused
        r, g = sch.split(fused, [None, grid])
        sch.reorder(g, r)
        return r

    p, c, *_ = sch.get_loops(partial)
    sch.reorder(c, p)
    sums = rounds(c, p)
    n, c, _ = sch.get_loops(mapped)
    p, n_in = sch.split(n, [count, None])
    sch.reorder(c, p, n_in)
    round_loop = sch.merge(sums, rounds(c, p), *([] if tail is None else [tail]))
    sch.bind(sch.get_loops(partial)[0], "blockIdx.x")
    return round_loop


def after_barrier(sch, round_loop, names, combine: str, depth: int = 2, cluster: int = 0) -> None:
    """The map's per-channel blocks ``names`` (consumers first) at the round, in every
    thread's registers, and the barrier before ``combine`` (the partials' sum; its loop
    under the ``depth`` loops above a task): the grid's, or with ``cluster`` the
    cluster's of that many blocks."""
    for name in names:
        block = sch.get_sblock(name)
        sch.compute_at(block, round_loop, preserve_unit_loops=True)
        outputs_to(sch, block, "local")
    loop = sch.get_loops(sch.get_sblock(combine))[depth]
    if cluster:
        grid_barrier.before_cluster(sch, loop, cluster)
    else:
        grid_barrier.before(sch, loop)


def copy_in(sch, copy, round_loop, knobs, depth: int = 2, asynchronous: bool = False) -> None:
    """A part's copy at the round, lanes on consecutive 16-byte chunks; ``depth``: the
    loops above a task's (the block's and the round's; the block's alone without
    rounds). ``asynchronous``: the copy issued as ``cp.async`` (:mod:`tvm_fusion.async_copy`)."""
    sch.compute_at(copy, round_loop, preserve_unit_loops=True)
    _, serial, vec = lanes_split(sch, copy, depth, knobs.threads, knobs.vector, 1)
    sch.vectorize(vec)
    if asynchronous:
        async_copy.mark(sch, serial)


def reduce_from(sch, partial, on_chip, knobs, depth: int = 2) -> None:
    """The partial sums across the lanes, 16 bytes of each copy at a time."""
    _, serial = thread_reduce(sch, partial, depth, knobs.threads, knobs.vector, 1, on_chip[0])
    for name in on_chip[1:]:
        stage_in_registers(sch, partial, name, serial)


def map_from(sch, block, on_chip, knobs, depth: int = 2) -> None:
    """The map from the copies, 16-byte stores (the lanes split a part evenly)."""
    _, serial, vec = lanes_split(sch, block, depth, knobs.threads, knobs.vector, 1)
    for name in on_chip:
        stage_in_registers(sch, block, name, serial)
    store_vectors(sch, block, serial, vec, perfect=True)


def outputs_in_tasks(sch, outputs, sums, count):
    """The per-channel ``outputs`` (the blocks ``sums``, producers last, at them in
    registers) as a loop over the (channel, part) tasks, ``count`` parts a channel,
    whose part 0 alone writes (a split of a unit loop by ``count``: a predicate),
    for :func:`task_rounds` to merge after the map: each channel's outputs written
    by its first block instead of a second kernel. Where the running statistics are
    updated in place, only that block reads and writes them (:func:`first_thread`
    leaves it to one thread); its channel's other blocks' partials are there after
    the barrier before the map."""
    channel = merge_rows(sch, outputs)
    for name in sums:
        sch.compute_at(sch.get_sblock(name), channel, preserve_unit_loops=True)
        outputs_to(sch, sch.get_sblock(name), "local")
    return first_part_only(sch, channel, count, sch.get_sblock(outputs[0]))


def first_thread(sch, outputs, threads) -> None:
    """Each of the ``outputs`` blocks written by thread 0 of a ``threads``-lane block
    (their producers stay in every thread's registers)."""
    for name in outputs:
        single_thread(sch, sch.get_sblock(name), threads)


def outputs_kernel(sch, outputs, sums) -> None:
    """The second kernel: the per-channel ``outputs`` merged into one channel loop, the
    blocks ``sums`` (producers last) at it in registers, a thread a channel."""
    channel = merge_rows(sch, outputs)
    for name in sums:
        sch.compute_at(sch.get_sblock(name), channel, preserve_unit_loops=True)
        outputs_to(sch, sch.get_sblock(name), "local")
    blocks, lanes = sch.split(channel, [None, OUTPUT_THREADS])
    sch.bind(blocks, "blockIdx.x")
    sch.bind(lanes, "threadIdx.x")


@dataclass(frozen=True)
class GridPersistentKnobs(Knobs):
    threads: int = 1024
    vector: int = 8
    grid: int = 128  # G, blocks (a multiple of P that divides the tasks)


class GridPersistentCandidate(Candidate):
    """What the grid-wide forward and backward share: where they apply and are the
    default, and their knobs."""

    target_kind = "cuda"
    knobs = GridPersistentKnobs
    claims = {"shuffles": True, "vector_loads": True, "atomics": True}  # the grid barrier's
    # Each channel's first block writes the per-channel outputs after its map
    # (:func:`outputs_in_tasks`), one launch instead of two: a block a task only.
    one_launch = False

    @property
    def copies(self) -> int:
        """How many part-sized tensors a block keeps on chip: the decomposition's."""
        return PART_COPIES[self.algorithm]

    def applies(self, problem) -> bool:
        return problem.op == self.op and fits_in_parts(problem, self.copies)

    def grid(self, knobs):
        """G, the blocks that walk the tasks in rounds; None: a block a task."""
        return knobs.grid

    def cluster(self, problem) -> int:
        """Blocks a cluster barrier waits for; 0: the grid barrier."""
        return 0

    def depth(self, knobs) -> int:
        """Loops above a task's: the block's and, with rounds, the round's."""
        return 1 if self.grid(knobs) is None else 2

    # The parts' copies issued as cp.async (tvm_fusion.async_copy).
    asynchronous_copies = True

    def prefers(self, problem, target: Target) -> bool:
        return fills_the_sms(problem, target, self.copies)

    def choices(self, problem, target: Target) -> dict[str, list[int]]:
        return {"threads": thread_choices(problem, self.copies),
                "vector": vector_choices(DTYPE_BYTES[problem.dtype], problem.shape[2]),
                "grid": grid_choices(problem, target, self.copies)}

    def default_for(self, problem, target: Target) -> GridPersistentKnobs:
        return GridPersistentKnobs(threads=thread_choices(problem, self.copies)[-1],
                                   vector=widest_vector(problem.dtype, problem.shape[2]),
                                   grid=grid_choices(problem, target, self.copies)[-1])


MAX_CLUSTER = 8  # blocks in a portable thread-block cluster


@dataclass(frozen=True)
class ClusterKnobs(Knobs):
    threads: int = 1024
    vector: int = 8


class ClusterParts:
    """What the cluster candidates (``bn_forward_cluster``, ``bn_backward_cluster`` and
    the forward's smaller parts, ``bn_forward_cluster_half`` and ``_quarter``) change in
    the grid-wide ones they derive from: a block a (channel, part) task, no rounds and no
    grid barrier; a channel's P parts (consecutive blocks) are one thread-block cluster,
    and the barrier between the partial sums and the map waits for that cluster alone
    (``grid_barrier.before_cluster``). So P is at most 8 (a portable cluster), the knobs
    have no grid, and the target is sm_90 or later (``targets.has_clusters``).
    ``lane_share``: the default lanes are the grid-wide default's over it (at most
    ``LANES``' largest over it), the same bytes a lane where a part has 1/``lane_share``
    of the bytes."""

    knobs = ClusterKnobs
    claims = {"shuffles": True, "vector_loads": True}
    lane_share = 1

    def applies(self, problem) -> bool:
        return super().applies(problem) and parts(problem, self.copies) <= MAX_CLUSTER

    def unsupported(self, target: Target) -> str:
        return "" if has_clusters(target) else f"its thread-block clusters need sm_90 or later, the target is {target}"

    def prefers(self, problem, target: Target) -> bool:
        return False

    def choices(self, problem, target: Target) -> dict[str, list[int]]:
        return {k: v for k, v in super().choices(problem, target).items() if k != "grid"}

    def default_for(self, problem, target: Target) -> ClusterKnobs:
        knobs = super().default_for(problem, target)
        lanes = [t for t in self.choices(problem, target)["threads"] if t <= LANES[-1] // self.lane_share]
        return ClusterKnobs(threads=max(lanes, default=knobs.threads), vector=knobs.vector)

    def grid(self, knobs):
        return None

    def cluster(self, problem) -> int:
        return parts(problem, self.copies)


# Shared memory of an SM that blocks may take (sm_90: 227 KB): how many blocks of a part
# size can be resident on one SM at once.
SHARED_BYTES_AN_SM = 227 * 1024


def resident_blocks(problem, target: Target, count: int, tensors: int) -> int:
    """Blocks that keep ``tensors`` parts (of ``count`` a channel) each and fit the SMs'
    shared memory at once."""
    block = tensors * problem.count // count * DTYPE_BYTES[problem.dtype]
    return sm_count(target) * max(1, SHARED_BYTES_AN_SM // block)


class ClusterRounds(ClusterParts):
    """What the cluster candidates with rounds (``bn_forward_cluster_rounds``,
    ``bn_backward_cluster_rounds``) change in ``ClusterParts``: a grid of G blocks, in
    clusters of P, walks the (channel, part) tasks in rounds of G, as the grid-wide
    kernels' does, with the cluster barrier in each round instead of the grid's (a
    channel's P tasks are consecutive blocks of one cluster in the same round). G is a
    knob: multiples of P that divide the tasks, up to the blocks whose parts fit the
    SMs' shared memory at once (``resident_blocks``; no cooperative launch: a cluster
    waits for its own blocks only). ``tensors``: the parts a block keeps on chip (x; x
    and dy)."""

    knobs = GridPersistentKnobs
    tensors = 1

    def choices(self, problem, target: Target) -> dict[str, list[int]]:
        count = parts(problem, self.copies)
        tasks, most = count * problem.channels, resident_blocks(problem, target, count, self.tensors)
        grids = [g for g in range(count, min(tasks, most) + 1, count) if tasks % g == 0]
        return {**super().choices(problem, target), "grid": grids}

    def default_for(self, problem, target: Target) -> GridPersistentKnobs:
        knobs = super().default_for(problem, target)
        return GridPersistentKnobs(threads=knobs.threads, vector=knobs.vector,
                                   grid=self.choices(problem, target)["grid"][-1])

    def grid(self, knobs):
        return knobs.grid


class PipelinedRounds:
    """What the pipelined grid-wide candidates (``bn_forward_grid_pipelined``,
    ``bn_backward_grid_pipelined``) add to the grid-wide ones they derive from: 16-byte
    copies only (cp.async takes 4, 8 or 16 bytes a lane), never the heuristic's pick
    (slower than the unpipelined kernels on every shape the H100 timed), and the round
    loop pipelined after their schedule (:mod:`tvm_fusion.async_rounds`). ``on_chip``:
    the copies' blocks; ``partial``: the partial sums (a cross-thread reduction);
    ``combine``: the partials' sum after the grid barrier."""

    on_chip: tuple[str, ...]
    partial: str
    combine: str

    def applies(self, problem) -> bool:
        return super().applies(problem) and reads_16_bytes(problem.dtype, problem.shape[2])

    def prefers(self, problem, target: Target) -> bool:
        return False

    asynchronous_copies = False  # the software pipeline makes the copies asynchronous itself

    def schedule(self, sch, problem, knobs) -> None:
        super().schedule(sch, problem, knobs)
        copies = [sch.get_sblock(name) for name in self.on_chip]
        async_rounds.pipeline(sch, sch.get_loops(copies[0])[1], copies, [sch.get_sblock(self.partial)],
                              sch.get_sblock(self.combine))


@register
class BNForwardGridPersistent(GridPersistentCandidate):
    name = "bn_forward_grid_persistent"
    op = "bn_forward"
    algorithm = "shifted_parts"

    def schedule(self, sch, problem: BNForwardProblem, knobs) -> None:
        count = parts(problem, self.copies)
        partial, y = sch.get_sblock("part_moments"), sch.get_sblock("y")
        # 1. The part's copy in shared memory, for both readers (placed below). Taken
        # before the shift K[c] = x[0, c, 0] is inlined, so that K stays a read of x
        # itself (through the copy it would stretch the part's region to row 0).
        copy = sch.cache_read(partial, read_index(sch, partial, "x"), "shared.dyn", consumer_blocks=[partial, y])
        on_chip = sch.get(copy).writes[0].source.name
        sch.compute_inline(sch.get_sblock("shift"))
        outputs, sums = channel_outputs(problem), ("var", "mean", "moments")
        tail = outputs_in_tasks(sch, outputs, sums, count) if self.one_launch else None
        round_loop = task_rounds(sch, partial, y, count, self.grid(knobs), tail)
        # 4. The map's coefficients after the barrier, every thread in its registers.
        depth = self.depth(knobs)
        after_barrier(sch, round_loop, ("bn_scale", "bn_shift", "var_map", "mean_map", "moments_map"), "moments_map",
                      depth, self.cluster(problem))
        copy_in(sch, copy, round_loop, knobs, depth, self.asynchronous_copies)
        # 2. The partial sums across the lanes, 16 bytes of the copy at a time; K[c]
        # loaded once a round into a register (inlined, nvcc reloaded it for every value).
        shift = sch.cache_read(partial, read_index(sch, partial, "x"), "local", consumer_blocks=[partial])
        sch.compute_at(shift, round_loop, preserve_unit_loops=True)
        reduce_from(sch, partial, [on_chip], knobs, depth)
        # 5. y from the copy, 16-byte stores.
        map_from(sch, y, [on_chip], knobs, depth)
        # The per-channel outputs: a second kernel, a thread a channel, or thread 0 of
        # each channel's first block.
        if tail is None:
            outputs_kernel(sch, outputs, sums)
        else:
            first_thread(sch, outputs, knobs.threads)
