"""cross_entropy_grad at its three levels.

* The contract: argument checks that name the argument, and the float64 reference
  against torch autograd (float64) for every option, weight or not, int32 and int64
  targets, partly and wholly ignored batches, NaN/inf rows, a zero denominator.
* The algorithm level: every decomposition, compiled unscheduled for the CPU.
* The CPU candidates with outputs poisoned first: every option in fp32/bf16/fp16,
  every knob config, odd and large V (50257), all-ignored batches, bad targets,
  against the float64 reference and against torch autograd; dispatch and a tiny tune.
* The CUDA candidates' generated code (no GPU needed): no barrier under a thread
  guard for the default and sampled configs, no shared store by every thread, shuffles
  where a cross-thread step is, 16-byte loads and stores, no scratch buffer, int64
  offsets past 2^31 elements (32768 x 151936 bf16).
* ``gpu``-marked (skipped without a GPU): every CUDA candidate on torch CUDA tensors
  with poisoned outputs against torch autograd in float64, including 32768 x 151936
  bf16 (the int64 path).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import numpy as np
import pytest
import tvm

from helpers import (TOLERANCES, assert_close, candidate_params, check_compiles_without_spills, has_gpu, needs_nvcc,
                     np_dtype, random_floats, rng, run_poisoned, shipped_problems, torch_or_none)
from test_cuda_codegen import barriers_under_a_guard, kernel_params, shared_stores_by_every_thread, without_ticket
from tvm_fusion import dispatch, registry, single_launch, targets, tuner
from tvm_fusion.codegen import cuda_report, nvcc_path
from tvm_fusion.compute import ALGORITHMS, algorithms_for, prim_func, problem_from_json, problem_of, problem_to_json
from tvm_fusion.compute.cross_entropy_grad import MODE_OF
from tvm_fusion.contracts import CrossEntropyGradProblem, TargetOutOfRangeError, cross_entropy_grad_problem
from tvm_fusion.contracts import cross_entropy as ce_ref
from tvm_fusion.contracts import cross_entropy_grad as grad_ref
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.kernel import build_kernel
from tvm_fusion.registry import CANDIDATE_ANNOTATION
from tvm_fusion.schedules.cuda.common import widest_vector

torch = torch_or_none()
CPU = targets.resolve("llvm")
CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
DTYPES = ["float32", "float16", "bfloat16"]
MODES = ["fused", "from_lse"]
REDUCTIONS = ["none", "mean", "sum"]
OPTIONS = list(itertools.product(REDUCTIONS, [False, True], [0.0, 0.1]))  # reduction, weighted, smoothing


# -- cases and checks -------------------------------------------------------------
def case(gen, batch, classes, dtype="float32", target_dtype="int64", weighted=False, ignored=0.25,
         ignore_index=-100, scale=3.0):
    logits = random_floats(gen, (batch, classes), dtype, scale=scale)
    target = gen.integers(0, classes, batch).astype(target_dtype)
    target[gen.random(batch) < ignored] = ignore_index
    weight = (gen.random(classes) + 0.05).astype(np.float32) if weighted else None
    return logits, target, weight


def problem_for(logits, target, weight, reduction, smoothing, mode, ignore_index=-100) -> CrossEntropyGradProblem:
    return cross_entropy_grad_problem(
        logits.shape, np.dtype(logits.dtype).name, target.shape, np.dtype(target.dtype).name,
        None if weight is None else weight.shape, "float32", ignore_index, reduction, smoothing, mode,
    )


def kernel_inputs(problem, gen, logits, target, weight):
    """The PrimFunc's inputs and the upstream gradient (None: 1, the fused mode's)."""
    inputs = [logits, target] + ([weight] if weight is not None else [])
    if problem.mode == "fused":
        return inputs, None
    dloss = np.asarray(gen.standard_normal(problem.dloss_shape) * 2, dtype=np.float32)
    lse = grad_ref.reference_lse(logits).astype(np.float32)
    return inputs + [lse, dloss], dloss


def named(kernel, inputs, outs) -> dict[str, np.ndarray]:
    return {name: out for (name, _, _), out in zip(kernel.params[len(inputs):], outs)}


def grad_tolerance(dtype: str, classes: int, scale: float) -> tuple[float, float]:
    """(rtol, atol) of dlogits against the float64 reference. float32: exp and
    accumulation rounding of the row's sum (a serial float32 sum over V on the CPU
    when no lane count divides V: up to ~5e-6 relative at V = 50257); 16-bit: one ulp
    of the stored value (a float32 error may round the other way), and fp16's
    subnormal spacing for the small gradients of a mean."""
    atol = 2e-6 * math.log2(classes + 2) * scale
    if dtype == "float32":
        return 2e-5, atol
    if dtype == "float16":
        return 2.0**-10, atol + 2.0**-24
    return 2.0**-7, atol


def check_grad(dlogits, logits, target, weight, reduction, smoothing, dloss, dtype, ignore_index=-100, what=""):
    expected = grad_ref.reference_grad(logits, target, weight, ignore_index, reduction, smoothing, dloss)
    finite = expected[np.isfinite(expected)]
    scale = float(np.abs(finite).max()) if finite.size else 1.0
    rtol, atol = grad_tolerance(dtype, logits.shape[1], max(scale, 1e-30))
    assert_close(np.asarray(dlogits, np.float64), expected, rtol, atol, f"dlogits {what}")


def check_forward(outs, logits, target, weight, reduction, smoothing, ignore_index=-100):
    """The fused mode's forward outputs: loss, lse, first_bad_row (and the denominator)."""
    ref = ce_ref.reference(logits, target, weight, ignore_index, reduction, smoothing)
    classes = logits.shape[1]
    tol = 2e-5 * max(1.0, math.log2(classes) / 4)
    assert_close(outs["loss"].reshape(ref.shape), ref, tol, tol, f"loss ({reduction})")
    assert_close(outs["lse"], grad_ref.reference_lse(logits), 2e-6 * math.log2(classes + 2), 2e-5, "lse")
    assert outs["first_bad_row"][0] == logits.shape[0]
    if reduction == "mean":
        t = target.astype(np.int64)
        w = np.ones(classes) if weight is None else weight.astype(np.float64)
        denom = np.where(t != ignore_index, w[np.where(t != ignore_index, t, 0)], 0.0).sum()
        assert_close(outs["denom"], np.array([denom]), 1e-6, 1e-6, "denom")


# -- the contract ---------------------------------------------------------------------
@pytest.mark.parametrize("reduction, weighted, smoothing", OPTIONS)
@pytest.mark.parametrize("target_dtype", ["int32", "int64"])
@pytest.mark.parametrize("ignored", [0.0, 0.3, 1.0])
def test_reference_matches_torch_autograd_in_float64(reduction, weighted, smoothing, target_dtype, ignored):
    if torch is None:
        pytest.skip("torch not installed")
    gen = rng()
    batch, classes = 11, 13
    logits = gen.standard_normal((batch, classes)) * 3
    target = gen.integers(0, classes, batch).astype(target_dtype)
    target[gen.random(batch) < ignored] = -100
    if ignored == 1.0:
        target[:] = -100
    weight = gen.random(classes) + 0.05 if weighted else None
    x = torch.tensor(logits, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(
        x, torch.from_numpy(target).long(), None if weight is None else torch.tensor(weight),
        reduction=reduction, label_smoothing=smoothing,
    )
    upstream = torch.tensor(gen.standard_normal(loss.shape) * 2)
    (expected,) = torch.autograd.grad(loss, x, upstream)
    ours = grad_ref.reference_grad(logits, target, weight, -100, reduction, smoothing, upstream.numpy())
    assert_close(ours, expected.numpy(), 1e-12, 1e-12, "reference vs torch")
    if ignored == 1.0:  # a mean over no row: loss NaN, gradient zeros (torch's)
        assert (ours == 0).all()


def test_reference_special_cases_match_torch():
    """NaN and +inf rows (ignored or not), a row of -inf, an in-range ignore_index,
    and a mean whose valid rows all weigh 0."""
    if torch is None:
        pytest.skip("torch not installed")
    F = torch.nn.functional
    gen = rng()
    logits = gen.standard_normal((6, 9)) * 2
    logits[1, 3] = np.nan
    logits[2, 4] = np.inf
    logits[3, :] = -np.inf
    logits[5, 0] = np.nan
    target = np.array([0, 1, 2, 3, 4, 3])  # ignore_index 3: rows 3 and 5 ignored
    weight = gen.random(9) + 0.1
    for reduction, smoothing, w in itertools.product(REDUCTIONS, [0.0, 0.2], [None, weight]):
        x = torch.tensor(logits, requires_grad=True)
        loss = F.cross_entropy(x, torch.from_numpy(target), None if w is None else torch.tensor(w),
                               ignore_index=3, reduction=reduction, label_smoothing=smoothing)
        (expected,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
        ours = grad_ref.reference_grad(logits, target, w, 3, reduction, smoothing)
        assert_close(ours, expected.numpy(), 1e-12, 1e-12, f"special rows {reduction} {smoothing}")
    zero = np.ones(9)
    zero[[1, 2]] = 0.0  # the valid rows' targets weigh nothing: denominator 0
    clean = gen.standard_normal((3, 9))
    x = torch.tensor(clean, requires_grad=True)
    t = np.array([1, -100, 2])
    for smoothing in (0.0, 0.2):
        loss = F.cross_entropy(x, torch.from_numpy(t), torch.tensor(zero), label_smoothing=smoothing)
        (expected,) = torch.autograd.grad(loss, x)
        ours = grad_ref.reference_grad(clean, t, zero, -100, "mean", smoothing)
        assert_close(ours, expected.numpy(), 1e-12, 1e-12, "zero denominator")
        assert np.isnan(ours[[0, 2]]).all() and (ours[1] == 0).all()


@pytest.mark.parametrize("call, error, words", [
    (lambda: cross_entropy_grad_problem((4, 10), "float32", mode="backward"), ValueError, ["mode", "'backward'"]),
    (lambda: cross_entropy_grad_problem((4, 10), "float32", lse_shape=(4,)), ValueError, ["lse", "mode='fused'"]),
    (lambda: cross_entropy_grad_problem((4, 10), "float32", dloss_shape=(1,)), ValueError, ["dloss", "mode='fused'"]),
    (lambda: cross_entropy_grad_problem((4, 10), "float32", mode="from_lse", lse_shape=(3,)), ValueError,
     ["lse.shape", "(4,)", "(3,)"]),
    (lambda: cross_entropy_grad_problem((4, 10), "float32", mode="from_lse", lse_dtype="float16"), TypeError,
     ["lse dtype", "float16"]),
    (lambda: cross_entropy_grad_problem((4, 10), "float32", mode="from_lse", dloss_shape=(4,)), ValueError,
     ["dloss.shape", "() or (1,)", "'mean'"]),
    (lambda: cross_entropy_grad_problem((4, 10), "float32", reduction="none", mode="from_lse", dloss_shape=(1,)),
     ValueError, ["dloss.shape", "(4,)", "'none'"]),
    (lambda: cross_entropy_grad_problem((4, 10), "float32", mode="from_lse", dloss_dtype="float64"), TypeError,
     ["dloss dtype", "float64"]),
    (lambda: cross_entropy_grad_problem((4, 10, 2), "float32"), ValueError, ["cross_entropy_grad", "rank 2"]),
    (lambda: cross_entropy_grad_problem((4, 10), "int8"), TypeError, ["cross_entropy_grad", "logits dtype"]),
    (lambda: cross_entropy_grad_problem((4, 10), "float32", (3,)), ValueError, ["target.shape", "(3,)"]),
    (lambda: cross_entropy_grad_problem((4, 10), "float32", weight_shape=(9,)), ValueError, ["weight.shape"]),
    (lambda: cross_entropy_grad_problem((4, 10), "float32", reduction="avg"), ValueError, ["reduction", "'avg'"]),
    (lambda: cross_entropy_grad_problem((4, 10), "float32", label_smoothing=2.0), ValueError, ["label_smoothing"]),
    (lambda: grad_ref.reference_grad(np.zeros((2, 3)), np.array([0, 3])), TargetOutOfRangeError, ["target[1] = 3"]),
])
def test_bad_arguments_are_named(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value!s}"


def test_problem_round_trips_and_tags_its_prim_func():
    problem = cross_entropy_grad_problem((8, 100), "bfloat16", (8,), "int32", (100,), "float32", 3, "sum", 0.1,
                                         "from_lse", (8,), "float32", (1,))
    assert problem_from_json(problem_to_json(problem)) == problem
    assert problem.key() == "cross_entropy_grad_8x100_bfloat16_from_lse_sum_int32_w_ig3_ls0.1"
    assert problem.canonical() == CrossEntropyGradProblem(8, 100, "bfloat16", mode="from_lse")
    assert problem.forward().op == "cross_entropy" and problem.forward().has_weight
    assert problem.num_inputs == 5 and problem.dloss_shape == ()
    for algorithm in algorithms_for(problem):
        func = prim_func(problem, algorithm)
        assert problem_of(func) == problem and str(func.attrs["tvm_fusion.algorithm"]) == algorithm
        assert [p.name for p in func.params][: problem.num_inputs] == ["logits", "target", "weight", "lse", "dloss"]
    with pytest.raises(ValueError, match="computes mode 'fused'"):
        prim_func(problem, "fused")


# -- the algorithm level ---------------------------------------------------------------
def run_unscheduled(func, inputs):
    ex = tvm.compile(tvm.IRModule({"main": func}), target=CPU)
    params = [(p.name, tuple(int(d) for d in p.shape), str(p.dtype)) for p in func.params]
    args = [tvm.runtime.tensor(a.reshape(shape)) for a, (_, shape, _) in zip(inputs, params)]  # a 0-d dloss as (1,)
    outs = [tvm.runtime.tensor(np.full(shape, np.nan if "float" in dt else -1, dt))
            for _, shape, dt in params[len(inputs):]]
    ex["main"](*args, *outs)
    return {name: o.numpy() for (name, _, _), o in zip(params[len(inputs):], outs)}


@pytest.mark.parametrize("algorithm", ALGORITHMS["cross_entropy_grad"])
@pytest.mark.parametrize("reduction, weighted, smoothing", OPTIONS)
def test_decompositions_unscheduled(algorithm, reduction, weighted, smoothing):
    gen = rng()
    # padded, parts: whole granules; window: B V a multiple of a granule (4 float32 values)
    batch, classes = {"fused_padded": (9, 40), "fused_window": (12, 37), "fused_granules": (12, 37),
                      "fused_parts": (9, 40)}.get(algorithm, (9, 37))
    logits, target, weight = case(gen, batch, classes, weighted=weighted)
    target[1] = -100
    problem = problem_for(logits, target, weight, reduction, smoothing, MODE_OF[algorithm])
    inputs, dloss = kernel_inputs(problem, gen, logits, target, weight)
    outs = run_unscheduled(prim_func(problem, algorithm), inputs)
    check_grad(outs["dlogits"], logits, target, weight, reduction, smoothing, dloss, "float32", what=algorithm)
    if problem.mode == "fused":
        check_forward(outs, logits, target, weight, reduction, smoothing)


# -- the CPU candidates -----------------------------------------------------------------
def run_cpu(problem, gen, logits, target, weight, candidate=None, knobs=None):
    cand = candidate or registry.default_candidate(problem, CPU).name
    kernel = build_kernel(problem, CPU, cand, knobs)
    inputs, dloss = kernel_inputs(problem, gen, logits, target, weight)
    return named(kernel, inputs, run_poisoned(kernel, inputs)), dloss


def check_all(outs, dloss, problem, logits, target, weight, what=""):
    check_grad(outs["dlogits"], logits, target, weight, problem.reduction, problem.label_smoothing, dloss,
               problem.dtype, problem.ignore_index, what)
    assert outs["dlogits"].dtype == np_dtype(problem.dtype)
    if problem.mode == "fused":
        check_forward(outs, logits, target, weight, problem.reduction, problem.label_smoothing, problem.ignore_index)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction, weighted, smoothing", OPTIONS)
def test_cpu_candidates_every_option_and_dtype(mode, reduction, weighted, smoothing):
    gen = rng()
    for (batch, classes), dtype, target_dtype in [((7, 37), "float32", "int64"), ((5, 64), "bfloat16", "int32"),
                                                  ((3, 40), "float16", "int64")]:
        logits, target, weight = case(gen, batch, classes, dtype, target_dtype, weighted)
        problem = problem_for(logits, target, weight, reduction, smoothing, mode)
        names = [c.name for c in registry.applicable(problem, CPU)]
        assert len(names) == 1, names
        outs, dloss = run_cpu(problem, gen, logits, target, weight, names[0])
        check_all(outs, dloss, problem, logits, target, weight, f"{dtype} {problem.key()}")


@pytest.mark.parametrize("mode", MODES)
def test_cpu_every_knob_config(mode):
    gen = rng()
    logits, target, weight = case(gen, 12, 64, weighted=True)
    problem = problem_for(logits, target, weight, "mean", 0.1, mode)
    for cand in registry.applicable(problem, CPU):
        configs = cand.all_configs(problem, CPU)
        assert len(configs) >= 4
        for knobs in configs:
            outs, dloss = run_cpu(problem, gen, logits, target, weight, cand.name, knobs)
            check_all(outs, dloss, problem, logits, target, weight, str(knobs))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype, classes, options", [
    ("bfloat16", 50257, {}), ("float32", 50257, {"weighted": True, "smoothing": 0.1, "reduction": "sum"}),
    ("float16", 32000, {"reduction": "none"}), ("float32", 1, {}), ("bfloat16", 3, {"smoothing": 0.3}),
    ("float32", 7, {"ignore_index": 2, "weighted": True, "smoothing": 0.1}),  # an in-range ignore_index
])
def test_cpu_odd_and_large_vocabularies(mode, dtype, classes, options):
    gen = rng()
    batch = 4 if classes > 1000 else 6
    ignore = options.get("ignore_index", -100)
    logits, target, weight = case(gen, batch, classes, dtype, weighted=options.get("weighted", False), ignore_index=ignore)
    problem = problem_for(logits, target, weight, options.get("reduction", "mean"), options.get("smoothing", 0.0), mode,
                          ignore)
    outs, dloss = run_cpu(problem, gen, logits, target, weight)
    check_all(outs, dloss, problem, logits, target, weight, problem.key())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cpu_all_ignored_batch_has_zero_gradient(mode, reduction):
    gen = rng()
    logits, target, weight = case(gen, 5, 33, "bfloat16", weighted=True, ignored=1.0)
    target[:] = -100
    problem = problem_for(logits, target, weight, reduction, 0.1, mode)
    outs, dloss = run_cpu(problem, gen, logits, target, weight)
    assert (outs["dlogits"].astype(np.float32) == 0).all()
    if mode == "fused":
        loss = outs["loss"]
        assert np.isnan(loss).all() if reduction == "mean" else (loss == 0).all()
        check_forward(outs, logits, target, weight, reduction, 0.1)


def test_cpu_nan_and_inf_rows_and_a_zero_denominator_follow_torch():
    gen = rng()
    logits = random_floats(gen, (6, 9), "float32")
    logits[1, 3] = np.nan
    logits[2, 4] = np.inf
    logits[3, :] = -np.inf
    logits[5, 0] = np.nan
    target = np.array([0, 1, 2, 3, 4, -100])
    for mode, reduction in itertools.product(MODES, REDUCTIONS):
        problem = problem_for(logits, target, None, reduction, 0.2, mode)
        outs, dloss = run_cpu(problem, gen, logits, target, None)
        check_grad(outs["dlogits"], logits, target, None, reduction, 0.2, dloss, "float32", what=problem.key())
        assert np.isnan(outs["dlogits"][[1, 2, 3, 5]]).all() and np.isfinite(outs["dlogits"][[0, 4]]).all()
    weight = np.ones(9, np.float32)
    weight[[0, 4]] = 0.0
    target = np.array([0, -100, 4, -100, 0, -100])  # the valid rows' targets weigh nothing
    clean = random_floats(gen, (6, 9), "float32")
    for mode, smoothing in itertools.product(MODES, [0.0, 0.2]):
        problem = problem_for(clean, target, weight, "mean", smoothing, mode)
        outs, dloss = run_cpu(problem, gen, clean, target, weight)
        check_grad(outs["dlogits"], clean, target, weight, "mean", smoothing, dloss, "float32", what="zero denominator")
        assert np.isnan(outs["dlogits"][[0, 2, 4]]).all() and (outs["dlogits"][[1, 3, 5]] == 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_cpu_bad_target_is_flagged_and_its_row_gets_zero(mode):
    gen = rng()
    logits, target, _ = case(gen, 6, 10, ignored=0.0)
    target[3], target[4] = 10, -1
    problem = problem_for(logits, target, None, "none", 0.1, mode)
    outs, _ = run_cpu(problem, gen, logits, target, None)
    assert (outs["dlogits"][[3, 4]] == 0).all() and np.isfinite(outs["dlogits"]).all()
    if mode == "fused":
        assert outs["first_bad_row"][0] == 3 and (outs["loss"][[3, 4]] == 0).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction, weighted, smoothing", OPTIONS)
def test_cpu_candidates_match_torch_autograd(mode, reduction, weighted, smoothing):
    if torch is None:
        pytest.skip("torch not installed")
    gen = rng()
    logits, target, weight = case(gen, 16, 50, weighted=weighted)
    problem = problem_for(logits, target, weight, reduction, smoothing, mode)
    outs, dloss = run_cpu(problem, gen, logits, target, weight)
    x = torch.from_numpy(logits).double().requires_grad_()
    loss = torch.nn.functional.cross_entropy(
        x, torch.from_numpy(target), None if weight is None else torch.from_numpy(weight).double(),
        reduction=reduction, label_smoothing=smoothing,
    )
    upstream = torch.ones_like(loss) if dloss is None else torch.from_numpy(dloss).double().reshape(loss.shape)
    (expected,) = torch.autograd.grad(loss, x, upstream)
    scale = float(expected.abs().max())
    assert_close(outs["dlogits"], expected.numpy(), 1e-5, 1e-6 * max(scale, 1e-30), "dlogits vs torch")
    if mode == "fused":
        assert_close(outs["loss"].reshape(loss.shape), loss.detach().numpy(), 2e-5, 2e-5, "loss vs torch")


def test_registry_dispatch_and_annotation():
    for target, mode in itertools.product((CPU, CUDA), MODES):
        problem = cross_entropy_grad_problem((64, 1000), "bfloat16", mode=mode)
        cand = registry.default_candidate(problem, target)
        assert cand.op == "cross_entropy_grad" and MODE_OF[cand.algorithm] == mode
        assert all(MODE_OF[c.algorithm] == mode for c in registry.applicable(problem, target))
    problem = cross_entropy_grad_problem((8, 64), "float32", mode="fused")
    kernel = dispatch.kernel_for(problem, CPU)
    assert kernel.candidate == "cross_entropy_grad_parallel" and kernel.source == "heuristic"
    sch = tvm.s_tir.Schedule(kernel.mod)
    assert str(sch.get(sch.get_sblock("dlogits")).annotations[CANDIDATE_ANNOTATION]) == kernel.candidate


@pytest.mark.slow
def test_cpu_tune_records_dispatch_and_a_correct_kernel(tmp_path):
    """The registry's machinery end to end: knobs sampled in MetaSchedule, a record,
    dispatch reading it back and its kernel right."""
    problem = cross_entropy_grad_problem((16, 256), "float32", mode="fused", reduction="sum", label_smoothing=0.1)
    result = tuner.tune([problem], CPU, trials=2, log_dir=str(tmp_path))
    assert problem.key() in result.best
    choice = dispatch.choose(problem, CPU, str(tmp_path))
    assert choice.source == "record" and choice.mod is not None
    kernel = dispatch.kernel_for(problem, CPU, str(tmp_path))
    gen = rng()
    logits, target, _ = case(gen, 16, 256)
    inputs, _ = kernel_inputs(problem, gen, logits, target, None)
    check_all(named(kernel, inputs, run_poisoned(kernel, inputs)), None, problem, logits, target, None, "tuned")


# -- the CUDA candidates' generated code -------------------------------------------------
def check_ptx_vector_loads_shuffles_no_spills(kernel) -> None:
    """The kernel's PTX (nvcc) has 16-byte global loads and shuffles, and ptxas reports
    no spills and no stack."""
    report = cuda_report(kernel)
    assert report.vector_loads > 0 and report.shuffles > 0, report
    assert not any(report.spill_bytes.values()) and not any(report.stack_bytes.values()), report


def row_kernel(source: str) -> str:
    """The body of the kernel that writes dlogits, up to the loss stage its last block
    runs where single_launch merged that in (after the merge's fence)."""
    bodies = re.split(r'(?=extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?\w+\([^)]*\) \{)', source)
    (body,) = [b for b in bodies if b.startswith("extern") and ("dlogits_ptr[" in b or "dlogits_ptr +" in b)]
    return body.split("__threadfence();")[0]



def expects_shuffles(cand, problem) -> bool:
    """Shuffles come from a cross-thread reduction: the fused candidates' row statistics
    and target pass; from_lse has them only in its first kernels (the mean's
    denominator, the weights' sum with smoothing)."""
    if problem.mode == "fused":
        return True
    return problem.reduction == "mean" or (problem.has_weight and problem.label_smoothing > 0)


CUDA_CASES = [((4096, 32000), "bfloat16", {}), ((128, 32000), "float32", {"reduction": "none"}),
              ((64, 50257), "float16", {"weight_shape": (50257,), "label_smoothing": 0.1}),
              ((65536, 1000), "bfloat16", {"reduction": "sum", "target_dtype": "int32"}),
              ((65, 1000), "float16", {"reduction": "none", "weight_shape": (1000,), "label_smoothing": 0.2}),
              ((3, 16), "float32", {"ignore_index": 2}),
              ((2, 73736), "float16", {"weight_shape": (73736,), "label_smoothing": 0.1})]  # head_in_shared


def cuda_cases():
    for (shape, dtype, options), mode in itertools.product(CUDA_CASES, MODES):
        problem = cross_entropy_grad_problem(shape, dtype, mode=mode, **options)
        for cand in registry.applicable(problem, CUDA):
            yield pytest.param(problem, cand.name, id=f"{cand.name}-{problem.key()}")


def test_every_cuda_candidate_has_cases():
    from tvm_fusion import schedules

    names = set(schedules.DISPATCH_ORDER[("cross_entropy_grad", "cuda")])
    covered = {param.values[1] for param in cuda_cases()}
    assert names == covered and len(names) >= 4
    for mode in MODES:
        assert sum(MODE_OF[registry.get(n).algorithm] == mode for n in names) >= 2


@pytest.mark.parametrize("problem, candidate", list(cuda_cases()))
def test_cuda_source_shows_the_strategy(problem, candidate):
    kernel = build_kernel(problem, CUDA, candidate)
    source = kernel.device_source()
    cand = registry.get(candidate)
    assert ("__shfl_down_sync" in source) == expects_shuffles(cand, problem)
    assert "atomic" not in without_ticket(source).lower()  # single_launch's tickets only
    scratch = kernel_params(source) - {name for name, _, _ in kernel.params} - {single_launch.COUNTER}
    # but chunk partials, and the parts' pairs a cluster exchanges (row_in_cluster)
    assert all(name.endswith("_rf") or name.startswith("part_online_") for name in scratch), \
        "a kernel takes a scratch buffer"
    assert not barriers_under_a_guard(source)
    assert not shared_stores_by_every_thread(source), shared_stores_by_every_thread(source)[:2]
    if candidate.endswith("warp_per_row"):  # values between lanes by shuffles only
        assert "__shared__" not in row_kernel(source)


def sampled_cases():
    shapes = [((24, 724), "float32", {"weight_shape": (724,), "reduction": "sum"}),
              ((3, 1000), "bfloat16", {"label_smoothing": 0.1}), ((5, 50257), "float16", {}),
              ((65, 1000), "float16", {"reduction": "none", "weight_shape": (1000,), "label_smoothing": 0.2}),
              ((2, 8), "bfloat16", {"reduction": "none"}), ((1, 16), "float32", {})]
    problems = [cross_entropy_grad_problem(shape, dtype, mode=mode, **options)
                for (shape, dtype, options), mode in itertools.product(shapes, MODES)]
    yield from candidate_params(problems, CUDA, 4)  # with the default: 5 builds a case (6 took 185 s of CI)


@pytest.mark.parametrize("problem, candidate, configs", list(sampled_cases()))
def test_no_barrier_under_a_guard_nor_shared_store_by_all_for_sampled_configs(problem, candidate, configs):
    for knobs in configs:
        source = build_kernel(problem, CUDA, candidate, knobs).device_source()
        assert not barriers_under_a_guard(source), f"{knobs}: {barriers_under_a_guard(source)[:2]}"
        assert not shared_stores_by_every_thread(source), f"{knobs}: {shared_stores_by_every_thread(source)[:2]}"


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("problem, candidate", list(cuda_cases())[::2])
def test_nvcc_ptx_has_16_byte_loads_and_stores_and_no_spills(problem, candidate):
    kernel = build_kernel(problem, CUDA, candidate)
    report = cuda_report(kernel)
    assert not any(report.spill_bytes.values()) and not any(report.stack_bytes.values()), report
    assert (report.shuffles > 0) == expects_shuffles(registry.get(candidate), problem)
    vector = kernel.knobs.as_dict().get("vector", 16 // DTYPE_BYTES[problem.dtype])  # none: a granule a load
    if vector * DTYPE_BYTES[problem.dtype] == 16:
        assert report.vector_loads > 0, "the vector knob says 16-byte loads but the PTX has none"
    if vector * DTYPE_BYTES[problem.dtype] == 16 and problem.classes * DTYPE_BYTES[problem.dtype] % 16 == 0:
        # (a row off the 16-byte grid starts mid-granule: its own elements take 2-byte stores)
        assert re.search(r"st\.global(?:\.\w+)*\.v4\.(?:u|b|f)32", report.ptx), "no 16-byte store of dlogits"



@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_padded_warp_gradient_reads_the_row_once():
    """``cross_entropy_grad_warp_per_row_padded`` on 65536x1000 fp16 (default knobs): in
    the row kernel's PTX a lane loads its 4 granules for the statistics, and the
    gradient map reloads only the last, partial one (its step guarded by the row's
    end); 4 16-byte stores of dlogits. The unpadded warp kernel loads the row again
    for the map."""
    def row_kernel(candidate):
        ptx = cuda_report(build_kernel(cross_entropy_grad_problem((65536, 1000), "float16"), CUDA, candidate)).ptx
        kernels = re.split(r"\.entry ", ptx)[1:]
        return next(k for k in kernels if re.search(r"st\.global(?:\.\w+)*\.v4", k))

    v4_load = r"ld\.global(?:\.nc)?\.v4\.(?:u|b|f)32"
    padded = row_kernel("cross_entropy_grad_warp_per_row_padded")
    assert len(re.findall(v4_load, padded)) == 5
    assert len(re.findall(r"st\.global(?:\.\w+)*\.v4\.(?:u|b|f)32", padded)) == 4
    assert len(re.findall(v4_load, row_kernel("cross_entropy_grad_warp_per_row"))) > 5

@pytest.mark.parametrize("mode", MODES)
def test_int64_offsets_past_two_to_the_31(mode):
    problem = cross_entropy_grad_problem((32768, 151936), "bfloat16", mode=mode)
    assert problem.numel > 2**31
    small = cross_entropy_grad_problem((4096, 32000), "bfloat16", mode=mode)
    names = [c.name for c in registry.applicable(problem, CUDA)]
    assert names
    for name in names:
        source = build_kernel(problem, CUDA, name).device_source()
        stores = [line for line in source.splitlines() if "dlogits_ptr +" in line]
        assert stores and all("(int64_t)blockIdx.x" in line for line in stores), stores[:1]
        if registry.get(name).applies(small):
            assert "int64_t)blockIdx" not in build_kernel(small, CUDA, name).device_source()


# -- on the GPU ---------------------------------------------------------------------------
GPU_SHAPES = [((4096, 32000), {}), ((128, 32000), {"reduction": "none"}), ((65536, 1000), {"reduction": "sum"}),
              ((257, 1000), {"weight": True, "label_smoothing": 0.1, "target_dtype": "int32"}),
              ((64, 50257), {"reduction": "sum", "label_smoothing": 0.2}), ((3, 724), {"weight": True}),
              ((1, 151936), {}), ((64, 1000), {"all_ignored": True}),
              ((50000, 1000), {"weight": True, "label_smoothing": 0.1})]  # two-level stages: 50 chunks
BIG = ((32768, 151936), {})  # bf16 only: 5e9 elements, the int64 path


def gpu_problem(shape, options, dtype, mode):
    o = dict(options)
    return cross_entropy_grad_problem(
        shape, dtype, (shape[0],), o.get("target_dtype", "int64"), (shape[1],) if o.get("weight") else None,
        "float32", -100, o.get("reduction", "mean"), o.get("label_smoothing", 0.0), mode,
    )


def gpu_cases():
    cases = [(shape, options, dtype) for shape, options in GPU_SHAPES for dtype in DTYPES]
    cases.append((BIG[0], BIG[1], "bfloat16"))
    for (shape, options, dtype), mode in itertools.product(cases, MODES):
        problem = gpu_problem(shape, options, dtype, mode)
        for cand in registry.applicable(problem, CUDA):
            yield pytest.param(shape, tuple(sorted(options.items())), dtype, mode, cand.name,
                               id=f"{cand.name}-{problem.key()}{'-all_ignored' if 'all_ignored' in options else ''}")


def device_inputs(problem, options, device):
    batch, classes = problem.shape
    logits = (torch.randn(problem.shape, device=device) * 2).to(getattr(torch, problem.dtype))
    target = torch.randint(0, classes, (batch,), device=device, dtype=getattr(torch, problem.target_dtype))
    target[torch.rand(batch, device=device) < 0.1] = -100
    if options.get("all_ignored"):
        target[:] = -100
    weight = torch.rand(classes, device=device) + 0.5 if problem.has_weight else None
    inputs = [logits, target] + ([weight] if weight is not None else [])
    dloss = None
    if problem.mode == "from_lse":
        lse = torch.cat([torch.logsumexp(logits[i : i + 1024].float(), dim=1) for i in range(0, batch, 1024)])
        dloss = torch.randn(problem.dloss_shape, device=device) * 2
        inputs += [lse, dloss]
    return inputs, dloss


def run_on_device(kernel, inputs, device):
    """Launch on torch tensors with poisoned outputs (NaN; -7777 for ints), on torch's
    current stream for CUDA."""
    import tvm_ffi

    args = [tvm_ffi.from_dlpack(t)._create_view(shape) for t, (_, shape, _) in zip(inputs, kernel.params)]
    outs = {}
    for name, shape, dtype in kernel.params[len(inputs):]:
        fill = -7777 if dtype.startswith("int") else float("nan")
        outs[name] = torch.full(shape, fill, dtype=getattr(torch, dtype), device=device)
    if device == "cuda":
        with tvm_ffi.use_torch_stream():
            kernel(*args, *(tvm_ffi.from_dlpack(o) for o in outs.values()))
        torch.cuda.synchronize()
    else:
        kernel(*args, *(tvm_ffi.from_dlpack(o) for o in outs.values()))
    return outs


def torch_reference(problem, logits, target, weight, dloss, rows=1024):
    """Yields ``(first row, d loss / d logits)`` for each block of rows, by torch autograd
    in float64 (the big shapes would need tens of GB at once), then ``(None, the
    per-row losses)``."""
    F = torch.nn.functional
    f64 = {"dtype": torch.float64, "device": logits.device}
    t = target.long()
    valid = t != problem.ignore_index
    w = None if weight is None else weight.double()
    upstream = torch.ones((), **f64) if dloss is None else dloss.double()
    if problem.reduction == "mean":
        share = valid.double() if w is None else torch.where(valid, w[t.clamp(0, problem.classes - 1)], 0.0)
        denom = share.sum()
        scale = upstream.reshape(()) / denom if denom != 0 else torch.tensor(float("nan"), **f64)
        per_row = scale.expand(problem.batch)
    elif problem.reduction == "sum":
        per_row = upstream.reshape(()).expand(problem.batch)
    else:
        per_row = upstream.expand(problem.batch) if dloss is None else upstream
    losses = []
    for i in range(0, problem.batch, rows):
        x = logits[i : i + rows].double().requires_grad_()
        loss = F.cross_entropy(x, t[i : i + rows], w, ignore_index=problem.ignore_index, reduction="none",
                               label_smoothing=problem.label_smoothing)
        (grad,) = torch.autograd.grad(loss, x, per_row[i : i + rows].contiguous())
        losses.append(loss.detach())
        yield i, grad
    yield None, torch.cat(losses)


def check_on_device(problem, options, kernel, device):
    """Run ``kernel`` on torch tensors of ``device`` and compare every output with
    torch autograd in float64, a block of rows at a time."""
    inputs, dloss = device_inputs(problem, options, device)
    outs = run_on_device(kernel, inputs, device)
    weight = inputs[2] if problem.has_weight else None
    dlogits = outs["dlogits"]
    worst, scale = 0.0, 0.0
    rtol, _ = grad_tolerance(problem.dtype, problem.classes, 1.0)
    for start, expected in torch_reference(problem, inputs[0], inputs[1], weight, dloss):
        if start is None:
            row_loss = expected
            break
        ours = dlogits[start : start + expected.shape[0]].double()
        assert torch.equal(torch.isnan(ours), torch.isnan(expected)), f"NaN pattern differs in rows from {start}"
        finite = torch.isfinite(expected)
        if finite.any():
            scale = max(scale, float(expected[finite].abs().max()))
            excess = (ours - expected).abs() - rtol * expected.abs()
            worst = max(worst, float(excess[finite].max()))
    _, atol = grad_tolerance(problem.dtype, problem.classes, max(scale, 1e-30))
    assert worst <= atol, f"dlogits off by {worst:.3g} beyond rtol (atol {atol:.3g}, scale {scale:.3g})"
    if options.get("all_ignored"):
        assert bool((dlogits == 0).all())
    if problem.mode == "fused":
        assert outs["first_bad_row"].item() == problem.batch
        lse = torch.cat([torch.logsumexp(inputs[0][i : i + 1024].double(), dim=1)
                         for i in range(0, problem.batch, 1024)])
        bound = 2e-6 * math.log2(problem.classes + 2) * float(lse.abs().max()) + 2e-5
        assert float((outs["lse"].double() - lse).abs().max()) < bound
        if problem.reduction == "none":
            expected_loss = row_loss
        elif problem.reduction == "sum":
            expected_loss = row_loss.sum().reshape(1)
        else:
            t = inputs[1].long()
            valid = t != -100
            share = valid.double() if weight is None else torch.where(valid, weight.double()[t.clamp(min=0)], 0.0)
            expected_loss = (row_loss.sum() / share.sum()).reshape(1)
            assert abs(outs["denom"].item() - share.sum().item()) <= 1e-6 * share.sum().item()
        got = outs["loss"].double().reshape(-1)
        assert torch.equal(torch.isnan(got), torch.isnan(expected_loss))
        finite = torch.isfinite(expected_loss)
        if finite.any():
            size = max(1.0, float(expected_loss[finite].abs().max()))
            tol = 4 * TOLERANCES[problem.dtype]["rtol"] * math.log2(problem.classes + 2) * size
            assert float((got[finite] - expected_loss[finite]).abs().max()) < tol


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape, options, dtype", [
    ((40, 1000), {}, "bfloat16"), ((3, 724), {"weight": True, "reduction": "none"}, "float32"),
    ((2100, 64), {"reduction": "sum", "label_smoothing": 0.2, "target_dtype": "int32"}, "float16"),
    ((64, 100), {"all_ignored": True}, "float32"),
])
def test_device_check_on_cpu_torch_tensors(mode, shape, options, dtype):
    """The GPU test's path (torch inputs through DLPack, poisoned torch outputs, the
    float64 autograd reference in blocks of rows) run here with the CPU candidates."""
    if torch is None:
        pytest.skip("torch not installed")
    problem = gpu_problem(shape, options, dtype, mode)
    check_on_device(problem, options, build_kernel(problem, CPU, registry.default_candidate(problem, CPU).name), "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("shape, options, dtype, mode, candidate", list(gpu_cases()))
def test_cuda_candidate_on_gpu(shape, options, dtype, mode, candidate):
    options = dict(options)
    problem = gpu_problem(shape, options, dtype, mode)
    check_on_device(problem, options, build_kernel(problem, targets.resolve("cuda"), candidate), "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("problem", shipped_problems("cross_entropy_grad"))
def test_shipped_gradient_records_give_correct_kernels(problem):
    """What dispatch runs for every gradient problem of the shipped H200 log (its tuned
    record, or the default where the record is not clearly faster), against torch
    autograd in float64 with poisoned outputs (issue 11's five fused shapes since 1509b80)."""
    options = {"weight": True} if problem.has_weight else {}
    check_on_device(problem, options, dispatch.kernel_for(problem, targets.resolve("cuda")), "cuda")


IN_PLACE_CASES = [((4096, 32000), "float16", {}), ((64, 128256), "bfloat16", {"label_smoothing": 0.1}),
                  ((65, 1000), "float32", {"reduction": "none", "weight_shape": (1000,)}), ((5, 50257), "float16", {})]


def in_place_cases():
    for shape, dtype, options in IN_PLACE_CASES:
        problem = cross_entropy_grad_problem(shape, dtype, mode="fused", in_place=True, **options)
        for cand in registry.applicable(problem, CUDA):
            yield pytest.param(problem, cand.name, id=f"{cand.name}-{problem.key()}")


@pytest.mark.parametrize("problem, candidate", list(in_place_cases()))
def test_in_place_kernels_read_each_row_before_a_barrier_and_promise_no_alias(problem, candidate):
    """The gradient written over the logits: no ``__restrict__`` (the device kernels'
    no-alias promise withdrawn), and the row loss's logit read before the first
    block-wide barrier, so no thread stores into the row before every read of it."""
    source = build_kernel(problem, CUDA, candidate).device_source()
    assert "__restrict__" not in source
    body = row_kernel(source)
    target_read = re.search(r"logits_ptr\[[^\]]*target_ptr", body)
    assert target_read and "target_logit" in body
    lines = body.split("\n")
    barrier = next(i for i, line in enumerate(lines) if "__syncthreads()" in line)
    store = next(i for i, line in enumerate(lines) if " = " in line and "dlogits_ptr" in line.split(" = ")[0])
    read = next(i for i, line in enumerate(lines) if target_read.group(0) in line)
    assert read < barrier < store
    out_of_place = dataclasses.replace(problem, in_place=False)
    assert "__restrict__" in build_kernel(out_of_place, CUDA, candidate).device_source()


def test_in_place_candidates_exclude_warp_per_row_and_cover_every_row_length():
    for shape, dtype, options in IN_PLACE_CASES:
        problem = cross_entropy_grad_problem(shape, dtype, mode="fused", in_place=True, **options)
        names = [c.name for c in registry.applicable(problem, CUDA)]
        assert names and "cross_entropy_grad_warp_per_row" not in names


def test_in_place_gradient_takes_its_out_of_place_records_candidate_where_it_applies():
    """No tune times a gradient in place: dispatch reapplies the out-of-place twin's
    record (the shipped sm_90 log's), and where that candidate cannot write in place
    (the warp-per-row kernels) falls through to the heuristic, never to a kernel that
    refuses the problem."""
    for shape, dtype in [((8192, 128256), "bfloat16"), ((4096, 32000), "float16")]:
        out_of_place = cross_entropy_grad_problem(shape, dtype, mode="fused")
        in_place = dataclasses.replace(out_of_place, in_place=True)
        record, twin = dispatch.choose(out_of_place, CUDA), dispatch.choose(in_place, CUDA)
        assert record.source == "record" and twin.source == "record (out of place)", (shape, record, twin)
        assert (twin.candidate, twin.knobs) == (record.candidate, record.knobs)
        assert "out of place" in dispatch.explain(in_place, CUDA)
    out_of_place = cross_entropy_grad_problem((65536, 1000), "float16", mode="fused")
    in_place = dataclasses.replace(out_of_place, in_place=True)
    assert "warp_per_row" in dispatch.choose(out_of_place, CUDA).candidate
    choice = dispatch.choose(in_place, CUDA)
    assert choice.source == "heuristic" and registry.get(choice.candidate).applies(in_place)
    # Odd rows: no record since the granule candidate, which cannot write in place (its
    # edge granules are the neighbouring rows'); the heuristic gives the online one.
    out_of_place = cross_entropy_grad_problem((16384, 50257), "bfloat16", mode="fused")
    in_place = dataclasses.replace(out_of_place, in_place=True)
    assert dispatch.choose(out_of_place, CUDA).candidate == "cross_entropy_grad_granules_in_shared"
    choice = dispatch.choose(in_place, CUDA)
    assert (choice.source, choice.candidate) == ("heuristic", "cross_entropy_grad_online")


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_in_place_kernel_compiles_without_spills():
    problem = cross_entropy_grad_problem((4096, 32000), "float16", mode="fused", in_place=True)
    report = cuda_report(build_kernel(problem, CUDA, "cross_entropy_grad_row_in_shared"))
    assert not any(report.spill_bytes.values()) and report.vector_loads > 0, report


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_online_gradient_unrolls_rows_read_as_scalars():
    """V odd in bf16: the online candidate's default ``unroll`` (``FULL_UNROLL``) unrolls
    its row loops, so the row kernel's PTX holds many more 2-byte loads of the logits
    than at the old 16 (which left both loops rolled), and nothing spills. Rows on the
    16-byte grid keep 16 (unrolled at 1024 threads they spill: the module docstring)."""
    from tvm_fusion.schedules.cuda.cross_entropy_grad_online import FULL_UNROLL

    cand = registry.get("cross_entropy_grad_online")
    scalar, grid = cross_entropy_grad_problem((16384, 50257), "bfloat16"), cross_entropy_grad_problem((8192, 128256), "bfloat16")
    assert cand.default_for(scalar, CUDA).unroll == FULL_UNROLL in cand.choices(scalar, CUDA)["unroll"]
    assert cand.default_for(grid, CUDA).unroll == 16 and FULL_UNROLL not in cand.choices(grid, CUDA)["unroll"]

    def scalar_loads(knobs):
        report = cuda_report(build_kernel(scalar, CUDA, cand.name, knobs))
        assert not any(report.spill_bytes.values()) and not any(report.stack_bytes.values()), report
        (row,) = [k for k in re.split(r"\.entry ", report.ptx)[1:] if re.search(r"st\.global(?:\.\w+)*\.[ub]16", k)]
        return len(re.findall(r"ld\.global(?:\.nc)?\.[ub]16", row))

    default = cand.default_for(scalar, CUDA)
    rolled, unrolled = scalar_loads(dataclasses.replace(default, unroll=16)), scalar_loads(default)
    assert unrolled >= 4 * rolled, (rolled, unrolled)


BATCHED = [
    # (shape, options, dtype, threads, batch): a lane's chunks ``batch`` at a time.
    ((48, 128256), {}, "bfloat16", 501, 4),  # 16032 chunks = 501 x 4 x 8: no guard
    ((48, 128256), {"reduction": "none", "label_smoothing": 0.1}, "bfloat16", 512, 8),  # ragged: guarded
    ((37, 32000), {"weight": True, "reduction": "sum"}, "float16", 1024, 4),
    ((20, 1000), {"target_dtype": "int32"}, "float32", 128, 8),  # 250 chunks: most lanes idle in a step
    ((64, 100), {"all_ignored": True}, "bfloat16", 128, 2),
]


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("shape, options, dtype, threads, batch", BATCHED)
def test_online_gradient_batches_on_gpu(shape, options, dtype, threads, batch):
    """cross_entropy_grad_online's ``batch`` knob against float64 on poisoned outputs:
    an even split and ragged ones (a guard per chunk), every option kind."""
    problem = gpu_problem(shape, options, dtype, "fused")
    knobs = registry.get("cross_entropy_grad_online").knobs(threads=threads, vector=8 if dtype != "float32" else 4,
                                                            unroll=16, batch=batch)
    check_on_device(problem, options, build_kernel(problem, CUDA, "cross_entropy_grad_online", knobs), "cuda")


ROWS = [
    # (shape, options, dtype, threads, batch, rows): a block's ``rows`` rows one after the other.
    ((256, 32000), {}, "float16", 512, 4, 2),
    ((240, 50257), {"weight": True, "label_smoothing": 0.1}, "bfloat16", 1024, 1, 2),  # scalar rows
    ((264, 4096), {"reduction": "none"}, "float32", 256, 2, 2),
    ((96, 128256), {"reduction": "sum", "target_dtype": "int32"}, "bfloat16", 1024, 8, 3),
    ((128, 1000), {"all_ignored": True}, "bfloat16", 128, 1, 4),
]


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("shape, options, dtype, threads, batch, rows", ROWS)
def test_online_gradient_rows_per_block_on_gpu(shape, options, dtype, threads, batch, rows):
    """cross_entropy_grad_online's ``rows`` knob against float64 on poisoned outputs:
    each block's rows in turn, the statistics' shared buffers reused row after row."""
    problem = gpu_problem(shape, options, dtype, "fused")
    knobs = registry.get("cross_entropy_grad_online").knobs(
        threads=threads, vector=widest_vector(dtype, shape[1]), unroll=16, batch=batch, rows=rows)
    check_on_device(problem, options, build_kernel(problem, CUDA, "cross_entropy_grad_online", knobs), "cuda")


HEADS = [
    # (shape, options, dtype, threads, batch): the row's head in shared memory, the tail from the logits.
    ((48, 128256), {}, "bfloat16", 1024, 4),  # H = 98304, a tail of 3.66 steps: guarded
    ((33, 73736), {"weight": True, "label_smoothing": 0.1, "reduction": "none"}, "float16", 512, 2),  # H = 65536
    ((20, 40000), {"reduction": "sum", "target_dtype": "int32"}, "float32", 256, 1),  # H = 32768
    ((64, 151936), {"all_ignored": True}, "bfloat16", 1024, 2),
]


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("shape, options, dtype, threads, batch", HEADS)
def test_head_in_shared_on_gpu(shape, options, dtype, threads, batch):
    """cross_entropy_grad_head_in_shared against float64 on poisoned outputs: heads of
    one to three grains, every option kind, lanes and batches of its space."""
    problem = gpu_problem(shape, options, dtype, "fused")
    knobs = registry.get("cross_entropy_grad_head_in_shared").knobs(
        threads=threads, vector=widest_vector(dtype, shape[1]), unroll=16, batch=batch)
    check_on_device(problem, options, build_kernel(problem, CUDA, "cross_entropy_grad_head_in_shared", knobs), "cuda")


@needs_nvcc
def test_head_in_shared_reads_the_head_from_shared_memory_and_the_tail_from_the_logits():
    """The build's loop partition splits the statistics' chunk loop and the map's loop at
    H: the head's parts load 16 bytes from the shared copy, the tail's 16 bytes from the
    logits, and no load picks its source at run time; the copy is 16-byte loads and
    stores, a barrier before the first read of it; no spills at 1024 lanes."""
    problem = gpu_problem((8192, 128256), {}, "bfloat16", "fused")
    kernel = build_kernel(problem, CUDA, "cross_entropy_grad_head_in_shared")
    body = row_kernel(kernel.device_source())
    copy = re.findall(r"ptx_cp_async_legacy_cg_16_\d+_\d+\(row_head_shared_dyn_ptr, [^;]*logits_ptr[, []", body)  # cp.async
    assert len(copy) == 12  # 98304 values: 12 steps of 1024 lanes x 8, unrolled
    from_head = re.findall(r"_src_local_ptr(?:_\d)? \+ 0\) = \*\(uint4\*\)\(row_head_shared_dyn_ptr", body)
    from_logits = re.findall(r"_src_local_ptr(?:_\d)? \+ 0\) = \*\(uint4\*\)\(logits_ptr", body)
    assert len(from_head) == 8 and len(from_logits) == 8, (len(from_head), len(from_logits))  # 4 a step, each pass
    assert "likely" not in body and " ? " not in body.split("row_head_shared_dyn_ptr", 1)[1]
    assert body.index("__syncthreads()") < body.index("row_src_local_ptr + 0) = *(uint4*)(row_head_shared_dyn_ptr")
    assert re.search(r"\*\(uint4\*\)\(dlogits_ptr", body)
    check_compiles_without_spills(kernel)


def test_online_gradient_rows_knob_walks_a_blocks_rows_in_turn():
    """``rows`` 1 leaves the row kernel a block a row (the split's unit loop vanishes);
    at 64 the grid is B / 64 blocks, each running the statistics (their barriers) and
    the gradient pass of its rows one after the other. The choices deal the rows out
    evenly to one or two blocks an SM (8192 rows on 132 SMs: 64 a block on 128 blocks,
    32 on 256), and only 1 where B is under the SMs."""
    cand = registry.get("cross_entropy_grad_online")
    problem = gpu_problem((8192, 128256), {}, "bfloat16", "fused")
    assert cand.choices(problem, CUDA)["rows"] == [1, 32, 64] and cand.default_for(problem, CUDA).rows == 1
    assert cand.choices(gpu_problem((128, 32000), {}, "float16", "fused"), CUDA)["rows"] == [1]
    knobs = cand.knobs(threads=1024, vector=8, unroll=16, batch=4)
    one = row_kernel(build_kernel(problem, CUDA, cand.name, knobs).device_source())
    many = row_kernel(build_kernel(problem, CUDA, cand.name, dataclasses.replace(knobs, rows=64)).device_source())
    loop = re.search(r"for \(int (\w+) = 0; \1 < 64; \+\+\1\) \{", many)
    assert loop and "< 64;" not in one
    assert "__syncthreads" in many[loop.end():] and "((int)blockIdx.x) * 64)" in many
    assert "((int)blockIdx.x) * 64)" not in one


def test_online_gradient_batch_issues_a_steps_loads_together():
    """``batch`` 1 is the schedule as before (the same CUDA as without the knob's
    split); at 4 a lane's step holds four 16-byte loads of the logits in each pass."""
    problem = gpu_problem((64, 128256), {}, "bfloat16", "fused")
    knobs = registry.get("cross_entropy_grad_online").knobs
    one = row_kernel(build_kernel(problem, CUDA, "cross_entropy_grad_online",
                                  knobs(threads=501, vector=8, unroll=16, batch=1)).device_source())
    four = row_kernel(build_kernel(problem, CUDA, "cross_entropy_grad_online",
                                   knobs(threads=501, vector=8, unroll=16, batch=4)).device_source())
    assert one.count("*(uint4*)(logits_ptr") == 2  # a load a step, each pass
    assert four.count("*(uint4*)(logits_ptr") == 8
    assert "if (" not in four.split("__syncthreads")[0]  # 501 x 4 divides the row's chunks: no guard before the reduction
    assert 4 in registry.get("cross_entropy_grad_online").choices(problem, CUDA)["batch"]
