"""cross_entropy_aligned_rows: rows off the 16-byte grid (odd V), a scalar head, aligned
16-byte body loads and a scalar tail per row.

The decomposition is ``compute.cross_entropy``'s ``aligned_online``; the kernels are
built through the registry (``build_kernel``). CPU: the decomposition's index arithmetic against the
float64 reference (unscheduled, on LLVM: every row residue, head and tail), and the
generated CUDA (16-byte loads, no local memory, shuffles). GPU (marked, skipped
without one): the scheduled kernel with poisoned outputs, every option, sampled knobs.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

import tvm
import tvm_fusion as tf
from helpers import TOLERANCES, assert_close, default_and_sampled, has_gpu, random_floats, rng, run_poisoned
from test_cuda_codegen import TICKET
from tvm_fusion import registry, schedules, targets
from tvm_fusion.codegen import cuda_report, nvcc_path
from tvm_fusion.compute import prim_func
from tvm_fusion.contracts import cross_entropy as ce_ref
from tvm_fusion.contracts.common import DTYPE_BYTES
from tvm_fusion.kernel import Kernel, build_kernel, compiled_form
from tvm_fusion.schedules.cuda import cross_entropy_aligned_rows as aligned

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
NAME = "cross_entropy_aligned_rows"
CANDIDATE = registry.get(NAME)
OPTIONS = [
    dict(weight=weight, reduction=reduction, label_smoothing=smoothing, target_dtype=target_dtype)
    for (weight, smoothing), reduction, target_dtype in itertools.product(
        [(False, 0.0), (True, 0.0), (False, 0.1), (True, 0.2)], ["none", "mean", "sum"], ["int64", "int32"])
    if target_dtype == "int64" or reduction == "mean"
]


def option_id(options) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items())


# -- the data and the reference -------------------------------------------------------
def ce_inputs(gen, problem):
    batch, classes = problem.shape
    logits = random_floats(gen, (batch, classes), problem.dtype, scale=3.0)
    target = gen.integers(0, classes, batch).astype(problem.target_dtype)
    target[gen.random(batch) < 0.15] = -100
    # The first and last classes, which only the head or the tail reads.
    target[: min(batch, 4)] = [0, classes - 1, 1, classes - 2][: min(batch, 4)]
    weight = (gen.random(classes) + 0.05).astype(np.float32) if problem.has_weight else None
    return [logits, target] + ([weight] if weight is not None else [])


def check(kernel, problem, gen) -> None:
    inputs = ce_inputs(gen, problem)
    outs = run_poisoned(kernel, inputs)
    weight = inputs[2] if problem.has_weight else None
    ref = ce_ref.reference(inputs[0], inputs[1], weight, problem.ignore_index, problem.reduction,
                           problem.label_smoothing)
    tol = TOLERANCES[problem.dtype]
    loss = outs[0] if problem.reduction == "none" else outs[-2]
    # A sum over many rows: float32 rounding grows with the count.
    scale = np.sqrt(problem.batch) if problem.reduction == "sum" else 1.0
    assert_close(loss.reshape(ref.shape), ref, tol["rtol"] * scale, tol["atol"] * scale,
                 f"{kernel.candidate} [{kernel.knobs}] loss ({problem.reduction})")
    assert outs[-1][0] == problem.batch, "no target is out of range"


def cuda_kernel(problem, knobs=None, target=CUDA) -> Kernel:
    return build_kernel(problem, target, NAME, knobs)


def tunable_kernel(problem, target=CUDA) -> Kernel:
    """The candidate's tunable space (``tunable=True``), compiled as a tuning trial is."""
    sch = tvm.s_tir.Schedule(prim_func(problem, aligned.ALGORITHM))
    CANDIDATE.apply_to(sch, problem, target, tunable=True)
    with target:
        compiled = compiled_form(sch.mod, problem)
        executable = tvm.compile(compiled, target=target, tir_pipeline="default")
    return Kernel(problem, target, NAME, CANDIDATE.knobs(), "explicit", sch.mod, executable, compiled)


def llvm_kernel(problem) -> Kernel:
    """The decomposition unscheduled, compiled for the CPU: its arithmetic alone."""
    func = prim_func(problem, aligned.ALGORITHM)
    target = tvm.target.Target("llvm")
    mod = tvm.IRModule({"main": func})
    compiled = compiled_form(mod, problem)
    with target:
        executable = tvm.compile(compiled, target=target)
    return Kernel(problem, target, NAME + " (unscheduled)", CANDIDATE.knobs(), "explicit", mod, executable, compiled)


# -- predicates -----------------------------------------------------------------------
def test_registered_first_in_dispatch_order_after_split_row():
    # split_row prefers only few rows of 60 KiB and more (its docstring): it goes first,
    # before this candidate, so that it displaces it there.
    assert schedules.DISPATCH_ORDER[("cross_entropy", "cuda")][:2] == ["cross_entropy_split_row", NAME]


@pytest.mark.parametrize("shape, dtype, fits", [
    ((16384, 50257), "bfloat16", True), ((3000, 50257), "float16", True), ((513, 32001), "bfloat16", True),
    ((7, 1001), "float32", True), ((7, 1002), "float16", True), ((7, 1002), "float32", True),
    ((4096, 32000), "bfloat16", False), ((7, 1000), "float32", False), ((7, 1004), "float32", False),
    ((64, 255), "float16", False), ((64, 101), "float32", False),
])
def test_fits_rows_off_the_16_byte_grid(shape, dtype, fits):
    problem = tf.make_problem("cross_entropy", shape, dtype)
    assert CANDIDATE.applies(problem) == fits
    assert (shape[1] * DTYPE_BYTES[dtype] % 16 != 0) or not fits
    assert CANDIDATE.applies(problem) == fits
    assert CANDIDATE.prefers(problem, CUDA) == (fits and shape[1] >= aligned.PREFERRED_CLASSES)


def test_is_a_compute_algorithm():
    from tvm_fusion.compute import ALGORITHMS
    assert aligned.ALGORITHM in ALGORITHMS["cross_entropy"]
    problem = tf.make_problem("cross_entropy", (5, 1001), "float16")
    assert [c.name for c in registry.applicable(problem, CUDA)][:2] == ["cross_entropy_split_row", NAME]
    with pytest.raises(ValueError, match="aligned_online"):
        prim_func(tf.make_problem("cross_entropy", (5, 15), "float16"), aligned.ALGORITHM)


# -- the decomposition on the CPU ------------------------------------------------------
# 17 rows: i V mod c takes every residue, so every head length and tail length occurs.
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
@pytest.mark.parametrize("dtype, classes", [("float32", 1001), ("float16", 1001), ("bfloat16", 1003),
                                            ("float32", 1002), ("bfloat16", 1006)])
def test_decomposition_matches_the_reference(dtype, classes, options):
    problem = tf.make_problem("cross_entropy", (17, classes), dtype, **options)
    check(llvm_kernel(problem), problem, rng())


@pytest.mark.parametrize("shape, dtype", [((9, 50257), "float16"), ((9, 32001), "bfloat16"), ((5, 257), "float32")])
def test_decomposition_long_rows(shape, dtype):
    problem = tf.make_problem("cross_entropy", shape, dtype, label_smoothing=0.1, reduction="none")
    check(llvm_kernel(problem), problem, rng())


# -- the generated CUDA ---------------------------------------------------------------
def vector_loads_of_logits(source: str) -> list[str]:
    return re.findall(r"\*\((?:uint4|float4)\*\)\(logits_ptr \+", source)


# Every residue of the row's byte length mod 16: 16-bit V = 1000 + r (r = 1..7: 2, 4,
# ..., 14 bytes), float32 V = 1001..1003 (4, 8, 12 bytes); and the table's shapes.
CODEGEN_CASES = ([((7, 1000 + r), "bfloat16" if r % 2 else "float16") for r in range(1, 8)]
                 + [((7, 1000 + r), "float32") for r in range(1, 4)]
                 + [((16384, 50257), "bfloat16"), ((3000, 50257), "float16"), ((513, 32001), "bfloat16"),
                    ((7, 1001), "float32")])


@pytest.mark.parametrize("shape, dtype", CODEGEN_CASES, ids=lambda v: str(v))
def test_body_is_16_byte_loads(shape, dtype):
    problem = tf.make_problem("cross_entropy", shape, dtype)
    source = cuda_kernel(problem).device_source()
    assert vector_loads_of_logits(source), "the body should load the logits 16 bytes at a time"
    assert "__shfl_down_sync" in source
    # The register stage is one granule, indexed by constants.
    assert re.search(r"logits_local_ptr\[(4|8)\];", source), "the register stage should be one 16-byte granule"


@pytest.mark.parametrize("options", [OPTIONS[0], OPTIONS[-1], dict(weight=True, label_smoothing=0.1, reduction="sum")],
                         ids=option_id)
def test_options_keep_the_16_byte_body(options):
    problem = tf.make_problem("cross_entropy", (513, 32001), "bfloat16", **options)
    assert vector_loads_of_logits(cuda_kernel(problem).device_source())


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("shape, dtype, options", [
    ((16384, 50257), "bfloat16", {}), ((3000, 50257), "float16", {}),
    ((513, 32001), "bfloat16", {"weight": True, "label_smoothing": 0.1}), ((7, 1001), "float32", {"reduction": "none"}),
])
def test_ptx_vector_loads_shuffles_no_spills(shape, dtype, options):
    problem = tf.make_problem("cross_entropy", shape, dtype, **options)
    kernel = cuda_kernel(problem)
    report = cuda_report(kernel)
    assert report.vector_loads > 0, report
    assert report.shuffles > 0
    assert report.local_memory == 0, "register stage in local memory"
    assert not any(report.spill_bytes.values()) and not any(report.stack_bytes.values()), report
    assert report.atomics == len(re.findall(TICKET, kernel.device_source()))  # single_launch's tickets only


def test_every_knob_config_builds():
    problem = tf.make_problem("cross_entropy", (64, 50257), "float16", weight=True, label_smoothing=0.1)
    for knobs in CANDIDATE.all_configs(problem, CUDA):
        assert vector_loads_of_logits(cuda_kernel(problem, knobs).device_source()), knobs


def test_tunable_space_builds():
    problem = tf.make_problem("cross_entropy", (64, 50257), "bfloat16")
    kernel = tunable_kernel(problem)
    assert vector_loads_of_logits(kernel.device_source())


# -- on the GPU -----------------------------------------------------------------------
GPU_SHAPES = [((7, 1001), "float16"), ((7, 1001), "bfloat16"), ((7, 1001), "float32"),
              ((3000, 50257), "float16"), ((513, 32001), "bfloat16"), ((513, 32001), "float32"),
              ((129, 50257), "float32"), ((16384, 50257), "bfloat16")]


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
@pytest.mark.parametrize("shape, dtype", GPU_SHAPES[:6], ids=lambda v: str(v))
def test_correct_on_gpu_every_option(shape, dtype, options):
    problem = tf.make_problem("cross_entropy", shape, dtype, **options)
    check(cuda_kernel(problem, target=targets.resolve("cuda")), problem, rng())


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape, dtype", GPU_SHAPES, ids=lambda v: str(v))
def test_correct_on_gpu_sampled_knobs(shape, dtype):
    problem = tf.make_problem("cross_entropy", shape, dtype, weight=True, label_smoothing=0.1)
    target = targets.resolve("cuda")
    for knobs in default_and_sampled(CANDIDATE, problem, target, 4):
        check(cuda_kernel(problem, knobs, target), problem, rng())
