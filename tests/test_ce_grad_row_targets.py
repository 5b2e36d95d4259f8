"""cross_entropy_grad_row_targets and cross_entropy_grad_row_in_shared_targets: the fused
gradient of a small batch in one launch, every row block summing the mean's denominator
over the targets itself, the first bad row and the denominator written by the batch
stage (``fused_row_targets``), on block_per_row's and row_in_shared's row kernels.

CPU: where the candidate applies and that dispatch takes it where it took its base; the
decomposition is in ``test_cross_entropy_grad``'s unscheduled test (every option,
float64 reference) and here with bad targets; the generated CUDA (one kernel where the
base candidate has two or three, the targets read in the row kernel before any gradient
store, ``denom`` and ``first_bad_row`` stored only in the last block's stage), the PTX
(16-byte loads, shuffles, no spills), sampled knobs. GPU: the kernel on torch tensors
with poisoned outputs against torch autograd in float64, every option, default and
sampled knobs (``test_cross_entropy_grad``'s GPU shapes take it too where it applies),
and bad targets.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_close, default_and_sampled, has_gpu, rng, torch_or_none
from test_cross_entropy_grad import (case, check_on_device, check_ptx_vector_loads_shuffles_no_spills, gpu_problem,
                                     problem_for, run_on_device, run_unscheduled)
from tvm_fusion import registry, targets
from tvm_fusion.codegen import nvcc_path
from tvm_fusion.compute import prim_func
from tvm_fusion.contracts import cross_entropy_grad_problem
from tvm_fusion.dispatch import choose
from tvm_fusion.kernel import build_kernel

torch = torch_or_none()
CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
# each one-launch candidate and the candidate whose row kernel it keeps
BASES = {"cross_entropy_grad_row_targets": "cross_entropy_grad_block_per_row",
         "cross_entropy_grad_row_in_shared_targets": "cross_entropy_grad_row_in_shared"}


def problem(shape, dtype="float16", **options):
    return cross_entropy_grad_problem(shape, dtype, mode="fused", **options)


@pytest.mark.parametrize("name", BASES)
@pytest.mark.parametrize("shape, options, applies", [
    ((128, 32000), {}, True),
    ((1024, 1000), {"reduction": "sum", "label_smoothing": 0.1}, True),
    ((1025, 32000), {}, False),  # past MAX_BATCH
    ((128, 32000), {"reduction": "none"}, False),  # no batch stage to carry the first bad row
    ((128, 32000), {"in_place": True}, False),
])
def test_where_it_applies(name, shape, options, applies):
    assert registry.get(name).applies(problem(shape, **options)) is applies


@pytest.mark.parametrize("name, applies", [("cross_entropy_grad_row_targets", True),
                                           ("cross_entropy_grad_row_in_shared_targets", False)])
def test_a_row_past_shared_memory(name, applies):
    """row_in_shared's rows fit shared memory beside a second block (112 KB): 151936 fp16
    does not."""
    assert registry.get(name).applies(problem((1, 151936), weight_shape=(151936,))) is applies


@pytest.mark.parametrize("shape, dtype, picked, source", [
    ((128, 32000), "float16", "cross_entropy_grad_row_targets", "record (one-launch twin)"),  # the shipped record's twin
    # few rows of 64 KB and more: row_in_shared's twin (its preference, H100 A/B)
    ((64, 32000), "bfloat16", "cross_entropy_grad_row_in_shared_targets", "heuristic"),
    ((1, 32000), "float16", "cross_entropy_grad_row_in_shared_targets", "heuristic"),
    ((99, 50304), "bfloat16", "cross_entropy_grad_row_in_shared_targets", "heuristic"),
    # past three quarters of the SMs (132 on sm_90), or rows under 64 KB: block_per_row's
    ((100, 32000), "float16", "cross_entropy_grad_row_targets", "heuristic"),
    ((64, 8192), "float16", "cross_entropy_grad_row_targets", "heuristic"),
    ((64, 20000), "float32", "cross_entropy_grad_row_targets", "heuristic"),  # float32 rows: untimed
    ((512, 32000), "bfloat16", "cross_entropy_grad_row_in_shared_targets", "heuristic"),
    ((1024, 32000), "float16", "cross_entropy_grad_row_in_shared_targets", "heuristic"),
])
def test_dispatch_takes_the_twin_where_it_took_the_base(shape, dtype, picked, source):
    choice = choose(problem(shape, dtype), CUDA)
    assert (choice.candidate, choice.source) == (picked, source), choice
    assert registry.get(picked).twin_of in choice.reason or source == "heuristic"


@pytest.mark.parametrize("shape, options", [((2048, 32000), {}), ((512, 32000), {"reduction": "none"}),
                                            ((512, 32000), {"in_place": True}), ((64, 32000), {"in_place": True}),
                                            ((2000, 32000), {"reduction": "sum"})])
def test_dispatch_keeps_the_base_where_no_twin_applies(shape, options):
    assert choose(problem(shape, **options), CUDA).candidate == "cross_entropy_grad_row_in_shared"


@pytest.mark.parametrize("name", BASES)
def test_each_is_its_base_s_twin(name):
    assert registry.get(name).twin_of == BASES[name]
    assert registry.one_launch_twin(BASES[name], problem((128, 32000)), CUDA).name == name
    assert registry.one_launch_twin(BASES[name], problem((2048, 32000)), CUDA) is None


@pytest.mark.parametrize("name", BASES)
@pytest.mark.parametrize("shape, options, base_launches", [
    ((128, 32000), {}, 2), ((128, 32000), {"reduction": "sum"}, 2),
    ((128, 32000), {"weight_shape": (32000,), "label_smoothing": 0.1}, 2),
    # short rows take few lanes (64 at 1024x1000): more than 4 batch rows a lane, where
    # the base's batch stage keeps a launch of its own; this one's runs on the row lanes
    ((1024, 1000), {}, 3), ((600, 4096), {"reduction": "sum"}, 3),
])
def test_one_kernel_where_the_base_has_more(name, shape, options, base_launches):
    p = problem(shape, **options)
    ours = build_kernel(p, CUDA, name)
    theirs = build_kernel(p, CUDA, BASES[name])
    assert ours.launches() == 1 and theirs.launches() == base_launches, (ours.launches(), theirs.launches())
    body = ours.device_source().split('extern "C" __global__')[-1]  # the definition, after its declaration
    rows, last_block = body.split("__threadfence();", 1)
    # The row part reads the targets (the denominator, the row's own target) and stores
    # the gradient; the outputs of the old targets pass come only from the last block.
    assert "target_ptr[((int)threadIdx.x)]" in rows or "reduction" in options or shape != (128, 32000)
    assert "dlogits_ptr" in rows and "launch_ticket" in last_block
    for output in ("first_bad_row_ptr[0] =",) + (("denom_ptr[0] =",) if "reduction" not in options else ()):
        assert output not in rows and output in last_block, output
    # The denominator is summed before the first gradient store of the row.
    if "reduction" not in options:
        assert rows.index("in_thread_row_denom") < rows.index("dlogits_ptr +")


@pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("name", BASES)
@pytest.mark.parametrize("shape, dtype", [((128, 32000), "float16"), ((1024, 1000), "bfloat16"),
                                          ((3, 20000), "float32")])
def test_ptx_vector_loads_shuffles_no_spills(name, shape, dtype):
    check_ptx_vector_loads_shuffles_no_spills(build_kernel(problem(shape, dtype), CUDA, name))


@pytest.mark.parametrize("name", BASES)
@pytest.mark.parametrize("shape", [(200, 32000), (1024, 2000)])
def test_sampled_knobs_build_one_kernel(name, shape):
    p = problem(shape, "bfloat16", label_smoothing=0.1)
    for knobs in default_and_sampled(registry.get(name), p, CUDA, 4):
        assert build_kernel(p, CUDA, name, knobs).launches() == 1, knobs


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bad_targets_unscheduled(reduction):
    """The decomposition these candidates compute, on the CPU unscheduled, with a target
    past the classes and a negative one other than ignore_index: ``first_bad_row``
    names the first, both rows' gradients and losses are zero, and the other rows'
    are float64 torch's with the bad rows ignored."""
    if torch is None:
        pytest.skip("torch not installed")
    gen = rng()
    logits, target, _ = case(gen, 9, 37, ignored=0.0)
    target[3], target[6], target[1] = 37, -5, -100
    p = problem_for(logits, target, None, reduction, 0.1, "fused")
    outs = run_unscheduled(prim_func(p, "fused_row_targets"), [logits, target])
    assert outs["first_bad_row"][0] == 3
    assert (outs["dlogits"][[1, 3, 6]] == 0).all() and np.isfinite(outs["dlogits"]).all()
    ignored = torch.from_numpy(target).clone()
    ignored[[3, 6]] = -100
    x = torch.from_numpy(logits).double().requires_grad_()
    loss = torch.nn.functional.cross_entropy(x, ignored, reduction=reduction, label_smoothing=0.1)
    (want,) = torch.autograd.grad(loss, x)
    assert_close(outs["dlogits"], want.numpy(), 1e-5, 1e-6 * float(want.abs().max()), "dlogits")
    assert_close(outs["loss"].reshape(()), loss.detach().numpy(), 2e-5, 2e-5, "loss")
    if reduction == "mean":
        assert outs["denom"][0] == 6


# -- on the GPU ---------------------------------------------------------------------------
GPU_CASES = [((128, 32000), {}), ((1024, 2000), {"weight": True, "label_smoothing": 0.1}),
             ((77, 50000), {"reduction": "sum", "target_dtype": "int32"}), ((1, 151936), {}),
             ((64, 1000), {"all_ignored": True}), ((300, 4096), {"reduction": "sum", "all_ignored": True})]


def gpu_params():
    for name in BASES:
        candidate = registry.get(name)
        for shape, options in GPU_CASES:
            for dtype in ("float16", "bfloat16", "float32"):
                p = gpu_problem(shape, options, dtype, "fused")
                if not candidate.applies(p):  # row_in_shared: rows past 112 KB
                    continue
                for knobs in default_and_sampled(candidate, p, CUDA, 2 if dtype == "bfloat16" else 0):
                    yield pytest.param(name, shape, tuple(sorted(options.items())), dtype, knobs,
                                       id=f"{name[19:]}-{p.key()}-{knobs}{'-all_ignored' if 'all_ignored' in options else ''}")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("name, shape, options, dtype, knobs", list(gpu_params()))
def test_on_gpu_against_float64(name, shape, options, dtype, knobs):
    options = dict(options)
    p = gpu_problem(shape, options, dtype, "fused")
    check_on_device(p, options, build_kernel(p, targets.resolve("cuda"), name, knobs), "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("name", BASES)
@pytest.mark.parametrize("shape, reduction", [((128, 16000), "mean"), ((1000, 2000), "sum"), ((1024, 1000), "mean")])
def test_on_gpu_bad_targets(name, shape, reduction):
    """A target past the classes and a negative one other than ignore_index, with
    poisoned outputs: ``first_bad_row`` names the first, both rows' gradients are zero,
    the rest is float64 torch's gradient with those rows ignored."""
    batch, classes = shape
    p = problem(shape, "float32", reduction=reduction)
    kernel = build_kernel(p, targets.resolve("cuda"), name)
    gen = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(shape, device="cuda", generator=gen) * 2
    target = torch.randint(0, classes, (batch,), device="cuda", generator=gen)
    bad = [batch // 3, batch // 2]
    target[bad[0]], target[bad[1]] = classes, -5
    outs = run_on_device(kernel, [logits, target], "cuda")
    assert outs["first_bad_row"].item() == bad[0]
    assert bool((outs["dlogits"][bad] == 0).all())
    ignored = target.clone()
    ignored[bad] = -100
    x = logits.double().requires_grad_()
    loss = torch.nn.functional.cross_entropy(x, ignored, reduction=reduction)
    (want,) = torch.autograd.grad(loss, x)
    worst = float((outs["dlogits"].double() - want).abs().max())
    assert worst <= 1e-5 * float(want.abs().max()), worst
    assert abs(outs["loss"].item() - loss.item()) <= 1e-5 * abs(loss.item())
    if reduction == "mean":
        assert outs["denom"].item() == batch - 2
