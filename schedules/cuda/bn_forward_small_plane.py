"""BatchNorm's training forward on NCHW with small planes, as channels-last over columns.

Pattern ``x(SRR) -> (sum, sumsq)[p, j](SS) -> (sum, sumsq)[c](S) -> mean, var ->
invstd, running, coef(S) -> y(SS)`` on the ``(N, C, L)`` view seen as the matrix
``(N, C * L)``: column ``j = c * L + l``, and ``x[n, c, l]`` lies at ``n * C * L + j``,
so 8 consecutive fp16 columns (4 fp32) are one aligned 16-byte vector whenever
``C * L * bytes % 16 == 0``, even where a plane is not (``L * bytes % 16 != 0``: 7x7,
14x14). The ``shifted`` decomposition, scheduled (no compute of its own):

Kernel 1, grid (splits, column groups), block (column lanes, rows): the
channels-last partials (``common.row_partials``, unchanged) with C * L "channels".
1. ``moments`` is rfactored over l into per-column sums ``moments_rf`` (block layout
   ``(l, c; n) -> (j; n)``), and the column block's reads are ``reindex``-ed onto
   ``(n, j)``: x as ``x_reindex[n, j]``, the shift ``K[c(j)]`` as ``shift_reindex[j]``
   (:func:`column_sums`). ``row_partials`` then deals the rows out ``n = ((s J + j)
   R + r) U + b`` and rfactors the partial index ``p = (s, r)`` into a (P, C * L)
   float32 workspace pair.
2. ``threadIdx.x`` owns 8 consecutive columns: per row one 16-byte load of x
   (``unroll`` rows together), the shift copied once per thread into 8 registers
   (the copies inlined: ``K[c] = x[0, c, 0]``); ``d``, ``d^2`` summed in float32.
Kernel 2, grid (C,), 64 lanes for 7x7 (:func:`column_finalize`):
3. Lane ``l`` sums column ``c * L + l``'s P partials in registers, then the lanes'
   sums are reduced across the block (shuffles, one shared hop); thread 0 writes
   ``mean`` and ``var`` into shared memory, then ``bn_scale``, ``bn_shift`` (a (C,)
   workspace each), ``save_mean``, ``save_invstd`` and the running statistics.
Kernel 3, kernel 1's grid (:func:`column_map`):
4. ``y`` on the ``(n, j)`` layout: each thread copies its 8 columns' ``bn_shift``,
   ``bn_scale`` (and ``bias``) into registers once (``reindex``: per column, so the
   two channels a vector may straddle cost nothing), then per row one 16-byte load
   of x, ``y`` in float32, one 16-byte store (the ``reindex``-ed write-back's index
   ``n C L + (j / L) L + j % L`` simplifies to ``n C L + j``).

Why: block per channel (``bn_forward_persistent``, 256 lanes) reads a 7x7 channel
with 2-byte loads. On the H200 256x2048x7x7 fp16 takes 0.0602 ms against 0.0243 ms
for one read and one write of x, and ptxas gives that kernel 80 registers (3 blocks
an SM, a 17% tail wave); its forward plus backward 0.1482 against 0.0607. Here every
access of x and y is 16 bytes; the price is a second read of x (a 51 MB x is about
the H200's L2) and a (P, C * L) float32 workspace pair (P = 8 by default there:
6.4 MB written and read). Measured (H200, kernels under graph replay): forward 0.0508 ms
and backward 0.0740 on 256x2048x7x7 fp16, against 0.0613 and 0.0888 for the persistent
kernels; the first version, which stored its partials channel-major (a 4-byte store
a sector), took 0.0702 and 0.0953 (its per-kernel profile, not in the CSV, put most of that in
kernel 1 reading 51 MB). Preferred where it wins (:data:`PREFERRED_VALUES`).

Applies: training, NCHW (not channels-last), N >= 2, with ``L * bytes % 16 != 0`` (an aligned
plane takes the block-per-channel kernels' 16-byte loads), ``C * L * bytes % 16 == 0``
(rows of the column view start on 16 bytes) and ``L <= MAX_PLANE`` (the finalize
reads ``P * L`` partials a channel). Knobs: :class:`SmallPlaneCandidate`, the
channels-last space of the ``(N, C * L)`` view.

Not used: a ``columns`` decomposition in TE: the schedule gets the column view
from the ``shifted`` compute (``rfactor`` of l, ``transform_block_layout``,
``reindex``) and the decomposition stays one. One finalize reduction over ``P * L``
partials (rfactoring the fused (s, r, l) loop): ``transform_block_layout`` then
meets the rfactored block, whose bindings are not plain loop variables when the
rows do not split evenly (3x16x7x7), and refuses.
A per-channel register copy of the coefficients (``registers_per_thread``): the 8
columns of a lane may straddle two channels, TVM's region is then ``(j0 % L + 7) /
L + 1`` channels, a dynamic extent and dynamically indexed (local-memory) arrays.
Column-wide sums over rows within one kernel (all N rows of a column group in one
block, the map from registers): with N = 256 rows a block holds 256 x 8 values a
lane, past the register file.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tvm import s_tir
from tvm.target import Target

from tvm_fusion import launch_order
from tvm_fusion.compute.bn_forward import channel_outputs
from tvm_fusion.contracts import BNForwardProblem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.registry import register

from ..common import outputs_to, read_index, single_thread
from .common import (
    FINALIZE_THREADS, VECTOR_BYTES, ChannelsLastCandidate, ChannelsLastKnobs, batched_loads, channels_last_grid,
    row_partials,
)

# Planes up to 32x32: the finalize's lanes sum P * L partials a channel (P = 8 by
# default: 8192 at L = 1024, 64 a lane of 128), and past that a block per channel
# reads long planes well. From first principles, not measured.
MAX_PLANE = 1024


def small_plane(problem: Any) -> bool:
    """An NCHW problem whose planes are short and misaligned (``L * bytes % 16 != 0``)
    while its column view's rows are aligned (``C * L * bytes % 16 == 0``), of two rows
    at least: with one (N = 1) the column sums' row loop has extent 1, TVM drops its
    reduction variable and ``row_partials``' ``decompose_reduction`` finds no
    reduction block (the block-per-channel kernels take one image)."""
    if problem.channels_last or len(problem.shape) != 3:
        return False
    rows, channels, plane = problem.shape
    size = DTYPE_BYTES[problem.dtype]
    return (rows >= 2 and plane <= MAX_PLANE and plane * size % VECTOR_BYTES != 0
            and channels * plane * size % VECTOR_BYTES == 0)


# Preferred over the persistent kernels on 16-bit inputs of 2^24 values and more. H200
# A/B of 2026-12-02 (results/benchmarks.csv), kernels under graph replay, against
# bn_forward_persistent / bn_backward_persistent: 256x2048x7x7 fp16 forward 0.0508 ms
# against 0.0613, backward 0.0740 against 0.0888; but fp32 256x2048x7x7 0.0968 against
# 0.0879, 64x512x7x7 fp16 (1.6 M values) 0.0131 against 0.0064 and 32x1024x14x14 fp16
# (6.4 M) 0.0171 against 0.0108: below that, one block a channel with its values on chip
# wins. Tunable everywhere it applies.
PREFERRED_VALUES = 1 << 24


def prefers_small_plane(problem: Any) -> bool:
    return small_plane(problem) and DTYPE_BYTES[problem.dtype] == 2 and problem.numel >= PREFERRED_VALUES


def columns_of(problem: Any) -> SimpleNamespace:
    """The ``(N, C * L)`` column view of an ``(N, C, L)`` problem, as the channels-last
    knob machinery reads it (``shape``, ``channels``, ``dtype``)."""
    rows, channels, plane = problem.shape
    return SimpleNamespace(shape=(rows, channels * plane), channels=channels * plane, dtype=problem.dtype)


class SmallPlaneCandidate(ChannelsLastCandidate):
    """:class:`ChannelsLastCandidate`'s space on the ``(N, C * L)`` view: grid (splits,
    column groups), block (column lanes, rows), ``threadIdx.x`` on ``vector``
    consecutive columns (``vector`` divides C * L: one 16-byte access a row)."""

    def choices(self, problem: Any, target: Target) -> dict[str, list[int]]:
        return super().choices(columns_of(problem), target)

    def default_for(self, problem: Any, target: Target) -> ChannelsLastKnobs:
        return super().default_for(columns_of(problem), target)

    def prefers(self, problem: Any, target: Target) -> bool:
        return prefers_small_plane(problem)


def column_layout(plane: int):
    """``(n, c, l) -> (n, c * L + l)``: a map block on the column view."""
    return lambda n, c, l: (n, c * plane + l)


def column_sums(sch: s_tir.Schedule, name: str, plane: int) -> tuple[list[str], list[str]]:
    """Turn the reduction ``name`` (``(c; n, l)`` loops) into per-column sums over the
    rows, ``<name>_rf`` (``(j; n)``, j = c * L + l, a (C * L,) buffer), and ``name`` into
    their per-channel sum over l, then ``reindex`` the column block's reads onto
    ``(n, j)`` (the row inputs: ``x[n, c(j), l(j)]`` becomes ``x_reindex[n, j]``) and
    ``j`` (the per-channel ones: ``K[c(j)]`` becomes ``K_reindex[j]``, a column's
    copy). The column block is then a channels-last reduction of ``C * L``
    "channels". Returns ``(row buffers, copy blocks)``: the reindexed row inputs, and
    every copy block, to be inlined once ``common.row_partials`` has staged them."""
    block = sch.get_sblock(name)
    channel, row, l = sch.get_loops(block)
    sch.reorder(channel, l, row)
    columns = sch.rfactor(l, factor_axis=1)
    channel, l, row = sch.get_loops(columns)
    sch.reorder(l, channel)  # loops in the block's (l, c, n) order, as the layout wants
    sch.transform_block_layout(columns, lambda l, c, n: (c * plane + l, n))
    for index in range(len(sch.get(columns).writes)):
        sch.transform_layout(columns, ("write", index), lambda c, l: (c * plane + l,))
    rows, copies = [], []
    for region in list(sch.get(columns).reads):
        source = region.source
        if len(source.shape) not in (1, 3):
            continue
        copy = sch.reindex(columns, ("read", read_index(sch, columns, source.name)))
        if len(source.shape) == 3:  # (j, n) -> (n, j): a row's columns side by side

            def rows_first(j, n):
                return n, j

            sch.transform_block_layout(copy, rows_first)
            sch.transform_layout(copy, ("write", 0), rows_first)
            rows.append(sch.get(copy).writes[0].source.name)
        copies.append(sch.get(copy).name_hint)
    return rows, copies


def column_partials(sch: s_tir.Schedule, name: str, knobs, plane: int, inline: tuple[str, ...] = ()) -> None:
    """Kernel 1: the partials of the reduction ``name`` per column, over the rows a
    thread owns: :func:`column_sums`, then ``common.row_partials`` on the column
    block (a (P, C * L) float32 workspace), the row inputs staged through registers
    16 bytes a row, the per-column copies of per-channel values (the shift, mean,
    invstd) made once per thread; the copy blocks and ``inline`` (the shift K[c]
    block) are then inlined into their readers."""
    rows, copies = column_sums(sch, name, plane)
    row_copies = tuple(copy for copy in copies if sch.get(sch.get_sblock(copy)).writes[0].source.name in rows)
    row_partials(sch, f"{name}_rf", knobs, tuple(rows), inline=row_copies)
    for copy in [*copies, *inline]:
        if copy not in row_copies:
            sch.compute_inline(sch.get_sblock(copy))


def finalize_lanes(plane: int) -> int:
    """Kernel 2's lanes: a warp for planes up to 32 values, then 64, then
    ``FINALIZE_THREADS``: a lane a column (or a few), each summing that column's P
    partials."""
    return 32 if plane <= 32 else (64 if plane <= 64 else FINALIZE_THREADS)


def column_finalize(sch: s_tir.Schedule, name: str, plane: int, consumers: list[str]) -> None:
    """Kernel 2, grid (C,): lane ``t`` of a channel's block sums column ``l = t`` (and
    ``t + lanes``, ...) over its P partials in registers (``<name>_rf``, computed at
    the lane), then the lanes' sums are reduced across the block (``name``: shuffles,
    one shared hop) into registers; thread 0 runs ``consumers`` in that order
    (``common.channel_finalize``'s reasons)."""
    lanes = finalize_lanes(plane)
    block = sch.get_sblock(name)
    channel, l = sch.get_loops(block)
    sch.bind(channel, "blockIdx.x")
    serial, lane = sch.split(l, [None, lanes])
    sch.reorder(lane, serial)
    sch.bind(lane, "threadIdx.x")
    columns = sch.get_sblock(f"{name}_rf")
    sch.compute_at(columns, serial, preserve_unit_loops=True)
    outputs_to(sch, columns, "local")
    outputs_to(sch, block, "local")
    for consumer_name in consumers:
        consumer = sch.get_sblock(consumer_name)
        sch.reverse_compute_at(consumer, channel)
        single_thread(sch, consumer, lanes)


def to_registers(sch: s_tir.Schedule, block, inline: tuple[str, ...] = ()) -> tuple[list, list]:
    """``reindex`` every read of the map ``block`` (laid out ``(n, j)``) onto its own
    iteration, in registers: the row inputs (``(N, C, L)`` buffers) as ``[n, j]``, the
    per-channel ones (``(C,)`` buffers) as ``[j]``, a column's copy; the producer
    blocks in ``inline`` are then inlined into their readers. Returns ``(row copies,
    column copies)``, to be placed."""
    rows, columns = [], []
    for region in list(sch.get(block).reads):
        rank = len(region.source.shape)
        if rank not in (1, 3):
            continue
        copy = sch.reindex(block, ("read", read_index(sch, block, region.source.name)))
        sch.set_scope(copy, 0, "local")
        (rows if rank == 3 else columns).append(copy)
    for name in inline:
        sch.compute_inline(sch.get_sblock(name))
    return rows, columns


def column_map(sch: s_tir.Schedule, name: str, knobs, plane: int, computed: tuple[str, ...] = ()) -> None:
    """Kernel 3: the map ``name`` over ``(N, C, L)`` laid out ``(n, j)``, on kernel 1's
    grid (``common.channels_last_map`` on the column view). Each thread copies its
    columns' ``per_channel`` values (and the ``computed`` coefficients, inlined into
    that copy) into registers once; per row the ``staged`` inputs come in with one
    16-byte load each (``unroll`` rows of them first) and the result goes out with one
    16-byte store through registers."""
    block = sch.get_sblock(name)
    sch.transform_block_layout(block, column_layout(plane))
    rows, columns = to_registers(sch, block, computed)
    out = sch.reindex(block, ("write", 0))
    sch.set_scope(block, 0, "local")
    row, column = sch.get_loops(block)
    run, step, lane_row, batch = sch.split(row, [knobs.splits, None, knobs.rows, knobs.unroll])
    lane = channels_last_grid(sch, run, lane_row, step, column, knobs, batch)
    for copy in columns:
        sch.compute_at(copy, lane, preserve_unit_loops=True)
    for copy in rows:
        batched_loads(sch, copy, step)
    sch.reverse_compute_at(out, step, preserve_unit_loops=True)
    *_, out_rows, out_vec = sch.get_loops(out)
    sch.vectorize(out_vec)
    sch.unroll(out_rows)
    sch.unroll(batch)
    # Each block walks its rows from the end, which kernel 1 read last (launch_order).
    launch_order.reverse(sch, step)


@register
class BNForwardSmallPlane(SmallPlaneCandidate):
    name = "bn_forward_small_plane"
    op = "bn_forward"
    algorithm = "shifted"

    def applies(self, problem: BNForwardProblem) -> bool:
        return problem.op == self.op and problem.training and small_plane(problem)

    def schedule(self, sch, problem: BNForwardProblem, knobs) -> None:
        plane = problem.shape[2]
        # 1-2. Kernel 1: per-column partials, x and K[c(j)] through registers.
        column_partials(sch, "moments", knobs, plane, inline=("shift",))
        # 3. Kernel 2: the finalize, mean and var in shared memory.
        column_finalize(sch, "moments", plane, ["mean", "var", "bn_scale", "bn_shift", *channel_outputs(problem)])
        for name in ("mean", "var"):
            sch.set_scope(sch.get_sblock(name), 0, "shared")
        # 4. Kernel 3: the map, each thread's columns' coefficients in registers.
        column_map(sch, "y", knobs, plane)
