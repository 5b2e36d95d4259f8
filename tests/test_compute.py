"""Algorithm level: each decomposition, compiled unscheduled for the CPU, against float64.

This checks the TE compute itself (the math of each decomposition), apart from any
schedule; the candidates are checked in test_cpu.py and test_gpu.py."""

import numpy as np
import pytest
import tvm

from helpers import TOLERANCES, assert_close, random_floats, rng
from tvm_fusion.compute import ALGORITHMS, prim_func
from tvm_fusion.contracts import bn_stats_problem, cross_entropy_problem
from tvm_fusion.contracts import bn_stats as bn_ref
from tvm_fusion.contracts import cross_entropy as ce_ref

CPU = tvm.target.Target({"kind": "llvm"})


def run_unscheduled(func, inputs):
    ex = tvm.compile(tvm.IRModule({"main": func}), target=CPU)
    params = [(p.name, tuple(int(d) for d in p.shape), str(p.dtype)) for p in func.params]
    args = [tvm.runtime.tensor(a.reshape(shape)) for a, (_, shape, _) in zip(inputs, params)]
    outs = [tvm.runtime.tensor(np.full(shape, np.nan if "float" in dt else -1, dt)) for _, shape, dt in params[len(inputs):]]
    ex["main"](*args, *outs)
    return [o.numpy() for o in outs]


@pytest.mark.parametrize("algorithm", ALGORITHMS["bn_stats"])
@pytest.mark.parametrize("shape, layout", [((3, 4, 5, 6), "NCHW"), ((2, 5, 3, 4), "NHWC"), ((7, 3), "NCHW"), ((2, 3, 11), "NCHW")])
def test_bn_decompositions(algorithm, shape, layout):
    x = random_floats(rng(), shape, "float32", loc=0.5, scale=2.0)
    problem = bn_stats_problem(shape, "float32", layout)
    mean, var = run_unscheduled(prim_func(problem, algorithm), [x])
    ref_mean, ref_var = bn_ref.reference(x, layout)
    tol = TOLERANCES["float32"]
    assert_close(mean, ref_mean, tol["rtol"], tol["atol"], "mean")
    assert_close(var, ref_var, tol["rtol"], tol["atol"], "var")


def test_shifted_sums_survive_cancellation_where_one_pass_does_not():
    """mean 1000, std 0.01 in float32: sum/sumsq cancels, the shifted form does not."""
    x = random_floats(rng(), (8, 4, 32, 32), "float32", loc=1000.0, scale=0.01)
    problem = bn_stats_problem(x.shape, "float32")
    _, ref_var = bn_ref.reference(x)
    _, var_shifted = run_unscheduled(prim_func(problem, "shifted"), [x])
    _, var_one_pass = run_unscheduled(prim_func(problem, "one_pass"), [x])
    assert_close(var_shifted, ref_var, 1e-3, 1e-9, "shifted var")
    assert np.max(np.abs(var_one_pass - ref_var) / ref_var) > 0.5  # the trap is real


@pytest.mark.parametrize("algorithm", ALGORITHMS["cross_entropy"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_ce_decompositions(algorithm, reduction, weighted, smoothing):
    gen = rng()
    batch, classes = 9, 37
    logits = random_floats(gen, (batch, classes), "float32", scale=3.0)
    target = gen.integers(0, classes, batch)
    target[[1, 5]] = -100
    weight = gen.random(classes).astype(np.float32) + 0.1 if weighted else None
    problem = cross_entropy_problem(
        logits.shape, "float32", target.shape, "int64", None if weight is None else weight.shape,
        "float32", -100, reduction, smoothing,
    )
    inputs = [logits, target] + ([weight] if weighted else [])
    outs = run_unscheduled(prim_func(problem, algorithm), inputs)
    loss, first_bad = outs[-2], outs[-1]
    ref = ce_ref.reference(logits, target, weight, -100, reduction, smoothing)
    assert_close(loss.reshape(ref.shape), ref, 1e-5, 1e-5, f"{algorithm} loss")
    assert first_bad[0] == batch



@pytest.mark.parametrize("dtype, classes", [("float16", 1001), ("bfloat16", 1003), ("float32", 1001), ("float32", 1002)])
@pytest.mark.parametrize("weighted, smoothing", [(False, 0.0), (True, 0.2)])
def test_ce_aligned_online_every_row_residue(dtype, classes, weighted, smoothing):
    """``aligned_online`` cuts rows at the flat 16-byte granules: 17 rows give every
    start residue (so every head and tail length) in 16-bit rows and float32 rows."""
    gen = rng()
    batch = 17
    logits = random_floats(gen, (batch, classes), dtype, scale=3.0)
    target = gen.integers(0, classes, batch)
    target[:4] = [0, classes - 1, 1, classes - 2]  # classes only the head or the tail reads
    target[[5, 9]] = -100
    weight = gen.random(classes).astype(np.float32) + 0.1 if weighted else None
    problem = cross_entropy_problem(
        logits.shape, dtype, target.shape, "int64", None if weight is None else weight.shape,
        "float32", -100, "none", smoothing,
    )
    inputs = [logits, target] + ([weight] if weighted else [])
    loss, first_bad = run_unscheduled(prim_func(problem, "aligned_online"), inputs)
    ref = ce_ref.reference(logits, target, weight, -100, "none", smoothing)
    tol = TOLERANCES[dtype]
    assert_close(loss.reshape(ref.shape), ref, tol["rtol"], tol["atol"], "aligned_online loss")
    assert first_bad[0] == batch

BN_TRAIN_SHAPES = [((3, 4, 5, 6), "NCHW"), ((2, 5, 3, 4), "NHWC"), ((7, 3), "NCHW"), ((2, 3, 11), "NCHW")]


@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS["bn_forward"] if a != "running"])
@pytest.mark.parametrize("shape, layout", BN_TRAIN_SHAPES)
def test_bn_forward_training_decompositions(algorithm, shape, layout):
    """Every training decomposition of the forward gives the float64 outputs."""
    from tvm_fusion.contracts import bn_forward as ref
    from tvm_fusion.contracts.bn_forward import bn_forward_problem

    gen = rng()
    problem = bn_forward_problem(shape, "float32", layout)
    x = random_floats(gen, shape, "float32", loc=0.5, scale=2.0)
    c = problem.channels
    weight, bias = gen.standard_normal(c).astype("float32"), gen.standard_normal(c).astype("float32")
    running_mean, running_var = gen.standard_normal(c).astype("float32"), (gen.random(c) + 0.5).astype("float32")
    momentum = np.array(0.2, "float32")
    outs = run_unscheduled(prim_func(problem, algorithm), [x, weight, bias, running_mean, running_var, momentum])
    want = ref.reference(x, weight, bias, running_mean, running_var, 0.2, problem)
    names = ["y", "save_mean", "save_invstd", "running_mean_out", "running_var_out"]
    tol = TOLERANCES["float32"]
    for name, got in zip(names, outs):
        assert_close(got.reshape(want[name].shape), want[name], tol["rtol"], tol["atol"], name)


@pytest.mark.parametrize("algorithm", ALGORITHMS["bn_backward"])
@pytest.mark.parametrize("shape, layout", BN_TRAIN_SHAPES)
def test_bn_backward_decompositions(algorithm, shape, layout):
    from tvm_fusion.contracts import bn_backward as ref
    from tvm_fusion.contracts.bn_backward import bn_backward_problem

    gen = rng()
    problem = bn_backward_problem(shape, "float32", layout, True, True)
    x = random_floats(gen, shape, "float32", loc=0.5, scale=2.0)
    dy = random_floats(gen, shape, "float32")
    c = problem.channels
    mean, invstd = gen.standard_normal(c).astype("float32"), (gen.random(c) + 0.5).astype("float32")
    weight = gen.standard_normal(c).astype("float32")
    dx, dweight, dbias = run_unscheduled(prim_func(problem, algorithm), [x, dy, mean, invstd, weight])
    want = ref.reference(x, dy, mean, invstd, weight, layout, True)
    tol = TOLERANCES["float32"]
    for name, got, expected in zip(("dx", "dweight", "dbias"), (dx, dweight, dbias), want):
        assert_close(got.reshape(expected.shape), expected, tol["rtol"], tol["atol"], name)
