"""cross_entropy_grad_row_in_cluster: the fused gradient of rows too long for one block's
shared memory, each row cut into P parts (``compute.cross_entropy_grad.row_parts``), a
part a block on chip, a row's P blocks one thread-block cluster that exchanges the
parts' (sum of exp, max) pairs through a cluster barrier.

The decomposition is ``fused_parts``: the statistics and the map over a (B P, L) view of
the logits, so that every stage of a part has the part's own extent. CPU: the parts'
rule and its error; where the candidate applies; the decomposition unscheduled against
the float64 reference (every option; float32 and float16: TVM's LLVM code generation
does not build this function's bfloat16 form); the generated CUDA (a part copied with
16-byte loads, one cluster barrier between the parts' stores and their loads,
16-byte gradient stores bounded by the part, lse and the row loss written by a row's
first block only, the kernel launched in clusters of P), no spills, every knob and the
tuner's build. GPU: the kernel on torch tensors with poisoned outputs against torch
autograd in float64, every option, sampled knobs, NaN and +inf rows and an all-ignored
batch.
"""

from __future__ import annotations

import re

import pytest
import tvm

import tvm_fusion as tf
from helpers import check_cluster_barrier, default_and_sampled, has_gpu, rng, torch_or_none
from test_bn_grid_persistent import lowered
from test_ce_grad_window import OPTIONS, check_nan_rows_and_all_ignored, gpu_options, grad_problem, option_id
from test_cross_entropy_grad import OPTIONS as OPTION_TUPLES
from test_cross_entropy_grad import (
    case, check_forward, check_grad, check_on_device, check_ptx_vector_loads_shuffles_no_spills, gpu_problem,
    kernel_inputs, problem_for, row_kernel, run_unscheduled,
)
from tvm_fusion import grid_barrier, registry, schedules, targets
from tvm_fusion.codegen import nvcc_path
from tvm_fusion.compute import prim_func
from tvm_fusion.compute.cross_entropy_grad import PARTS_ALGORITHM, row_parts
from tvm_fusion.kernel import build_kernel
from tvm_fusion.tuner import build_module

torch = torch_or_none()
CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
NAME = "cross_entropy_grad_row_in_cluster"
CANDIDATE = registry.get(NAME)


# -- the parts and where the candidate applies ----------------------------------------
@pytest.mark.parametrize("classes, dtype, parts", [
    (128256, "bfloat16", 4), (151936, "bfloat16", 4), (256000, "bfloat16", 8), (128256, "float32", 8),
    (65536, "float16", 2), (32000, "float32", 2),
    (200000, "float32", 8),  # 781 KB: past 8 parts of 75 KB, so 8 of 98 KB
])
def test_parts_are_the_fewest_equal_whole_chunks_that_fit(classes, dtype, parts):
    assert row_parts(grad_problem((4, classes), dtype)) == parts


@pytest.mark.parametrize("shape, dtype, parts", [
    ((128, 32000), "float16", 4), ((64, 32000), "bfloat16", 8),  # the fewest that give 512 blocks
    ((200, 1000), "float16", 5),  # 125 chunks: 5 parts of 25 cut them equally, no fewer do
    ((4, 4096), "float32", 8),    # never 512 blocks: the most parts
    ((4096, 32000), "float16", 2), ((256, 32000), "float16", 2),  # enough rows: the fewest parts
])
def test_short_rows_are_cut_to_spread_a_few_rows_over_the_gpu(shape, dtype, parts):
    assert row_parts(grad_problem(shape, dtype)) == parts


@pytest.mark.parametrize("classes, dtype", [(50257, "bfloat16"), (4000000, "float32"), (38, "float32")])
def test_parts_name_a_row_they_cannot_cut(classes, dtype):
    with pytest.raises(ValueError, match="fused_parts cuts a row into 2 to 8 equal parts"):
        row_parts(grad_problem((4, classes), dtype))


@pytest.mark.parametrize("shape, dtype, options, applies", [
    ((8192, 128256), "bfloat16", {}, True),
    ((16, 32000), "float32", {"weight": True, "label_smoothing": 0.1}, True),  # 125 KB
    ((4096, 32000), "float16", {}, False),      # 62.5 KB: one block's shared memory holds the row
    ((128, 32000), "float16", {}, True),        # ... but 128 rows leave SMs idle: the rows cut to spread them
    ((256, 32000), "float16", {}, False),       # 256 rows: two parts a row would be all it adds
    ((16384, 50257), "bfloat16", {}, False),    # odd V: no equal parts of whole chunks
    ((8192, 128256), "bfloat16", {"in_place": True}, True),
])
def test_applies_to_rows_past_one_blocks_shared_memory(shape, dtype, options, applies):
    assert CANDIDATE.applies(grad_problem(shape, dtype, **options)) == applies
    assert not CANDIDATE.applies(tf.make_problem("cross_entropy_grad", shape, dtype, mode="from_lse"))


@pytest.mark.parametrize("shape, dtype, picked", [
    ((4096, 151936), "bfloat16", True), ((2048, 256000), "bfloat16", True), ((1024, 128256), "float32", True),
    ((4096, 128256), "bfloat16", True),   # 250.5 KiB: faster than head_in_shared since the barrier lost its fences
    ((16384, 65536), "float16", False),   # 128 KiB: head_in_shared faster
    ((64, 151936), "bfloat16", False),    # fewer rows than SMs: untimed
])
def test_dispatch_picks_it_for_rows_past_240_kib(shape, dtype, picked):
    problem = grad_problem(shape, dtype)
    assert CANDIDATE.prefers(problem, CUDA) == picked
    in_place = grad_problem(shape, dtype, in_place=True)
    assert CANDIDATE.prefers(in_place, CUDA) == picked  # the docstring's in-place H100 times
    if picked:  # no shipped record for these shapes, and the cost model was trained before it
        assert tf.dispatch.choose(problem, CUDA).candidate == NAME
        assert tf.dispatch.choose(in_place, CUDA).candidate == NAME


def test_the_shipped_record_of_8192x128256_names_it():
    """Rows of 250.5 KiB prefer it, and the shipped record of 8192x128256 bf16 (the H200
    tune of 2026-12-06) names it at tuned knobs, out of place and in place (the in-place
    problem reapplies the out-of-place record)."""
    for in_place in (False, True):
        problem = grad_problem((8192, 128256), "bfloat16", in_place=in_place)
        assert CANDIDATE.prefers(problem, CUDA)
        choice = tf.dispatch.choose(problem, CUDA)
        assert choice.source.startswith("record") and choice.candidate == NAME
        assert str(choice.knobs) == "threads=256,vector=8,unroll=4"


def test_needs_thread_block_clusters():
    assert CANDIDATE.unsupported(CUDA) == ""
    assert "sm_90" in CANDIDATE.unsupported(targets.resolve({"kind": "cuda", "arch": "sm_80"}))
    assert NAME in schedules.DISPATCH_ORDER[("cross_entropy_grad", "cuda")]


# -- the decomposition ----------------------------------------------------------------
@pytest.mark.parametrize("reduction, weighted, smoothing", OPTION_TUPLES)
@pytest.mark.parametrize("dtype, shape", [("float32", (9, 40)), ("float16", (7, 64)), ("float16", (5, 48))])
def test_decomposition_matches_the_reference(dtype, shape, reduction, weighted, smoothing):
    gen = rng()
    logits, target, weight = case(gen, *shape, dtype, weighted=weighted)
    target[1] = -100
    problem = problem_for(logits, target, weight, reduction, smoothing, "fused")
    inputs, dloss = kernel_inputs(problem, gen, logits, target, weight)
    outs = run_unscheduled(prim_func(problem, PARTS_ALGORITHM), inputs)
    check_grad(outs["dlogits"], logits, target, weight, reduction, smoothing, dloss, dtype, what=PARTS_ALGORITHM)
    check_forward(outs, logits, target, weight, reduction, smoothing)


# -- the generated CUDA ---------------------------------------------------------------
CODEGEN_CASES = [((8192, 128256), "bfloat16", {}), ((16, 32000), "float32", {"weight": True, "label_smoothing": 0.1}),
                 ((64, 65536), "float16", {"reduction": "none"}), ((2048, 256000), "bfloat16", {"reduction": "sum"}),
                 ((32768, 151936), "bfloat16", {}),  # past 2^31 elements
                 ((128, 32000), "float16", {}), ((200, 1000), "float16", {"weight": True})]  # short rows cut


@pytest.mark.parametrize("shape, dtype, options", CODEGEN_CASES, ids=str)
def test_cuda_source_has_a_part_a_block_and_one_cluster_barrier(shape, dtype, options):
    problem = grad_problem(shape, dtype, **options)
    parts = row_parts(problem)
    source = build_kernel(problem, CUDA, NAME).device_source()
    row = row_kernel(source)
    # The part copied into shared memory 16 bytes a lane, as cp.async (tvm_fusion.async_copy)
    # waited for before the barrier; the last step's lanes bounded by the part.
    assert re.search(r"ptx_cp_async_legacy_cg_16_\d+_\d+\(logits_parts_shared_dyn_ptr, [^;]*logits_ptr[, []", row)
    assert "wait_all();" in row
    # One barrier (its asm clobbering memory, no fence beside it), under no condition, between the parts' pairs
    # stored and loaded back.
    assert row.count(grid_barrier.CLUSTER_SYNC_CALL) == 1 and "grid_sync" not in row
    at = row.index(grid_barrier.CLUSTER_SYNC_CALL)
    check_cluster_barrier(source, row)
    stored = [m.start() for m in re.finditer(r"\bpart_online_v[01]_ptr\[[^\]]*\] =", row)]
    loaded = [m.start() for m in re.finditer(r"\bpart_online_v[01]_ptr\[", row) if m.start() not in stored]
    assert stored and loaded and max(stored) < at < min(loaded)
    assert row[:at].count("{") - row[:at].count("}") == 1, "the barrier under a condition"
    # The gradient stored 16 bytes at a time, every store inside its own part: a lane's
    # vector index against the part's vector count, never the row's or the tensor's.
    stores = re.findall(r"if \(([^{]*)\) \{\s*\*\((?:uint4|float4)\*\)\(dlogits_ptr \+", row)
    bare = re.findall(r"\n\s*\*\((?:uint4|float4)\*\)\(dlogits_ptr \+", row)
    assert stores or bare
    for guard in stores:
        assert "blockIdx" not in guard, guard
    # lse and the row loss: one store each, by thread 0 of the row's first block (casts
    # dropped: past 2^31 elements the indices are int64_t).
    plain = re.sub(r"\((?:int|int64_t)\)", "", row)
    first = re.compile(rf"if \(+blockIdx\.x\) (& {parts - 1}|% {parts})\) < 1\) && \(\(threadIdx\.x\) < 1\)\) \{{")
    loss = "loss" if problem.reduction == "none" else "row_loss"
    at = plain.index(grid_barrier.CLUSTER_SYNC_CALL)
    for name in ("lse", loss):
        found = [m.start() for m in re.finditer(rf"\b{name}_ptr\[[^\]]*\] =", plain)]
        assert len(found) == 1 and found[0] > at, name
        guards = [m.end() for m in first.finditer(plain, 0, found[0])]
        inside = plain[guards[-1]:found[0]] if guards else "}"
        assert inside.count("{") >= inside.count("}"), name


@pytest.mark.parametrize("shape, dtype", [((8192, 128256), "bfloat16"), ((16, 32000), "float32")], ids=str)
def test_in_place_the_logits_are_read_before_the_barrier_and_written_after(shape, dtype):
    """In place, the row loss's target logit is read first, by the row's first block only,
    the part's copy before the barrier too, and every store of the gradient (over the
    logits) after it; no ``__restrict__``."""
    problem = grad_problem(shape, dtype, in_place=True)
    source = build_kernel(problem, CUDA, NAME).device_source()
    assert "__restrict__" not in source
    row = row_kernel(source)
    at = row.index(grid_barrier.CLUSTER_SYNC_CALL)
    reads = [m.start() for m in re.finditer(r"[^d]logits_ptr[ \[]", row)]
    stores = [m.start() for m in re.finditer(r"\(dlogits_ptr \+", row)]
    assert reads and stores and max(reads) < at < min(stores)
    target_read = re.search(r"logits_ptr\[[^\]]*target_ptr", row)
    plain = re.sub(r"\((?:int|int64_t)\)", "", row[:target_read.start()])
    guard = rf"if \(+blockIdx\.x\) (& {row_parts(problem) - 1}|% {row_parts(problem)})\) < 1\) \{{"
    assert re.search(guard, plain), "the target logit read by the row's first block only"


def test_the_row_kernel_alone_is_launched_in_clusters_of_its_parts():
    problem = grad_problem((8192, 128256), "bfloat16")
    kernel = build_kernel(problem, CUDA, NAME)
    text = "".join(f.script() for f in lowered(kernel, problem).functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    launches = re.findall(r'T.launch_thread\("(blockIdx.x|clusterCtaIdx.x)", (\d+)\)', text)
    assert ("clusterCtaIdx.x", "4") in launches and [n for n, _ in launches].count("clusterCtaIdx.x") == 1
    assert launches[launches.index(("clusterCtaIdx.x", "4")) - 1] == ("blockIdx.x", str(8192 * 4))
    assert grid_barrier.COOPERATIVE not in text


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.parametrize("shape, dtype, options", CODEGEN_CASES[:3] + CODEGEN_CASES[5:], ids=str)
def test_ptx_vector_loads_shuffles_no_spills(shape, dtype, options):
    check_ptx_vector_loads_shuffles_no_spills(build_kernel(grad_problem(shape, dtype, **options), CUDA, NAME))


def test_every_knob_config_builds():
    problem = grad_problem((16, 128256), "float16", weight=True, label_smoothing=0.1)
    for knobs in CANDIDATE.all_configs(problem, CUDA):
        assert grid_barrier.CLUSTER_SYNC_CALL in build_kernel(problem, CUDA, NAME, knobs).device_source(), knobs


def test_its_choice_is_read_back_from_the_store_that_takes_over_dlogits():
    """The schedule inlines ``dlogits`` (the gather), the block that carries a choice's
    annotations; it writes them on the map's store too, where ``registry.annotated_choice``
    (the tuner's and the records' reader) finds them."""
    problem = grad_problem((64, 128256), "bfloat16")
    knobs = CANDIDATE.knobs(threads=256, vector=8, unroll=4)
    sch = CANDIDATE.apply(prim_func(problem, PARTS_ALGORITHM), CUDA, knobs=knobs)
    assert registry.annotated_choice(sch, "cross_entropy_grad") == (NAME, knobs)
    bare = tvm.s_tir.Schedule(prim_func(tf.make_problem("bn_stats", (2, 3, 4, 4), "float32"), "shifted"))
    with pytest.raises(ValueError, match="expected one block carrying the choice of a scheduled cross_entropy_grad"):
        registry.annotated_choice(bare, "cross_entropy_grad")


def test_tuners_build_launches_in_clusters_too():
    problem = grad_problem((64, 128256), "bfloat16")
    sch = tvm.s_tir.Schedule(prim_func(problem, PARTS_ALGORITHM))
    CANDIDATE.apply_to(sch, problem, CUDA, tunable=True)
    with CUDA:
        built = build_module(sch.mod, CUDA)
    assert grid_barrier.CLUSTER_SYNC_CALL in built.imports[0].inspect_source()


# -- on the GPU -----------------------------------------------------------------------
GPU_SHAPES = [((16, 32000), "float32"), ((8, 128256), "bfloat16"), ((24, 65536), "float16"),
              ((4, 256000), "bfloat16"), ((8192, 128256), "bfloat16"), ((4096, 151936), "float16"),
              ((256, 128256), "float32"),
              # short rows cut to spread a batch of few rows (row_parts: P = 4, 8, 5, 8)
              ((128, 32000), "float16"), ((64, 32000), "bfloat16"), ((200, 1000), "float16"), ((32, 4096), "float32")]


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
@pytest.mark.parametrize("shape, dtype", GPU_SHAPES[:4], ids=str)
def test_correct_on_gpu_every_option(shape, dtype, options):
    options = gpu_options(options)
    problem = gpu_problem(shape, options, dtype, "fused")
    check_on_device(problem, options, build_kernel(problem, targets.resolve("cuda"), NAME), "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("shape, dtype", GPU_SHAPES, ids=str)
def test_correct_on_gpu_sampled_knobs(shape, dtype):
    options = {"weight": True, "label_smoothing": 0.1}
    problem = gpu_problem(shape, options, dtype, "fused")
    target = targets.resolve("cuda")
    for knobs in default_and_sampled(CANDIDATE, problem, target, 3):
        check_on_device(problem, options, build_kernel(problem, target, NAME, knobs), "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
def test_all_ignored_batch_and_nan_rows_on_gpu():
    """A batch with every row ignored (mean: NaN loss and gradient, as torch) and rows
    holding NaN or +inf (in a row's first, inner and last part), whose gradient is NaN on
    the whole row (every part) as torch's."""
    x = (torch.randn(64, 65536, device="cuda") * 2).half()
    x[3, 17], x[9, 65535], x[12, 40000] = float("nan"), float("inf"), float("inf")
    t = torch.randint(0, 65536, (64,), device="cuda")
    kernel = build_kernel(grad_problem((64, 65536), "float16"), targets.resolve("cuda"), NAME)
    check_nan_rows_and_all_ignored(kernel, x, t)
