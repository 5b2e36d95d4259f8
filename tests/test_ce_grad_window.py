"""cross_entropy_grad_window_in_shared: the fused gradient of rows off the 16-byte grid
(odd V in fp16/bf16), each row's 16-byte granules of the flat logits (its window)
copied into shared memory with aligned loads, then the statistics and the gradient
from there.

The decomposition is ``compute.cross_entropy_grad``'s ``fused_window``. CPU: its index
arithmetic against the float64 reference, unscheduled on LLVM, with rows of every
residue (so every head and tail length) and the tensor's last row, whose window is
clamped (float32 and float16; TVM's LLVM backend cannot compile a bf16 buffer between
two computations, the window, so bf16 is checked on the GPU only); the predicates;
the generated CUDA (16-byte loads into dynamic shared memory, shuffles, no spills).
GPU (marked, skipped without one): the scheduled kernel on torch tensors with
poisoned outputs against torch autograd in float64, every option, sampled knobs.
"""

from __future__ import annotations

import itertools
import re

import pytest
import tvm

import tvm_fusion as tf
from helpers import default_and_sampled, has_gpu, rng, torch_or_none
from test_cuda_codegen import TICKET
from test_cross_entropy_grad import (
    case, check_forward, check_grad, check_on_device, gpu_problem, kernel_inputs, problem_for, row_kernel,
    run_on_device, run_unscheduled,
)
from tvm_fusion import registry, schedules, targets
from tvm_fusion.codegen import cuda_report, nvcc_path
from tvm_fusion.compute import prim_func
from tvm_fusion.compute.cross_entropy_grad import window_granules
from tvm_fusion.kernel import Kernel, build_kernel, compiled_form
from tvm_fusion.schedules.cuda import cross_entropy_grad_window_in_shared as window

torch = torch_or_none()
CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
NAME = "cross_entropy_grad_window_in_shared"
CANDIDATE = registry.get(NAME)
OPTIONS = [dict(reduction=reduction, weight=weight, label_smoothing=smoothing)
           for reduction, (weight, smoothing) in itertools.product(
               ["none", "mean", "sum"], [(False, 0.0), (True, 0.0), (False, 0.1), (True, 0.2)])]


def option_id(options) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items())


def grad_problem(shape, dtype, **options):
    return tf.make_problem("cross_entropy_grad", shape, dtype, mode="fused", **options)


# -- predicates -----------------------------------------------------------------------
def test_registered_right_after_the_granules_candidate():
    """Its decomposition's twin, ``cross_entropy_grad_granules_in_shared`` (the same window,
    the gradient stored by granules), comes first."""
    order = schedules.DISPATCH_ORDER[("cross_entropy_grad", "cuda")]
    assert order[:2] == ["cross_entropy_grad_granules_in_shared", NAME]


@pytest.mark.parametrize("shape, dtype, fits", [
    ((16384, 50257), "bfloat16", True), ((3000, 50257), "float16", True), ((8, 37), "float16", True),
    ((16, 1001), "float32", True), ((24, 57337), "bfloat16", True),
    ((24, 57339), "bfloat16", False),  # a window of 7168 granules: 112 KB and more
    ((4096, 32000), "bfloat16", False), ((16, 1000), "float32", False),  # rows on the grid
    ((3, 1001), "float16", False),  # B V not a multiple of 8: the last granule would be partial
    ((8, 15), "float16", False),  # under two granules
    ((64, 50257), "float32", False),  # a window of 201 KB
])
def test_fits_rows_off_the_grid_whose_window_fits(shape, dtype, fits):
    problem = grad_problem(shape, dtype)
    assert CANDIDATE.applies(problem) == fits
    assert not CANDIDATE.applies(grad_problem(shape, dtype, in_place=True))
    assert not CANDIDATE.applies(tf.make_problem("cross_entropy_grad", shape, dtype, mode="from_lse"))
    assert not CANDIDATE.prefers(problem, CUDA)  # slower than the online candidate (its docstring)


def test_is_a_compute_algorithm_that_names_its_limits():
    from tvm_fusion.compute import ALGORITHMS
    assert window.ALGORITHM in ALGORITHMS["cross_entropy_grad"]
    assert window_granules(grad_problem((8, 50257), "bfloat16")) == 6283  # ceil((50257 + 7) / 8)
    with pytest.raises(ValueError, match="fused_window needs B \\* V a multiple of 8"):
        prim_func(grad_problem((3, 1001), "float16"), window.ALGORITHM)
    # Dispatch's pick there is the granule candidate (same window, 16-byte stores).
    assert registry.default_candidate(grad_problem((16384, 50257), "bfloat16"), CUDA).name == \
        "cross_entropy_grad_granules_in_shared"


# -- the decomposition on the CPU ------------------------------------------------------
# 16 rows of V = 1001: i V mod 8 takes every residue (every head length), and the last
# row's window reaches the tensor's end (the clamp).
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
@pytest.mark.parametrize("dtype, shape", [("float32", (16, 1001)), ("float16", (16, 1001)),
                                          ("float32", (12, 37)), ("float16", (8, 37))])
def test_decomposition_matches_the_reference(dtype, shape, options):
    gen = rng()
    logits, target, weight = case(gen, *shape, dtype=dtype, weighted=options["weight"])
    target[:3] = [0, shape[1] - 1, -100]  # the first and last classes: in the head's and tail's granules
    problem = problem_for(logits, target, weight, options["reduction"], options["label_smoothing"], "fused")
    inputs, dloss = kernel_inputs(problem, gen, logits, target, weight)
    outs = run_unscheduled(prim_func(problem, window.ALGORITHM), inputs)
    check_grad(outs["dlogits"], logits, target, weight, options["reduction"], options["label_smoothing"], dloss,
               dtype, what=window.ALGORITHM)
    check_forward(outs, logits, target, weight, options["reduction"], options["label_smoothing"])


# -- the generated CUDA ---------------------------------------------------------------
def window_loads(source: str) -> list[str]:
    """16-byte copies of the logits straight into the window in dynamic shared memory:
    ``cp.async`` waited for before the statistics read it (:mod:`tvm_fusion.async_copy`,
    in launch_order's pipeline), or a 16-byte load and store (a build by TVM's own
    pipeline, which ignores the mark)."""
    copies = re.findall(r"ptx_cp_async_legacy_cg_16_\d+_\d+\(window_shared_dyn_ptr, [^;]*logits_ptr[, []", source)
    if copies:
        return copies if "wait_all();" in source else []
    return re.findall(r"\*\((?:uint4|float4)\*\)\(window_shared_dyn_ptr \+ [^;]*= \*\((?:uint4|float4)\*\)\(logits_ptr \+",
                      source)


CODEGEN_CASES = [((16384, 50257), "bfloat16", {}), ((3000, 50257), "float16", {"weight": True, "label_smoothing": 0.1}),
                 ((16, 1001), "float32", {"reduction": "none"}), ((64, 4097), "bfloat16", {"reduction": "sum"})]


@pytest.mark.parametrize("shape, dtype, options", CODEGEN_CASES, ids=str)
def test_window_is_copied_with_16_byte_loads(shape, dtype, options):
    source = row_kernel(build_kernel(grad_problem(shape, dtype, **options), CUDA, NAME).device_source())
    assert window_loads(source), "the window should be copied 16 bytes at a time"
    assert "extern __shared__" in source and "__shfl_down_sync" in source
    # The statistics read the window 16 bytes at a time too.
    assert re.search(r"= \*\((?:uint4|float4)\*\)\(window_shared_dyn_ptr \+", source)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("shape, dtype, options", CODEGEN_CASES, ids=str)
def test_ptx_vector_loads_shuffles_no_spills(shape, dtype, options):
    kernel = build_kernel(grad_problem(shape, dtype, **options), CUDA, NAME)
    report = cuda_report(kernel)
    tickets = len(re.findall(TICKET, kernel.device_source()))  # single_launch's, one a merged pair
    assert report.vector_loads > 0 and report.shuffles > 0 and report.atomics == tickets, report
    assert not any(report.spill_bytes.values()) and not any(report.stack_bytes.values()), report


def test_default_copies_a_50257_class_row_in_one_unrolled_step():
    """13 granules a lane at 512 threads: the default unroll leaves no copy loop, so a
    lane's loads are all issued before its first shared store."""
    source = row_kernel(build_kernel(grad_problem((16384, 50257), "bfloat16"), CUDA, NAME).device_source())
    assert len(window_loads(source)) == 13


def test_every_knob_config_builds():
    problem = grad_problem((64, 50257), "float16", weight=True, label_smoothing=0.1)
    for knobs in CANDIDATE.all_configs(problem, CUDA):
        assert window_loads(build_kernel(problem, CUDA, NAME, knobs).device_source()), knobs


def test_tunable_space_builds():
    problem = grad_problem((64, 50257), "bfloat16")
    sch = tvm.s_tir.Schedule(prim_func(problem, window.ALGORITHM))
    CANDIDATE.apply_to(sch, problem, CUDA, tunable=True)
    with CUDA:
        executable = tvm.compile(compiled_form(sch.mod, problem), target=CUDA)
    kernel = Kernel(problem, CUDA, NAME, CANDIDATE.knobs(), "explicit", sch.mod, executable)
    assert window_loads(kernel.device_source())


# -- on the GPU -----------------------------------------------------------------------
# Both window candidates: this one and cross_entropy_grad_granules_in_shared (the same
# window, the gradient stored by granules; its CPU tests are in test_ce_grad_granules.py).
WINDOWED = [NAME, "cross_entropy_grad_granules_in_shared"]
GPU_SHAPES = [((8, 37), "float16"), ((24, 1001), "bfloat16"), ((16, 1001), "float32"),
              ((2048, 50257), "bfloat16"), ((3000, 50257), "float16"), ((16384, 50257), "bfloat16"),
              ((2048, 32001), "bfloat16")]


def gpu_options(options) -> dict:
    return {"reduction": options["reduction"], "label_smoothing": options["label_smoothing"],
            **({"weight": True} if options["weight"] else {})}


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
@pytest.mark.parametrize("shape, dtype", GPU_SHAPES[:4], ids=str)
@pytest.mark.parametrize("name", WINDOWED)
def test_correct_on_gpu_every_option(name, shape, dtype, options):
    options = gpu_options(options)
    problem = gpu_problem(shape, options, dtype, "fused")
    check_on_device(problem, options, build_kernel(problem, targets.resolve("cuda"), name), "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("shape, dtype", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("name", WINDOWED)
def test_correct_on_gpu_sampled_knobs(name, shape, dtype):
    options = {"weight": True, "label_smoothing": 0.1}
    problem = gpu_problem(shape, options, dtype, "fused")
    target = targets.resolve("cuda")
    for knobs in default_and_sampled(registry.get(name), problem, target, 3):
        check_on_device(problem, options, build_kernel(problem, target, name, knobs), "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("name", WINDOWED)
def test_all_ignored_batch_and_nan_rows_on_gpu(name):
    """A batch with every row ignored (mean: NaN loss and gradient, as torch) and rows
    holding NaN or +inf (in an edge granule too), whose gradient is NaN on the whole row
    as torch's."""
    x = (torch.randn(64, 1001, device="cuda") * 2).half()
    x[3, 17], x[9, 1000], x[12, 0] = float("nan"), float("inf"), float("inf")
    t = torch.randint(0, 1001, (64,), device="cuda")
    problem = grad_problem((64, 1001), "float16")
    assert registry.default_candidate(problem, CUDA).name not in WINDOWED  # too few rows: chosen explicitly below
    kernel = build_kernel(problem, targets.resolve("cuda"), name)
    check_nan_rows_and_all_ignored(kernel, x, t)


def check_nan_rows_and_all_ignored(kernel, x, t) -> None:
    """``kernel`` (a mean's fused gradient) on logits ``x`` with targets ``t``, then with
    every row ignored, against torch autograd in float64, outputs poisoned first: NaN
    exactly where torch's gradient is NaN, the loss NaN where torch's is, the finite
    gradient within 2e-3."""
    import torch.nn.functional as F

    for target in (t, torch.full_like(t, -100)):
        theirs = x.double().requires_grad_()
        ref_loss = F.cross_entropy(theirs, target)
        (ref_grad,) = torch.autograd.grad(ref_loss, theirs)
        outs = run_on_device(kernel, [x, target], "cuda")  # outputs poisoned first
        grad, loss = outs["dlogits"].double(), outs["loss"].double()
        assert torch.equal(torch.isnan(grad), torch.isnan(ref_grad))
        assert torch.isnan(loss).item() == torch.isnan(ref_loss).item()
        finite = torch.isfinite(ref_grad)
        assert float((grad[finite] - ref_grad[finite]).abs().max()) < 2e-3
