"""folded_prologue: the gradient's targets pass run by its row kernel's blocks.

* The generated CUDA (no GPU needed), the pass switched on: one launch fewer for the
  mean, sum and "none" on 65536 x 1000; for the mean the chunk claims, the flag set by
  the final block, the wait placed after the row statistics and before the first read
  of the denominator, the reset in the loss stage; no wait for the sum; the same
  registers and no spills (nvcc); unchanged where the pass does not apply (a one-block
  targets pass) or is off.
* ``gpu``-marked: the folded kernels against torch autograd in float64 with poisoned
  outputs, called again and again (the counters left at 0 for the next call), on two
  streams and replayed in a CUDA graph, with a bad target and with every row ignored.
"""

from __future__ import annotations

import re

import pytest
import tvm
import tvm_ffi

from helpers import has_gpu, torch_or_none
from test_cross_entropy_grad import check_on_device, gpu_problem, row_kernel
from test_dependent_launch import cross_entropy_training_step, on_two_streams_and_in_a_graph
from tvm_fusion import dispatch, folded_prologue, records, single_launch, targets
from tvm_fusion.codegen import cuda_report, nvcc_path
from tvm_fusion.contracts import cross_entropy_grad_problem

torch = torch_or_none()
CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\([^)]*\) \{')
FLAG = rf"launch_counter_ptr\[{folded_prologue.FLAG}\]"
CLAIMS = rf"atomicAdd\(\(&\(launch_counter_ptr\[{folded_prologue.A_NEXT}\]\)\), 1\)"


@pytest.fixture
def folded(monkeypatch):
    monkeypatch.setattr(folded_prologue, "ENABLED", True)
    records.invalidate()
    yield
    records.invalidate()


def bodies(source: str) -> list[str]:
    """Each kernel's definition, in order."""
    starts = [m.start() for m in KERNEL.finditer(source)]
    return [source[a:b] for a, b in zip(starts, [*starts[1:], len(source)])]


def gradient(shape, dtype, **options):
    problem = cross_entropy_grad_problem(shape, dtype, mode="fused", **options)
    return dispatch.kernel_for(problem, CUDA)


def test_mean_is_two_launches_and_waits_after_the_statistics(folded):
    kernel = gradient((65536, 1000), "float16")
    assert kernel.candidate == "cross_entropy_grad_warp_per_row_padded"
    rows, loss = bodies(kernel.device_source())
    # the targets pass and its final block inside the row kernel, its stores there
    assert "first_bad_row_ptr[0] = " in rows and "denom_ptr[0] = " in rows
    assert len(re.findall(CLAIMS, rows)) == 4, "claims at a block's start and at its wait, each before and in the loop"
    assert len(re.findall(rf"atomicExch\(\(&\({FLAG}\)\), 1\)", rows)) == 2
    spin = re.search(rf"if \(!\(\(__ldcv\(\(&\({FLAG}\)\)\) == 0\)\)\) \{{ break; \}}\s*__nanosleep\(", rows)
    assert spin, "lane 0 waits on the flag"
    # the wait comes after the row's statistics (its loads, its sum's broadcast shuffle)
    # and before the first read of the denominator
    reads = [m.start() for m in re.finditer(r"denom_ptr\[0\] ==", rows)]
    assert reads and min(reads) > spin.end()
    assert rows.find("*(uint4*)(logits_ptr") < rows.find("__shfl_sync(") < spin.start()
    # the loss stage (the next launch) resets the claims and the flag
    assert f"launch_counter_ptr[{folded_prologue.A_NEXT}] = 0;" in loss and f"launch_counter_ptr[{folded_prologue.FLAG}] = 0;" in loss
    assert f"launch_counter_ptr[{folded_prologue.A_DONE}] = 0;" in rows


@pytest.mark.parametrize("reduction, launches", [("sum", 2), ("none", 1)])
def test_sum_and_none_fold_without_a_wait(folded, reduction, launches):
    kernel = gradient((65536, 1000), "bfloat16", reduction=reduction)
    parts = bodies(kernel.device_source())
    assert len(parts) == launches and kernel.launches() == launches
    rows = parts[0]
    assert "__ldcv" not in rows and "__nanosleep" not in rows and not re.search(CLAIMS, rows)
    assert "if (((int)blockIdx.x) < 64) {" in rows and "first_bad_row_ptr[0] = " in rows


def test_off_or_not_applicable_leaves_the_launches(folded, monkeypatch):
    small = bodies(gradient((4096, 1000), "float16").device_source())  # one-block targets pass: not folded
    assert not any("__ldcv" in body or "fold_" in body for body in small)
    monkeypatch.setattr(folded_prologue, "ENABLED", False)
    records.invalidate()
    plain = gradient((65536, 1000), "float16")
    assert plain.launches() == 3 and "fold_" not in plain.device_source()


def test_counters_are_long_enough_for_every_slot():
    assert single_launch.COUNTER_INTS == folded_prologue.COUNTER_INTS > folded_prologue.FLAG
    assert len({folded_prologue.A_NEXT // 32, folded_prologue.A_DONE // 32, folded_prologue.FLAG // 32, 0}) == 4
    counter = single_launch.tvm_counter(tvm.cpu())
    assert counter.shape == (folded_prologue.COUNTER_INTS,) and not counter.numpy().any()


def test_calls_on_tvm_tensors_take_a_counter_per_stream():
    """Two streams' calls at once must not share a counter (a folded loss stage resets the
    flag another call's blocks wait on): TVM tensors' counters follow TVM's current stream."""
    device = tvm.cpu()
    first = single_launch.tvm_counter(device)
    with tvm_ffi.use_raw_stream(device, 0x5EED):
        other = single_launch.tvm_counter(device)
        assert other is single_launch.tvm_counter(device)
    assert other is not first and single_launch.tvm_counter(device) is first


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_row_kernel_keeps_its_registers_and_spills_nothing(folded, monkeypatch):
    report = cuda_report(gradient((65536, 1000), "float16"))
    monkeypatch.setattr(folded_prologue, "ENABLED", False)
    records.invalidate()
    plain = cuda_report(gradient((65536, 1000), "float16"))
    assert not any(report.spill_bytes.values()), report.spill_bytes
    assert max(report.registers.values()) == max(plain.registers.values()), (report.registers, plain.registers)


# -- on the GPU ---------------------------------------------------------------------------
CASES = [((65536, 1000), "float16", {}), ((65536, 1000), "bfloat16", {"reduction": "sum"}),
         ((65536, 1000), "float32", {"reduction": "none"}),
         ((50000, 1000), "float16", {"weight": True, "label_smoothing": 0.1}),
         ((32768, 1000), "bfloat16", {"all_ignored": True})]


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("shape, dtype, options", CASES)
def test_folded_kernel_equals_float64_call_after_call(folded, shape, dtype, options):
    problem = gpu_problem(shape, options, dtype, "fused")
    kernel = dispatch.kernel_for(problem, targets.resolve("cuda"))
    assert "fold_" in kernel.device_source(), kernel.candidate
    for _ in range(3):  # fresh data each call: a counter left set would skip or hang the next
        check_on_device(problem, options, kernel, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
def test_folded_kernel_flags_a_bad_target(folded):
    from test_cross_entropy_grad import run_on_device

    problem = gpu_problem((65536, 1000), {}, "float16", "fused")
    kernel = dispatch.kernel_for(problem, targets.resolve("cuda"))
    logits = torch.randn(problem.shape, device="cuda").half()
    for bad_row in (40000, 7):
        target = torch.randint(0, 1000, (problem.batch,), device="cuda")
        target[bad_row] = 1000
        target[bad_row + 5] = -3
        outs = run_on_device(kernel, [logits, target], "cuda")
        assert outs["first_bad_row"].item() == bad_row
        assert outs["denom"].item() == problem.batch - 2


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
def test_folded_training_step_on_two_streams_and_in_a_graph(poisoned, folded):
    shape = (65536, 1000)
    assert "fold_" in gradient(shape, "float16").device_source()
    on_two_streams_and_in_a_graph(*cross_entropy_training_step(shape, "float16"))
