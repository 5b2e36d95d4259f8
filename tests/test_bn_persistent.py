"""bn_forward_persistent: BatchNorm's training forward with the channel kept on chip.

Where it applies (the channel fits registers or shared memory), what its CUDA code
must show (x loaded once, before the statistics, 16-byte loads and stores where the
vector says so, the register copy a lane's own share, shuffles, no spills), that its
tuning space replays, and on a GPU that every staging and knob sample computes the
float64 reference (|mean| >> std included) with outputs poisoned before the run."""

import re

import pytest

from helpers import check_threads_decisions_replay, needs_nvcc, on_gpu
from test_bn_forward import check_knobs_on_gpu
from test_cuda_codegen import barriers_under_a_guard, kernel_params, scoped_lines, shared_stores_by_every_thread
from tvm_fusion import registry, targets
from tvm_fusion.contracts.bn_forward import bn_forward_problem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.kernel import build_kernel
from tvm_fusion.schedules.cuda.bn_forward_persistent import (
    REGISTERS, SHARED, PersistentKnobs, register_threads, shared_threads,
)
from tvm_fusion.schedules.cuda.bn_forward_small_plane import prefers_small_plane
from tvm_fusion.schedules.cuda.common import vector_choices

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
NAME = "bn_forward_persistent"
CANDIDATE = registry.get(NAME)


def problem(shape, dtype, affine=True, track_running=True, training=True, layout="NCHW"):
    return bn_forward_problem(shape, dtype, layout, affine, training, track_running)


# Why each shape: the ResNet tail (12544 values a channel, 25 KB; L = 49 is odd, so
# scalar loads); 8x8 planes at two dtypes (16-byte vectors, registers); a shape with
# odd planes whose chunks split over no power-of-two lane count (shared memory, a
# guarded tail); bf16 at 32x16x8x8 (the bit-shift widening).
FITS = [((256, 2048, 7, 7), "float16", REGISTERS), ((128, 64, 8, 8), "float16", REGISTERS),
        ((128, 64, 8, 8), "float32", REGISTERS), ((3, 5, 7, 9), "float32", SHARED),
        ((32, 16, 8, 8), "bfloat16", REGISTERS)]


@pytest.mark.parametrize("shape, dtype, staging", FITS)
def test_applies_where_the_channel_fits_and_goes_first(shape, dtype, staging):
    p = problem(shape, dtype)
    assert CANDIDATE.applies(p) and CANDIDATE.default_for(p, CUDA).staging == staging
    # 16-bit channels of 2^24 values and more go to the small-plane kernels first (faster there).
    first = "bn_forward_small_plane" if prefers_small_plane(p) else NAME
    assert registry.default_candidate(p, CUDA).name == first


@pytest.mark.parametrize("p, why", [
    (problem((64, 256, 56, 56), "float16"), "200704 values a channel (401 KB)"),
    (problem((256, 2048, 7, 7), "float16", training=False), "eval keeps no statistics on chip"),
    (problem((32, 8, 8, 16), "float16", layout="NHWC"), "channels last: the (M, C) view"),
    (problem((5, 3, 7), "float32"), "35 values: too few for two steps of 32 lanes"),
], ids=lambda v: v if isinstance(v, str) else v.key())
def test_does_not_apply(p, why):
    assert not CANDIDATE.applies(p), why
    assert registry.default_candidate(p, CUDA).name != NAME


def test_fit_limits():
    # 64 fp32 registers a lane at 512 lanes, 32 at 1024: 512x64x8x8 (8192 vectors of 4).
    assert register_threads(problem((512, 64, 8, 8), "float32")) == [512, 1024]
    # 49152 fp16 values a channel (96 KB) fit shared memory, 50176 do not.
    assert shared_threads(problem((1024, 3, 48), "float16")) and not shared_threads(problem((1024, 3, 49), "float16"))


def configs(p):
    """The default, a sample of the space, and the other staging where it fits too (with
    shared memory at both ends of its threads and vectors)."""
    import random

    space = CANDIDATE.all_configs(p, CUDA)
    found = [CANDIDATE.default_for(p, CUDA)] + random.Random(NAME).sample(space, min(2, len(space)))
    vector = found[0].vector
    if found[0].staging == REGISTERS and shared_threads(p):
        narrowest = min(vector_choices(DTYPE_BYTES[p.dtype], p.shape[2]))
        found.append(PersistentKnobs(threads=shared_threads(p)[-1], vector=vector, staging=SHARED))
        found.append(PersistentKnobs(threads=shared_threads(p)[0], vector=narrowest, staging=SHARED))
    if len(register_threads(p)) > 1:  # the largest lane count too
        found.append(PersistentKnobs(threads=register_threads(p)[-1], vector=vector, staging=REGISTERS))
    return list(dict.fromkeys(found))


def kernel_body(source: str) -> list[str]:
    """The lines of the kernel's definition, after its signature."""
    return re.split(r'extern "C" __global__ void [^;{]*\{\n', source, maxsplit=1)[1].splitlines()


@pytest.mark.parametrize("shape, dtype, staging", FITS)
def test_cuda_source_loads_x_once_and_stores_y_from_the_copy(shape, dtype, staging):
    for affine, track in ((True, True), (False, False)):
        p = problem(shape, dtype, affine, track)
        for knobs in configs(p):
            kernel = build_kernel(p, CUDA, NAME, knobs)
            source = kernel.device_source()
            assert "__shfl_down_sync" in source and "atomic" not in source.lower()
            assert kernel_params(source) <= {name for name, _, _ in kernel.params}, "a global workspace"
            assert not barriers_under_a_guard(source) and not shared_stores_by_every_thread(source), knobs
            steps = -(-p.count // (knobs.vector * knobs.threads))  # chunks a lane stages
            lines = kernel_body(source)
            guards = [" ".join(opened) for _, opened in scoped_lines("\n".join(lines))]
            loads = [i for i, line in enumerate(lines) if "x_ptr" in line]
            shift = [i for i in loads if "threadIdx.x) < 1)" in guards[i]]  # thread 0's K[c]
            copy = [i for i in loads if i not in shift]
            stores = [i for i, line in enumerate(lines) if "y_ptr" in line]
            first_shuffle = next(i for i, line in enumerate(lines) if "__shfl_down_sync" in line)
            # Every load of x before the statistics, every store of y after them.
            assert max(loads) < first_shuffle < min(stores), knobs
            assert len(copy) == len(stores) == steps, knobs
            if knobs.staging == REGISTERS:
                # The shift from x by thread 0 (a value of its own first chunk); the copy
                # is the lane's own share, steps x vector values, not the channel.
                assert len(shift) == 1 and "extern __shared__" not in source, knobs
                assert re.search(rf"\bx_local_ptr\[{steps * knobs.vector}\];", source), knobs
            else:
                # The shift from the shared copy; no register copy of the channel.
                assert not shift and "extern __shared__" in source and "x_local_ptr" not in source, knobs
            if knobs.vector * DTYPE_BYTES[p.dtype] == 16:  # 16-byte loads and stores (float4 for fp32)
                assert all(re.search(r"\*\((?:uint|float)4\*\)\(x_ptr", lines[i]) for i in copy), knobs
                assert all(re.search(r"\*\((?:uint|float)4\*\)\(y_ptr", lines[i]) for i in stores), knobs


@needs_nvcc
@pytest.mark.parametrize("p, knobs", [
    (problem((512, 64, 8, 8), "float32"), PersistentKnobs(threads=512, vector=4, staging=REGISTERS)),  # 64 words
    (problem((512, 64, 8, 8), "float32"), PersistentKnobs(threads=1024, vector=4, staging=REGISTERS)),  # 32 words
    (problem((1024, 64, 8, 8), "float16"), PersistentKnobs(threads=1024, vector=8, staging=REGISTERS)),
    (problem((256, 2048, 7, 7), "float16"), None),  # 49 scalar values a lane
    (problem((1024, 3, 48), "float16"), PersistentKnobs(threads=512, vector=8, staging=SHARED)),  # 96 KB
], ids=lambda v: v.key() if hasattr(v, "key") else str(v))
def test_cuda_kernel_compiles_without_spills(p, knobs):
    from tvm_fusion.codegen import cuda_report

    kernel = build_kernel(p, CUDA, NAME, knobs)
    report = cuda_report(kernel)
    assert not any(report.spill_bytes.values()) and not any(report.stack_bytes.values()), report
    assert report.shuffles > 0 and report.atomics == 0, report
    if kernel.knobs.vector * DTYPE_BYTES[p.dtype] == 16:
        assert report.vector_loads > 0, report


@pytest.mark.parametrize("p", [problem((3, 5, 7, 9), "float32"), problem((32, 16, 8, 8), "float16")],
                         ids=lambda p: p.key())
def test_tuning_space_replays_with_every_decision(p):
    """The tuner replays a candidate's trace with other sampled decisions: each must
    build and launch the threads it says (shared memory: several; registers: one)."""
    check_threads_decisions_replay(CANDIDATE, p, CUDA)


# -- on a GPU ----------------------------------------------------------------------------
# (shape, dtype, (affine, track_running)): FITS's shapes, and 96 KB a channel (shared
# memory past the 48 KB a block gets without the runtime's opt-in).
GPU_CASES = [((256, 2048, 7, 7), "float16", (True, True)), ((32, 16, 8, 8), "bfloat16", (True, False)),
             ((32, 16, 8, 8), "float32", (False, True)), ((3, 5, 7, 9), "float32", (True, True)),
             ((3, 5, 7, 9), "float32", (False, False)), ((128, 64, 8, 8), "float16", (False, False)),
             ((1024, 3, 48), "float16", (True, True))]


@on_gpu
@pytest.mark.parametrize("shape, dtype, mode", GPU_CASES)
def test_on_gpu_every_staging_computes_the_reference(shape, dtype, mode):
    p = problem(shape, dtype, *mode)
    check_knobs_on_gpu(p, NAME, configs(p))
