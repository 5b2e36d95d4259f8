"""BatchNorm's backward, one thread block per channel, the channel's x and dy kept on chip.

Pattern ``x, dy(SRR) -> on chip -> (sum dy, sum dy * xhat)(S) -> dbias, dweight,
coef(S) -> dx(SSS) from chip`` on the ``(N, C, L)`` view, the ``dual_reduce``
decomposition. ``bn_backward_block_per_channel`` reads x and dy twice (the sums, then
the map); here a block loads its channel's x and dy once and both the sums and the
map read that copy: x and dy read once, dx written once, the fewest bytes
(``bytes_moved``). For channels whose x and dy fit on chip together: 256x2048x7x7
fp16 (12544 values, 2 x 25 KB), 32x16x8x8; not 64x256x56x56 (2 x 401 KB:
``bn_backward_block_per_channel``).

1. The output loops (``dx``'s channel first, then ``dbias`` and ``dweight``) are
   merged into one channel loop bound to ``blockIdx.x``, dx's per-channel
   coefficients computed at it.
2. The channel's dy, and in training its x, are loaded once, lanes over consecutive
   ``vector``-wide chunks (16-byte loads where 8 fp16 or 4 fp32 values divide L), every
   lane's loop unrolled, into (``staging``, bn_forward_persistent's rules): registers,
   ``cache_read`` to ``local`` in the ``(c, s, t, v)`` layout (``lane_layout``: lane
   t's ``s x v`` values of each tensor, a register array), or ``shared.dyn``, the
   channel's values in order. Eval's dx reads no x: its x goes through registers one
   chunk at a time in the sums and is not kept.
3. ``grad_sums`` sums ``dy`` and ``dy * xhat`` in float32 over the on-chip copies (from
   shared memory 16 bytes at a time into registers), then ``__shfl_down_sync`` and
   one shared-memory hop.
4. Thread 0 turns the sums into dx's ``bn_dx_mean`` and ``bn_dx_xhat`` in shared
   memory (so the allreduce result's last readers are thread 0's: a block every
   thread ran there would race StorageRewrite's reuse of it, cross_entropy_grad's
   ``row_order`` lesson); every thread keeps ``bn_dx_scale`` in registers.
5. ``dx`` from the on-chip copies, the same chunks, 16-byte stores through registers
   where the lanes split the channel evenly (``store_vectors``: always with registers;
   for a sampled space, every point must). In eval dx reads no sum and TVM places it
   ahead of the sums.
6. Thread 0 writes ``dbias`` and ``dweight``, the sums' last readers.

Fit: bn_forward_persistent's, for two tensors of the channel's size (``copies=2``,
training and eval alike): registers
where the chunks split evenly over the lanes within half the forward's
``REGISTER_WORDS`` a tensor, else shared memory within half its
``SHARED_BYTES_MAX``, else the candidate does not apply. First in the dispatch order
and without ``prefers``, it is the default wherever it applies; knobs as the
forward's (``staging`` one choice per shape, with registers so are ``threads`` and
``vector``).

Not used: a fit rule of one tensor in eval (only dy stays on chip there), because
``staging`` and the register layout are one choice per shape and one rule keeps the
two modes' kernels alike; eval could take channels twice as long. Registers for 7x7
planes at 256 lanes (49 scalars of x and 49 of dy a lane, 98 registers), because
that is past the 64 ``REGISTER_WORDS`` allows (a budget from first principles, not
measured): shared memory takes them.
An explicitly unrolled sums loop over two ``shared.dyn`` copies, because TVM 0.27's
MergeSharedMemoryAllocations rejects the reduction's lets at the kernel's top level
("Load memory in places other than store"): that loop is left to nvcc's ``#pragma
unroll``. The grid-wide variant for channels that do not fit is
``bn_backward_grid_persistent``.

Run only through code generation and nvcc here; the gpu suite's checks against
float64 have not run on a GPU yet, and it has not been timed.
"""

from __future__ import annotations

from tvm.target import Target

from tvm_fusion.compute.bn_backward import dx_coefficients
from tvm_fusion.contracts import BNBackwardProblem
from tvm_fusion.registry import Candidate, register

from ..common import knob_value, lanes_split, merge_rows, outputs_to, read_index, single_thread, stage_in_registers
from .bn_forward_persistent import (
    REGISTERS, SHARED, SHARED_STEPS, PersistentKnobs, lane_layout, lanes, on_chip_choices, on_chip_default,
    register_threads, shared_threads,
)
from .common import store_vectors

COPIES = 2  # x and dy, each the channel's size


@register
class BNBackwardPersistent(Candidate):
    name = "bn_backward_persistent"
    op = "bn_backward"
    target_kind = "cuda"
    algorithm = "dual_reduce"
    knobs = PersistentKnobs
    claims = {"shuffles": True, "vector_loads": True}

    def applies(self, problem: BNBackwardProblem) -> bool:
        return (problem.op == self.op and not problem.channels_last
                and bool(register_threads(problem, COPIES) or shared_threads(problem, COPIES)))

    def choices(self, problem: BNBackwardProblem, target: Target) -> dict[str, list[int]]:
        return on_chip_choices(problem, COPIES)

    def default_for(self, problem: BNBackwardProblem, target: Target) -> PersistentKnobs:
        return on_chip_default(problem, COPIES)

    def splits_evenly(self, problem: BNBackwardProblem, knobs) -> bool:
        """dx's chunks split evenly over the lanes: for the knobs given, or for sampled
        ones every (threads, vector) of the space (a trace replayed with another
        decision keeps the structure this one chose). Always with registers."""
        space = self.choices(problem, None)
        threads = [knobs.threads] if isinstance(knobs.threads, int) else space["threads"]
        vectors = [knobs.vector] if isinstance(knobs.vector, int) else space["vector"]
        return all(problem.count // v % t == 0 for t in threads for v in vectors)

    def schedule(self, sch, problem: BNBackwardProblem, knobs) -> None:
        staging = knob_value(sch, knobs.staging)  # one choice per shape: safe to branch on
        sums, dx = sch.get_sblock("grad_sums"), sch.get_sblock("dx")
        kept = ("x", "dy") if problem.training else ("dy",)  # what dx reads
        # 2. The copies of the channel that the sums and dx read.
        if staging == REGISTERS:
            threads, vector = knob_value(sch, knobs.threads), knob_value(sch, knobs.vector)
            copies = [sch.cache_read(sums, read_index(sch, sums, name), "local", consumer_blocks=[sums, dx])
                      for name in kept]
            layout = lane_layout(problem, threads, vector)
            # Blocks first, then the buffers: their indices are then the blocks' own vars.
            for copy in copies:
                sch.transform_block_layout(copy, layout)
            sch.transform_block_layout(dx, layout)
            # A unit value axis would be a spatial loop under the reduction's: not with vector 1.
            sums_layout = layout if vector > 1 else lambda n, c, l: layout(n, c, l)[:3]
            sch.transform_block_layout(sums, lambda c, n, l: sums_layout(n, c, l))
            for copy in copies:
                sch.transform_layout(copy, ("write", 0), layout)
        else:
            threads, vector = knobs.threads, knobs.vector
            copies = [sch.cache_read(sums, read_index(sch, sums, name), "shared.dyn", consumer_blocks=[sums, dx])
                      for name in kept]
            on_chip = [sch.get(copy).writes[0].source.name for copy in copies]
            n, c, plane = sch.get_loops(dx)
            sch.reorder(c, n, plane)
        # 1. One channel loop for the outputs, dx's coefficients at it; dx first, so that
        # thread 0's outputs are the sums' last readers (eval's dx reads no sum: it then
        # runs ahead of them).
        for name in dx_coefficients(problem):
            sch.compute_at(sch.get_sblock(name), sch.get_loops(dx)[0], preserve_unit_loops=True)
        channel = merge_rows(sch, ["dx", "dbias", "dweight"])
        sch.bind(channel, "blockIdx.x")
        # 4. dx's mean and xhat terms by thread 0 into shared memory, its scale in registers.
        for name in dx_coefficients(problem)[1:]:
            block = sch.get_sblock(name)
            sch.set_scope(block, 0, "shared")
            single_thread(sch, block, threads)
        outputs_to(sch, sch.get_sblock("bn_dx_scale"), "local")
        # 3. The dual sums over the copies, across the block (eval's x one chunk a step).
        sch.compute_at(sums, channel, preserve_unit_loops=True)
        if staging == SHARED and len(kept) > 1:
            # Two shared.dyn buffers: TVM 0.27's MergeSharedMemoryAllocations then fails on
            # the lets of an explicitly unrolled reduction at the kernel's top level ("Load
            # memory in places other than store"); the loop stays, with ``#pragma unroll``.
            _, serial, _ = lanes_split(sch, sums, 1, threads, vector, SHARED_STEPS[1])
            sch.unannotate(serial, "pragma_unroll_explicit")
            sch.annotate(serial, "pragma_unroll_explicit", 0)
        else:
            serial = lanes(sch, sums, staging, threads, vector)
        if staging == SHARED:
            for name in on_chip:
                stage_in_registers(sch, sums, name, serial)
        if not problem.training:
            stage_in_registers(sch, sums, "x", serial)
        outputs_to(sch, sums, "local")
        # 2. The copies' loads, ahead of every reader.
        for copy in copies:
            sch.compute_at(copy, channel, preserve_unit_loops=True)
            lanes(sch, copy, staging, threads, vector)
            sch.vectorize(sch.get_loops(copy)[-1])
        # 5. dx from the copies.
        dx = sch.get_sblock("dx")
        serial = lanes(sch, dx, staging, threads, vector)
        if staging == SHARED:
            for name in on_chip:
                stage_in_registers(sch, dx, name, serial)
        store_vectors(sch, dx, serial, sch.get_loops(dx)[-1], perfect=self.splits_evenly(problem, knobs))
        # 6. dbias and dweight on thread 0, the sums' last readers.
        for name in ("dbias", "dweight"):
            single_thread(sch, sch.get_sblock(name), threads)
