"""CUDA steps and launch ladders shared by the candidates.

A number used by more than one candidate is written here once, with its evidence;
a threshold only one candidate uses stays in that candidate's module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tvm import s_tir
from tvm.target import Target

from tvm_fusion import launch_order
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, ladder
from tvm_fusion.targets import sm_count

from ..common import (
    LoopRV, SBlockRV, lane_steps, lanes_split, merge_rows, outputs_to, read_index, row_loss_name,
    single_thread, stage_in_registers, thread_reduce, unroll,
)

MAX_THREADS = 1024
WARP = 32
VECTOR_BYTES = 16  # one 128-bit load (LDG.E.128) per lane
# Threads of the grid-split candidates' finalize kernel (one block per channel sums
# that channel's partials).
FINALIZE_THREADS = 128
# Blocks per SM a grid-split kernel aims for: enough resident blocks that every SM
# keeps loads in flight (split_plane's splits, channels_last's splits).
BLOCKS_PER_SM = 4

# Threads per block by 16-byte vectors per row: about 8-16 vectors per lane per
# pass, from first principles. On the H200 (2026-11-29, results/benchmarks.csv) the
# default for 4096x32000 fp16 (256 threads, vector 8) took 0.1153 ms; the tuner found
# 512 threads with vector 4 at 0.0894 ms (runner time): tuning records, not this
# ladder, carry such per-shape findings. Used by every block-per-row cross entropy.
THREADS_BY_VECTORS = [(1024, 64), (4096, 256), (16384, 512)]


def vector_choices(elem_bytes: int, contiguous: int) -> list[int]:
    """Vector widths up to 16 bytes that divide the contiguous run (so every vector
    is aligned and in bounds); 1 only when no wider one does (a unit loop changes
    the loop structure, which a tuning trace replayed with another decision cannot
    follow)."""
    widths = []
    width = 2
    while width * elem_bytes <= VECTOR_BYTES:
        if contiguous % width == 0:
            widths.append(width)
        width *= 2
    return widths or [1]


def widest_vector(dtype: str, contiguous: int) -> int:
    """The widest of :func:`vector_choices`: every candidate's default vector."""
    return max(vector_choices(DTYPE_BYTES[dtype], contiguous))


def reads_16_bytes(dtype: str, contiguous: int) -> bool:
    """The widest vector that divides the contiguous run is 16 bytes (not the scalar
    loads of, e.g., an odd V in fp16/bf16)."""
    return widest_vector(dtype, contiguous) * DTYPE_BYTES[dtype] == VECTOR_BYTES


def spans_two_vectors(classes: int, dtype: str) -> bool:
    """A row holds more than one of its widest vectors. With a single vector the
    cross-thread reduction's serial loop has extent 1 and disappears, the block's
    syncs land under the lane guard, and TVM 0.27 refuses to lower ("Cannot insert
    syncs inside condition"): found by the GPU sweep's builds at V = 1, 2, 4 (float32)
    and V = 8 (16-bit)."""
    return classes > widest_vector(dtype, classes)


# A one-block batch stage runs on the row kernel's lanes where each lane then sums at
# most this many rows (as many as the widest block takes on 4096 rows): single_launch
# then runs it in the row kernel's last block, one launch fewer. Past it, the stage
# keeps MAX_THREADS lanes, whose loads are more in flight than a merge saves.
MERGED_ROWS_PER_LANE = 4


def batch_threads(sch: s_tir.Schedule, rows: int, row_threads: Any) -> Any:
    """The lanes of the one-block batch stage over ``rows`` after a row kernel of
    ``row_threads`` lanes (``threadIdx.x`` only; an int or a sampled knob): those lanes
    where that merges the two launches at no more than MERGED_ROWS_PER_LANE rows a
    lane, else MAX_THREADS."""
    return row_threads if rows <= MERGED_ROWS_PER_LANE * knobs_value(sch, row_threads) else MAX_THREADS


def schedule_ce_batch_stage(sch: s_tir.Schedule, problem, row_threads: Any = None) -> None:
    """Second kernel of cross entropy: one block sums the row losses and weights and
    finds the first bad target, each thread striding over rows, then a warp-shuffle
    reduction; thread 0 writes ``loss`` and ``first_bad_row``. Its lanes: MAX_THREADS,
    or with ``row_threads`` (the row kernel's lanes) :func:`batch_threads`'s."""
    reduction = problem.reduction
    threads = MAX_THREADS if row_threads is None else batch_threads(sch, problem.batch, row_threads)
    if reduction == "none":
        one_block_reduce(sch, "first_bad_row", threads)
    else:
        one_block_reduce(sch, "batch", threads, epilogues=("first_bad_row", "loss"))


# One block reads a batch stage's rows at one SM's bandwidth: on the H200, 65536 rows
# of a float32 loss and an int64 target (786 KB) are several microseconds, a sixth of
# the 0.042 ms cross entropy of 65536x1000 fp16 (padded A/B grid at fc88131). From
# this many rows on, the stage is two kernels: CHUNK_ROWS rows a block into partials
# (an rfactor, one block per chunk), then one block over the partials. Fewer rows keep
# one kernel: a launch (about 1 us under graph replay) costs more than it saves.
TWO_LEVEL_ROWS = 16384
CHUNK_ROWS = 1024
CHUNK_THREADS = 256
MIN_CHUNKS = 8


def batch_chunks(rows: int) -> int:
    """The chunks of a two-level batch stage over ``rows``: the divisor of ``rows``
    nearest ``rows / CHUNK_ROWS``, at most MAX_THREADS (the second kernel is one
    block), or 1 (one kernel) below TWO_LEVEL_ROWS or where no divisor gives
    MIN_CHUNKS chunks. A divisor, because an uneven cut puts the chunk index and the
    reduced index in one predicate, and TVM 0.27 then silently skips the cross-thread
    lowering: each lane read-modify-writes the partial, a race (seen in the generated
    CUDA of 50000 rows cut into 49 chunks)."""
    if rows < TWO_LEVEL_ROWS:
        return 1
    wanted = rows / CHUNK_ROWS
    divisors = [d for d in range(MIN_CHUNKS, MAX_THREADS + 1) if rows % d == 0]
    return min(divisors, key=lambda d: (abs(d - wanted), d)) if divisors else 1


def one_block_reduce(
    sch: s_tir.Schedule, name: str, threads: int = MAX_THREADS, epilogues: tuple[str, ...] = (),
    chunk_threads: int = CHUNK_THREADS,
) -> None:
    """A reduction to one value in one block: each thread strides over the reduced
    axis, then the cross-thread step (shuffles within warps, shared memory across).
    With ``epilogues`` the result stays in shared memory and thread 0 runs each
    epilogue (the copies into the function's outputs). Where :func:`batch_chunks`
    cuts the rows, a first kernel of one block a chunk writes partials (an rfactor),
    and the block reduces those, on as many lanes as the partials kernel has
    (``chunk_threads``)."""
    block = sch.get_sblock(name)
    unit, reduced = sch.get_loops(block)
    chunks = batch_chunks(int(sch.get(reduced).extent))
    if chunks > 1:
        chunk, _ = sch.split(reduced, [chunks, None])
        partial = sch.rfactor(chunk, 0)
        partial_unit, chunk, within = sch.get_loops(partial)
        sch.bind(sch.fuse(partial_unit, chunk), "blockIdx.x")
        serial, lane = sch.split(within, [None, chunk_threads])
        sch.reorder(lane, serial)
        sch.bind(lane, "threadIdx.x")
        unit, reduced = sch.get_loops(block)
        # The partials kernel's lanes, so that single_launch runs this block in its last one.
        threads = chunk_threads
    sch.bind(unit, "blockIdx.x")
    serial, lane = sch.split(reduced, [None, threads])
    sch.reorder(lane, serial)
    sch.bind(lane, "threadIdx.x")
    if not epilogues:
        return
    outputs_to(sch, block, "shared")
    for epilogue_name in epilogues:
        epilogue = sch.get_sblock(epilogue_name)
        sch.reverse_compute_at(epilogue, unit)
        single_thread(sch, epilogue, threads)


# -- the cross entropy gradient ---------------------------------------------------
def schedule_grad_prologue(sch: s_tir.Schedule, problem, row_lanes: int | None = None) -> None:
    """The gradient's first kernels, one block each, before any row: the pass over the
    targets (fused: the first bad row, and for the mean its denominator; from_lse: the
    mean's denominator) and, from_lse with weight and smoothing, the weights' sum.
    ``row_lanes``: the row kernel's lanes, which a fused targets pass cut into chunks
    then takes (:mod:`tvm_fusion.folded_prologue` runs it in the row kernel's blocks)."""
    lanes = row_lanes if row_lanes is not None and batch_chunks(problem.batch) > 1 else CHUNK_THREADS
    if problem.mode == "fused" and problem.reduction == "mean":
        one_block_reduce(sch, "target_stats", epilogues=("first_bad_row", "denom"), chunk_threads=lanes)
    elif problem.mode == "fused":
        one_block_reduce(sch, "first_bad_row", chunk_threads=lanes)
    elif problem.reduction == "mean":
        one_block_reduce(sch, "denom")
    if problem.mode == "from_lse" and problem.has_weight and problem.label_smoothing > 0.0:
        one_block_reduce(sch, "weight_total")


def schedule_grad_batch_stage(sch: s_tir.Schedule, problem, row_threads: Any = None) -> None:
    """The fused gradient's last kernel: one block sums the row losses, thread 0 writes
    ``loss`` (over the denominator for the mean), on the lanes
    :func:`schedule_ce_batch_stage` takes. Nothing for "none"."""
    if problem.mode == "fused" and problem.reduction != "none":
        threads = MAX_THREADS if row_threads is None else batch_threads(sch, problem.batch, row_threads)
        one_block_reduce(sch, "batch", threads, epilogues=("loss",))


def grad_map(
    sch: s_tir.Schedule, keep_outer: int, threads, vector, unroll_step, thread_axis: str = "threadIdx.x",
    staged: str = "logits", block: SBlockRV | None = None, batch: Any = None, source: str | None = None,
) -> None:
    """``dlogits`` over the row laid out ``[threadIdx, serial, vector]`` (consecutive
    lanes, consecutive vectors): per step a lane loads ``vector`` logits (from
    ``staged``: the logits, or their copy in shared memory) with one load into
    registers, computes the gradient there in float32 and stores the ``vector``
    results with one store (16 bytes each way when ``vector * bytes == 16``). The
    per-row coefficients must already be at the row, in registers. ``block``: the
    ``dlogits`` block's random variable where the caller holds one (see
    ``cross_entropy_grad_row_in_shared``), else looked up. ``batch``: the serial loop
    split ``[step, batch]``, a lane's ``batch`` vectors of a step ``threads`` apart and
    the batch loop unrolled, so that their loads can issue together (:func:`online_chunks`).
    ``source``: a block that computes the vectors ``dlogits`` reads (``fused_head``'s
    ``map_src``), staged by moving it into registers instead of a ``cache_read`` of
    ``staged``; that map's loop is one the build's loop partition splits, and it is not
    walked backwards (the reversal is untried on a partitioned loop)."""
    block = sch.get_sblock("dlogits") if block is None else block
    _, serial, vec = lanes_split(sch, block, keep_outer, threads, vector, unroll_step, thread_axis, batch)
    at = sch.get_loops(block)[-2]  # the batch loop, or the serial one without a batch
    sch.unroll(vec)
    if source is None:
        stage_in_registers(sch, block, staged, at)
    else:
        in_registers_at(sch, sch.get_sblock(source), at)
    store = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(store, at, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(store)[-1])
    if source is None:
        # From the row's end: the statistics pass read it last, so it is the part still in L2.
        launch_order.reverse(sch, serial)


def in_registers_at(sch: s_tir.Schedule, block: SBlockRV, at: LoopRV) -> None:
    """``block`` (a stage that computes what its readers load) moved under loop ``at``,
    its output in registers, written with one vector store."""
    sch.compute_at(block, at, preserve_unit_loops=True)
    outputs_to(sch, block, "local")
    sch.vectorize(sch.get_loops(block)[-1])


def online_chunks(sch: s_tir.Schedule, threads, unroll_step, scope: str, batch: Any = None,
                  source: str | None = None) -> None:
    """The online (max, sum of exponentials) of the row the block is bound to: its
    16-byte chunks strided across ``threads`` lanes (``unroll_step`` a step), each
    chunk loaded once into registers and reduced there (``chunk_max``,
    ``chunk_sumexp``), the lanes' partial pairs combined into ``row_online``, whose
    result lives in ``scope``. ``batch``: a lane takes ``batch`` chunks a step, chunk
    ``((step batch + b) threads + lane)``, the batch loop unrolled so that nvcc can
    issue their loads before the exps of the first (one load in flight a lane is
    what a rolled loop leaves). ``source``: :func:`chunks_at`'s."""
    online = sch.get_sblock("row_online")
    serial, at, _ = lane_steps(sch, sch.get_loops(online)[-1], threads, batch)
    unroll(sch, serial, unroll_step)
    outputs_to(sch, online, scope)
    chunks_at(sch, at, source)


def chunks_at(sch: s_tir.Schedule, at: LoopRV, source: str | None = None,
              staged: str = "logits") -> tuple[SBlockRV, SBlockRV, SBlockRV]:
    """``chunk_sumexp`` and ``chunk_max`` moved under loop ``at`` in registers, the
    chunk's logits staged there with one vector load: a ``cache_read`` of ``staged``
    (the logits, or their copy on chip), or ``source``, a block that computes the
    chunk's values (``fused_head``'s ``row_src``), moved there. Returns the two blocks
    and the stage."""
    chunk_sum, chunk_max = sch.get_sblock("chunk_sumexp"), sch.get_sblock("chunk_max")
    for block in (chunk_sum, chunk_max):
        sch.compute_at(block, at, preserve_unit_loops=True)
        outputs_to(sch, block, "local")
    if source is None:
        stage = sch.cache_read(chunk_max, read_index(sch, chunk_max, staged), "local",
                               consumer_blocks=[chunk_max, chunk_sum])
        sch.compute_at(stage, at, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(stage)[-1])
    else:
        stage = sch.get_sblock(source)
        in_registers_at(sch, stage, at)
    return chunk_sum, chunk_max, stage


def merge_grad_rows(sch: s_tir.Schedule, problem, statistics: tuple[str, ...] = ("row_max", "row_sumexp")):
    """One row loop for the fused gradient's per-row blocks, in :func:`row_order`;
    returns it. In place, ``target_logit`` comes first, in every thread's registers:
    the row's statistics then end in a block-wide barrier (a multi-warp allreduce, or
    the copy into shared memory) before any thread stores the row's gradient over
    the logits it read."""
    first = ["target_logit"] if problem.in_place else []
    row = merge_rows(sch, first + row_order(row_loss_name(problem), statistics))
    if problem.in_place:
        outputs_to(sch, sch.get_sblock("target_logit"), "local")
    return row


def row_order(loss: str, statistics: tuple[str, ...] = ("row_max", "row_sumexp")) -> list[str]:
    """The fused gradient's per-row blocks in the order a row kernel runs them: the
    statistics, the coefficients and ``dlogits``, then ``lse`` and the row loss.

    The statistics' last readers must be ``lse`` and the row loss (thread 0, stores to
    global memory). A multi-warp allreduce leaves its result in a shared buffer that
    every thread reads (``red_result``); StorageRewrite runs before that lowering and
    gives a one-float register born where the statistic dies to the statistic's own
    buffer, in place. Were a coefficient the last reader, every thread would store
    its coefficient into the shared result while others still read the statistic
    there (a race seen in the generated code: ``grad_a`` written over the row's sum
    of exponentials)."""
    return list(statistics) + ["dlogits", "lse", loss]


# -- one block per channel of the (N, C, L) view (BatchNorm's forward and backward) ---------
# Threads per block by vectors per channel, from first principles (a few vectors per
# lane per step). H200, 2026-11-29 (results/benchmarks.csv): bn_stats 64x256x56x56 fp16
# with 256 threads 0.0350 ms (2.94 TB/s); 256x2048x7x7 with 256 threads 0.0236 ms.
THREADS_BY_COUNT = [(4096, 128), (32768, 256), (262144, 512)]


@dataclass(frozen=True)
class ChannelBlockKnobs(Knobs):
    threads: int = 256
    vector: int = 8
    unroll: int = 8


class ChannelBlockCandidate(Candidate):
    """The space of a CUDA candidate that gives each channel of the (N, C, L) view a
    thread block: lanes over the channel's planes, ``vector`` values a load (dividing
    L, so no vector crosses a plane)."""

    target_kind = "cuda"
    knobs = ChannelBlockKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def choices(self, problem: Any, target: Target) -> dict[str, list[int]]:
        return {
            "threads": [64, 128, 256, 512],
            "vector": vector_choices(DTYPE_BYTES[problem.dtype], problem.shape[2]),
            "unroll": [1, 4, 8],
        }

    def default_for(self, problem: Any, target: Target) -> ChannelBlockKnobs:
        vector = widest_vector(problem.dtype, problem.shape[2])
        threads = min(512, ladder(problem.count // vector, THREADS_BY_COUNT, MAX_THREADS))
        return ChannelBlockKnobs(threads=threads, vector=vector, unroll=8)


def shifted_sums(sch: s_tir.Schedule, channel, threads, vector, unroll_step, staged: str = "x") -> None:
    """bn_stats's ``shifted`` sums of the channel the block is bound to: ``moments``
    across the block (16-byte loads of ``staged`` through registers, shuffles plus one
    shared hop), its result in registers; the shift ``K[c]`` loaded once into shared
    memory by thread 0."""
    moments = sch.get_sblock("moments")
    sch.compute_at(moments, channel, preserve_unit_loops=True)
    thread_reduce(sch, moments, 1, threads, vector, unroll_step, staged)
    outputs_to(sch, moments, "local")
    shift = sch.get_sblock("shift")
    sch.compute_at(shift, channel, preserve_unit_loops=True)
    sch.set_scope(shift, 0, "shared")
    single_thread(sch, shift, threads)


def plane_map(sch: s_tir.Schedule, block, knobs, staged: tuple[str, ...]) -> None:
    """A map over the channel's planes (the block's loops after the channel): lanes
    over consecutive vectors, the ``staged`` inputs loaded 16 bytes at a time into
    registers, the result stored 16 bytes at a time."""
    chunks = loop_extent(sch, block, 1) // knobs_value(sch, knobs.vector)
    _, serial, vec = lanes_split(sch, block, 1, knobs.threads, knobs.vector, knobs.unroll)
    for name in staged:
        stage_in_registers(sch, block, name, serial)
    store_vectors(sch, block, serial, vec, perfect=chunks % knobs_value(sch, knobs.threads) == 0)
    # From the channel's end, which the block's reduction read last (launch_order).
    launch_order.reverse(sch, serial)


def store_vectors(sch: s_tir.Schedule, block, at, vec, perfect: bool) -> None:
    """The block's result stored ``vector`` values at a time through registers, when
    the lanes split its loop evenly (``perfect``). Otherwise its values are stored one
    by one under the block's own bound: the write-back that ``reverse_compute_at``
    places under ``at`` gets no bound of its own when the lanes' index is a
    floordiv/floormod of a fused (n, l) loop, and the lanes past the end stored 16
    bytes each beyond the output (bn_backward (4, 6, 40) fp32, 128 lanes: dx stores
    unguarded, torch's neighbouring tensors overwritten on the H200, 2026-12-01).
    A row of cross entropy (one linear index) keeps its bound."""
    if perfect:
        out = sch.cache_write(block, 0, "local")
        sch.reverse_compute_at(out, at, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(out)[-1])
    else:
        sch.unroll(vec)


def loop_extent(sch: s_tir.Schedule, block, keep_outer: int) -> int:
    """The product of the block's loop extents after the first ``keep_outer``."""
    extent = 1
    for loop in sch.get_loops(block)[keep_outer:]:
        extent *= int(sch.get(loop).extent)
    return extent


def knobs_value(sch: s_tir.Schedule, knob: Any) -> int:
    """A knob's value: an int, or a sampled one's decision in this schedule."""
    return knob if isinstance(knob, int) else int(sch.get(knob))


# -- each channel of the (N, C, L) view split across blocks (BatchNorm's split_plane) --------
# Few channels for the SMs, and long planes: a block per channel leaves SMs idle or
# lightly loaded. H200 bench of 2026-11-29 (results/benchmarks.csv), bn_stats:
# 32x64x112x112 fp16 0.0166 ms split against 0.0317 a block per channel, 8x3x224x224
# 0.0045 against 0.0303, and 64x256x56x56 (256 channels, 1.9 blocks an SM) 0.0280
# against 0.0349 once kernel 1's run had no remainder (even_partials; 0.0400 before,
# A/B of 2026-12-02). The split forward wins there too: 64x256x56x56 fp16 0.0900 ms
# against 0.0977 (H200, 2026-12-01 at 32f74c8), 0.0826 with the even kernel 1.
SPLIT_PLANE_CHANNELS_PER_SM = 2
SPLIT_PLANE_MIN_COUNT = 16384


def prefers_split_plane(problem: Any, target: Target) -> bool:
    """Few channels for the SMs and long planes (the rule above)."""
    return problem.channels < SPLIT_PLANE_CHANNELS_PER_SM * sm_count(target) and problem.count >= SPLIT_PLANE_MIN_COUNT


def plane_splits(problem: Any) -> list[int]:
    """Split counts that divide the fused (n, l / vector) run of a channel evenly, each
    run 32 vectors at least. An uneven cut puts the run index and the reduction index
    in one predicate, and TVM then silently skips the cross-thread lowering (lanes race
    on the partial: seen on bn_stats 8x32x1009 on the H200, 2026-11-29)."""
    vector = widest_vector(problem.dtype, problem.shape[2])
    run = problem.count // vector
    return [s for s in range(2, 257) if run % s == 0 and run // s >= 32]


# Kernel 1's lanes and batches (vectors a lane loads before it sums them).
PARTIAL_THREADS = (128, 256, 512)
PARTIAL_BATCHES = (1, 2, 4, 8)


def lowers(problem: Any, knobs: Any) -> bool:
    """Whether TVM 0.27 lowers a split-plane configuration: where a split's run is
    exactly ``threads`` vectors and a lane's batch more than one, the lowering divides
    by zero ("Check failed: pb->value != 0") for all three split-plane candidates
    (bn_stats 32x96x40x40 bf16 at splits=50, threads=128, unroll=2: one of the H200
    grid's configurations that did not build). Runs shorter or longer than the lanes,
    however they fit the batch, lower (14 checked on that shape), and so does a batch
    of one."""
    return knobs.unroll == 1 or problem.count // knobs.vector // knobs.splits != knobs.threads


def wanted_splits(problem: Any, target: Target) -> int:
    """Blocks a channel needs for ``BLOCKS_PER_SM`` blocks an SM."""
    return -(-(BLOCKS_PER_SM * sm_count(target)) // problem.channels)


def even_partials(problem: Any, target: Target) -> tuple[int, int, int]:
    """Kernel 1's ``(splits, threads, unroll)`` for a split-plane candidate: a run that
    a block's ``threads x unroll`` vectors deal out with no remainder. A remainder puts
    a bounds guard on every step, and nvcc then neither issues a batch's loads together
    nor hoists the shift ``K[c]`` out of the loop: at 4 splits of 64x256x56x56 (13
    steps of 512 lanes for 12.25 steps of work) one 16-byte load a lane was in flight
    and ``K[c]`` was reloaded every step. The widest batch (4, then 2) first, over split
    counts from the fewest that give ``BLOCKS_PER_SM`` blocks an SM up to four times
    that, the most lanes first; then batches of one; with no even triple, the old rule
    (a guard)."""
    vector = widest_vector(problem.dtype, problem.shape[2])
    run = problem.count // vector
    wanted = wanted_splits(problem, target)
    options = plane_splits(problem)
    near = [s for s in options if wanted <= s <= 4 * wanted] or options
    for batch in (4, 2, 1):
        for splits in near:
            for threads in reversed(PARTIAL_THREADS):
                if (run // splits) % (threads * batch) == 0:
                    return splits, threads, batch
    splits = min((s for s in options if s >= wanted), default=options[-1])
    per_block = run // splits
    threads = 512 if per_block >= 512 * 8 else (256 if per_block >= 256 * 2 else 128)
    return splits, threads, 1


@dataclass(frozen=True)
class SplitPlaneMapKnobs(Knobs):
    splits: int = 8  # blocks per channel in kernel 1
    threads: int = 256  # kernel 1's lanes
    vector: int = 8
    unroll: int = 4  # kernel 1's vectors a lane loads before it sums them
    map_threads: int = 256  # kernel 3's lanes
    map_steps: int = 4  # kernel 3's vectors per lane


class SplitPlaneMapCandidate(Candidate):
    """The space of a CUDA candidate that splits each channel of the (N, C, L) view over
    ``splits`` blocks for its sums (kernel 1), finalizes per channel (kernel 2) and
    maps the whole tensor (kernel 3): bn_forward's and bn_backward's split_plane."""

    target_kind = "cuda"
    knobs = SplitPlaneMapKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def prefers(self, problem: Any, target: Target) -> bool:
        return prefers_split_plane(problem, target)

    def choices(self, problem: Any, target: Target) -> dict[str, list[int]]:
        return {
            "splits": plane_splits(problem),
            "threads": list(PARTIAL_THREADS),
            "vector": [widest_vector(problem.dtype, problem.shape[2])],
            "unroll": list(PARTIAL_BATCHES),
            "map_threads": [128, 256, 512],
            "map_steps": [1, 2, 4, 8],
        }

    def builds(self, problem: Any, knobs: Any) -> bool:
        return lowers(problem, knobs)

    def default_for(self, problem: Any, target: Target) -> SplitPlaneMapKnobs:
        """Kernel 1 by :func:`even_partials`; kernel 3 with 256 lanes of 4 vectors (64
        bytes in flight a lane per tensor, from first principles: not measured)."""
        splits, threads, batch = even_partials(problem, target)
        return SplitPlaneMapKnobs(splits=splits, threads=threads, vector=widest_vector(problem.dtype, problem.shape[2]),
                                  unroll=batch, map_threads=256, map_steps=4)

    def map_step(self, sch: s_tir.Schedule, name: str, staged: tuple[str, ...], knobs: Any) -> None:
        """Kernel 3, the map ``name`` over the whole tensor: :func:`tensor_map`."""
        tensor_map(sch, name, staged, knobs)


@dataclass(frozen=True)
class SplitPlaneRunsKnobs(Knobs):
    splits: int = 8  # blocks per channel, in kernel 1 and in the map
    threads: int = 256  # lanes of both
    vector: int = 8
    unroll: int = 4  # vectors a lane loads a step, in both


class SplitPlaneRunsCandidate(SplitPlaneMapCandidate):
    """A split-plane candidate whose map takes kernel 1's blocks and walks each run from
    its end (:func:`run_map`): the knobs of kernel 1 are the map's too."""

    knobs = SplitPlaneRunsKnobs

    def applies(self, problem: Any) -> bool:
        return super().applies(problem) and bool(even_runs(problem))

    def choices(self, problem: Any, target: Target) -> dict[str, list[int]]:
        """The split counts, lanes and batches of :func:`even_runs`' triples: of their
        product a third to a half is even (64x256x56x56: 24 of 72), where the split-plane
        space's whole product would leave an eighth (24 of 204), and the tuner replays
        a design space with other samples, keeping those that build (``builds``)."""
        even = even_runs(problem)
        return {"splits": sorted({s for s, _, _ in even}), "threads": sorted({t for _, t, _ in even}),
                "vector": [widest_vector(problem.dtype, problem.shape[2])], "unroll": sorted({b for _, _, b in even})}

    def builds(self, problem: Any, knobs: Any) -> bool:
        """Runs that a step's lanes deal out with no remainder only: with one, the map
        stores one value at a time under its bound (:func:`store_vectors`), a map no
        tuner would keep."""
        return super().builds(problem, knobs) and (knobs.splits, knobs.threads, knobs.unroll) in even_runs(problem)

    def default_for(self, problem: Any, target: Target) -> SplitPlaneRunsKnobs:
        """Kernel 1 by :func:`even_partials` where its run has no remainder, else the
        even triple whose split count is nearest the one it wants (:func:`even_runs`);
        then :func:`wider_step`'s lanes for the same step."""
        vector = widest_vector(problem.dtype, problem.shape[2])
        even = even_runs(problem)
        triple = even_partials(problem, target)
        if triple not in even:
            wanted = wanted_splits(problem, target)
            triple = min(even, key=lambda t: (abs(t[0] - wanted), -t[2], -t[1]))
        splits, threads, batch = wider_step(triple, even)
        return SplitPlaneRunsKnobs(splits=splits, threads=threads, vector=vector, unroll=batch)

    def map_step(self, sch: s_tir.Schedule, name: str, staged: tuple[str, ...], knobs: Any) -> None:
        """Kernel 3 on kernel 1's grid and runs, walked backwards: :func:`run_map`."""
        run_map(sch, name, staged, knobs)


def split_plane_partials(sch: s_tir.Schedule, name: str, staged: tuple[str, ...], knobs: Any) -> None:
    """Kernel 1 of a split-plane candidate, grid (C, splits): the reduction ``name`` over
    each channel's (n, l), L split by ``knobs.vector``, (n, l_outer) fused and cut into
    ``knobs.splits`` runs, the run index rfactored out (a (splits, C) float32 workspace
    per sum); each block reduces its run ``[threadIdx.x, serial, batch, vector]``: a lane
    takes ``knobs.unroll`` vectors ``threads`` apart (consecutive lanes on consecutive
    vectors), the batch loop unrolled so that its 16-byte loads of the ``staged``
    inputs issue before the sums; then shuffles and one shared-memory hop. With
    :func:`even_partials`' knobs the run has no remainder, hence no bounds guard."""
    block = sch.get_sblock(name)
    stages = [sch.cache_read(block, read_index(sch, block, buffer), "local", consumer_blocks=[block])
              for buffer in staged]
    _, n, l = sch.get_loops(block)
    l_outer, _ = sch.split(l, [None, knobs.vector])
    run, _ = sch.split(sch.fuse(n, l_outer), [knobs.splits, None])
    partial = sch.rfactor(run, factor_axis=0)
    channel, run, within, vec = sch.get_loops(partial)
    sch.bind(channel, "blockIdx.x")
    sch.bind(run, "blockIdx.y")
    serial, batch, lane = sch.split(within, [None, knobs.unroll, knobs.threads])
    sch.reorder(lane, serial, batch, vec)
    sch.bind(lane, "threadIdx.x")
    for stage in stages:
        sch.compute_at(stage, batch, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(stage)[-1])
    sch.unroll(batch)


def finalize_channels(sch: s_tir.Schedule, name: str, steps: list[str]) -> None:
    """Kernel 2 of a split-plane candidate, grid (C,): each block sums its channel's
    partials of ``name`` across ``FINALIZE_THREADS`` lanes (shuffles), then thread 0
    runs each per-channel block of ``steps``, in that order. TVM's merge puts the
    merged loop at the last loop's place and checks no dependence: the last step
    must be one that comes before the map reading the steps' results (else the
    map's kernel runs first). Only thread 0 reads the allreduce result: no block
    that every thread runs is there to race StorageRewrite's reuse of its buffer."""
    final = merge_rows(sch, steps)
    sch.bind(final, "blockIdx.x")
    block = sch.get_sblock(name)
    sch.compute_at(block, final)  # no unit loop left below the partials' loop
    lanes_split(sch, block, 1, FINALIZE_THREADS, 1, 1)
    outputs_to(sch, block, "local")  # the sums stay on chip, no (C,) buffer in global memory
    for step in steps:
        single_thread(sch, sch.get_sblock(step), FINALIZE_THREADS)


def tensor_map(sch: s_tir.Schedule, name: str, staged: tuple[str, ...], knobs: Any) -> None:
    """Kernel 3 of a split-plane candidate: the map ``name`` over the whole (N, C, L)
    tensor, (n, c, l / vector) fused and cut ``[blockIdx.x, serial, threadIdx.x]``
    (``knobs.map_steps`` vectors a lane, ``knobs.map_threads`` lanes): consecutive
    lanes take consecutive vectors, the ``staged`` inputs loaded and the result stored
    16 bytes at a time through registers. ``vector`` divides L, so a vector lies in
    one plane and its channel index is one per vector."""
    block = sch.get_sblock(name)
    n, c, l = sch.get_loops(block)
    chunks = loop_extent(sch, block, 0) // knobs_value(sch, knobs.vector)
    l_outer, vec = sch.split(l, [None, knobs.vector])
    run, serial, lane = sch.split(sch.fuse(n, c, l_outer), [None, knobs.map_steps, knobs.map_threads])
    sch.reorder(lane, serial)
    sch.bind(run, "blockIdx.x")
    # Last block first: kernel 1's blocks run channels fastest and its runs of (n, l)
    # in order, so over several waves the tensor's end is what it read last, still in
    # L2 (launch_order); in one wave it is the end of every run (run_map).
    launch_order.reverse(sch, run)
    sch.bind(lane, "threadIdx.x")
    unroll(sch, serial, knobs.map_steps)
    sch.unroll(vec)
    for buffer in staged:
        stage_in_registers(sch, block, buffer, serial)
    per_block = knobs_value(sch, knobs.map_steps) * knobs_value(sch, knobs.map_threads)
    store_vectors(sch, block, serial, vec, perfect=chunks % per_block == 0)


def even_runs(problem: Any) -> list[tuple[int, int, int]]:
    """The ``(splits, threads, batch)`` of the split-plane space whose runs a step of
    ``threads x batch`` vectors deals out with no remainder (so longer than ``threads``
    where the batch is more than one: TVM lowers them, see :func:`lowers`)."""
    vector = widest_vector(problem.dtype, problem.shape[2])
    run = problem.count // vector
    return [(s, t, b) for s in plane_splits(problem) for t in PARTIAL_THREADS for b in PARTIAL_BATCHES
            if (run // s) % (t * b) == 0]


RUN_LANES = 256  # the most lanes wider_step gives a runs' block


def wider_step(triple: tuple[int, int, int], even: list[tuple[int, int, int]]) -> tuple[int, int, int]:
    """``(splits, threads, batch)`` with twice the lanes and half the batch (the same
    step of ``threads x batch`` vectors, so still even) while the batch stays two or more
    and the lanes ``RUN_LANES`` or fewer.

    Why, from the split-plane A/B on the H200 (2026-12-05, rows "probe: split-plane maps
    A/B" of results/benchmarks.csv): the backward's map reads x and dy, and at a batch
    of 4 nvcc gives it 40 registers, 12 blocks of 128 an SM, not 16. On 64x256x56x56
    its 1792 blocks then take 1.13 waves (0.85 at 32 registers), and forward + backward
    took 0.2221 ms at 128 lanes x 4 against 0.2103 at 256 x 2 (32 registers); on
    32x64x112x112 fp16, less than a wave either way, 0.1109 against 0.1075 (twice the
    warps for the same 111 KB in flight an SM). The forward alone (one input, 32
    registers at either) moved within 2% (0.0813 -> 0.0812, bf16 0.0831 -> 0.0816). A
    batch of one (8x3x224x224 at 128 x 2 -> 256 x 1) was slower: 0.0145 -> 0.0147 ms
    forward + backward, so the batch stops at two. Untimed: kernel 1 at 256 lanes x 4
    (64x64x112x112 fp16) keeps that, and its backward map the 40 registers (6 blocks of
    256 an SM, 1.13 waves); 512 x 2 would take 32."""
    splits, threads, batch = triple
    while batch > 2 and 2 * threads <= RUN_LANES and (splits, 2 * threads, batch // 2) in even:
        threads, batch = 2 * threads, batch // 2
    return splits, threads, batch


def run_map(sch: s_tir.Schedule, name: str, staged: tuple[str, ...], knobs: Any) -> None:
    """Kernel 3 of a split-plane candidate laid out as kernel 1 (:func:`split_plane_partials`),
    walked backwards: the map ``name`` over each channel's (n, l / vector) cut into
    ``knobs.splits`` runs, a block per (channel, run) in kernel 1's launch order (channels
    fastest), each run ``[threadIdx.x, serial, batch, vector]`` as kernel 1 reads it; then
    the grid and every run's serial loop marked to run from their ends
    (:func:`launch_order.reverse`), so the map's first blocks are kernel 1's last and
    each reads first what its partner read last.

    The reason: kernel 1's blocks are all resident at once where they fit in one wave
    (64x256x56x56 at 7 splits of 128 lanes: 1792 blocks, 16 an SM), each walking its run
    for the whole kernel, so what the L2 holds at its end is the last part of every run,
    spread over the tensor, not the tensor's end that :func:`tensor_map`'s flat walk
    starts at. The channel is the block's, so the map's coefficients are read once a
    lane."""
    block = sch.get_sblock(name)
    n, c, l = sch.get_loops(block)
    l_outer, vec = sch.split(l, [None, knobs.vector])
    sch.reorder(c, n)
    run, within = sch.split(sch.fuse(n, l_outer), [knobs.splits, None])
    per_run = loop_extent(sch, block, 2) // knobs_value(sch, knobs.vector)
    sch.reorder(run, c)
    grid = sch.fuse(run, c)
    sch.bind(grid, "blockIdx.x")
    launch_order.reverse(sch, grid)
    serial, batch, _ = lane_steps(sch, within, knobs.threads, knobs.unroll)
    launch_order.reverse(sch, serial)
    for buffer in staged:
        stage_in_registers(sch, block, buffer, batch)
    per_step = knobs_value(sch, knobs.threads) * knobs_value(sch, knobs.unroll)
    store_vectors(sch, block, batch, vec, perfect=per_run % per_step == 0)


# -- the channels-last view (M, C): rows dealt out to blocks and lanes, lanes on channels ----
# Two partials of two rows each is the smallest split whose row loop keeps two steps
# (see ChannelsLastCandidate.choices). Below this many rows a channels-last reduction
# keeps one partial (splits = rows = 1): its row loop has M steps, two or three, and
# at M = 1 (eval's backward) no lane lies past the row, so no row guard exists to be
# hoisted over the write-back.
MIN_ROWS = 4


@dataclass(frozen=True)
class ChannelsLastKnobs(Knobs):
    splits: int = 132  # blocks along M (the default comes from the target's SMs)
    rows: int = 4  # threadIdx.y
    channel_lanes: int = 32  # threadIdx.x: channel vectors per block
    vector: int = 8
    unroll: int = 4  # rows a lane loads (16 bytes each) before it computes on them


# Rows per (block, lane row, step) granule that an even split keeps whole: 8 steps of
# 16 lane rows, so every rows knob (up to 16) and unroll knob (up to 8) divides it.
EVEN_GRANULES = (128, 16)


def even_splits(rows_total: int, wanted: int) -> int:
    """The largest split count in ``[wanted / 2, wanted]`` that deals ``rows_total``
    out in whole granules (:data:`EVEN_GRANULES`), else ``wanted``. An even split
    leaves the row loop without a bounds guard, so nvcc hoists loop-invariant reads
    (the shift ``K[c]``: at 528 splits of 64x56x56x256 it reloaded eight of them a
    row) and the unrolled loads issue together."""
    for granule in EVEN_GRANULES:
        if rows_total % granule:
            continue
        units = rows_total // granule
        for splits in range(min(wanted, units), max(1, wanted // 2) - 1, -1):
            if units % splits == 0:
                return splits
    return wanted


class ChannelsLastCandidate(Candidate):
    """The space of a CUDA candidate on the ``(M, C)`` view: grid (splits, channel
    groups), block (channel lanes, rows); ``threadIdx.x`` owns ``vector`` consecutive
    channels (``vector`` divides C: one 16-byte access a row), rows are dealt out
    ``m = ((s J + j) R + r) U + b`` (block ``s``, ``threadIdx.y = r``, step ``j``, row
    ``b`` of a lane's batch of ``unroll``)."""

    target_kind = "cuda"
    knobs = ChannelsLastKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def choices(self, problem: Any, target: Target) -> dict[str, list[int]]:
        rows_total = problem.shape[0]
        # Every (splits, rows) pair leaves each lane at least two steps of rows
        # (splits * rows * 2 <= M). With one step the row loop vanishes, TVM hoists
        # the row guard over the write-back too, and the partials of lanes past the
        # last row are never written: the finalize kernel then read stale workspace
        # (the H200 sweep: (M, C) = (8, 32) fp16 gave means off by 2.95 from the
        # second call on, correct on the first).
        rows = [r for r in (1, 2, 4, 8, 16) if r * 2 <= rows_total]
        sms = sm_count(target)
        splits = [s for s in (sms // 4, sms // 2, sms, 2 * sms, 4 * sms)  # 33 .. 528 on 132 SMs
                  if s * max(rows, default=1) * 2 <= rows_total]
        splits = sorted({even_splits(rows_total, s) for s in splits})  # 32 .. 392 on 64x56x56
        if rows_total < MIN_ROWS:  # one partial of all M rows (MIN_ROWS says why)
            splits, rows = [1], [1]
        elif not splits:  # few rows: fewer blocks, and two partials at least (one block)
            splits = [max(1, rows_total // (2 * max(rows)))]
            rows = [r for r in rows if r * splits[0] >= 2]
        return {
            "splits": splits,
            "rows": rows,
            "channel_lanes": [8, 16, 32, 64, 128, 256],
            "vector": vector_choices(DTYPE_BYTES[problem.dtype], problem.channels),
            "unroll": [1, 2, 4, 8],
        }

    def default_for(self, problem: Any, target: Target) -> ChannelsLastKnobs:
        vector = widest_vector(problem.dtype, problem.channels)
        lanes = 1
        while lanes * vector < problem.channels and lanes < 256:
            lanes *= 2
        if problem.shape[0] < MIN_ROWS:
            return ChannelsLastKnobs(splits=1, rows=1, channel_lanes=lanes, vector=vector, unroll=4)
        rows = max(1, min(16, 256 // lanes, problem.shape[0] // 2))  # two steps at least
        groups = -(-problem.channels // (lanes * vector))
        splits = max(1, min(BLOCKS_PER_SM * sm_count(target) // groups, problem.shape[0] // (rows * 8) or 1))
        splits = even_splits(problem.shape[0], splits)
        if splits * rows < 2:  # wide rows (256 lanes x 1 row): two blocks, two partials
            splits = 2
        return ChannelsLastKnobs(splits=splits, rows=rows, channel_lanes=lanes, vector=vector, unroll=4)

    def near_default(self, problem: Any, target: Target) -> list[ChannelsLastKnobs]:
        """The default with a quarter, a half and an eighth of its splits: each lane
        then sums 4, 2 and 8 times the rows, and the workspace holds that many times
        fewer partials. Those are what the H200 grids found fastest where the default
        was not (2026-12-04, 29 NHWC shapes): on 9 of them (1568-100352 rows) the best
        configuration gave a lane 12-64 rows where the default gives 8-16, and the
        default was 1.09-1.37x slower. The evenly thinned space seldom holds such a
        configuration (its splits are a few fixed multiples of the SMs)."""
        default = self.default_for(problem, target)
        near = []
        for divisor in (4, 2, 8):
            if default.splits // divisor < 1:
                continue
            splits = even_splits(problem.shape[0], default.splits // divisor)
            if splits * default.rows >= 2 and splits != default.splits:
                knobs = dataclasses.replace(default, splits=splits)
                if knobs not in near:
                    near.append(knobs)
        return near


def channels_last_grid(sch: s_tir.Schedule, run: LoopRV, lane_row: LoopRV, step: LoopRV, channel: LoopRV,
                       knobs, batch: LoopRV | None = None) -> LoopRV:
    """Lay rows and channels out as :class:`ChannelsLastCandidate` says: ``run`` on
    ``blockIdx.x``, ``lane_row`` on ``threadIdx.y``, the channel loop split into groups
    (``blockIdx.y``) of ``channel_lanes`` lanes (``threadIdx.x``) of ``vector``
    channels; a lane's row ``step`` loop (then its ``batch`` of rows, when given) and
    its vector innermost. Returns the lane loop, where a thread's channels are fixed."""
    group, lane, vec = sch.split(channel, [None, knobs.channel_lanes, knobs.vector])
    sch.reorder(run, group, lane_row, lane, step, *([batch] if batch is not None else []), vec)
    sch.bind(run, "blockIdx.x")
    sch.bind(group, "blockIdx.y")
    sch.bind(lane_row, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")
    return lane


# float32 values in one 16-byte store (TVM's CUDA codegen has no float32x8).
STORE_FLOATS = 4
# The largest shared tile of a block's lane partials (rows_through_shared): a quarter
# of an H200 SM's shared memory, so four such blocks fit.
SHARED_TILE_BYTES = 32 * 1024


def float_stores(sch: s_tir.Schedule, block: SBlockRV) -> None:
    """A lane's write-back of consecutive float32 values (its channels), ``STORE_FLOATS``
    a store, when its innermost loop is a serial run of a multiple of them."""
    inner = sch.get_loops(block)[-1]
    loop = sch.get(inner)
    extent = int(loop.extent)
    if loop.thread_binding is None and extent > 1:
        width = min(STORE_FLOATS, extent)
        if extent % width == 0:
            sch.vectorize(sch.split(inner, [None, width])[1])


def row_partials(sch: s_tir.Schedule, name: str, knobs, staged: tuple[str, ...], inline: tuple[str, ...] = ()) -> None:
    """Kernel 1 of a channels-last reduction: per-thread partials of the block ``name``
    (a reduction over M per channel), in a ``(P, C)`` float32 workspace.

    1. Rows dealt out to (block ``s``, lane ``r``) in batches of ``unroll``
       consecutive rows, the partial index ``p = (s, r)``
       rfactored out (``<name>_rf``, partial-major: a lane writes its ``vector``
       channels' partials with 16-byte stores and a warp's lanes write one contiguous
       run). Channel-major, each of a lane's partials went to its own 32-byte sector:
       on 64x56x56x256 bf16 (P = 3136) 1.6 M scattered 4-byte stores a sum, and the
       partials kernel took 53 us where the map, moving twice the bytes, took 53 (H200,
       2026-12-02, per-kernel profile).
    2. ``threadIdx.x`` owns ``vector`` consecutive channels: the ``staged`` inputs come
       through registers with one 16-byte load a row, per-channel inputs (a (C,)
       buffer: the backward's mean and invstd) once per thread; the sums stay in
       registers (``cache_write`` to ``local``) and are written once. The blocks in
       ``inline`` (the shift K[c]) are inlined after the stages, so their reads stay
       apart. A lane loads ``unroll`` rows (16 bytes each) before it sums them
       (:func:`batched_loads`).
    3. The accumulators are zeroed before the row loop (``decompose_reduction``), not
       under its bounds predicate: when ``splits * rows`` outruns the rows, the last
       blocks own no row at all, and an init that only ran with the first valid row
       left their registers unset. Their garbage partials made the variance of
       100352x64 fp16 (splits=528, rows=16) reach 3e31 on the H200.

    The arithmetic stays scalar: TVM's CUDA codegen has no float32x8 type."""
    block = sch.get_sblock(name)
    stages = [sch.cache_read(block, read_index(sch, block, source), "local", consumer_blocks=[block])
              for source in staged]
    for inlined in inline:
        sch.compute_inline(sch.get_sblock(inlined))
    channel, row = sch.get_loops(block)
    # m = ((s J + j) R + r) U + b: a lane's batch of U rows is consecutive (as in
    # channels_last_map), so each register stage's box is exactly its rows.
    run, step, lane_row, batch = sch.split(row, [knobs.splits, None, knobs.rows, knobs.unroll])
    sch.reorder(channel, run, lane_row, step, batch)
    partial = sch.rfactor(sch.fuse(run, lane_row), factor_axis=0)
    write_backs = [sch.cache_write(partial, index, "local") for index in range(len(sch.get(partial).writes))]
    channel, p, step, batch = sch.get_loops(partial)
    run, lane_row = sch.split(p, [knobs.splits, knobs.rows])
    lane = channels_last_grid(sch, run, lane_row, step, channel, knobs, batch)
    for write_back in write_backs:
        sch.reverse_compute_at(write_back, lane)
        float_stores(sch, write_back)
    registers_per_thread(sch, partial, lane)
    for stage in stages:
        batched_loads(sch, stage, step)
    sch.unroll(batch)
    sch.decompose_reduction(partial, step)  # zero every partial, rows or not
    rows, vector = knobs_value(sch, knobs.rows), knobs_value(sch, knobs.vector)
    group = knobs_value(sch, knobs.channel_lanes) * vector
    # One block (splits = 1): its rows are the partials. A tile past SHARED_TILE_BYTES
    # stays in global memory (the 48 KB static limit: rows=4 of 256 lanes x 8 channels,
    # two sums, is 64 KB, and NVRTC refused the kernel on the H200). Fewer channels than
    # threads (vector < rows) too: see rows_through_shared.
    if (rows > 1 and knobs_value(sch, knobs.splits) > 1 and vector % rows == 0
            and rows * group * 4 * len(write_backs) <= SHARED_TILE_BYTES):
        rows_through_shared(sch, name, knobs, sch.get_loops(partial)[1], write_backs)


def rows_through_shared(sch: s_tir.Schedule, name: str, knobs, group: LoopRV, write_backs: list) -> None:
    """Kernel 1's partials of a block's ``rows`` lane rows summed in the block: the
    lanes' write-backs go to shared memory, a ``(rows, channels)`` tile a sum, and the
    block's threads, one channel each, add a channel's ``rows`` values in registers and
    store one partial per (block, channel) (``<name>`` rfactored again over the split
    index). The finalize then reads ``splits`` partials a channel, not ``splits x rows``
    (64x56x56x256: 392, not 3136, and a 0.8 MB workspace, not 6.4).

    The block's ``channel_lanes x vector`` channels are dealt to its ``rows x
    channel_lanes`` threads ``vector / rows`` each, so ``rows`` must divide ``vector``.
    With more threads than channels TVM's split guarded the spare threads by the
    tensor's channel bound, not the block's: on the H200 threads of one block wrote
    the next block's channels (13 sampled configurations failed, every one with
    rows > vector, e.g. rows=4 vector=2 on 64x56x56x256 fp16: y off by 4.6)."""
    for write_back in write_backs:
        sch.set_scope(write_back, 0, "shared")
    final = sch.get_sblock(name)
    _, p = sch.get_loops(final)
    split, _ = sch.split(p, [knobs.splits, knobs.rows])
    block_sums = sch.rfactor(split, factor_axis=0)
    # Unit loops kept (rows=1, or one channel a group): the loop count, and so the
    # trace, is then the same for every knob value. A tune replays the design space's
    # trace with other sampled knobs, and where the count changed MetaSchedule failed
    # the whole tune ("old_outputs.size() == new_outputs.size() (4 vs. 3)" in
    # get_loops; 9 of 40 replays on 16x35x35x288 fp16 NHWC, first seen on the H200).
    sch.reverse_compute_at(block_sums, group, preserve_unit_loops=True)
    sums_out = [sch.cache_write(block_sums, index, "local") for index in range(len(sch.get(block_sums).writes))]
    _, rows, channels = sch.get_loops(block_sums)[2:]  # under (run, group): a unit loop, the rows, the channels
    sch.reorder(channels, rows)
    _, lane_row, lane = sch.split(channels, [None, knobs.rows, knobs.channel_lanes])
    sch.bind(lane_row, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")
    sch.unroll(rows)
    for out in sums_out:
        sch.reverse_compute_at(out, lane)


def channel_finalize(sch: s_tir.Schedule, reduced: str, consumers: list[str]) -> None:
    """Kernel 2 of a channels-last reduction: a block per channel sums the channel's
    partials of ``reduced`` across ``FINALIZE_THREADS`` lanes (shuffles plus one shared
    hop) into registers, then thread 0 runs ``consumers`` in that order, each moved
    into the channel loop (``reverse_compute_at``: the kernel stays where the sums
    are, before the map, whichever side of the map a consumer was written on).
    Thread 0 is the allreduce result's only reader: a block every thread ran there
    would race StorageRewrite's reuse of it (cross_entropy_grad's ``row_order``
    lesson)."""
    block = sch.get_sblock(reduced)
    channel, _ = sch.get_loops(block)
    sch.bind(channel, "blockIdx.x")
    lanes_split(sch, block, 1, FINALIZE_THREADS, 1, 1)
    outputs_to(sch, block, "local")
    for name in consumers:
        consumer = sch.get_sblock(name)
        sch.reverse_compute_at(consumer, channel)
        single_thread(sch, consumer, FINALIZE_THREADS)


def channels_last_map(sch: s_tir.Schedule, name: str, knobs, staged: tuple[str, ...],
                      computed: tuple[str, ...] = ()) -> None:
    """Kernel 3: the map ``name`` over ``(M, C)`` on kernel 1's grid: rows dealt out the
    same way, ``threadIdx.x`` on ``vector`` consecutive channels. The ``computed``
    blocks (coefficients from the inputs alone, consumers first) run in each thread's
    registers for its channels; every other per-channel value the map reads (a (C,)
    buffer: the finalize's coefficients, weight, bias, mean) is loaded into registers
    once per thread. Per row the ``staged`` inputs come in with one 16-byte load each
    (``unroll`` rows of them before the arithmetic, :func:`batched_loads`) and the
    result goes out with one 16-byte store."""
    block = sch.get_sblock(name)
    row, channel = sch.get_loops(block)
    # A lane's batch is ``unroll`` consecutive rows, m = ((s J + j) R + r) U + b, so the
    # register stage's box is exactly them (rows R apart would box (U - 1) R + 1 rows).
    run, step, lane_row, batch = sch.split(row, [knobs.splits, None, knobs.rows, knobs.unroll])
    lane = channels_last_grid(sch, run, lane_row, step, channel, knobs, batch)
    for producer in computed:
        coefficient = sch.get_sblock(producer)
        sch.compute_at(coefficient, lane, preserve_unit_loops=True)
        outputs_to(sch, coefficient, "local")
    registers_per_thread(sch, block, lane)
    for source in staged:
        stage = sch.cache_read(block, read_index(sch, block, source), "local", consumer_blocks=[block])
        batched_loads(sch, stage, step)
    out = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(out, step, preserve_unit_loops=True)
    *_, out_batch, out_vec = sch.get_loops(out)
    sch.vectorize(out_vec)
    sch.unroll(out_batch)
    sch.unroll(batch)
    # Each block walks its run of rows from the end: kernel 1's blocks walked theirs
    # from the start, so each run's end is what they read last, still in L2
    # (launch_order).
    launch_order.reverse(sch, step)


def batched_loads(sch: s_tir.Schedule, stage: SBlockRV, step: LoopRV) -> None:
    """The register stage ``stage`` moved to ``step``, the loop over a lane's batches
    of ``unroll`` rows: its ``unroll`` 16-byte loads (one a row, vectorized over the
    lane's channels, the row loop unrolled) are issued together, before the
    arithmetic on them. With one load a step, as before, a lane had 16 bytes in flight
    and 4 blocks of 256 lanes an SM 16 KB, under what HBM's latency asks for."""
    sch.compute_at(stage, step, preserve_unit_loops=True)
    *_, rows, vec = sch.get_loops(stage)
    sch.vectorize(vec)
    sch.unroll(rows)


def registers_per_thread(sch: s_tir.Schedule, block: SBlockRV, lane: LoopRV) -> None:
    """Load every per-channel value the block reads from global memory (a (C,) buffer)
    into registers at ``lane``, the loop that fixes a thread's channels: once per
    thread, not once per row."""
    per_channel = [region.source.name for region in sch.get(block).reads
                   if len(region.source.shape) == 1 and region.source.scope() == "global"]
    for source in per_channel:
        stage = sch.cache_read(block, read_index(sch, block, source), "local", consumer_blocks=[block])
        sch.compute_at(stage, lane, preserve_unit_loops=True)
