"""cross_entropy_grad_granules_in_shared: the fused gradient of rows off the 16-byte grid
(odd V in fp16/bf16), the row's window in shared memory as the window candidate's, the
gradient computed and stored a 16-byte granule at a time.

The decomposition is ``compute.cross_entropy_grad``'s ``fused_granules``: the map laid
out as the window, then a gather into ``dlogits``, which ``tvm_fusion.granule_stores``
replaces with stores of the granules themselves. CPU: the decomposition unscheduled
and as rewritten (the stores' index and their guards), against the float64 reference,
with rows of every residue mod 8 and the tensor's last row; the rewrite's contract
(idempotent, other functions untouched); the generated CUDA (16-byte loads into the
window, one 16-byte store of the gradient, no gather kernel, no spills), through
``build_kernel`` and through the tuner's build; dispatch's pick. Its GPU tests (the
kernel on torch tensors with poisoned outputs against torch autograd in float64, every
option, sampled knobs, NaN rows and an all-ignored batch) are the window candidate's,
parametrized over both, in test_ce_grad_window.py.
"""

from __future__ import annotations

import re

import pytest
import tvm

import tvm_fusion as tf
from helpers import rng
from test_ce_grad_window import OPTIONS, grad_problem, option_id
from test_cross_entropy_grad import (
    case, check_forward, check_grad, check_ptx_vector_loads_shuffles_no_spills, kernel_inputs, problem_for,
    row_kernel, run_unscheduled,
)
from tvm_fusion import granule_stores, registry, schedules, targets
from tvm_fusion.codegen import nvcc_path
from tvm_fusion.compute import prim_func
from tvm_fusion.compute.cross_entropy_grad import GRANULES
from tvm_fusion.kernel import build_kernel
from tvm_fusion.schedules.cuda import cross_entropy_grad_granules_in_shared as granules
from tvm_fusion.tuner import build_module

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
NAME = "cross_entropy_grad_granules_in_shared"
CANDIDATE = registry.get(NAME)
WINDOW = registry.get("cross_entropy_grad_window_in_shared")


# -- predicates -----------------------------------------------------------------------
def test_registered_first_in_dispatch_order():
    assert schedules.DISPATCH_ORDER[("cross_entropy_grad", "cuda")][0] == NAME


@pytest.mark.parametrize("shape, dtype", [
    ((16384, 50257), "bfloat16"), ((3000, 50257), "float16"), ((8, 37), "float16"), ((16, 1001), "float32"),
    ((24, 57337), "bfloat16"), ((24, 57339), "bfloat16"), ((4096, 32000), "bfloat16"), ((3, 1001), "float16"),
    ((8, 15), "float16"), ((64, 50257), "float32"),
])
def test_applies_where_the_window_candidate_does(shape, dtype):
    """The same window in shared memory: rows off the grid, B V whole granules, the
    window within two blocks an SM; never in place (an edge granule holds the next
    row's logits)."""
    problem = grad_problem(shape, dtype)
    assert CANDIDATE.applies(problem) == WINDOW.applies(problem)
    assert not CANDIDATE.applies(grad_problem(shape, dtype, in_place=True))
    assert not CANDIDATE.applies(tf.make_problem("cross_entropy_grad", shape, dtype, mode="from_lse"))


@pytest.mark.parametrize("shape, dtype, picked", [
    ((16384, 50257), "bfloat16", True), ((3000, 50257), "float16", True), ((2048, 32001), "bfloat16", True),
    ((4096, 20001), "float32", True),  # the five shapes of its docstring's table, smoothing aside
    ((263, 50257), "bfloat16", False), ((64, 1001), "float16", False),  # under two rows an SM
    ((4096, 32000), "float16", False),  # rows on the grid: row_in_shared
])
def test_dispatch_picks_it_for_odd_rows_that_fill_the_gpu(shape, dtype, picked):
    """Its A/B beat the online candidate (the pick before) on every shape timed; the
    16384x50257 bf16 record of the online candidate was dropped so that dispatch takes it,
    and the H200 tune of 2026-12-06 shipped this candidate's tuned knobs for that shape."""
    from tvm_fusion import dispatch

    choice = dispatch.choose(grad_problem(shape, dtype), CUDA)
    assert (choice.candidate == NAME) == picked, choice
    if shape == (16384, 50257):
        assert choice.source.startswith("record") and str(choice.knobs) == "threads=512,unroll=8"
    elif picked:
        assert choice.source == "heuristic" and choice.knobs == CANDIDATE.default_for(grad_problem(shape, dtype), CUDA)


# -- the decomposition on the CPU ------------------------------------------------------
# 16 rows of V = 1001: i V mod 8 takes every residue (every head length), and the last
# row's window reaches the tensor's end (the clamp); (8, 37): rows of under 5 granules.
@pytest.mark.parametrize("rewritten", [False, True], ids=["gather", "granule stores"])
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
@pytest.mark.parametrize("dtype, shape", [("float32", (16, 1001)), ("float16", (16, 1001)),
                                          ("float32", (12, 37)), ("float16", (8, 37))])
def test_decomposition_matches_the_reference(dtype, shape, options, rewritten):
    gen = rng()
    logits, target, weight = case(gen, *shape, dtype=dtype, weighted=options["weight"])
    target[:3] = [0, shape[1] - 1, -100]  # the first and last classes: in the edge granules
    problem = problem_for(logits, target, weight, options["reduction"], options["label_smoothing"], "fused")
    inputs, dloss = kernel_inputs(problem, gen, logits, target, weight)
    func = prim_func(problem, granules.ALGORITHM)
    if rewritten:
        func = granule_stores.stores_in_place(func)
    outs = run_unscheduled(func, inputs)  # outputs poisoned (NaN) first
    check_grad(outs["dlogits"], logits, target, weight, options["reduction"], options["label_smoothing"], dloss,
               dtype, what=f"{granules.ALGORITHM} rewritten={rewritten}")
    check_forward(outs, logits, target, weight, options["reduction"], options["label_smoothing"])


def test_rewrite_drops_the_gather_and_the_buffer_once():
    problem = grad_problem((16, 1001), "float16")
    func = prim_func(problem, granules.ALGORITHM)
    assert GRANULES in func.script() and 'sblock("dlogits")' in func.script()
    once = granule_stores.stores_in_place(func)
    text = once.script()
    assert f"{GRANULES} = " not in text and 'sblock("dlogits")' not in text
    assert [p.name for p in once.params] == [p.name for p in func.params]  # the signature is unchanged
    assert granule_stores.stores_in_place(once).same_as(once)
    other = prim_func(problem, "fused_window")
    assert granule_stores.stores_in_place(other).same_as(other)


def test_rewrite_names_a_function_it_cannot_rewrite():
    problem = grad_problem((16, 1001), "float16")
    func = prim_func(problem, granules.ALGORITHM)
    broken = func.with_attr("tvm_fusion.algorithm", granules.ALGORITHM).with_body(
        prim_func(problem, "fused_window").body)
    with pytest.raises(ValueError, match="granule_stores: expected one store into dlogits_granules"):
        granule_stores.stores_in_place(broken)


# -- the generated CUDA ---------------------------------------------------------------
def granule_stores_in(source: str) -> list[str]:
    """16-byte stores of the gradient from registers."""
    return re.findall(r"\*\(uint4\*\)\(dlogits_ptr \+ [^;]*= \*\(uint4\*\)", source)


CODEGEN_CASES = [((16384, 50257), "bfloat16", {}), ((3000, 50257), "float16", {"weight": True, "label_smoothing": 0.1}),
                 ((64, 4097), "bfloat16", {"reduction": "sum"}), ((16, 1001), "float16", {"reduction": "none"}),
                 ((65536, 50257), "bfloat16", {})]  # past 2^31 elements: int64 offsets, still 16-byte aligned


@pytest.mark.parametrize("shape, dtype, options", CODEGEN_CASES, ids=str)
def test_gradient_is_stored_16_bytes_a_granule(shape, dtype, options):
    kernel = build_kernel(grad_problem(shape, dtype, **options), CUDA, NAME)
    source = kernel.device_source()
    row = row_kernel(source)
    assert granule_stores_in(row), "the gradient should be stored 16 bytes at a time"
    # The window copied 16 bytes a granule, as cp.async (tvm_fusion.async_copy).
    assert re.search(r"ptx_cp_async_legacy_cg_16_\d+_\d+\(window_shared_dyn_ptr, [^;]*logits_ptr[, []", row)
    assert "__shfl_down_sync" in row
    # No kernel reads a granule buffer back: the gather is gone, and with it a pass over B V
    # (a lane's own granule in registers may keep the name: dlogits_granules_local_ptr).
    assert f"{GRANULES}_ptr" not in source
    assert [p[0] for p in kernel.params if p[0] == "dlogits"] == ["dlogits"]
    if shape[0] * shape[1] >= 2**31:
        assert all("int64_t" in store for store in granule_stores_in(row))


def test_statistics_sweep_the_rows_inside_granules_unmasked():
    """The build's loop partition splits the statistics' steps over the window: on
    16384x50257 bf16 at 512 threads (13 steps) the 11 middle ones, whose granules all
    lie inside the row, read them with no test; and the sum reads the max from a
    register, not the allreduce's shared result (a volatile load an element)."""
    row = row_kernel(build_kernel(grad_problem((16384, 50257), "bfloat16"), CUDA, NAME).device_source())
    loops = re.findall(r"for \(int (\w+) = 0; \1 < 11; \+\+\1\) \{(.*?)\n  \}", row, re.S)
    assert len(loops) == 2, "the max's and the sum's middle steps"
    for _, body in loops:
        assert "if (" not in body and "condval" not in body
    assert not [line for line in row.splitlines() if "expf" in line and "volatile" in line]


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("shape, dtype, options", CODEGEN_CASES[:3], ids=str)
def test_ptx_vector_loads_shuffles_no_spills(shape, dtype, options):
    check_ptx_vector_loads_shuffles_no_spills(build_kernel(grad_problem(shape, dtype, **options), CUDA, NAME))


def test_every_knob_config_builds():
    problem = grad_problem((64, 50257), "float16", weight=True, label_smoothing=0.1)
    for knobs in CANDIDATE.all_configs(problem, CUDA):
        assert granule_stores_in(build_kernel(problem, CUDA, NAME, knobs).device_source()), knobs


def test_tuners_build_stores_granules_too():
    """The tuner builds the scheduled module through launch_order's pipeline, with no
    compiled_form before it: the rewrite runs there as well (and its space builds)."""
    problem = grad_problem((64, 50257), "bfloat16")
    sch = tvm.s_tir.Schedule(prim_func(problem, granules.ALGORITHM))
    CANDIDATE.apply_to(sch, problem, CUDA, tunable=True)
    with CUDA:
        built = build_module(sch.mod, CUDA)
    source = built.imports[0].inspect_source()
    assert granule_stores_in(source) and f"{GRANULES}_ptr" not in source
