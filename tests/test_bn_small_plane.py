"""BatchNorm's forward and backward on NCHW with small planes, CUDA: the column view.

bn_forward_small_plane and bn_backward_small_plane read x (and dy) as the matrix
(N, C * L) and run as three kernels (per-column partials, a finalize per channel, the
map): checked here by where they apply (L * bytes % 16 != 0, C * L * bytes % 16 == 0),
the generated code (16-byte loads of x and dy and stores of y and dx, shuffles in
the finalize, no barrier under a thread guard, every workspace written by an earlier
kernel than its readers: test_bn_channels_last_cuda's checks), nvcc's report (no
spills), coverage (every small-plane problem picks the candidate and its default
builds), and on a GPU against the float64 references with poisoned outputs."""

import random

import pytest

from helpers import check_compiles_without_spills, needs_nvcc, on_gpu, rng, run_poisoned
from test_bn_channels_last_cuda import check_backward_on_gpu, check_channels_last_source, kernel_bodies
from test_bn_forward import MODES as ALL_FORWARD_MODES  # (training, track_running, affine)
from test_bn_forward import check as check_forward
from test_bn_forward import inputs as forward_inputs
from test_bn_forward import kernel_args

from tvm_fusion import registry, targets
from tvm_fusion.contracts.bn_backward import bn_backward_problem
from tvm_fusion.contracts.bn_forward import bn_forward_problem
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.kernel import build_kernel
from tvm_fusion.schedules.cuda.bn_forward_small_plane import PREFERRED_VALUES
from tvm_fusion.schedules.cuda.common import MAX_THREADS

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
FORWARD = "bn_forward_small_plane"
BACKWARD = "bn_backward_small_plane"
FORWARD_MODES = [mode for mode in ALL_FORWARD_MODES if mode[0]]  # the forward is training only
BACKWARD_MODES = [(True, True), (True, False), (False, True), (False, False)]  # (training, affine)
DTYPES = ["float16", "bfloat16", "float32"]


def forward(shape, dtype, mode=(True, True, True)):
    training, track, affine = mode
    return bn_forward_problem(shape, dtype, "NCHW", affine, training, track)


def backward(shape, dtype, mode=(True, True)):
    training, affine = mode
    return bn_backward_problem(shape, dtype, "NCHW", affine, training)


def configs(problem, count):
    """The default knobs and ``count`` launchable configurations of the space (256
    column lanes with 16 rows is 4096 threads: the tuner's verifier drops those),
    drawn with a fixed seed."""
    cand = registry.get(FORWARD if problem.op == "bn_forward" else BACKWARD)
    space = [k for k in cand.all_configs(problem, CUDA) if k.channel_lanes * k.rows <= MAX_THREADS]
    return [cand.default_for(problem, CUDA)] + random.Random(cand.name).sample(space, min(count, len(space)))


# -- where they apply -----------------------------------------------------------------------
# 7x7 and 14x14 planes are misaligned in 16-bit (98 and 392 bytes) and 7x7 in fp32 (196
# bytes); 14x14 fp32 planes are 784 bytes, aligned: the block-per-channel kernels' own
# 16-byte loads. 8x3x5x5 has C * L = 75 columns, an odd row (no aligned vector); one
# image (N = 1) is left to the block-per-channel kernels (small_plane says why).
APPLIES = [((256, 2048, 7, 7), "float16", True), ((256, 2048, 7, 7), "bfloat16", True),
           ((256, 2048, 7, 7), "float32", True), ((64, 512, 7, 7), "float16", True),
           ((32, 1024, 14, 14), "bfloat16", True), ((32, 1024, 14, 14), "float32", False),
           ((8, 3, 5, 5), "float16", False), ((8, 3, 5, 5), "float32", False),
           ((3, 16, 7, 7), "float16", True), ((3, 16, 7, 7), "float32", True),
           ((64, 256, 56, 56), "float16", False), ((4, 8, 40, 40), "float16", False),
           ((1, 8, 7, 7), "float16", False), ((2, 8, 7, 7), "float16", True)]


@pytest.mark.parametrize("shape, dtype, applies", APPLIES)
def test_applies_on_misaligned_small_planes_with_aligned_rows(shape, dtype, applies):
    for problem, name in ((forward(shape, dtype), FORWARD), (backward(shape, dtype), BACKWARD),
                          (backward(shape, dtype, (False, True)), BACKWARD)):
        assert registry.get(name).applies(problem) == applies, (problem.key(), name)
        picked = registry.default_candidate(problem, CUDA).name
        preferred = applies and DTYPE_BYTES[dtype] == 2 and problem.numel >= PREFERRED_VALUES
        assert (picked == name) == preferred, (problem.key(), picked)
    assert not registry.get(FORWARD).applies(forward(shape, dtype, (False, True, True)))  # eval
    assert not registry.get(FORWARD).applies(bn_forward_problem(shape, dtype, "NHWC"))


# -- the generated code ----------------------------------------------------------------------
# Why each shape: the ResNet stage-4 activation (7x7, 2048 channels), a small batch of
# it, 14x14, an odd batch (3 rows: one partial, a ragged row batch) with lanes past the
# last column (98 vectors on 128 lanes), fp32 (4-wide vectors).
CODEGEN_FORWARD = [((256, 2048, 7, 7), "float16", (True, True, True)), ((64, 512, 7, 7), "bfloat16", (True, False, False)),
                   ((32, 1024, 14, 14), "float16", (True, True, False)), ((3, 16, 7, 7), "float16", (True, True, True)),
                   ((3, 16, 7, 7), "float32", (True, False, False)), ((64, 512, 7, 7), "float32", (True, True, True))]
CODEGEN_BACKWARD = [((256, 2048, 7, 7), "float16", (True, True)), ((64, 512, 7, 7), "bfloat16", (False, True)),
                    ((32, 1024, 14, 14), "bfloat16", (True, False)), ((3, 16, 7, 7), "float16", (True, True)),
                    ((3, 16, 7, 7), "float32", (False, False)), ((64, 512, 7, 7), "float32", (True, True))]


@pytest.mark.parametrize("shape, dtype, mode", CODEGEN_FORWARD)
def test_forward_source_has_vector_accesses_and_kernels_in_order(shape, dtype, mode):
    problem = forward(shape, dtype, mode)
    for knobs in configs(problem, 2):
        check_channels_last_source(build_kernel(problem, CUDA, FORWARD, knobs), problem, knobs, "y", ("x",))


@pytest.mark.parametrize("shape, dtype, mode", CODEGEN_BACKWARD)
def test_backward_source_has_vector_accesses_and_kernels_in_order(shape, dtype, mode):
    problem = backward(shape, dtype, mode)
    staged = ("x", "dy") if problem.training else ("dy",)
    for knobs in configs(problem, 2):
        check_channels_last_source(build_kernel(problem, CUDA, BACKWARD, knobs), problem, knobs, "dx", staged)


def test_default_map_reads_rows_as_16_byte_vectors_only():
    """256x2048x7x7 fp16 with the default knobs: the map kernel (the last) touches x, dy
    and its output with uint4 accesses only, no scalar one."""
    for problem, name, rows in ((forward((256, 2048, 7, 7), "float16"), FORWARD, ("x", "y")),
                                (backward((256, 2048, 7, 7), "float16"), BACKWARD, ("x", "dy", "dx"))):
        _, _, body = kernel_bodies(build_kernel(problem, CUDA, name).device_source())[-1]
        for buffer in rows:
            assert f"*(uint4*)({buffer}_ptr" in body and f" {buffer}_ptr[" not in body, (name, buffer)


@needs_nvcc
@pytest.mark.parametrize("problem, candidate", [
    (forward((256, 2048, 7, 7), "float16"), FORWARD),
    (backward((256, 2048, 7, 7), "float16"), BACKWARD),
    (forward((32, 1024, 14, 14), "bfloat16", (True, False, False)), FORWARD),
    (backward((64, 512, 7, 7), "float32", (False, True)), BACKWARD),
], ids=lambda v: getattr(v, "key", lambda: v)())
def test_compiles_without_spills(problem, candidate):
    check_compiles_without_spills(build_kernel(problem, CUDA, candidate))


# -- every small-plane problem has a candidate whose default builds ---------------------------
COVERAGE_SHAPES = [(256, 2048, 7, 7), (64, 512, 7, 7), (32, 1024, 14, 14), (8, 3, 5, 5), (3, 16, 7, 7),
                   (2, 8, 7, 7), (5, 24, 3, 3)]


def coverage_problems():
    for shape in COVERAGE_SHAPES:
        for dtype in DTYPES:
            for mode in FORWARD_MODES:
                yield forward(shape, dtype, mode)
            for mode in BACKWARD_MODES:
                yield backward(shape, dtype, mode)


@pytest.mark.parametrize("problem", [p for p in coverage_problems()
                                     if registry.get(FORWARD if p.op == "bn_forward" else BACKWARD).applies(p)],
                         ids=lambda p: p.key())
def test_every_small_plane_problem_picks_the_candidate_whose_default_builds(problem):
    """Dispatch picks it where it prefers (16-bit, 2^24 values and more), and its
    default builds everywhere it applies."""
    name = FORWARD if problem.op == "bn_forward" else BACKWARD
    cand = registry.get(name)
    preferred = DTYPE_BYTES[problem.dtype] == 2 and problem.numel >= PREFERRED_VALUES
    assert cand.prefers(problem, CUDA) == preferred
    assert (registry.default_candidate(problem, CUDA).name == name) == preferred
    kernel = build_kernel(problem, CUDA, name)
    assert kernel.knobs == cand.default_for(problem, CUDA)


def test_coverage_includes_every_dtype_and_the_odd_batch():
    applied = {(p.input_shape, p.dtype) for p in coverage_problems()
               if registry.get(FORWARD if p.op == "bn_forward" else BACKWARD).applies(p)}
    assert {((3, 16, 7, 7), dtype) for dtype in DTYPES} <= applied
    assert ((8, 3, 5, 5), "float16") not in applied and ((32, 1024, 14, 14), "float32") not in applied


# -- on a GPU: against the float64 references --------------------------------------------------
# Why each case: the ResNet stage-4 activation (fp16, bf16: 51M values), 14x14, fp32 7x7
# (4-wide vectors), an odd batch of 3 (one partial, lanes past the last column), one
# pair of images (N = 2), 3x3 planes in 24 channels (a vector across three channels).
GPU_SHAPES = [((256, 2048, 7, 7), "float16"), ((256, 2048, 7, 7), "bfloat16"), ((32, 1024, 14, 14), "float16"),
              ((64, 512, 7, 7), "float32"), ((3, 16, 7, 7), "float16"), ((3, 16, 7, 7), "float32"),
              ((2, 8, 7, 7), "bfloat16"), ((5, 24, 3, 3), "float16")]


def gpu_params(make, modes):
    for shape, dtype in GPU_SHAPES:
        for mode in modes:
            problem = make(shape, dtype, mode)
            count = 1 if problem.numel > 10**7 else 3  # the float64 reference of 51M values is the slow part
            yield pytest.param(problem, configs(problem, count), id=problem.key())


@on_gpu
@pytest.mark.parametrize("problem, knob_sets", list(gpu_params(forward, FORWARD_MODES)))
def test_forward_on_gpu(problem, knob_sets):
    import tvm

    gen = rng()
    for knobs in knob_sets:
        kernel = build_kernel(problem, targets.resolve("cuda"), FORWARD, knobs)
        for loc, scale in ((0.0, 2.0), (1000.0, 1.0)):  # |mean| >> std too
            data = forward_inputs(gen, problem, loc=loc, scale=scale)
            outs = run_poisoned(kernel, kernel_args(problem, *data), tvm.cuda(0))
            check_forward(kernel, outs, problem, *data, what=f"{FORWARD} {knobs} mean {loc}")


@on_gpu
@pytest.mark.parametrize("problem, knob_sets", list(gpu_params(backward, BACKWARD_MODES)))
def test_backward_on_gpu(problem, knob_sets):
    check_backward_on_gpu(problem, BACKWARD, knob_sets)


@on_gpu
def test_repeated_calls_reuse_no_stale_workspace():
    """A second call on new data gives the new statistics (a partial left unwritten
    would carry the first call's)."""
    import tvm

    problem = forward((3, 16, 7, 7), "float16")
    kernel = build_kernel(problem, targets.resolve("cuda"), FORWARD)
    gen = rng()
    for loc in (0.0, 5.0):
        data = forward_inputs(gen, problem, loc=loc)
        outs = run_poisoned(kernel, kernel_args(problem, *data), tvm.cuda(0))
        check_forward(kernel, outs, problem, *data, what=f"call with mean {loc}")
