"""cross_entropy_split_row: few rows, each row's online pass cut into parts across blocks,
the fold and the batch run by the last block (one launch).

Here: where it applies and dispatch prefers it, its default parts, its CUDA (one kernel, one ticket, a block a
(row, part), 16-byte loads of aligned rows, the parts' pairs in workspace buffers), every
knob configuration and the tuner's sampled space build. On the GPU: against the float64
reference on NaN-poisoned outputs, three calls on one launch counter (test_gpu's
candidate sweep covers it on its cross entropy shapes too)."""

import re

import pytest

import tvm_fusion as tf
from helpers import has_gpu, torch_or_none
from test_cuda_codegen import TICKET
from tvm_fusion import dispatch, registry, targets
from tvm_fusion.codegen import cuda_report, nvcc_path
from tvm_fusion.kernel import build_kernel
from tvm_fusion.schedules.cuda import cross_entropy_split_row as split_row

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
NAME = "cross_entropy_split_row"
CANDIDATE = registry.get(NAME)
torch = torch_or_none()

CASES = [((128, 32000), "float16", {}), ((4, 50257), "float16", {}), ((1, 32000), "float32", {}),
         ((128, 32000), "bfloat16", {"reduction": "none"}),
         ((96, 5000), "float32", {"reduction": "sum", "weight": True, "label_smoothing": 0.1}),
         ((512, 1001), "float16", {"reduction": "sum"}),
         # medium rows (dispatch's since d3e5d23: parts of about 16 KiB), with options
         ((8, 32000), "bfloat16", {"reduction": "sum", "weight": True, "label_smoothing": 0.1}),
         ((2, 65536), "float32", {"reduction": "none"}), ((48, 50257), "float16", {"label_smoothing": 0.05})]


def problem(shape, dtype, options):
    return tf.make_problem("cross_entropy", shape, dtype, **options)


def test_applies_to_few_rows_only():
    assert CANDIDATE.applies(problem((split_row.MAX_ROWS, 1000), "float16", {}))
    assert not CANDIDATE.applies(problem((split_row.MAX_ROWS + 1, 1000), "float16", {}))
    assert not CANDIDATE.applies(problem((4, 24), "float16", {}))  # 3 chunks: no two parts of two


@pytest.mark.parametrize("shape, dtype, preferred", [
    ((16, 128256), "bfloat16", True),    # H100: 7.73 us against 10.62 for the pick before
    ((64, 151936), "bfloat16", True),    # 14.51 against 17.73
    ((8, 256000), "bfloat16", True),     # 9.11 against 24.74
    ((1, 128256), "float32", True),      # 501 KiB: parts of 32 KiB, the rule's one row
    ((66, 128256), "bfloat16", True),    # half a row an SM of 132
    ((67, 128256), "bfloat16", False),   # more rows: a block a row fills more of the GPU
    ((128, 151936), "bfloat16", False),  # 21.34 against 20.19: loses
    ((128, 32000), "float16", False),    # 64 KB rows: loses at every split
    ((1, 32000), "float32", False),      # 125 KiB, one row: loses at every split
    # Medium rows, 60-240 KiB, 2 to 49 rows on 132 SMs (H100, the docstring's second table):
    ((4, 50257), "float16", True),       # 98 KiB: 6.55 us at 8 parts against 7.07 (aligned rows)
    ((4, 50257), "bfloat16", True),      # 6.18 against 7.16
    ((8, 32000), "float16", True),       # 62.5 KiB: 5.31 against 5.98
    ((2, 65536), "bfloat16", True),      # 4.73 against 7.82
    ((48, 32000), "bfloat16", True),     # 5.71 against 6.40
    ((49, 32000), "bfloat16", True),     # 0.375 a SM: 49.5 rows
    ((50, 32000), "bfloat16", False),
    ((64, 50257), "bfloat16", False),    # 9.69 against 8.43: loses
    ((1, 50257), "float32", False),      # one row
    ((1, 32000), "float16", False),      # one row: 4.90 against 4.29
    ((16, 15000), "float32", False),     # 58.6 KiB: under 60
])
def test_dispatch_prefers_it_for_few_rows_of_60_kib_and_more_over_the_cost_model(shape, dtype, preferred):
    """Preferred where the H100 A/B found it faster (the module's table), and dispatch
    takes it there although the shipped cost model, trained before it, ranks others."""
    p = problem(shape, dtype, {})
    assert CANDIDATE.prefers(p, CUDA) == preferred
    choice = dispatch.choose(p, CUDA)
    assert (choice.candidate == NAME) == preferred, choice
    if preferred:
        assert choice.source == "heuristic" and "trained without cross_entropy_split_row" in choice.reason
        assert choice.knobs == CANDIDATE.default_for(p, CUDA)
        assert tf.build("cross_entropy", shape, dtype, target=CUDA).candidate == NAME


@pytest.mark.parametrize("shape, dtype, splits, threads", [
    ((16, 128256), "bfloat16", 8, 256),   # 250 KiB: 8 parts of 31 KiB, the A/B's best
    ((64, 151936), "bfloat16", 8, 256),   # 297 KiB: 8 (37 KiB), the best; 16 parts 13% slower
    ((32, 256000), "bfloat16", 16, 256),  # 500 KiB: 16 (31 KiB), the best
    ((8, 256000), "bfloat16", 16, 256),   # the best; 32 parts 4% slower
    ((4, 50257), "float16", 8, 256),      # 98 KiB: 8 parts of 12 KiB (medium rows: about 16 KiB)
    ((16, 100000), "float16", 16, 256),   # 195 KiB: 16 parts of 12 KiB
    ((8, 32000), "float16", 4, 256),      # 62.5 KiB: 4 parts of 16 KiB, the A/B's best
    ((512, 1001), "float16", 2, 128),     # a short row: the fewest parts
])
def test_default_parts_hold_about_32_kib_or_16_on_medium_rows(shape, dtype, splits, threads):
    knobs = CANDIDATE.default_for(problem(shape, dtype, {}), CUDA)
    assert (knobs.splits, knobs.threads) == (splits, threads)


@pytest.mark.parametrize("shape, dtype, options", CASES, ids=lambda c: str(c))
def test_one_launch_a_block_a_part_then_the_last_block_folds(shape, dtype, options):
    p = problem(shape, dtype, options)
    kernel = build_kernel(p, CUDA, NAME)
    source = kernel.device_source()
    assert kernel.launches() == 1 and len(re.findall(TICKET, source)) == 1
    blocks = int(re.search(r"launch_ticket == (\d+)\)", source).group(1)) + 1
    assert blocks == shape[0] * kernel.knobs.splits
    assert {name for name, _, _ in kernel.workspace} >= {"row_online_v0_rf", "row_online_v1_rf"}
    own, _, last_block = source.partition("__threadfence();")
    assert_lanes_reduce_across_threads(own)
    assert last_block.count("__syncthreads();") >= 1, "the fold, a barrier, then the batch"
    if shape[1] * tf.contracts.common.DTYPE_BYTES[dtype] % 16 == 0:
        assert re.search(r"\*\((uint4|float4)\*\)\(logits_ptr", own), "16-byte loads of aligned rows"


def assert_lanes_reduce_across_threads(own: str) -> None:
    """Kernel 1 (``own``: the source before the fence) reduces a part's chunks as a
    cross-thread reduction: each lane's pair in registers, then shuffles, then one store
    of the part's pair. Where TVM did not lower it (a part guarded by the row's end as
    well as its own step, before ``split_online``), every lane read-modify-wrote the pair
    in global memory with no shuffle: wrong losses on an H100 wherever the parts did not
    divide the row's chunks."""
    assert "in_thread_row_online_v0_rf" in own, "each lane's pair in registers first"
    assert "__shfl_down_sync" in own, "a part's lanes combine through shuffles"
    stores = re.findall(r"(?<!\w)row_online_v0_rf_ptr\[[^\]]*\] = ", own)
    assert len(stores) == 1, f"one store of the part's pair, found {len(stores)}"


@pytest.mark.parametrize("shape, dtype, options", CASES[:3], ids=lambda c: str(c))
def test_every_knob_config_builds_as_one_launch(shape, dtype, options):
    """(4, 50257) fp16 has 6283 chunks a row, which no split divides: the padded chunks
    of ``split_online`` make every part exact."""
    p = problem(shape, dtype, options)
    for knobs in CANDIDATE.all_configs(p, CUDA):
        kernel = build_kernel(p, CUDA, NAME, knobs)
        assert kernel.launches() == 1, knobs
        assert_lanes_reduce_across_threads(kernel.device_source().partition("__threadfence();")[0])


def test_tunable_space_builds():
    import tvm
    from tvm import s_tir

    from tvm_fusion.compute import prim_func
    from tvm_fusion.kernel import compiled_form

    p = problem((128, 32000), "bfloat16", {})
    for seed in (1, 2, 3):
        sch = s_tir.Schedule(prim_func(p, CANDIDATE.algorithm), seed=seed)
        CANDIDATE.apply_to(sch, p, CUDA, tunable=True)
        with CUDA:
            assert tvm.compile(compiled_form(sch.mod, p), target=CUDA) is not None


@pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc")
def test_ptx_has_no_spills():
    report = cuda_report(build_kernel(problem((128, 32000), "float16", {}), CUDA, NAME))
    assert report.vector_loads > 0 and report.shuffles > 0
    assert not any(report.spill_bytes.values()) and not any(report.stack_bytes.values()), report


# -- on the GPU -----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("shape, dtype, options", CASES, ids=lambda c: str(c))
def test_split_rows_match_float64_call_after_call(shape, dtype, options):
    from test_gpu import assert_ce_kernel_correct, ce_data

    p = problem(shape, dtype, options)
    kernel = build_kernel(p, targets.resolve("cuda"), NAME)
    for _ in range(3):  # one counter: each call's last block must reset it
        ce_data.cache_clear()
        assert_ce_kernel_correct(kernel, shape, tuple(sorted(options.items())), dtype)
