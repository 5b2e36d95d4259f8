"""BatchNorm's training forward, one thread block per channel, the channel kept on chip.

Pattern ``x(SRR) -> on chip -> (sum, sumsq)(S) -> mean, var -> invstd, running,
coef(S) -> y(SSS) from chip`` on the ``(N, C, L)`` view, the ``shifted``
decomposition. ``bn_forward_block_per_channel`` reads x twice (the sums, then the
map); here a block loads its channel once and both the sums and the map read that
copy: x read once and y written once, the fewest bytes (``bytes_moved``). For
channels that fit on chip: 256x2048x7x7 fp16 (12544 values, 25 KB), 128x64x8x8; not
64x256x56x56 (200704 values, 401 KB: ``bn_forward_block_per_channel``).

1. The output loops (``y``'s channel first, then the per-channel outputs) are merged
   into one channel loop bound to ``blockIdx.x``.
2. The channel is loaded once, lanes over consecutive ``vector``-wide chunks (16-byte
   loads where 8 fp16 or 4 fp32 values divide L; scalar ones for 7x7 planes), every
   lane's loop unrolled, into (``staging``):
   registers: a ``cache_read`` to ``local`` laid out ``(c, s, t, v)``, chunk ``q = s *
   threads + t`` of the channel in lane ``t``'s step ``s``. The copy, ``moments`` and
   ``y`` iterate that layout (``transform_block_layout``), so TVM compacts the copy to
   lane t's own ``s x v`` values: a register array, indexed by constants once unrolled;
   shared: a ``cache_read`` to ``shared.dyn``, the channel's values in order.
3. Thread 0 puts the shift ``K[c] = x[0, c, 0]`` in shared memory: from the shared
   copy, or with registers from x itself (one scalar load of the sector that holds
   its own first chunk: a lane's registers are its own).
4. ``moments`` sums ``d = x - K`` and ``d^2`` in float32 over the on-chip copy (from
   shared memory 16 bytes at a time into registers), then ``__shfl_down_sync`` and one
   shared-memory hop.
5. Thread 0 turns the sums into ``mean`` and ``var`` in shared memory (so the
   allreduce result's last readers are thread 0's: a block every thread ran there
   would race StorageRewrite's reuse of it, cross_entropy_grad's ``row_order``
   lesson); after the barrier every thread computes the map's coefficients.
6. ``y`` from the on-chip copy, the same chunks, 16-byte stores.
7. Thread 0 writes the per-channel outputs.

Fit: registers where the channel's chunks split evenly over the lanes, two or more
a lane, within ``REGISTER_WORDS``; else shared memory up to ``SHARED_BYTES_MAX``
(``SHARED_STEPS`` chunks a lane); else the candidate does not apply. First in the
dispatch order and without ``prefers``, it is the default wherever it applies.
``staging`` is one choice per shape (the schedule branches on it: a trace replayed
with another decision could not follow), and with registers so are ``threads`` and
``vector``, which the layout bakes in; with shared memory the tuner searches both.

Channels that do not fit one block: ``bn_forward_grid_persistent`` (several blocks
per channel, a grid barrier between the sums and the map). Earlier versions of this
docstring said TVM could not do that: it can. ``T.cuda.grid_sync()`` emits
``cooperative_groups::this_grid().sync()`` (tests/test_cuda_codegen.py checks it), and
a PrimFunc whose ``tirx.kernel_launch_params`` attribute holds
``tirx.use_cooperative_launch`` is launched with ``cuLaunchCooperativeKernel``
(:mod:`tvm_fusion.grid_barrier`; on an H100 the grid-wide kernels compute the float64
reference, and a grid too large for one launch failed with
``CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`` instead of hanging).

Not used: registers for a channel that does not split evenly over the lanes: the
layout would need padding, and ``transform_block_layout`` takes bijective maps only.
Static shared memory (``shared``): 48 KB a block at most, while ``shared.dyn`` is
sized at launch and TVM 0.27's CUDA runtime raises the kernel's limit
(``cuFuncSetAttribute``, ``MAX_DYNAMIC_SHARED_SIZE_BYTES``) for 48 KB and more, up to
the H200's 227 KB.

On the H200 (results/benchmarks.csv, 2026-12-01 at 32f74c8): 256x2048x7x7 fp16 0.0600 ms
(block per channel 0.0737, split plane 0.0960), 41% of its one-pass floor: the register
staging of 7x7 planes loads scalars (49 values: no 16-byte vector divides the plane).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.target import Target

from tvm_fusion.compute.bn_forward import channel_outputs
from tvm_fusion.contracts import BNForwardProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import Candidate, Knobs, ladder, register

from ..common import knob_value, lanes_split, merge_rows, outputs_to, read_index, single_thread, stage_in_registers
from .common import THREADS_BY_COUNT, vector_choices, widest_vector

REGISTERS, SHARED = 0, 1  # the staging knob's values (knobs are ints)
THREADS = [32, 64, 128, 256, 512, 1024]
# 32-bit registers of on-chip copies a lane may keep, by threads per block: half of
# what a lane gets when the block has the SM's 64K registers to itself (64 at 1024
# threads), the rest for addresses, sums and coefficients; at most 64 below that. From first
# principles; ptxas (CUDA 13.0, sm_90) reports no spills at both ends, 128 registers
# at 512 threads and 64 at 1024 (tests/test_bn_persistent.py).
REGISTER_WORDS = [(512, 64), (1024, 32)]
# A block's copies in shared memory: two blocks an SM fit the H200's 227 KB with room
# for the reductions' scratch, and the L1 keeps the rest of the 256 KB. From first
# principles, not measured.
SHARED_BYTES_MAX = 96 * 1024
# Chunks a lane stages with shared memory: its loops are unrolled (code size), and at
# least two so the cross-thread reduction keeps its serial loop (with one, TVM 0.27
# puts the block's syncs under the lane guard: ``spans_two_vectors``).
SHARED_STEPS = (2, 64)


@dataclass(frozen=True)
class PersistentKnobs(Knobs):
    threads: int = 256
    vector: int = 8
    staging: int = REGISTERS


@register
class BNForwardPersistent(Candidate):
    name = "bn_forward_persistent"
    op = "bn_forward"
    target_kind = "cuda"
    algorithm = "shifted"
    knobs = PersistentKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: BNForwardProblem) -> bool:
        return (problem.op == self.op and problem.training and not problem.channels_last
                and bool(register_threads(problem) or shared_threads(problem)))

    def choices(self, problem: BNForwardProblem, target: Target) -> dict[str, list[int]]:
        return on_chip_choices(problem, copies=1)

    def default_for(self, problem: BNForwardProblem, target: Target) -> PersistentKnobs:
        return on_chip_default(problem, copies=1)

    def schedule(self, sch, problem: BNForwardProblem, knobs) -> None:
        staging = knob_value(sch, knobs.staging)  # one choice per shape: safe to branch on
        moments, y, shift = (sch.get_sblock(name) for name in ("moments", "y", "shift"))
        # 2. The copy of the channel that the sums and the map read.
        if staging == REGISTERS:
            threads, vector = knob_value(sch, knobs.threads), knob_value(sch, knobs.vector)
            copy = sch.cache_read(moments, read_index(sch, moments, "x"), "local", consumer_blocks=[moments, y])
            layout = lane_layout(problem, threads, vector)
            # Blocks first, then the buffer: its indices are then the blocks' own vars.
            sch.transform_block_layout(copy, layout)
            sch.transform_block_layout(y, layout)
            # A unit value axis would be a spatial loop under the reduction's: not with vector 1.
            sums_layout = layout if vector > 1 else lambda n, c, l: layout(n, c, l)[:3]
            sch.transform_block_layout(moments, lambda c, n, l: sums_layout(n, c, l))
            sch.transform_layout(copy, ("write", 0), layout)
        else:
            threads, vector = knobs.threads, knobs.vector
            copy = sch.cache_read(moments, read_index(sch, moments, "x"), "shared.dyn",
                                  consumer_blocks=[shift, moments, y])
            on_chip = sch.get(copy).writes[0].source.name
            n, c, plane = sch.get_loops(y)
            sch.reorder(c, n, plane)
        # 1. One channel loop for the outputs.
        for name in ("bn_shift", "bn_scale"):
            sch.compute_at(sch.get_sblock(name), sch.get_loops(y)[0], preserve_unit_loops=True)
        channel = merge_rows(sch, ["y", *channel_outputs(problem)])
        sch.bind(channel, "blockIdx.x")
        # 5. mean and var by thread 0 into shared memory.
        for name in ("var", "mean"):
            block = sch.get_sblock(name)
            sch.compute_at(block, channel, preserve_unit_loops=True)
            sch.set_scope(block, 0, "shared")
            single_thread(sch, block, threads)
        # 4. The shifted sums over the copy, across the block.
        sch.compute_at(moments, channel, preserve_unit_loops=True)
        serial = lanes(sch, moments, staging, threads, vector)
        if staging == SHARED:
            stage_in_registers(sch, moments, on_chip, serial)
        outputs_to(sch, moments, "local")
        # 3. The shift, thread 0.
        sch.compute_at(shift, channel, preserve_unit_loops=True)
        sch.set_scope(shift, 0, "shared")
        single_thread(sch, shift, threads)
        # 2. The copy's loads, ahead of every reader.
        sch.compute_at(copy, channel, preserve_unit_loops=True)
        lanes(sch, copy, staging, threads, vector)
        sch.vectorize(sch.get_loops(copy)[-1])
        # 5. The coefficients in every thread's registers.
        for name in ("bn_shift", "bn_scale"):
            outputs_to(sch, sch.get_sblock(name), "local")
        # 6. y from the copy, 16-byte stores.
        y = sch.get_sblock("y")
        serial = lanes(sch, y, staging, threads, vector)
        if staging == SHARED:
            stage_in_registers(sch, y, on_chip, serial)
        out = sch.cache_write(y, 0, "local")
        sch.reverse_compute_at(out, serial, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(out)[-1])
        # 7. The per-channel outputs on thread 0.
        for name in channel_outputs(problem):
            single_thread(sch, sch.get_sblock(name), threads)


def on_chip_choices(problem, copies: int) -> dict[str, list[int]]:
    """The knob space of a candidate that keeps ``copies`` tensors of the channel's size
    on chip (the forward x; the backward x and dy): with registers one point, the
    layout bakes threads and vector in; with shared memory its threads and vectors."""
    if register_threads(problem, copies):
        knobs = on_chip_default(problem, copies)
        return {"threads": [knobs.threads], "vector": [knobs.vector], "staging": [REGISTERS]}
    return {"threads": shared_threads(problem, copies),
            "vector": vector_choices(DTYPE_BYTES[problem.dtype], problem.shape[2]), "staging": [SHARED]}


def on_chip_default(problem, copies: int) -> PersistentKnobs:
    """block_per_channel's lanes by vectors per channel, moved to the nearest count the
    staging allows (the next larger one, else the largest)."""
    vector = widest_vector(problem.dtype, problem.shape[2])
    options, staging = register_threads(problem, copies), REGISTERS
    if not options:
        options, staging = shared_threads(problem, copies), SHARED
    wanted = ladder(problem.count // vector, THREADS_BY_COUNT, THREADS[-1])
    threads = min((t for t in options if t >= wanted), default=options[-1])
    return PersistentKnobs(threads=threads, vector=vector, staging=staging)


def register_threads(problem, copies: int = 1) -> list[int]:
    """Thread counts that split the channel's chunks (of the widest vector) evenly over
    the lanes with at most ``REGISTER_WORDS`` 32-bit registers a lane for its share of
    the ``copies`` tensors kept."""
    vector = widest_vector(problem.dtype, problem.shape[2])
    chunks = problem.count // vector
    words = -(-vector * DTYPE_BYTES[problem.dtype] // 4)  # a 16-bit value alone takes a register
    return [t for t in THREADS
            if chunks % t == 0 and 2 <= chunks // t
            and copies * (chunks // t) * words <= ladder(t, REGISTER_WORDS, 0)]


def shared_threads(problem, copies: int = 1) -> list[int]:
    """Thread counts that give every lane ``SHARED_STEPS`` chunks, for every vector of
    the space, when the ``copies`` tensors of the channel fit ``SHARED_BYTES_MAX``;
    none when they do not."""
    if copies * problem.count * DTYPE_BYTES[problem.dtype] > SHARED_BYTES_MAX:
        return []
    vectors = vector_choices(DTYPE_BYTES[problem.dtype], problem.shape[2])
    fewest, most = problem.count // max(vectors), problem.count // min(vectors)
    low, high = SHARED_STEPS
    return [t for t in THREADS if fewest >= low * t and -(-most // t) <= high]


def lane_layout(problem: BNForwardProblem, threads: int, vector: int):
    """``(n, c, l) -> (c, s, t, v)``: chunk ``q = s * threads + t`` of the channel, value
    ``v`` of it (``vector`` divides L, and ``threads`` the chunks: a bijection)."""
    per_plane = problem.shape[2] // vector

    def layout(n, c, l):
        chunk = n * per_plane + l // vector
        return c, chunk // threads, chunk % threads, l % vector

    return layout


def lanes(sch, block, staging: int, threads, vector):
    """The block's loops after the channel as ``[threadIdx.x, serial, vector]``, the
    serial loop unrolled; returns it. With registers the layout's ``(s, t[, v])``
    loops are those already."""
    if staging == REGISTERS:
        axes = len(sch.get(block).iter_vars) - 1  # after the channel
        serial, lane = sch.get_loops(block)[-axes:][:2]
        sch.reorder(lane, serial)
        sch.bind(lane, "threadIdx.x")
    else:
        _, serial, _ = lanes_split(sch, block, 1, threads, vector, 1)
    sch.unroll(serial)
    return serial
