"""The last block of a kernel runs the kernel after it (tvm_fusion.single_launch).

Here: which kernels merge, and what the merged CUDA does (a fence, a ticket drawn
by lane 0, the counter reset by the last block, the second kernel's body under a
block-uniform guard). On the GPU: merged kernels stay right call after call on two
streams and in a replayed CUDA graph, against float64 references."""

import re

import numpy as np
import pytest

import tvm_fusion as tf
from helpers import has_gpu, torch_or_none
from tvm_fusion import single_launch, targets
from tvm_fusion.kernel import build_kernel
from tvm_fusion.registry import get

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
torch = torch_or_none()

# (op, shape, dtype, options, candidate, knobs): each merges into one kernel.
MERGED = [
    ("cross_entropy", (128, 32000), "float16", {}, "cross_entropy_online", {"threads": 1024, "unroll": 16}),
    ("cross_entropy", (96, 5000), "float32", {"reduction": "sum", "weight": True}, "cross_entropy_online",
     {"threads": 1024, "unroll": 4}),
    ("cross_entropy", (128, 32000), "bfloat16", {"reduction": "none"}, "cross_entropy_online",
     {"threads": 1024, "unroll": 16}),
    ("bn_stats", (8, 3, 224, 224), "float16", {}, "bn_stats_split_plane", None),
]


def knobs_of(candidate, problem, values):
    default = get(candidate).default_for(problem, CUDA)
    return default if values is None else type(default)(**{**default.as_dict(), **values})


def merged_kernel(op, shape, dtype, options, candidate, knobs):
    problem = tf.make_problem(op, shape, dtype, **options)
    return build_kernel(problem, CUDA, candidate, knobs_of(candidate, problem, knobs))


def blocks_of_first_kernel(source: str) -> int:
    return int(re.search(r"launch_ticket == (\d+)\)", source).group(1)) + 1


@pytest.mark.parametrize("case", MERGED, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}")
def test_the_last_block_runs_the_second_kernel(case):
    kernel = merged_kernel(*case)
    source = kernel.device_source()
    assert kernel.counted and kernel.launches() == 1
    assert single_launch.COUNTER not in [name for name, _, _ in kernel.params]  # not an output
    assert "__threadfence();" in source
    assert re.search(r"if \(\(\(int\)threadIdx\.x\) == 0\) \{\s*int launch_ticket = atomicAdd\(\(&\(launch_counter_ptr\[0\]\)\), 1\);",
                     source), "lane 0 draws the ticket"
    assert "launch_counter_ptr[0] = 0;" in source, "the last block resets the counter for the next launch"
    assert "if (launch_is_last_ptr[0] != 0) {" in source
    op, shape = case[0], case[1]
    expected_blocks = shape[0] if op == "cross_entropy" else None
    if expected_blocks:  # a block a row (these knobs)
        assert blocks_of_first_kernel(source) == expected_blocks


def test_a_second_kernel_of_a_block_a_channel_runs_as_a_loop():
    kernel = merged_kernel(*MERGED[-1])
    source = kernel.device_source()
    assert re.search(r"for \(int blockIdx_x_serial = 0; blockIdx_x_serial < 3; \+\+blockIdx_x_serial\)", source)
    assert blocks_of_first_kernel(source) == 3 * kernel.knobs.splits


def test_kernels_that_cannot_merge_keep_their_launches():
    # Row kernel of 256 lanes, batch stage of 1024: different thread extents.
    problem = tf.make_problem("cross_entropy", (1024, 8192), "float32")
    kernel = build_kernel(problem, CUDA, "cross_entropy_online", knobs_of("cross_entropy_online", problem, {"threads": 256}))
    assert kernel.counted and kernel.launches() == 2
    assert "launch_counter" not in kernel.device_source()
    # A finalize block a channel over 64 channels keeps its own launch.
    problem = tf.make_problem("bn_stats", (32, 64, 112, 112), "float16")
    assert build_kernel(problem, CUDA, "bn_stats_split_plane").launches() == 2


def test_only_the_calls_kernels_take_a_counter():
    problem = tf.make_problem("cross_entropy_grad", (128, 32000), "float16")
    kernel = tf.build("cross_entropy_grad", (128, 32000), "float16", target=CUDA)
    assert kernel.problem == problem and not kernel.counted
    cpu = tf.build("cross_entropy", (128, 32000), "float16", target="llvm")
    assert not cpu.counted


def test_with_launch_counter_appends_one_int32_parameter():
    kernel = merged_kernel(*MERGED[0])
    mod = single_launch.with_launch_counter(kernel.mod)
    params = mod["main"].params
    assert [p.name for p in params[:-1]] == [p.name for p in kernel.mod["main"].params]
    assert params[-1].name == single_launch.COUNTER and str(params[-1].dtype) == "int32"
    assert tuple(int(d) for d in params[-1].shape) == (1,)


# -- on the GPU ---------------------------------------------------------------------
def reference(op, options, inputs):
    if op == "bn_stats":
        x = inputs[0].double()
        var, mean = torch.var_mean(x, dim=(0, 2, 3), correction=0)
        return [mean.float(), var.float()]
    logits, target, *weight = inputs
    loss = torch.nn.functional.cross_entropy(logits.double(), target, weight[0].double() if weight else None,
                                             reduction=options.get("reduction", "mean"))
    return [loss.float()]


def random_inputs(op, shape, dtype, options, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(shape, device="cuda", generator=gen) * (1 + seed % 3) + 0.25 * seed).to(getattr(torch, dtype))
    if op == "bn_stats":
        return [x]
    target = torch.randint(0, shape[1], (shape[0],), device="cuda", generator=gen)
    target[::7] = -100
    weight = [torch.rand(shape[1], device="cuda", generator=gen) + 0.5] if options.get("weight") else []
    return [x, target, *weight]


def call(op, options, inputs):
    if op == "bn_stats":
        return list(tf.bn_stats(inputs[0]))
    logits, target, *weight = inputs
    options = {k: v for k, v in options.items() if k != "weight"}  # make_problem's flag: the tensor goes here
    return [tf.cross_entropy(logits, target, weight[0] if weight else None, check_targets=False, **options)]


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("case", MERGED, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}")
def test_merged_kernels_stay_right_call_after_call_on_two_streams_and_in_a_graph(case):
    op, shape, dtype, options = case[:4]
    kernel = merged_kernel(*case)
    assert kernel.launches() == 1
    # The kernel itself, with poisoned outputs, three times on one counter.
    from test_gpu import run_kernel

    for seed in range(3):
        inputs = random_inputs(op, shape, dtype, options, seed)
        outs = run_kernel(kernel, inputs)
        got = outs[:2] if op == "bn_stats" else [outs[-2].reshape(reference(op, options, inputs)[0].shape)]
        for value, want in zip(got, reference(op, options, inputs)):
            np.testing.assert_allclose(value, want.cpu().numpy(), rtol=2e-4, atol=2e-4)
    # The public call (dispatch's kernel, which may or may not be this one), on two
    # streams at once, twenty calls each.
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    data = [random_inputs(op, shape, dtype, options, 10 + k) for k in range(2)]
    refs = [reference(op, options, d) for d in data]
    torch.cuda.synchronize()
    results = [[], []]
    for _ in range(20):
        for k, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                results[k].append(call(op, options, data[k]))
    torch.cuda.synchronize()
    for k in range(2):
        for got in results[k]:
            for value, want in zip(got, refs[k]):
                torch.testing.assert_close(value.reshape(want.shape), want, rtol=2e-4, atol=2e-4)
    # Captured once, replayed on new data three times, eager calls in between.
    static = [t.clone() for t in data[0]]
    graph = torch.cuda.CUDAGraph()
    call(op, options, static)  # warm: launcher built outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = call(op, options, static)
    for seed in range(20, 23):
        fresh = random_inputs(op, shape, dtype, options, seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        eager = call(op, options, data[1])
        torch.cuda.synchronize()
        for value, want in zip(captured, reference(op, options, fresh)):
            torch.testing.assert_close(value.reshape(want.shape), want, rtol=2e-4, atol=2e-4)
        for value, want in zip(eager, refs[1]):
            torch.testing.assert_close(value.reshape(want.shape), want, rtol=2e-4, atol=2e-4)
