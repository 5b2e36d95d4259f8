"""tvm_fusion.async_copy: the copies of a row (or a part) into shared memory issued as
``cp.async``.

CPU: the generated CUDA of each marked candidate (the gradient's and the forward's
row_in_shared, the gradient's row_in_cluster, granules' window and head_in_shared's head,
the BatchNorm forward and backward on-chip parts) copies with ``cp.async.cg`` 16 bytes a lane, holds no synchronous global-to-shared
copy, and waits (``cp.async.wait_all``) before the first barrier after the copies; the
backward's two copies share one wait; nvcc compiles it to PTX with the asynchronous copies
and no spills; the pipelined candidates (their copies asynchronous by TVM's software
pipeline) are unchanged; scalar copies (2 bytes a lane) stay synchronous and build; the A/B switch
builds the synchronous copies. The kernels' results on the GPU are the candidates' own gpu
tests (test_cross_entropy_grad, test_ce_grad_cluster, test_bn_cluster,
test_bn_grid_persistent), which build with the copies asynchronous.
"""

from __future__ import annotations

import re

import pytest

import tvm_fusion as tf
from tvm_fusion import async_copy, targets
from tvm_fusion.codegen import cuda_report, nvcc_path
from tvm_fusion.kernel import build_kernel

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
# A synchronous 16-byte copy from a global buffer into shared memory, as TVM prints it.
SYNC_COPY = re.compile(r"\w+_shared_dyn_ptr[\[ +].*= \*\((?:uint4|float4|uint2|float2)\*\)\(\w+_ptr \+")
CALL = "ptx_cp_async_legacy_cg_"
WAIT = "tvm_builtin_ptx_cp_async_wait_all_async_wait_all();"


def ce_grad(shape, dtype, **options):
    return tf.make_problem("cross_entropy_grad", shape, dtype, mode="fused", **options)


CASES = [
    # row_in_shared's dispatched shape; a 16-byte row past 64 KB with options (weight,
    # smoothing: more buffers in the kernel); the forward's own copy of the row
    (ce_grad((4096, 32000), "float16"), "cross_entropy_grad_row_in_shared"),
    (ce_grad((512, 50304), "bfloat16", weight=True, label_smoothing=0.1), "cross_entropy_grad_row_in_shared"),
    (tf.make_problem("cross_entropy", (4096, 32000), "float16"), "cross_entropy_row_in_shared"),
    # row_in_cluster: a bf16 row in parts with its copy's last step bounded by the part;
    # fp32 (4 values a lane) in place
    (ce_grad((1024, 128256), "bfloat16"), "cross_entropy_grad_row_in_cluster"),
    (ce_grad((256, 151936), "float32", in_place=True), "cross_entropy_grad_row_in_cluster"),
    # rows off the 16-byte grid: the window of whole granules (granules_in_shared, the
    # dispatched 16384x50257 bf16); a row too long for shared memory: its head
    (ce_grad((16384, 50257), "bfloat16"), "cross_entropy_grad_granules_in_shared"),
    (ce_grad((8192, 128256), "bfloat16"), "cross_entropy_grad_head_in_shared"),
    # BatchNorm: the forward dispatch picks on ResNet's stage-1 shape, the grid-wide
    # forward with rounds (bf16), and the backward's two copies (x and dy)
    (tf.make_problem("bn_forward", (64, 256, 56, 56), "float16", training=True), "bn_forward_cluster_half_one_launch"),
    (tf.make_problem("bn_forward", (32, 64, 112, 112), "bfloat16", training=True), "bn_forward_grid_persistent"),
    (tf.make_problem("bn_backward", (64, 256, 56, 56), "float16"), "bn_backward_cluster"),
]


def kernel_body(source: str) -> str:
    """The body of the kernel (a definition, not a declaration) that copies asynchronously."""
    bodies = re.split(r'\nextern "C" __global__ ', source)[1:]
    found = [b for b in bodies if CALL in b.split("{", 1)[-1]]
    assert len(found) == 1, f"{len(found)} kernels call {CALL}"
    return found[0]


@pytest.mark.parametrize("problem, candidate", CASES, ids=lambda v: v if isinstance(v, str) else v.key())
def test_the_marked_copies_are_asynchronous_and_waited_for_before_the_barrier(problem, candidate):
    source = build_kernel(problem, CUDA, candidate).device_source()
    body = kernel_body(source)
    assert not SYNC_COPY.search(body), "a synchronous global-to-shared copy is left"
    lines = [line.strip() for line in body.splitlines()]
    copies = [i for i, line in enumerate(lines) if line.startswith(CALL)]
    waits = [i for i, line in enumerate(lines) if line == WAIT]
    barriers = [i for i, line in enumerate(lines) if line.startswith(("__syncthreads();", "tvm_fusion_cluster_sync"))
                or "barrier.cluster" in line]
    assert copies and waits
    # each copy waited for before the first barrier after it
    for copy in copies:
        wait = next(w for w in waits if w > copy)
        assert not any(copy < b < wait for b in barriers), lines[copy]
    if candidate.startswith("bn_backward"):  # x's and dy's copies, one wait after both
        assert len(waits) == 1 and waits[0] > max(copies)


def test_nvcc_compiles_the_asynchronous_copies_without_spills():
    if nvcc_path() is None:
        pytest.skip("needs nvcc")
    problem, candidate = CASES[3]
    report = cuda_report(build_kernel(problem, CUDA, candidate))
    assert "cp.async.cg.shared.global" in report.ptx and "cp.async.wait_all" in report.ptx
    # every kernel of the module (the targets pass, the rows, the loss stage) without spills
    assert len(report.spill_bytes) == len(report.kernels) >= 2, report
    assert not any(report.spill_bytes.values()), report.spill_bytes


def test_pipelined_candidates_and_scalar_copies_are_left_as_they_were():
    pipelined = tf.make_problem("bn_forward", (64, 256, 56, 56), "float16", training=True)
    source = build_kernel(pipelined, CUDA, "bn_forward_grid_pipelined").device_source()
    assert WAIT not in source  # TVM's pipeline waits with its own wait_group
    scalar = ce_grad((512, 50257), "bfloat16")  # V odd: 2 bytes a lane
    source = build_kernel(scalar, CUDA, "cross_entropy_grad_row_in_shared").device_source()
    assert CALL not in source and WAIT not in source
    # planes of 225 fp16 values: x's and dy's copies scalar. This build failed in TVM
    # ("Load memory in places other than store") while storage rewrite was off for every
    # marked module (found by the gpu tests on an H100, 2026-12-06).
    planes = tf.make_problem("bn_backward", (1024, 3, 15, 15), "float16")
    for name in ("bn_backward_grid_persistent", "bn_backward_cluster"):
        source = build_kernel(planes, CUDA, name).device_source()
        assert CALL not in source and WAIT not in source and "extern __shared__" in source, name


def test_the_switch_builds_the_synchronous_copies(monkeypatch):
    problem, candidate = CASES[0]
    monkeypatch.setattr(async_copy, "ENABLED", False)
    source = build_kernel(problem, CUDA, candidate).device_source()
    assert CALL not in source and WAIT not in source and SYNC_COPY.search(source)
    monkeypatch.setattr(async_copy, "ENABLED", True)
    assert CALL in build_kernel(problem, CUDA, candidate).device_source()


def test_a_mark_on_a_thread_loop_is_refused():
    import tvm
    from tvm import s_tir, te

    a = te.placeholder((256,), "float32", name="a")
    b = te.compute((256,), lambda i: a[i], name="b")
    sch = s_tir.Schedule(tvm.IRModule({"main": te.create_prim_func([a, b])}))
    (loop,) = sch.get_loops(sch.get_sblock("b"))
    sch.bind(loop, "threadIdx.x")
    with pytest.raises(ValueError, match="marks a serial copy loop"):
        async_copy.mark(sch, loop)


def copy_source_offsets(source: str) -> list[str]:
    """The source offset (fourth argument) of each cp.async helper call in ``source``."""
    offsets = []
    for line in source.splitlines():
        line = line.strip()
        if not line.startswith(CALL):
            continue
        args, depth, start = [], 0, line.index("(") + 1
        for i, ch in enumerate(line[start:], start):
            if ch in "([":
                depth += 1
            elif ch in ")]":
                if depth == 0:
                    args.append(line[start:i].strip())
                    break
                depth -= 1
            elif ch == "," and depth == 0:
                args.append(line[start:i].strip())
                start = i + 1
        offsets.append(args[3])
    return offsets


def big_cases():
    """Each cross entropy candidate that copies asynchronously, on 32768 x 151936 bf16
    (5e9 elements: 64-bit offsets), the forward and the gradient; and the gradient on
    65536 x 50257 bf16 (3.3e9, rows off the 16-byte grid: the granule windows)."""
    from tvm_fusion import registry

    for op, shape in (("cross_entropy", (32768, 151936)), ("cross_entropy_grad", (32768, 151936)),
                      ("cross_entropy_grad", (65536, 50257))):
        problem = tf.make_problem(op, shape, "bfloat16")
        for cand in registry.applicable(problem, CUDA):
            yield pytest.param(problem, cand.name, id=f"{op}-{shape[1]}-{cand.name}")


@pytest.mark.parametrize("problem, candidate", list(big_cases()))
def test_copies_past_two_to_the_31_elements_pass_their_source_already_offset(problem, candidate):
    """TVM's cp.async helper takes its source offset as a C ``int``: a 64-bit offset
    would be truncated (an illegal address on an H100, row_in_cluster on this shape).
    Every copy gets ``&src[offset]`` and an offset of 0 instead."""
    source = build_kernel(problem, CUDA, candidate).device_source()
    if CALL not in source:
        pytest.skip(f"{candidate} copies synchronously on this shape")
    offsets = copy_source_offsets(source)
    assert offsets and offsets == ["0"] * len(offsets), offsets[:3]
    assert "(&(" in source


def test_copies_with_32_bit_offsets_are_printed_as_tvm_prints_them():
    problem, candidate = CASES[0]  # 4096 x 32000: 32-bit offsets
    offsets = copy_source_offsets(build_kernel(problem, CUDA, candidate).device_source())
    assert offsets and all(o != "0" and "int64_t" not in o for o in offsets), offsets[:3]
