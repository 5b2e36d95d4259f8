"""Loops walked backwards (tvm_fusion.launch_order): a marked grid or serial loop runs
from its last step to its first, its body unchanged.

Here: the lowered code binds the old index to ``n - 1 - walked``; a CPU kernel with a
marked loop computes what the unmarked one does; the BatchNorm maps and the gradient
pass are marked, and with the switch off they build forwards; a mark on a loop that
cannot run backwards is an error that names it. The GPU suite checks every marked
candidate against float64 on poisoned outputs (test_gpu.py)."""

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import s_tir, te

import tvm_fusion as tf
from tvm_fusion import launch_order, targets
from tvm_fusion import kernel as kernel_module
from tvm_fusion.kernel import build_kernel

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
LLVM = targets.resolve("llvm")


def scaled(shape=(6, 40)):
    x = te.placeholder(shape, "float32", "x")
    y = te.compute(shape, lambda i, j: x[i, j] * 2.0 + j, "y")
    return te.create_prim_func([x, y])


def marked_grid(extent_threads=32):
    sch = s_tir.Schedule(scaled())
    i, j = sch.get_loops(sch.get_sblock("y"))
    fused = sch.fuse(i, j)
    grid, lane = sch.split(fused, [None, extent_threads])
    sch.bind(grid, "blockIdx.x")
    sch.bind(lane, "threadIdx.x")
    launch_order.reverse(sch, grid)
    return sch


def test_a_marked_grid_binds_the_old_block_index_backwards():
    sch = marked_grid()
    assert launch_order.KEY in sch.mod.script()  # traced: a record's replay marks it again
    assert any(inst.kind.name == "Annotate" for inst in sch.trace.insts)
    src = tvm.compile(sch.mod, target=CUDA, tir_pipeline=launch_order.PIPELINE).mod.imports[0].inspect_source()
    # 6 x 40 values over 32 lanes: 8 blocks, the first launched takes the last 32 values.
    assert "int blockIdx_x = (7 - ((int)blockIdx.x));" in src
    plain = tvm.compile(sch.mod, target=CUDA).mod.imports[0].inspect_source()
    assert "7 - " not in plain and "blockIdx_x =" not in plain  # another pipeline: forwards, same results


def test_the_switch_off_builds_the_marked_grid_forwards(monkeypatch):
    monkeypatch.setattr(launch_order, "ENABLED", False)
    src = tvm.compile(marked_grid().mod, target=CUDA, tir_pipeline=launch_order.PIPELINE).mod.imports[0].inspect_source()
    assert "7 - " not in src and launch_order.KEY not in src


def test_a_marked_serial_loop_computes_what_the_forward_one_does():
    func = scaled((6, 40))
    x = np.random.default_rng(0).standard_normal((6, 40)).astype("float32")
    outs = []
    for mark in (False, True):
        sch = s_tir.Schedule(func)
        i, j = sch.get_loops(sch.get_sblock("y"))
        if mark:
            launch_order.reverse(sch, j)
        lowered = tvm.compile(sch.mod, target=LLVM, tir_pipeline=launch_order.PIPELINE)
        y = tvm.runtime.tensor(np.full((6, 40), np.nan, "float32"))  # poisoned: every element must be written
        lowered["main"](tvm.runtime.tensor(x), y)
        outs.append(y.numpy())
    np.testing.assert_array_equal(outs[0], x * 2 + np.arange(40, dtype="float32"))
    np.testing.assert_array_equal(outs[1], outs[0])


def test_the_lowered_serial_loop_walks_from_its_last_step():
    sch = s_tir.Schedule(scaled((6, 40)))
    _, j = sch.get_loops(sch.get_sblock("y"))
    launch_order.reverse(sch, j)
    pipeline, _, _ = tvm.tirx.get_tir_pipeline("s_tir")
    mod = tvm.IRModule({"main": sch.mod["main"].with_attr("target", LLVM)})
    with LLVM, tvm.transform.PassContext(opt_level=3):
        lowered = launch_order.lowered(pipeline, mod, tvm.transform.PassContext.current())
    script = lowered.script()
    assert "39 - j_walked" in script and launch_order.KEY not in script


def test_a_mark_on_a_thread_loop_is_an_error_that_names_it():
    sch = s_tir.Schedule(scaled())
    i, j = sch.get_loops(sch.get_sblock("y"))
    sch.bind(j, "threadIdx.x")
    with pytest.raises(ValueError, match="blockIdx.x or a serial loop.*threadIdx.x"):
        launch_order.reverse(sch, j)
    sch.vectorize(i)
    with pytest.raises(ValueError, match="vectorized"):
        launch_order.reverse(sch, i)


@pytest.mark.parametrize("op, shape, dtype, layout, candidate, walked", [
    # The split-plane map: its grid from the tensor's end, where kernel 1 read last.
    ("bn_forward", (64, 256, 56, 56), "float16", "NCHW", "bn_forward_split_plane", "int blockIdx_x = (6271 - ((int)blockIdx.x));"),
    ("bn_backward", (32, 64, 112, 112), "float16", "NCHW", "bn_backward_split_plane", "- ((int)blockIdx.x));"),
    # The channels-last map: each block's run of rows from its end.
    ("bn_forward", (64, 56, 56, 256), "bfloat16", "NHWC", "bn_forward_channels_last", "_walked"),
    ("bn_backward", (64, 56, 56, 256), "bfloat16", "NHWC", "bn_backward_channels_last", "_walked"),
    # The block-per-channel map: the channel's planes from their end.
    ("bn_backward", (64, 256, 56, 56), "float16", "NCHW", "bn_backward_block_per_channel", "_walked"),
    ("bn_forward", (64, 256, 56, 56), "float16", "NCHW", "bn_forward_block_per_channel", "_walked"),
    # The small-plane (column view) map: the same, on kernel 1's grid.
    ("bn_forward", (256, 2048, 7, 7), "float16", "NCHW", "bn_forward_small_plane", "_walked"),
    ("bn_backward", (256, 2048, 7, 7), "float16", "NCHW", "bn_backward_small_plane", "_walked"),
    # The fused gradient's second pass over a row, from the row's end.
    ("cross_entropy_grad", (8192, 128256), "bfloat16", None, "cross_entropy_grad_online", "_walked"),
])
def test_the_second_passes_are_marked_and_the_switch_builds_them_forwards(monkeypatch, op, shape, dtype, layout,
                                                                         candidate, walked):
    options = {"layout": layout} if layout else {"mode": "fused"}
    problem = tf.make_problem(op, shape, dtype, **options)
    assert walked in build_kernel(problem, CUDA, candidate).device_source()
    monkeypatch.setattr(launch_order, "ENABLED", False)
    assert "_walked" not in build_kernel(problem, CUDA, candidate).device_source()  # another cache entry


def test_dispatch_builds_a_records_choice_with_todays_schedule(monkeypatch):
    """A shipped record names the candidate and knobs; the kernel is today's schedule
    of them (so the marks reach tuned shapes), and the record's own module where
    today's schedule refuses its knobs."""
    from tvm_fusion import dispatch, registry

    problem = tf.make_problem("bn_backward", (32, 64, 112, 112), "float16")  # a split-plane record
    choice = dispatch.choose(problem, CUDA)
    assert choice.source == "record" and choice.mod is not None
    assert launch_order.KEY not in choice.mod.script()  # tuned before the marks
    kernel = dispatch.kernel_for(problem, CUDA)
    assert (kernel.candidate, kernel.knobs) == (choice.candidate, choice.knobs)
    assert "- ((int)blockIdx.x));" in kernel.device_source()

    candidate = registry.get(choice.candidate)

    def refuses(*args, **kwargs):
        raise ValueError("today's schedule refuses these knobs")

    monkeypatch.setattr(type(candidate), "schedule", refuses)
    monkeypatch.setattr(dispatch, "_KERNELS", {})
    monkeypatch.setattr(kernel_module, "_CACHE", {})
    kernel = dispatch.kernel_for(problem, CUDA)
    assert tvm_ffi.structural_equal(kernel.mod, choice.mod)


def test_a_loop_past_two_to_the_31_steps_is_not_unrolled_in_full():
    """TVM 0.27's UnrollLoop multiplies a loop's extent by its body's steps in a C int:
    a 2^29-long CPU plane's product wrapped negative, under the default threshold, and
    the compile unrolled it in full until memory ran out (2x2x536870919 fp16). The
    pipeline's threshold is the smallest int (launch_order.NO_AUTO_UNROLL). In a
    subprocess with its address space capped, so that a regression fails here
    instead of taking the machine's memory."""
    import subprocess
    import sys

    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
            "import tvm_fusion as tf\n"
            "for op in ('bn_stats', 'bn_forward'):\n"
            "    kernel = tf.build(op, (2, 2, 536870919), 'float16', 'llvm')\n"
            "    print(op, kernel.candidate)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["bn_stats", "bn_stats_parallel", "bn_forward", "bn_forward_parallel"]


@pytest.mark.parametrize("op, candidate", [("bn_forward", "bn_forward_split_plane_runs"),
                                           ("bn_forward", "bn_forward_block_per_channel"),
                                           ("bn_backward", "bn_backward_split_plane_runs"),
                                           ("bn_backward", "bn_backward_block_per_channel")])
def test_a_grid_past_two_to_the_31_elements_walks_back_on_64_bit_indices(op, candidate):
    """512x256x130x130 fp16 (2.2e9 elements): the grid's index is 64-bit, and so is the
    index walked backwards (a 32-bit one failed the build in TVM's IterVar check, and
    dispatch picks split_plane_runs for this shape)."""
    problem = tf.make_problem(op, (512, 256, 130, 130), "float16", **({"training": True} if op == "bn_forward" else {}))
    source = build_kernel(problem, CUDA, candidate).device_source()
    # each walked-back index (the grid's, a serial loop's) declared 64-bit, whatever the
    # declaration's type
    walked = re.findall(r"(\w+) (\w+_walked) = ", source) + re.findall(r"(\w+) (blockIdx_x) = ", source)
    assert walked and all(ty == "int64_t" for ty, _ in walked), walked
