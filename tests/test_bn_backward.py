"""BatchNorm's backward (``bn_backward``): contract, float64 reference, CPU kernel.

The reference is checked against float64 torch autograd of ``F.batch_norm``; every
candidate, default and sampled knobs, against the reference on fresh random data
with its outputs poisoned (NaN) before the run, per dtype tolerances."""

import itertools

import numpy as np
import pytest

from helpers import (
    candidate_params, check_channel_block_source, check_compiles_without_spills, needs_nvcc, on_gpu, random_floats,
    rng, run_poisoned, shipped_problems, torch_or_none,
)
from tvm_fusion import registry, targets
from tvm_fusion.contracts.bn_backward import bn_backward_problem, reference

CPU = targets.resolve("llvm")
torch = torch_or_none()
CASES = [((4, 6, 5, 7), "NCHW"), ((3, 5, 4, 8), "NHWC"), ((16, 12), "NCHW"), ((2, 3, 33), "NCHW"),
         ((1, 3, 2, 1), "NCHW"), ((7, 1, 3, 3), "NHWC"), ((32, 16, 8, 8), "NCHW"), ((8, 7, 7, 24), "NHWC")]
# Float32 arithmetic, relative to the largest element (the sums: times sqrt(n)), plus
# dx's final rounding to its dtype, relative to each element.
TOL = 3e-5
ROUNDING = {"float32": 0.0, "float16": 1e-3, "bfloat16": 8e-3}


def inputs(gen, problem, dtype, shift=1.0):
    shape, channels = problem.input_shape, problem.channels
    x = random_floats(gen, shape, dtype, loc=shift, scale=2.0)
    dy = random_floats(gen, shape, dtype)
    mean = gen.standard_normal(channels).astype(np.float32) + shift
    invstd = (gen.random(channels) + 0.5).astype(np.float32)
    weight = gen.standard_normal(channels).astype(np.float32) if problem.affine else None
    return x, dy, mean, invstd, weight


def kernel_args(problem, x, dy, mean, invstd, weight):
    return [x.reshape(problem.shape), dy.reshape(problem.shape), mean, invstd] + ([weight] if problem.affine else [])


def check(outs, x, dy, mean, invstd, weight, problem, what=""):
    dx, dweight, dbias = outs
    ref = reference(x, dy, mean, invstd, weight, problem.layout, problem.training)
    for name, got, want in zip(("dx", "dweight", "dbias"), (dx.reshape(x.shape), dweight, dbias), ref):
        scale = float(np.abs(want).max()) or 1.0
        tol = TOL * scale * (1.0 if name == "dx" else np.sqrt(problem.count))
        if name == "dx":
            tol = tol + ROUNDING[problem.dtype] * np.abs(want)
        err = np.abs(np.asarray(got, dtype=np.float64) - want)
        assert not np.isnan(err).any(), f"{what} {name}: an element is unwritten or NaN"
        assert (err <= tol).all(), f"{what} {name}: off by {err.max():.3g} (largest {scale:.3g})"


@pytest.mark.skipif(torch is None, reason="needs torch")
@pytest.mark.parametrize("training, affine", list(itertools.product([True, False], [True, False])))
@pytest.mark.parametrize("shape, layout", CASES[:4])
def test_reference_equals_torch_autograd_in_float64(training, affine, shape, layout):
    import torch.nn.functional as F

    gen = rng()
    problem = bn_backward_problem(shape, "float32", layout, affine, training)
    x, dy, mean, invstd, weight = inputs(gen, problem, "float32")
    to_nchw = (lambda a: a.permute(0, 3, 1, 2)) if layout == "NHWC" else (lambda a: a)
    xt = to_nchw(torch.tensor(x, dtype=torch.float64)).requires_grad_()
    w = torch.tensor(weight, dtype=torch.float64, requires_grad=True) if affine else None
    b = torch.zeros(problem.channels, dtype=torch.float64, requires_grad=True) if affine else None
    if training:
        data = xt.detach()
        axes = [d for d in range(data.dim()) if d != 1]
        mean = data.mean(dim=axes).numpy().astype(np.float64)
        invstd = (1 / torch.sqrt(data.var(dim=axes, unbiased=False) + 1e-5)).numpy()
        y = F.batch_norm(xt, None, None, w, b, training=True, eps=1e-5)
    else:
        rm, rv = torch.tensor(mean, dtype=torch.float64), torch.tensor(1 / invstd.astype(np.float64) ** 2 - 1e-5)
        y = F.batch_norm(xt, rm, rv, w, b, training=False, eps=1e-5)
    g = to_nchw(torch.tensor(dy, dtype=torch.float64))
    grads = torch.autograd.grad(y, [xt] + ([w, b] if affine else []), g)
    dx, dweight, dbias = reference(x, dy, mean, invstd, weight, layout, training)
    want_dx = grads[0].permute(0, 2, 3, 1) if layout == "NHWC" else grads[0]
    np.testing.assert_allclose(dx, want_dx.numpy(), rtol=1e-9, atol=1e-9)
    if affine:
        np.testing.assert_allclose(dweight, grads[1].numpy(), rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(dbias, grads[2].numpy(), rtol=1e-9, atol=1e-9)


def cpu_cases():
    problems = [bn_backward_problem(shape, dtype, layout, affine, training)
                for (shape, layout), dtype, (training, affine) in itertools.product(
                    CASES, ["float32", "bfloat16", "float16"], [(True, True), (True, False), (False, True)])
                if not (training and np.prod(shape) // (shape[-1] if layout == "NHWC" or len(shape) == 2 else shape[1]) < 2)]
    yield from candidate_params(problems, CPU, 2)


@pytest.mark.parametrize("problem, candidate, configs", list(cpu_cases()))
def test_cpu_candidates_every_option_and_dtype(problem, candidate, configs):
    from tvm_fusion.kernel import build_kernel

    gen = rng()
    for knobs in configs:
        kernel = build_kernel(problem, CPU, candidate, knobs)
        x, dy, mean, invstd, weight = inputs(gen, problem, problem.dtype, shift=3.0)
        check(run_poisoned(kernel, kernel_args(problem, x, dy, mean, invstd, weight)), x, dy, mean, invstd, weight, problem, f"{candidate} {knobs}")


def test_every_problem_has_a_cpu_candidate_and_the_api_builds_it():
    import tvm_fusion as tf

    kernel = tf.build("bn_backward", (8, 4, 3, 3), "float16", target="llvm", layout="NCHW", training=False)
    assert kernel.candidate == "bn_backward_parallel"
    assert [name for name, _, _ in kernel.outputs] == ["dx", "dweight", "dbias"]
    for shape, layout in CASES:
        assert registry.applicable(bn_backward_problem(shape, "float32", layout, training=False), CPU)


@pytest.mark.parametrize("call, error, words", [
    (lambda: bn_backward_problem((1, 3, 1, 1), "float32", training=True), ValueError, "more than 1 value per channel"),
    (lambda: bn_backward_problem((1, 3), "float32"), ValueError, "got input size (1, 3)"),
    (lambda: bn_backward_problem((4, 3, 2, 2), "float64"), TypeError, "dtype"),
    (lambda: bn_backward_problem((4, 3, 2, 2), "float32", layout="NWHC"), ValueError, "layout"),
    (lambda: bn_backward_problem((4, 3, 2, 2), "float32", affine=1), TypeError, "affine must be a bool"),
    (lambda: __import__("tvm_fusion").make_problem("bn_backward", (4, 3), "float32", momentum=0.1), TypeError,
     "unknown option"),
])
def test_bad_arguments_are_named(call, error, words):
    with pytest.raises(error, match=__import__("re").escape(words)):
        call()


def test_problem_round_trips_through_its_prim_func():
    from tvm_fusion.compute import prim_func, problem_of

    problem = bn_backward_problem((5, 7, 3), "bfloat16", "NCHW", affine=False, training=False)
    assert problem_of(prim_func(problem)) == problem
    assert problem.key() == "bn_backward_ncl_5x7x3_bfloat16_plain_eval"
    assert problem.num_inputs == 4 and "eval" in problem.describe()


# -- CUDA: the generated code here, the kernels on a GPU -----------------------------------
CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
CUDA_CASES = [((64, 256, 56, 56), "float16", True, True), ((32, 64, 112, 112), "bfloat16", True, False),
              ((256, 2048, 7, 7), "float16", False, True), ((5, 3, 7), "float32", True, True),
              ((2, 7, 13, 11), "bfloat16", False, False)]


def cuda_problems():
    return [bn_backward_problem(shape, dtype, "NCHW", affine, training)
            for shape, dtype, training, affine in CUDA_CASES]


@pytest.mark.parametrize("problem, candidate, configs", list(candidate_params(cuda_problems(), CUDA, 3)))
def test_cuda_source_has_shuffles_vector_loads_and_no_guarded_barrier(problem, candidate, configs):
    from tvm_fusion.kernel import build_kernel

    for knobs in configs:  # the sums read x, the map stores dx
        check_channel_block_source(build_kernel(problem, CUDA, candidate, knobs), problem, knobs, "dx", True)


@needs_nvcc
def test_cuda_kernel_compiles_without_spills():
    from tvm_fusion.kernel import build_kernel

    check_compiles_without_spills(build_kernel(cuda_problems()[0], CUDA, "bn_backward_block_per_channel"))


@on_gpu
@pytest.mark.parametrize("problem, candidate, configs", list(candidate_params(cuda_problems(), CUDA, 3)))
def test_cuda_candidates_on_gpu(problem, candidate, configs):
    import tvm

    from tvm_fusion.kernel import build_kernel

    gen = rng()
    for knobs in configs:
        kernel = build_kernel(problem, targets.resolve("cuda"), candidate, knobs)
        x, dy, mean, invstd, weight = inputs(gen, problem, problem.dtype, shift=3.0)
        check(run_poisoned(kernel, kernel_args(problem, x, dy, mean, invstd, weight), tvm.cuda(0)), x, dy, mean, invstd, weight, problem, f"{candidate} {knobs}")


@on_gpu
@pytest.mark.parametrize("problem", shipped_problems("bn_backward"))
def test_shipped_records_give_correct_kernels(problem):
    """What dispatch runs for every bn_backward problem of the shipped H200 log,
    against the float64 reference with poisoned outputs (its four shapes since 1509b80)."""
    import tvm

    from tvm_fusion import dispatch

    kernel = dispatch.kernel_for(problem, targets.resolve("cuda"))
    x, dy, mean, invstd, weight = inputs(rng(), problem, problem.dtype, shift=3.0)
    check(run_poisoned(kernel, kernel_args(problem, x, dy, mean, invstd, weight), tvm.cuda(0)), x, dy, mean, invstd, weight, problem, kernel.describe())
