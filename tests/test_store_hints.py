"""tvm_fusion.store_hints: the large cross entropy gradients' scalar stores evict-first.

CPU: the generated CUDA of the fused gradient of rows off the 16-byte grid (16384x50257
bf16: ``cross_entropy_grad_online``'s 2-byte stores) writes every ``dlogits`` value
through ``__stcs``, and nvcc makes them ``st.global.cs``; a gradient under the size
threshold, the 16-byte stores of rows on the grid, the backward from the saved lse, LLVM
builds and the A/B switch keep plain stores. GPU (marked, skipped without one): hinted
kernels of each dtype and option set and the in-place op against float64 torch on
poisoned outputs.
"""

from __future__ import annotations

import re
import subprocess

import pytest

import tvm_fusion as tf
from helpers import has_gpu, rng, torch_or_none
from test_cross_entropy_grad import check_on_device, gpu_problem
from tvm_fusion import dispatch, registry, store_hints, targets
from tvm_fusion.codegen import nvcc_path
from tvm_fusion.kernel import build_kernel

torch = torch_or_none()
CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
PLAIN_STORE = re.compile(r"dlogits_ptr\[[^;]*\] = ")


def grad_problem(shape, dtype, **options):
    options.setdefault("mode", "fused")
    return tf.make_problem("cross_entropy_grad", shape, dtype, **options)


@pytest.mark.parametrize("shape, dtype, options", [
    ((16384, 50257), "bfloat16", {}), ((16384, 50257), "bfloat16", {"in_place": True}),
    ((3000, 50257), "float16", {"weight": True, "label_smoothing": 0.1}),
    ((700, 50257), "float32", {"reduction": "none"}),
])
def test_every_scalar_store_of_a_large_gradient_is_evict_first(shape, dtype, options):
    source = dispatch.kernel_for(grad_problem(shape, dtype, **options), CUDA).device_source()
    assert "__stcs((&(dlogits_ptr[" in source
    assert not PLAIN_STORE.search(source), "a plain store of the gradient is left"


@pytest.mark.parametrize("problem", [grad_problem((16384, 50257), "bfloat16"), grad_problem((2048, 50257), "float32")],
                         ids=lambda p: p.key())
def test_every_candidate_the_tuner_may_pick_stores_the_large_gradient_evict_first(problem):
    names = [cand.name for cand in registry.applicable(problem, CUDA)]
    assert "cross_entropy_grad_online" in names and len(names) >= 2
    for name in names:
        source = build_kernel(problem, CUDA, name).device_source()
        assert "__stcs((&(dlogits_ptr[" in source and not PLAIN_STORE.search(source), name


def test_the_online_gradient_of_odd_rows_stores_all_its_unrolled_steps_evict_first():
    problem = grad_problem((16384, 50257), "bfloat16")
    kernel = build_kernel(problem, CUDA, "cross_entropy_grad_online")  # the tuner's to pick since granules_in_shared
    assert kernel.device_source().count("__stcs(") == -(-problem.classes // kernel.knobs.threads)  # 50 steps


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_nvcc_emits_streaming_stores(tmp_path):
    source = tmp_path / "k.cu"
    source.write_text(build_kernel(grad_problem((3000, 50257), "float16"), CUDA, "cross_entropy_grad_online").device_source())
    ptx = tmp_path / "k.ptx"
    subprocess.run([nvcc_path(), "-arch=sm_90", "-ptx", str(source), "-o", str(ptx)], check=True, capture_output=True)
    assert len(re.findall(r"st\.global\.cs\.[bu]16", ptx.read_text())) == 50


@pytest.mark.parametrize("problem", [
    grad_problem((64, 50257), "bfloat16"),  # 6.4 MB: stays as it is, its reader may find it in L2
    grad_problem((8192, 128256), "bfloat16"),  # 16-byte stores
    grad_problem((4096, 32000), "float16"),
    grad_problem((16384, 50257), "bfloat16", mode="from_lse"),  # one read of each row: nothing to keep in L2
    grad_problem((16384, 50257), "bfloat16", mode="from_lse", reduction="none"),  # dloss (B,), not 0-d
], ids=lambda p: p.key())
def test_small_gradients_vector_stores_and_the_backward_from_lse_stay_plain(problem):
    assert "__stcs" not in dispatch.kernel_for(problem, CUDA).device_source()


def test_llvm_builds_and_the_switch_keep_plain_stores(monkeypatch):
    problem = grad_problem((1400, 50257), "bfloat16")
    assert problem.batch * problem.classes * 2 >= store_hints.MIN_BYTES
    cpu = targets.resolve("llvm")
    llvm_ir = build_kernel(problem, cpu, dispatch.choose(problem, cpu).candidate).executable.mod.inspect_source("ll")
    assert "dlogits" in llvm_ir and "stcs" not in llvm_ir
    # build_kernel, whose cache keys the switch (dispatch.kernel_for's keeps its first build)
    choice = dispatch.choose(problem, CUDA)
    monkeypatch.setattr(store_hints, "ENABLED", False)
    assert "__stcs" not in build_kernel(problem, CUDA, choice.candidate, choice.knobs).device_source()
    monkeypatch.setattr(store_hints, "ENABLED", True)
    assert "__stcs" in build_kernel(problem, CUDA, choice.candidate, choice.knobs).device_source()


# -- on the GPU ---------------------------------------------------------------------------
gpu = pytest.mark.skipif(torch is None or not has_gpu(), reason="needs a CUDA GPU and torch")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape, options, dtype, mode", [
    ((1400, 50257), {}, "bfloat16", "fused"),
    ((1400, 50257), {"weight": True, "label_smoothing": 0.1, "reduction": "none"}, "float16", "fused"),
    ((700, 50257), {"reduction": "sum"}, "float32", "fused"),
    ((1400, 50257), {"weight": True, "label_smoothing": 0.2, "reduction": "sum"}, "bfloat16", "fused"),
])
def test_hinted_kernels_on_gpu(shape, options, dtype, mode):
    problem = gpu_problem(shape, options, dtype, mode)
    kernel = dispatch.kernel_for(problem, targets.resolve("cuda"))
    assert "__stcs" in kernel.device_source()
    check_on_device(problem, options, kernel, "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_hinted_in_place_gradient_on_gpu(dtype):
    from test_torch import check_in_place, make_inputs

    logits, target, weight, kwargs = make_inputs(rng(), 1400, 50257, dtype, {}, device="cuda")
    check_in_place(logits, target, weight, kwargs, dtype)
