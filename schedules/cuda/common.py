"""CUDA steps and launch ladders shared by the candidates.

A number used by more than one candidate is written here once, with its evidence;
a threshold only one candidate uses stays in that candidate's module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tvm import s_tir
from tvm.target import Target

from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, ladder

from ..common import (
    lanes_split, merge_rows, outputs_to, read_index, row_loss_name, single_thread, stage_in_registers, thread_reduce,
    unroll,
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


def schedule_ce_batch_stage(sch: s_tir.Schedule, reduction: str, threads: int = MAX_THREADS) -> None:
    """Second kernel of cross entropy: one block sums the row losses and weights and
    finds the first bad target, each thread striding over rows, then a warp-shuffle
    reduction; thread 0 writes ``loss`` and ``first_bad_row``."""
    if reduction == "none":
        one_block_reduce(sch, "first_bad_row", threads)
    else:
        one_block_reduce(sch, "batch", threads, epilogues=("first_bad_row", "loss"))


def one_block_reduce(
    sch: s_tir.Schedule, name: str, threads: int = MAX_THREADS, epilogues: tuple[str, ...] = ()
) -> None:
    """A reduction to one value in one block: each thread strides over the reduced
    axis, then the cross-thread step (shuffles within warps, shared memory across).
    With ``epilogues`` the result stays in shared memory and thread 0 runs each
    epilogue (the copies into the function's outputs)."""
    block = sch.get_sblock(name)
    unit, reduced = sch.get_loops(block)
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
def schedule_grad_prologue(sch: s_tir.Schedule, problem) -> None:
    """The gradient's first kernels, one block each, before any row: the pass over the
    targets (fused: the first bad row, and for the mean its denominator; from_lse: the
    mean's denominator) and, from_lse with weight and smoothing, the weights' sum."""
    if problem.mode == "fused" and problem.reduction == "mean":
        one_block_reduce(sch, "target_stats", epilogues=("first_bad_row", "denom"))
    elif problem.mode == "fused":
        one_block_reduce(sch, "first_bad_row")
    elif problem.reduction == "mean":
        one_block_reduce(sch, "denom")
    if problem.mode == "from_lse" and problem.has_weight and problem.label_smoothing > 0.0:
        one_block_reduce(sch, "weight_total")


def schedule_grad_batch_stage(sch: s_tir.Schedule, problem) -> None:
    """The fused gradient's last kernel: one block sums the row losses, thread 0
    writes ``loss`` (over the denominator for the mean). Nothing for "none"."""
    if problem.mode == "fused" and problem.reduction != "none":
        one_block_reduce(sch, "batch", epilogues=("loss",))


def grad_map(
    sch: s_tir.Schedule, keep_outer: int, threads, vector, unroll_step, thread_axis: str = "threadIdx.x",
    staged: str = "logits",
) -> None:
    """``dlogits`` over the row laid out ``[threadIdx, serial, vector]`` (consecutive
    lanes, consecutive vectors): per step a lane loads ``vector`` logits (from
    ``staged``: the logits, or their copy in shared memory) with one load into
    registers, computes the gradient there in float32 and stores the ``vector``
    results with one store (16 bytes each way when ``vector * bytes == 16``). The
    per-row coefficients must already be at the row, in registers."""
    block = sch.get_sblock("dlogits")
    _, serial, vec = lanes_split(sch, block, keep_outer, threads, vector, unroll_step, thread_axis)
    sch.unroll(vec)
    stage_in_registers(sch, block, staged, serial)
    store = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(store, serial, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(store)[-1])


def online_chunks(sch: s_tir.Schedule, threads, unroll_step, scope: str) -> None:
    """The online (max, sum of exponentials) of the row the block is bound to: its
    16-byte chunks strided across ``threads`` lanes (``unroll_step`` a step), each
    chunk loaded once into registers and reduced there (``chunk_max``,
    ``chunk_sumexp``), the lanes' partial pairs combined into ``row_online``, whose
    result lives in ``scope``."""
    online = sch.get_sblock("row_online")
    serial, lane = sch.split(sch.get_loops(online)[-1], [None, threads])
    sch.reorder(lane, serial)
    sch.bind(lane, "threadIdx.x")
    unroll(sch, serial, unroll_step)
    outputs_to(sch, online, scope)
    chunk_sum, chunk_max = sch.get_sblock("chunk_sumexp"), sch.get_sblock("chunk_max")
    for block in (chunk_sum, chunk_max):
        sch.compute_at(block, serial, preserve_unit_loops=True)
        outputs_to(sch, block, "local")
    stage = sch.cache_read(chunk_max, read_index(sch, chunk_max, "logits"), "local",
                           consumer_blocks=[chunk_max, chunk_sum])
    sch.compute_at(stage, serial, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(stage)[-1])


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


def shifted_sums(sch: s_tir.Schedule, channel, threads, vector, unroll_step) -> None:
    """bn_stats's ``shifted`` sums of the channel the block is bound to: ``moments``
    across the block (16-byte loads through registers, shuffles plus one shared hop),
    its result in registers; the shift ``K[c]`` loaded once into shared memory by
    thread 0."""
    moments = sch.get_sblock("moments")
    sch.compute_at(moments, channel, preserve_unit_loops=True)
    thread_reduce(sch, moments, 1, threads, vector, unroll_step, "x")
    outputs_to(sch, moments, "local")
    shift = sch.get_sblock("shift")
    sch.compute_at(shift, channel, preserve_unit_loops=True)
    sch.set_scope(shift, 0, "shared")
    single_thread(sch, shift, threads)


def plane_map(sch: s_tir.Schedule, block, knobs, staged: tuple[str, ...]) -> None:
    """A map over the channel's planes (the block's loops after the channel): lanes
    over consecutive vectors, the ``staged`` inputs loaded 16 bytes at a time into
    registers, the result stored 16 bytes at a time."""
    _, serial, _ = lanes_split(sch, block, 1, knobs.threads, knobs.vector, knobs.unroll)
    for name in staged:
        stage_in_registers(sch, block, name, serial)
    out = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(out, serial, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(out)[-1])
