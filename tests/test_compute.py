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


@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS["bn_stats"] if a != "padded_shifted"])  # below
@pytest.mark.parametrize("shape, layout", [((3, 4, 5, 6), "NCHW"), ((2, 5, 3, 4), "NHWC"), ((7, 3), "NCHW"), ((2, 3, 11), "NCHW")])
def test_bn_decompositions(algorithm, shape, layout):
    x = random_floats(rng(), shape, "float32", loc=0.5, scale=2.0)
    problem = bn_stats_problem(shape, "float32", layout)
    mean, var = run_unscheduled(prim_func(problem, algorithm), [x])
    ref_mean, ref_var = bn_ref.reference(x, layout)
    tol = TOLERANCES["float32"]
    assert_close(mean, ref_mean, tol["rtol"], tol["atol"], "mean")
    assert_close(var, ref_var, tol["rtol"], tol["atol"], "var")


@pytest.mark.parametrize("shape, dtype, loc", [((3, 4, 5, 8), "float32", 0.5), ((2, 3, 16), "float16", 0.5),
                                              ((5, 2, 4, 4), "float32", 1000.0), ((1, 3, 8), "float16", -2.0)])
def test_bn_padded_shifted(shape, dtype, loc):
    """``padded_shifted`` (the (N, C, L) view, L whole 16-byte granules) pads a
    channel's granules to 1024: 30 of 1024 here, 4 of 1024, ... The pads must add
    nothing, the largest values sitting in the last granule the pads re-read; and the
    shift keeps it exact at |mean| >> std."""
    x = random_floats(rng(), shape, dtype, loc=loc, scale=2.0 if loc != 1000.0 else 0.01)
    x[-1, :, -1] = loc + 9.0  # in the last granule of each channel
    problem = bn_stats_problem(shape, dtype, "NCHW")
    mean, var = run_unscheduled(prim_func(problem, "padded_shifted"), [x])
    ref_mean, ref_var = bn_ref.reference(x, "NCHW")
    tol = TOLERANCES[dtype]
    assert_close(mean, ref_mean, tol["rtol"], tol["atol"], "mean")
    assert_close(var, ref_var, 1e-3 if loc == 1000.0 else tol["rtol"], tol["atol"], "var")


def test_bn_padded_shifted_names_a_ragged_plane():
    with pytest.raises(ValueError, match="padded_shifted needs the"):
        prim_func(bn_stats_problem((2, 3, 7, 7), "float16", "NCHW"), "padded_shifted")


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
    batch, classes = 9, 40 if algorithm == "padded_three_pass" else 37  # padded: whole 16-byte granules
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



def check_row_losses(algorithm, dtype, logits, target, weight, smoothing):
    """``algorithm``'s per-row losses (reduction "none", unscheduled on the CPU) against
    float64, and no bad row flagged (``weight`` None or float64 values, made float32)."""
    weight = None if weight is None else weight.astype(np.float32)
    problem = cross_entropy_problem(
        logits.shape, dtype, target.shape, "int64", None if weight is None else weight.shape,
        "float32", -100, "none", smoothing,
    )
    inputs = [logits, target] + ([] if weight is None else [weight])
    loss, first_bad = run_unscheduled(prim_func(problem, algorithm), inputs)
    ref = ce_ref.reference(logits, target, weight, -100, "none", smoothing)
    tol = TOLERANCES[dtype]
    assert_close(loss.reshape(ref.shape), ref, tol["rtol"], tol["atol"], f"{algorithm} loss")
    assert first_bad[0] == logits.shape[0]


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
    check_row_losses("aligned_online", dtype, logits, target, gen.random(classes) + 0.1 if weighted else None,
                     smoothing)

# No bfloat16 here: unscheduled, the granules map is a bfloat16 buffer, which TVM's
# LLVM bfloat16 legalization miscompiles ("Invalid bitcast float to i16"). The CUDA
# candidate inlines the map; tests/test_gpu_sweep.py runs it on bfloat16.
@pytest.mark.parametrize("dtype, classes", [("float16", 1000), ("float16", 256), ("float32", 4), ("float32", 1028)])
@pytest.mark.parametrize("weighted, smoothing", [(False, 0.0), (True, 0.2), (False, 0.1)])
def test_ce_padded_three_pass(dtype, classes, weighted, smoothing):
    """``padded_three_pass`` reduces over granules padded to a multiple of 32: 125 of
    128, 32 of 32, 1 of 32 and 257 of 288 here. The padding must add nothing (a pad
    granule reads the last one again), with the largest logit placed in the last
    granule so that a pad read counted twice would show in the sums."""
    gen = rng()
    batch = 5
    logits = random_floats(gen, (batch, classes), dtype, scale=3.0)
    logits[:, -1] = 8.0  # the row max sits in the granule the padding re-reads
    target = gen.integers(0, classes, batch)
    target[0], target[3] = classes - 1, -100
    check_row_losses("padded_three_pass", dtype, logits, target, gen.random(classes) + 0.1 if weighted else None,
                     smoothing)


def test_ce_padded_three_pass_names_a_ragged_row():
    problem = cross_entropy_problem((4, 1001), "float16", (4,), "int64", None, "float32", -100, "mean", 0.0)
    with pytest.raises(ValueError, match="padded_three_pass needs V a multiple of 8"):
        prim_func(problem, "padded_three_pass")


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


@pytest.mark.parametrize("algorithm", ["shifted_parts", "shifted_half_parts", "shifted_quarter_parts"])
@pytest.mark.parametrize("shape, layout, parts", [((6, 4, 5), "NCHW", 3), ((6, 5, 3, 2), "NHWC", 2)])
def test_bn_forward_shifted_parts_with_several_parts(monkeypatch, shape, layout, parts, algorithm):
    """``shifted_parts``, ``shifted_half_parts`` and ``shifted_quarter_parts`` cut into
    several parts (a part's byte limit lowered so that these small shapes have them; the
    smaller parts' copies count twice or four times): the partials added up twice give
    the float64 outputs."""
    from tvm_fusion.compute import PART_COPIES, bn_stats
    from tvm_fusion.contracts import bn_forward as ref
    from tvm_fusion.contracts.bn_forward import bn_forward_problem

    copies = PART_COPIES[algorithm]
    problem = bn_forward_problem(shape, "float32", layout)
    per_row = copies * problem.count // problem.shape[0] * 4
    monkeypatch.setattr(bn_stats, "PART_BYTES", problem.shape[0] // parts * per_row)
    assert bn_stats.parts(problem, copies) == parts
    gen = rng()
    x = random_floats(gen, shape, "float32", loc=3.0, scale=2.0)
    c = problem.channels
    weight, bias = gen.standard_normal(c).astype("float32"), gen.standard_normal(c).astype("float32")
    running_mean, running_var = gen.standard_normal(c).astype("float32"), (gen.random(c) + 0.5).astype("float32")
    outs = run_unscheduled(prim_func(problem, algorithm),
                           [x, weight, bias, running_mean, running_var, np.array(0.2, "float32")])
    want = ref.reference(x, weight, bias, running_mean, running_var, 0.2, problem)
    tol = TOLERANCES["float32"]
    for name, got in zip(["y", "save_mean", "save_invstd", "running_mean_out", "running_var_out"], outs):
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


@pytest.mark.parametrize("algorithm, copies", [("dual_reduce_parts", 2), ("dual_reduce_half_parts", 4)])
@pytest.mark.parametrize("shape, layout, parts", [((6, 4, 5), "NCHW", 3), ((6, 5, 3, 2), "NHWC", 2)])
def test_bn_backward_dual_reduce_parts_with_several_parts(monkeypatch, shape, layout, parts, algorithm, copies):
    """``dual_reduce_parts`` and ``dual_reduce_half_parts`` cut into several parts (a
    part's byte limit lowered so that these small shapes have them): the partials
    added up twice give the float64 gradients."""
    from tvm_fusion.compute import bn_stats
    from tvm_fusion.contracts import bn_backward as ref
    from tvm_fusion.contracts.bn_backward import bn_backward_problem

    problem = bn_backward_problem(shape, "float32", layout, True, True)
    per_row = copies * problem.count // problem.shape[0] * 4  # x and dy, twice for half parts
    monkeypatch.setattr(bn_stats, "PART_BYTES", problem.shape[0] // parts * per_row)
    assert bn_stats.parts(problem, copies) == parts
    gen = rng()
    x, dy = random_floats(gen, shape, "float32", loc=0.5, scale=2.0), random_floats(gen, shape, "float32")
    c = problem.channels
    mean, invstd = gen.standard_normal(c).astype("float32"), (gen.random(c) + 0.5).astype("float32")
    weight = gen.standard_normal(c).astype("float32")
    got = run_unscheduled(prim_func(problem, algorithm), [x, dy, mean, invstd, weight])
    want = ref.reference(x, dy, mean, invstd, weight, layout, True)
    tol = TOLERANCES["float32"]
    for name, value, expected in zip(("dx", "dweight", "dbias"), got, want):
        assert_close(value.reshape(expected.shape), expected, tol["rtol"], tol["atol"], name)
