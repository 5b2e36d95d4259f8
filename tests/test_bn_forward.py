"""BatchNorm's forward (``bn_forward``): contract, float64 reference, CPU kernels.

The reference is checked against float64 ``F.batch_norm`` (training with the running
statistics' update, eval); every candidate, default and sampled knobs, against the
reference on fresh random data (|mean| >> std included) with outputs poisoned (NaN)
before the run, per dtype tolerances."""

import itertools
import re

import numpy as np
import pytest

from helpers import (
    candidate_params, check_channel_block_source, check_compiles_without_spills, needs_nvcc, on_gpu, random_floats,
    rng, run_poisoned, shipped_problems, torch_or_none,
)
from tvm_fusion import targets
from tvm_fusion.contracts.bn_forward import bn_forward_problem, reference

CPU = targets.resolve("llvm")
torch = torch_or_none()
CASES = [((4, 6, 5, 7), "NCHW"), ((3, 5, 4, 8), "NHWC"), ((16, 12), "NCHW"), ((2, 3, 33), "NCHW"),
         ((1, 3, 2, 1), "NCHW"), ((7, 1, 3, 3), "NHWC"), ((32, 16, 8, 8), "NCHW"), ((8, 7, 7, 24), "NHWC")]
MODES = [(True, True, True), (True, False, False), (True, True, False), (False, True, True), (False, True, False)]
ROUNDING = {"float32": 0.0, "float16": 1e-3, "bfloat16": 8e-3}  # y's final store, relative


def inputs(gen, problem, loc=0.0, scale=2.0):
    c = problem.channels
    x = random_floats(gen, problem.input_shape, problem.dtype, loc=loc, scale=scale)
    weight, bias = gen.standard_normal(c).astype(np.float32), gen.standard_normal(c).astype(np.float32)
    running_mean = (gen.standard_normal(c) + loc).astype(np.float32)
    running_var = ((gen.random(c) + 0.5) * scale * scale).astype(np.float32)
    momentum = np.array(gen.random() * 0.5 + 0.05, dtype=np.float32)
    return x, weight, bias, running_mean, running_var, momentum


def kernel_args(problem, x, weight, bias, running_mean, running_var, momentum):
    args = [x.reshape(problem.shape)]
    args += [weight, bias] if problem.affine else []
    args += [running_mean, running_var] if problem.track_running else []
    return args + ([momentum] if problem.updates_running else [])


def mean_rounding(problem, ref, weight):
    """Per channel, what rounding the mean to float32 moves y by: half an ulp of the
    mean times the map's scale (no float32 kernel does better: torch's does not)."""
    scale = ref["save_invstd"] * (np.abs(weight) if problem.affine else 1.0)
    return 2.0**-24 * np.abs(ref["save_mean"]) * scale * 2


def check(kernel, outs, problem, x, weight, bias, running_mean, running_var, momentum, what=""):
    ref = reference(x, weight if problem.affine else None, bias if problem.affine else None,
                    running_mean if problem.track_running else None, running_var if problem.track_running else None,
                    float(momentum), problem)
    assert [name for name, _, _ in kernel.outputs] == list(ref)
    for (name, _, _), got in zip(kernel.outputs, outs):
        want = ref[name]
        got = np.asarray(got, dtype=np.float64).reshape(want.shape)
        scale = float(np.abs(want).max()) or 1.0
        tol = 3e-5 * scale * (np.sqrt(problem.count) if name != "y" else 1.0)
        tol = tol + (ROUNDING[problem.dtype] * np.abs(want) if name == "y" else 0.0) + 1e-6 * np.abs(want)
        if name == "y":  # the float32 mean itself is off by up to half an ulp: |mean| >> std shows it
            tol = tol + mean_rounding(problem, ref, weight).reshape(
                (1,) * (len(want.shape) - 1) + (-1,) if problem.channels_last else (1, -1) + (1,) * (len(want.shape) - 2))
        err = np.abs(got - want)
        assert not np.isnan(err).any(), f"{what} {name}: an element is unwritten or NaN"
        assert (err <= tol).all(), f"{what} {name}: off by {err.max():.3g} (largest {scale:.3g})"


def check_knobs_on_gpu(problem, candidate: str, configs) -> None:
    """Each knob configuration of ``candidate`` on the GPU against the float64 reference,
    outputs poisoned before the run, |mean| >> std too."""
    import tvm

    from tvm_fusion.kernel import build_kernel

    gen = rng()
    for knobs in configs:
        kernel = build_kernel(problem, targets.resolve("cuda"), candidate, knobs)
        for loc, scale in ((0.0, 2.0), (1000.0, 1.0)):
            data = inputs(gen, problem, loc=loc, scale=scale)
            outs = run_poisoned(kernel, kernel_args(problem, *data), tvm.cuda(0))
            check(kernel, outs, problem, *data, what=f"{candidate} {knobs} mean {loc}")


@pytest.mark.skipif(torch is None, reason="needs torch")
@pytest.mark.parametrize("training, track, affine", MODES)
@pytest.mark.parametrize("shape, layout", CASES[:4])
def test_reference_equals_torch_batch_norm_in_float64(training, track, affine, shape, layout):
    import torch.nn.functional as F

    problem = bn_forward_problem(shape, "float32", layout, affine, training, track, eps=1e-3)
    x, weight, bias, rm, rv, momentum = inputs(rng(), problem, loc=1.0)
    to_nchw = (lambda a: a.permute(0, 3, 1, 2)) if layout == "NHWC" else (lambda a: a)
    xt = to_nchw(torch.tensor(x, dtype=torch.float64))
    rmt = torch.tensor(rm, dtype=torch.float64) if track else None
    rvt = torch.tensor(rv, dtype=torch.float64) if track else None
    w, b = (torch.tensor(weight, dtype=torch.float64), torch.tensor(bias, dtype=torch.float64)) if affine else (None, None)
    y = F.batch_norm(xt, rmt, rvt, w, b, training=training, momentum=float(momentum), eps=1e-3)
    ref = reference(x, weight if affine else None, bias if affine else None, rm if track else None,
                    rv if track else None, float(momentum), problem)
    want_y = y.permute(0, 2, 3, 1) if layout == "NHWC" else y
    np.testing.assert_allclose(ref["y"], want_y.numpy(), rtol=1e-9, atol=1e-9)
    if problem.updates_running:  # torch updated its running buffers in place
        np.testing.assert_allclose(ref["running_mean_out"], rmt.numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(ref["running_var_out"], rvt.numpy(), rtol=1e-9, atol=1e-12)


def cpu_cases():
    problems = []
    for (shape, layout), dtype, (training, track, affine) in itertools.product(
            CASES, ["float32", "bfloat16", "float16"], MODES):
        try:
            problems.append(bn_forward_problem(shape, dtype, layout, affine, training, track))
        except ValueError:  # one value per channel in training: the contract's error (tested below)
            continue
    yield from candidate_params(problems, CPU, 2)


@pytest.mark.parametrize("problem, candidate, configs", list(cpu_cases()))
def test_cpu_candidates_every_option_and_dtype(problem, candidate, configs):
    from tvm_fusion.kernel import build_kernel

    gen = rng()
    for knobs in configs:
        kernel = build_kernel(problem, CPU, candidate, knobs)
        data = inputs(gen, problem)
        check(kernel, run_poisoned(kernel, kernel_args(problem, *data)), problem, *data, what=f"{candidate} {knobs}")


def test_large_mean_small_spread_keeps_the_variance():
    """|mean| = 1000 x std: the shifted sums keep the variance (one_pass would lose it)."""
    import tvm_fusion as tf

    problem = bn_forward_problem((8, 4, 16, 16), "float32", "NCHW")
    kernel = tf.build("bn_forward", (8, 4, 16, 16), "float32", target="llvm")
    data = inputs(rng(), problem, loc=1000.0, scale=1.0)
    check(kernel, run_poisoned(kernel, kernel_args(problem, *data)), problem, *data, what="|mean| >> std")


@pytest.mark.parametrize("call, error, words", [
    (lambda: bn_forward_problem((1, 3, 1, 1), "float32"), ValueError, "got input size (1, 3, 1, 1)"),
    (lambda: bn_forward_problem((4, 3), "float32", training=False, track_running=False), ValueError,
     "track_running must be True"),
    (lambda: bn_forward_problem((4, 3), "float32", eps=-1.0), ValueError, "eps must be a finite number"),
    (lambda: bn_forward_problem((4, 3), "float32", eps=float("nan")), ValueError, "eps must be a finite number"),
    (lambda: bn_forward_problem((4, 3), "float32", training="yes"), TypeError, "training must be a bool"),
    (lambda: bn_forward_problem((4, 3), "int32"), TypeError, "dtype"),
    (lambda: __import__("tvm_fusion").make_problem("bn_forward", (4, 3), "float32", momentum=0.1), TypeError,
     "unknown option"),
])
def test_bad_arguments_are_named(call, error, words):
    with pytest.raises(error, match=re.escape(words)):
        call()


def test_problem_round_trips_and_eval_takes_no_momentum():
    from tvm_fusion.compute import algorithms_for, prim_func, problem_of

    for training in (True, False):
        problem = bn_forward_problem((5, 7, 3), "bfloat16", "NCHW", affine=False, training=training)
        func = prim_func(problem)
        assert problem_of(func) == problem
        names = [p.name for p in func.params]
        outputs = ["y", "save_mean", "save_invstd"] + (["running_mean_out", "running_var_out"] if training else [])
        assert ("momentum" in names) == training and names[-len(outputs):] == outputs
        training_algorithms = ("shifted", "shifted_sampled", "shifted_parts", "shifted_half_parts", "shifted_quarter_parts")
        assert algorithms_for(problem) == (training_algorithms if training else ("running",))


# -- CUDA: the generated code here, the kernels on a GPU -----------------------------------
CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
CUDA_CASES = [((64, 256, 56, 56), "float16", (True, True, True)), ((32, 64, 112, 112), "bfloat16", (True, False, False)),
              ((256, 2048, 7, 7), "float16", (False, True, True)), ((5, 3, 7), "float32", (True, True, False)),
              ((2, 7, 13, 11), "bfloat16", (False, True, False))]


def cuda_problems():
    return [bn_forward_problem(shape, dtype, "NCHW", affine, training, track)
            for shape, dtype, (training, track, affine) in CUDA_CASES]


@pytest.mark.parametrize("problem, candidate, configs", list(candidate_params(cuda_problems(), CUDA, 3)))
def test_cuda_source_has_vector_loads_and_no_guarded_barrier(problem, candidate, configs):
    from tvm_fusion.kernel import build_kernel

    for knobs in configs:  # eval reduces nothing: no shuffles
        kernel = build_kernel(problem, CUDA, candidate, knobs)
        check_channel_block_source(kernel, problem, knobs, "y", problem.training)


@needs_nvcc
def test_cuda_kernel_compiles_without_spills():
    from tvm_fusion.kernel import build_kernel

    check_compiles_without_spills(build_kernel(cuda_problems()[0], CUDA, "bn_forward_block_per_channel"))


@on_gpu
@pytest.mark.parametrize("problem, candidate, configs", list(candidate_params(cuda_problems(), CUDA, 3)))
def test_cuda_candidates_on_gpu(problem, candidate, configs):
    import tvm

    from tvm_fusion.kernel import build_kernel

    gen = rng()
    for knobs in configs:
        kernel = build_kernel(problem, targets.resolve("cuda"), candidate, knobs)
        for loc, scale in ((0.0, 2.0), (1000.0, 1.0)):  # |mean| >> std too
            data = inputs(gen, problem, loc=loc, scale=scale)
            outs = run_poisoned(kernel, kernel_args(problem, *data), tvm.cuda(0))
            check(kernel, outs, problem, *data, what=f"{candidate} {knobs} mean {loc}")


@on_gpu
@pytest.mark.parametrize("problem", shipped_problems("bn_forward"))
def test_shipped_records_give_correct_kernels(problem):
    """What dispatch runs for every bn_forward problem of the shipped H200 log (its
    tuned record, or the default where the record is not clearly faster), against the
    float64 reference with poisoned outputs, |mean| >> std too (its four shapes since
    1509b80)."""
    import tvm

    from tvm_fusion import dispatch

    gen, kernel = rng(), dispatch.kernel_for(problem, targets.resolve("cuda"))
    for loc, scale in ((0.0, 2.0), (1000.0, 1.0)):
        data = inputs(gen, problem, loc=loc, scale=scale)
        outs = run_poisoned(kernel, kernel_args(problem, *data), tvm.cuda(0))
        check(kernel, outs, problem, *data, what=f"{kernel.describe()} mean {loc}")
