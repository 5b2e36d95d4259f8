"""The last block of a kernel runs the kernel after it (tvm_fusion.single_launch).

Here: which kernels merge, and what the merged CUDA does (a fence, a ticket drawn
by lane 0, the counter reset by the last block, the second kernel's body under a
block-uniform guard). On the GPU: merged kernels stay right call after call on two
streams and in a replayed CUDA graph, against float64 references."""

import re

import numpy as np
import pytest
from tvm import tirx

import tvm_fusion as tf
from helpers import has_gpu, launch, torch_or_none
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
    # Row kernel of 256 lanes over 4096 rows: the batch stage keeps 1024 lanes (16 rows a
    # lane on 256), so the thread extents differ.
    problem = tf.make_problem("cross_entropy", (4096, 8192), "float32")
    kernel = build_kernel(problem, CUDA, "cross_entropy_online", knobs_of("cross_entropy_online", problem, {"threads": 256}))
    assert kernel.counted and kernel.launches() == 2
    assert "launch_counter" not in kernel.device_source()
    # A finalize block a channel over 64 channels keeps its own launch.
    problem = tf.make_problem("bn_stats", (32, 64, 112, 112), "float16")
    assert build_kernel(problem, CUDA, "bn_stats_split_plane").launches() == 2


def test_a_batch_stage_of_few_rows_takes_the_row_kernels_lanes_and_merges():
    # 1024 rows on 256 lanes: 4 rows a lane (MERGED_ROWS_PER_LANE), so one launch.
    problem = tf.make_problem("cross_entropy", (1024, 8192), "float32")
    kernel = build_kernel(problem, CUDA, "cross_entropy_online", knobs_of("cross_entropy_online", problem, {"threads": 256}))
    assert kernel.launches() == 1
    assert "__launch_bounds__(256)" in kernel.device_source()


def ticket_count(source: str) -> int:
    return len(re.findall(r"int launch_ticket = atomicAdd\(\(&\(launch_counter_ptr\[0\]\)\), 1\);", source))


@pytest.mark.parametrize("candidate, in_place", [("cross_entropy_grad_warp_per_row_padded", False),
                                                ("cross_entropy_grad_online", True)])
def test_the_gradients_two_level_stages_each_merge(candidate, in_place):
    # 65536 rows: the targets pass and the loss are each partials (64 blocks of 256 lanes)
    # then one block of 256 lanes; both pairs merge, the row kernel between them stays.
    problem = tf.make_problem("cross_entropy_grad", (65536, 1000), "float16", in_place=in_place)
    kernel = build_kernel(problem, CUDA, candidate)
    source = kernel.device_source()
    assert kernel.counted and kernel.launches() == 3
    assert ticket_count(source) == 2 and source.count("launch_counter_ptr[0] = 0;") == 2
    assert set(re.findall(r"launch_ticket == (\d+)\)", source)) == {"63"}  # the last of 64 partials blocks
    assert ("__restrict__" in source) is not in_place  # the aliased pipeline still withdraws no-alias


def test_the_gradients_loss_stage_runs_in_the_row_kernels_last_block():
    problem = tf.make_problem("cross_entropy_grad", (128, 32000), "float16")
    kernel = tf.build("cross_entropy_grad", (128, 32000), "float16", target=CUDA)
    assert kernel.problem == problem and kernel.counted
    # dispatch's pick, the one-launch twin: rows (each block summing the denominator) + loss
    assert kernel.candidate == "cross_entropy_grad_row_targets"
    assert kernel.launches() == 1 and ticket_count(kernel.device_source()) == 1
    base = build_kernel(problem, CUDA, "cross_entropy_grad_block_per_row", kernel.knobs)
    assert base.launches() == 2 and ticket_count(base.device_source()) == 1  # targets pass, then rows + loss
    cpu = tf.build("cross_entropy", (128, 32000), "float16", target="llvm")
    assert not cpu.counted
    bn = tf.build("bn_forward", (8, 16, 8, 8), "float16", target=CUDA)
    assert not bn.counted


@pytest.mark.parametrize("blocks, tickets", [
    ((8, 1, 1), [1]),        # the two one-block launches joined, then run by the 8 blocks' last
    ((8, 1, 1, 1), [1]),     # three joined
    ((1, 8, 1), [0, 1]),     # (8, 1) merged; the first launch stays: a merged launch is not merged again
    ((8, 1, 16, 1), [1, 1]),  # two merged pairs
    ((1, 1), [0]),           # joined, no ticket: the one block is the last
    ((8, 16), [0, 0]),       # a second launch of more than MAX_SERIAL_BLOCKS blocks keeps its own
])
def test_pairs_merge_from_the_last_launch_and_never_overlap(blocks, tickets):
    """Launches of few blocks merge into the launch before them, taken from the end, and
    consecutive one-block launches join first; a merged launch is neither merged again
    nor run by another's last block. ``tickets``: each launch's tickets after the pass."""
    bufs = [tirx.decl_buffer((64,), "float32", f"b{k}") for k in range(len(blocks))]
    counter = tirx.decl_buffer((1,), "int32", single_launch.COUNTER)
    stmts = [launch(blocks[0], 32, lambda bx, tx: tirx.BufferStore(bufs[0], tirx.Cast("float32", tx), [tx]))]
    for k in range(1, len(blocks)):
        stmts.append(launch(blocks[k], 32,
                            lambda bx, tx, k=k: tirx.BufferStore(bufs[k], tirx.BufferLoad(bufs[k - 1], [tx]), [tx])))
    func = single_launch.merge_launch_pairs(tirx.PrimFunc([*bufs, counter], tirx.SeqStmt(stmts)))
    launches = list(func.body.seq) if isinstance(func.body, tirx.SeqStmt) else [func.body]
    assert [s.script().count("atomicAdd") for s in launches] == tickets
    scripts = [s.script() for s in launches]
    for k in range(len(blocks)):  # each launch's store survives, once
        assert sum(len(re.findall(rf"\bb{k}\[tx(_\d+)?\] = ", script)) for script in scripts) == 1, k
    if blocks == (1, 1):  # joined: a barrier between the two bodies
        assert "tvm_storage_sync" in scripts[0]


# (shape, dtype, options, launches): the gradient's calls whose launches merge in pairs
# (65536 rows: both two-level stages, five launches to three; 128 rows in place: the
# loss into block_per_row's row kernel, three to two), and 128 rows not in place, whose
# one-launch twin (row_targets) dispatch now picks.
GRAD_MERGED = [((65536, 1000), "float16", {"reduction": "sum"}, 3),
               ((128, 32000), "bfloat16", {"inplace_backward": True}, 2), ((128, 32000), "bfloat16", {}, 1),
               ((65536, 1000), "float32", {"label_smoothing": 0.1, "inplace_backward": True}, 3)]


def grad_inputs(shape, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(shape, device="cuda", generator=gen) * 3 + seed).to(getattr(torch, dtype))
    target = torch.randint(0, shape[1], (shape[0],), device="cuda", generator=gen)
    target[::7] = -100
    return logits, target


def grad_reference(logits, target, options):
    x = logits.double().requires_grad_()
    kwargs = {k: v for k, v in options.items() if k != "inplace_backward"}
    loss = torch.nn.functional.cross_entropy(x, target, **kwargs)
    return loss.detach(), torch.autograd.grad(loss, x)[0]


def grad_call(logits, target, options):
    import tvm_fusion.torch as tft

    x = logits.clone().requires_grad_()
    if options.get("inplace_backward"):
        x = x * 1  # not a leaf: the gradient may overwrite it
    loss = tft.cross_entropy(x, target, check_targets=False, **options)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


def assert_grad_close(got, want, dtype):
    loss, grad = got
    tol = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}[dtype]
    torch.testing.assert_close(loss.double(), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), want[1], rtol=tol, atol=tol * float(want[1].abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("case", GRAD_MERGED, ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}-{len(c[2])}")
def test_merged_gradient_kernels_stay_right_on_two_streams_and_in_a_graph(poisoned, case):
    shape, dtype, options, launches = case
    problem = tf.make_problem("cross_entropy_grad", shape, dtype, in_place=bool(options.get("inplace_backward")),
                              **{k: v for k, v in options.items() if k != "inplace_backward"})
    from tvm_fusion.dispatch import kernel_for

    assert kernel_for(problem, targets.for_device("cuda")).launches() == launches
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    data = [grad_inputs(shape, dtype, k) for k in range(2)]
    refs = [grad_reference(*d, options) for d in data]
    torch.cuda.synchronize()
    results = [[], []]
    for _ in range(10):
        for k, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                results[k].append(grad_call(*data[k], options))
    torch.cuda.synchronize()
    for k in range(2):
        for got in results[k]:
            assert_grad_close(got, refs[k], dtype)
    static = [t.clone() for t in data[0]]
    grad_call(*static, options)  # warm: launcher built outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grad_call(*static, options)
    for seed in range(20, 22):
        for dst, src in zip(static, grad_inputs(shape, dtype, seed)):
            dst.copy_(src)
        graph.replay()
        eager = grad_call(*data[1], options)
        torch.cuda.synchronize()
        assert_grad_close(captured, grad_reference(*static, options), dtype)
        assert_grad_close(eager, refs[1], dtype)
