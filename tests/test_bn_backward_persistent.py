"""bn_backward_persistent: BatchNorm's backward with the channel's x and dy kept on chip.

Where it applies (x and dy of a channel fit registers or shared memory together), what
its CUDA code must show (x and dy loaded once, before the sums' shuffles, dx stored
from the copy, 16-byte loads and stores where the vector says so, no barrier under a
guard, no spills), that its tuning space replays, and on a GPU that every staging and
knob sample computes the float64 reference (|mean| >> std included) with outputs
poisoned before the run."""

import random
import re

import pytest

from helpers import (
    check_compiles_without_spills, check_threads_decisions_replay, needs_nvcc, on_gpu, rng, run_poisoned,
)
from test_bn_backward import check, inputs
from test_bn_persistent import kernel_body
from test_cuda_codegen import barriers_under_a_guard, kernel_params, shared_stores_by_every_thread
from tvm_fusion import registry, targets
from tvm_fusion.contracts.bn_backward import bn_backward_problem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.kernel import build_kernel
from tvm_fusion.schedules.cuda.bn_forward_persistent import (
    REGISTERS, SHARED, PersistentKnobs, register_threads, shared_threads,
)
from tvm_fusion.schedules.cuda.bn_forward_small_plane import prefers_small_plane

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
NAME = "bn_backward_persistent"
CANDIDATE = registry.get(NAME)
COPIES = 2


def problem(shape, dtype, training=True, affine=True, layout="NCHW"):
    return bn_backward_problem(shape, dtype, layout, affine, training)


# Why each shape: the ResNet tail (12544 values a channel, 2 x 25 KB; L = 49 is odd:
# scalar loads, and 49 scalars of each tensor a lane are past the register budget, so
# shared memory); 8x8 planes at two dtypes (16-byte vectors, registers; bf16 the
# bit-shift widening); odd planes whose chunks split over no power-of-two lane count
# (shared memory, a guarded tail); 70 chunks of 16 bytes over 32 lanes (a tail with
# vectors: dx stored one value at a time under its bound, ``store_vectors``).
FITS = [((256, 2048, 7, 7), "float16", SHARED), ((32, 16, 8, 8), "bfloat16", REGISTERS),
        ((32, 16, 8, 8), "float32", REGISTERS), ((3, 5, 7, 9), "float16", SHARED),
        ((7, 3, 40), "float32", SHARED)]


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape, dtype, staging", FITS)
def test_applies_where_x_and_dy_fit_and_goes_first(shape, dtype, staging, training):
    p = problem(shape, dtype, training)
    assert CANDIDATE.applies(p) and CANDIDATE.default_for(p, CUDA).staging == staging
    # 16-bit inputs of 2^24 values and more go to the small-plane kernels first (faster there).
    first = "bn_backward_small_plane" if prefers_small_plane(p) else NAME
    assert registry.default_candidate(p, CUDA).name == first


@pytest.mark.parametrize("p, why", [
    (problem((64, 256, 56, 56), "float16"), "200704 values a channel (2 x 401 KB)"),
    (problem((32, 8, 8, 16), "float16", layout="NHWC"), "channels last: the (M, C) view"),
    (problem((1024, 3, 48), "float16"), "96 KB a channel: the forward's copy fits, x and dy do not"),
], ids=lambda v: v if isinstance(v, str) else v.key())
def test_does_not_apply(p, why):
    assert not CANDIDATE.applies(p), why
    assert registry.default_candidate(p, CUDA).name != NAME


def test_fit_limits_are_the_forwards_halved():
    # 256x64x8x8 fp32: 4096 vectors of 4, 64 registers a lane at 512 lanes, 32 at 1024.
    assert register_threads(problem((256, 64, 8, 8), "float32"), COPIES) == [512, 1024]
    assert not register_threads(problem((512, 64, 8, 8), "float32"), COPIES)
    # 24576 fp16 values a channel (2 x 48 KB) fit shared memory, 25088 do not.
    assert shared_threads(problem((512, 3, 48), "float16"), COPIES)
    assert not shared_threads(problem((512, 3, 49), "float16"), COPIES)


def configs(p):
    """The default, a sample of the space, and shared memory where registers are the
    default and the copies fit there too (at both ends of its threads)."""
    space = CANDIDATE.all_configs(p, CUDA)
    found = [CANDIDATE.default_for(p, CUDA)] + random.Random(NAME).sample(space, min(2, len(space)))
    if found[0].staging == REGISTERS and shared_threads(p, COPIES):
        for threads in (shared_threads(p, COPIES)[0], shared_threads(p, COPIES)[-1]):
            found.append(PersistentKnobs(threads=threads, vector=found[0].vector, staging=SHARED))
    return list(dict.fromkeys(found))


def lines_with(lines, pattern):
    return [i for i, line in enumerate(lines) if re.search(pattern, line)]


@pytest.mark.parametrize("training, affine", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("shape, dtype, staging", FITS)
def test_cuda_source_loads_x_and_dy_once_and_stores_dx_from_the_copy(shape, dtype, staging, training, affine):
    p = problem(shape, dtype, training, affine)
    for knobs in configs(p):
        kernel = build_kernel(p, CUDA, NAME, knobs)
        source = kernel.device_source()
        assert "__shfl_down_sync" in source and "atomic" not in source.lower()
        assert kernel_params(source) <= {name for name, _, _ in kernel.params}, "a global workspace"
        assert not barriers_under_a_guard(source) and not shared_stores_by_every_thread(source), knobs
        steps = -(-p.count // (knobs.vector * knobs.threads))  # chunks a lane loads of each tensor
        lines = kernel_body(source)
        x_loads, dy_loads = lines_with(lines, r"\bx_ptr\b"), lines_with(lines, r"\bdy_ptr\b")
        stores = lines_with(lines, r"\bdx_ptr\b")
        first_shuffle = lines_with(lines, "__shfl_down_sync")[0]
        # One load a chunk of each, all before the sums' shuffles.
        assert len(x_loads) == len(dy_loads) == steps, knobs
        assert max(x_loads + dy_loads) < first_shuffle, knobs
        evenly = (p.count // knobs.vector) % knobs.threads == 0
        assert len(stores) == steps * (1 if evenly else knobs.vector), knobs  # else one value a store
        if training:  # dx reads the sums: every store after them
            assert first_shuffle < min(stores), knobs
        else:  # dx reads dy's copy only
            assert max(dy_loads) < min(stores), knobs
        if knobs.staging == REGISTERS:
            # A lane's own share of each kept tensor, steps x vector values; eval keeps no x.
            assert "extern __shared__" not in source, knobs
            assert re.search(rf"\bdy_local_ptr\[{steps * knobs.vector}\];", source), knobs
            x_values = steps * knobs.vector if training else knobs.vector
            assert re.search(rf"\bx_local_ptr\[{x_values}\];", source), knobs
        else:
            assert "extern __shared__" in source and "dy_local_ptr" not in source, knobs
        if knobs.vector * DTYPE_BYTES[p.dtype] == 16:  # 16-byte loads and stores (float4 for fp32)
            assert all(re.search(r"\*\((?:uint|float)4\*\)\((?:x|dy)_ptr", lines[i]) for i in x_loads + dy_loads)
            if evenly:
                assert all(re.search(r"\*\((?:uint|float)4\*\)\(dx_ptr", lines[i]) for i in stores), knobs


@needs_nvcc
@pytest.mark.parametrize("p, knobs", [
    (problem((256, 64, 8, 8), "float32"), PersistentKnobs(threads=512, vector=4, staging=REGISTERS)),  # 64 words
    (problem((256, 64, 8, 8), "float32"), PersistentKnobs(threads=1024, vector=4, staging=REGISTERS)),  # 32 words
    (problem((512, 64, 8, 8), "float16"), PersistentKnobs(threads=512, vector=8, staging=REGISTERS)),
    (problem((32, 16, 8, 8), "bfloat16", training=False), None),
    (problem((512, 3, 48), "float16"), PersistentKnobs(threads=512, vector=8, staging=SHARED)),  # 2 x 48 KB
], ids=lambda v: v.key() if hasattr(v, "key") else str(v))
def test_cuda_kernel_compiles_without_spills(p, knobs):
    check_compiles_without_spills(build_kernel(p, CUDA, NAME, knobs))


@needs_nvcc
def test_cuda_kernel_of_scalar_planes_compiles_without_spills():
    from tvm_fusion.codegen import cuda_report

    report = cuda_report(build_kernel(problem((256, 2048, 7, 7), "float16"), CUDA, NAME))
    assert not any(report.spill_bytes.values()) and not any(report.stack_bytes.values()), report
    assert report.shuffles > 0 and report.atomics == 0, report


@pytest.mark.parametrize("p", [problem((3, 5, 7, 9), "float16"), problem((3, 5, 7, 9), "float16", training=False)],
                         ids=lambda p: p.key())
def test_tuning_space_replays_with_every_decision(p):
    """Each threads decision of the shared-memory space builds and launches the threads
    it says; the uneven tails keep dx's stores one by one under the bound."""
    check_threads_decisions_replay(CANDIDATE, p, CUDA)


# -- on a GPU ----------------------------------------------------------------------------
# (shape, dtype, training, affine): FITS's shapes in both modes, affine or not.
GPU_CASES = [((256, 2048, 7, 7), "float16", True, True), ((256, 2048, 7, 7), "float16", False, False),
             ((32, 16, 8, 8), "bfloat16", True, False), ((32, 16, 8, 8), "bfloat16", False, True),
             ((32, 16, 8, 8), "float32", True, True), ((32, 16, 8, 8), "float32", False, False),
             ((3, 5, 7, 9), "float16", True, False), ((3, 5, 7, 9), "float16", False, True),
             ((7, 3, 40), "float32", True, True)]


@on_gpu
@pytest.mark.parametrize("shape, dtype, training, affine", GPU_CASES)
def test_on_gpu_every_staging_computes_the_reference(shape, dtype, training, affine):
    import tvm

    p = problem(shape, dtype, training, affine)
    gen = rng()
    for knobs in configs(p):
        kernel = build_kernel(p, targets.resolve("cuda"), NAME, knobs)
        for shift in (3.0, 1000.0):  # |mean| >> std too
            x, dy, mean, invstd, weight = inputs(gen, p, p.dtype, shift=shift)
            args = [x.reshape(p.shape), dy.reshape(p.shape), mean, invstd] + ([weight] if affine else [])
            outs = run_poisoned(kernel, args, tvm.cuda(0))
            check(outs, x, dy, mean, invstd, weight, p, f"{NAME} {knobs} mean {shift}")
