"""A function's launches overlapped with programmatic dependent launch
(tvm_fusion.dependent_launch), switched on.

Here: on hand-made launches, where each waits (before its first touch of what an
earlier launch wrote, or of a write to what one read, a loop's as a whole; at its end
where it touches none; the first launch first of all), which ones let the next start
(all but the last), and what is left alone (one launch, a cooperative launch, below
sm_90, a launch the walk cannot see, a function not asking, the switch off), and an
output that may be an input taken as that input (the build names such pairs: the
gradient in place, BatchNorm's running statistics). Built: on the gradient of 65536x1000
fp16 (three launches) the row kernel's loads and statistics come before its wait,
the denominator after; every kernel is launched with the programmatic launch
parameter; nvcc compiles it; and, read from the printed CUDA alone (not through the
pass's own walk), no launch of any default multi-launch build of the fused gradient
touches an earlier launch's buffers before its wait. The switch's defaults (the fused
gradient only; every op at 1; none at 0). On the GPU: the gradient, and BatchNorm's forward (its
running statistics updated in place) and backward, with the switch on (dispatch's
kernels, asserted to overlap), poisoned outputs against float64, call after call on
two streams and in a replayed CUDA graph."""

import os
import re
import subprocess
import sys

import pytest
import tvm
from tvm import tirx

import tvm_fusion as tf
from helpers import has_gpu, launch, torch_or_none
from tvm_fusion import dependent_launch, grid_barrier, launch_order, registry, targets
from tvm_fusion.codegen import cuda_report, nvcc_path
from tvm_fusion.stmts import seq
from tvm_fusion import kernel as kernel_module
from tvm_fusion.kernel import build_kernel

CUDA = targets.resolve({"kind": "cuda", "arch": "sm_90"})
torch = torch_or_none()
WAIT, TRIGGER = "griddepcontrol_wait", "griddepcontrol_launch_dependents"  # in the CUDA
TIR_WAIT, TIR_TRIGGER = 'griddepcontrol("wait"', 'griddepcontrol("launch_dependents"'  # in the TIR


@pytest.fixture
def switched_on(monkeypatch):
    """Every op's launches overlapped (``TVM_FUSION_DEPENDENT_LAUNCH=1``)."""
    monkeypatch.setattr(dependent_launch, "ENABLED", True)
    monkeypatch.setattr(dependent_launch, "EVERY_OP", True)


def func_of(*launches, params=None, asked=True, aliases=()):
    func = tirx.PrimFunc([], seq(list(launches)))
    func = func.with_attr(dependent_launch.ATTR, list(aliases)) if asked else func
    return func if params is None else func.with_attr(grid_barrier.LAUNCH_PARAMS, params)


def kernel_lines(func):
    """Each launch's statements (its printed lines, stripped), in order."""
    top = list(func.body.seq)
    return [[line.strip() for line in stmt.script().splitlines()] for stmt in top]


def index(lines, text):
    return next(i for i, line in enumerate(lines) if text in line)


A, B, C, D = (tirx.decl_buffer((64,), "float32", name) for name in "abcd")


def store(buf, value):
    return lambda bx, tx: tirx.BufferStore(buf, value(bx, tx), [tx])


def test_each_launch_waits_before_it_touches_what_an_earlier_one_wrote():
    first = launch(4, 32, lambda bx, tx: [tirx.BufferStore(B, tirx.BufferLoad(A, [tx]) * 2.0, [tx])])
    # reads a (an input: no wait), stores c, then reads b (written by the first): the wait
    second = launch(8, 32, lambda bx, tx: [tirx.BufferStore(C, tirx.BufferLoad(A, [tx]) + 1.0, [tx]),
                                       tirx.BufferStore(D, tirx.BufferLoad(B, [tx]), [tx])])
    third = launch(2, 32, lambda bx, tx: [tirx.BufferStore(A, tirx.BufferLoad(D, [tx]), [tx])])  # a: read before
    out = dependent_launch.overlapped(func_of(first, second, third), arch=90)
    assert dependent_launch.TAG in list(out.attrs[grid_barrier.LAUNCH_PARAMS])
    one, two, three = kernel_lines(out)
    # the first waits first of all, then lets the next start
    assert index(one, TIR_WAIT) < index(one, TIR_TRIGGER) < index(one, "b[tx] =")
    # the second lets the third start, stores c before its wait, reads b after it
    assert index(two, TIR_TRIGGER) < index(two, "c[tx] =") < index(two, TIR_WAIT) < index(two, "d[tx] = b[tx]")
    # the last waits before it writes a, which the earlier launches read; no trigger
    assert index(three, TIR_WAIT) < index(three, "a[tx] =") and not any(TIR_TRIGGER in line for line in three)


def test_a_launch_that_touches_nothing_earlier_waits_at_its_end():
    first = launch(4, 32, lambda bx, tx: [tirx.BufferStore(B, tirx.BufferLoad(A, [tx]), [tx])])
    second = launch(4, 32, lambda bx, tx: [tirx.BufferStore(C, tirx.BufferLoad(A, [tx]), [tx])])
    third = launch(4, 32, lambda bx, tx: [tirx.BufferStore(D, tirx.BufferLoad(C, [tx]), [tx])])
    _, two, _ = kernel_lines(dependent_launch.overlapped(func_of(first, second, third), arch=90))
    # c's store, then the wait (the third reads c after its own wait, which covers only
    # the second grid: the second ends after the first)
    assert index(two, "c[tx] =") < index(two, TIR_WAIT) == max(i for i, line in enumerate(two) if TIR_WAIT in line)


def threads_only(body):
    """A launch of one block: 32 lanes, no blockIdx attribute."""
    tx = tirx.Var("tx", "int32")
    thread = tirx.IterVar(tvm.ir.Range(0, 32), tx, tirx.IterVar.ThreadIndex, "threadIdx.x")
    return tirx.AttrStmt(thread, "thread_extent", 32, body(tx))


@pytest.mark.parametrize("case", ["one launch", "cooperative", "sm_80", "already", "not asked", "threads only"])
def test_left_alone(case):
    first = launch(4, 32, lambda bx, tx: [tirx.BufferStore(B, tirx.BufferLoad(A, [tx]), [tx])])
    second = launch(4, 32, lambda bx, tx: [tirx.BufferStore(C, tirx.BufferLoad(B, [tx]), [tx])])
    # a launch the walk would not see, between two it does: it reads b unguarded
    middle = threads_only(lambda tx: tirx.BufferStore(D, tirx.BufferLoad(B, [tx]), [tx]))
    func = {"one launch": func_of(first), "cooperative": func_of(first, second, params=[grid_barrier.COOPERATIVE]),
            "sm_80": func_of(first, second), "already": func_of(first, second, params=[dependent_launch.TAG]),
            "not asked": func_of(first, second, asked=False), "threads only": func_of(first, middle, second)}[case]
    out = dependent_launch.overlapped(func, arch=80 if case == "sm_80" else 90)
    assert out.same_as(func)


def test_a_conflict_inside_a_loop_waits_before_the_loop_and_writes_after_writes_wait():
    i = tirx.Var("i", "int32")
    first = launch(4, 32, lambda bx, tx: [tirx.BufferStore(B, tirx.BufferLoad(A, [tx]), [tx])])
    # a loop whose second statement reads b: the wait goes before the whole loop
    looped = launch(4, 32, lambda bx, tx: [
        tirx.BufferStore(C, tirx.BufferLoad(A, [tx]), [tx]),
        tirx.For(i, 0, 4, tirx.ForKind.SERIAL, tirx.SeqStmt([
            tirx.BufferStore(D, tirx.BufferLoad(A, [tx]), [tx]),
            tirx.BufferStore(D, tirx.BufferLoad(B, [tx]) + tirx.Cast("float32", i), [tx])]))])
    # writes b, which the first launch also writes: it waits before that store
    rewrites = launch(4, 32, lambda bx, tx: [tirx.BufferStore(B, tirx.BufferLoad(C, [tx]), [tx])])
    _, two, three = kernel_lines(dependent_launch.overlapped(func_of(first, looped, rewrites), arch=90))
    assert index(two, "c[tx] =") < index(two, TIR_WAIT) < index(two, "for i in")
    assert index(three, TIR_WAIT) < index(three, "b[tx] =")


def test_an_output_that_may_be_an_input_counts_as_that_input():
    """The build names such pairs (``e=a``): a later launch writing e waits before it,
    since an earlier one reads a; without the pair, e looks like a buffer of its own."""
    E = tirx.decl_buffer((64,), "float32", "e")
    first = launch(4, 32, lambda bx, tx: [tirx.BufferStore(B, tirx.BufferLoad(A, [tx]), [tx])])
    second = launch(4, 32, lambda bx, tx: [tirx.BufferStore(C, tirx.BufferLoad(D, [tx]), [tx]),
                                       tirx.BufferStore(E, tirx.BufferLoad(D, [tx]), [tx])])
    _, paired = kernel_lines(dependent_launch.overlapped(func_of(first, second, aliases=["e=a"]), arch=90))
    assert index(paired, "c[tx] =") < index(paired, TIR_WAIT) < index(paired, "e[tx] =")
    _, unpaired = kernel_lines(dependent_launch.overlapped(func_of(first, second), arch=90))
    assert index(unpaired, "e[tx] =") < index(unpaired, TIR_WAIT)  # at its end


@pytest.mark.parametrize("problem, pairs", [
    (tf.make_problem("cross_entropy_grad", (65536, 1000), "float16", in_place=True), {"dlogits": "logits"}),
    (tf.make_problem("bn_forward", (64, 56, 56, 256), "bfloat16", layout="NHWC", training=True),
     {"running_mean_out": "running_mean", "running_var_out": "running_var"}),
    (tf.make_problem("bn_backward", (64, 56, 56, 256), "bfloat16", layout="NHWC"), {}),
], ids=["grad in place", "bn forward", "bn backward"])
def test_the_build_names_the_outputs_that_may_be_inputs(switched_on, problem, pairs):
    assert dependent_launch.aliases(problem) == pairs
    for name in pairs:  # the names are the kernel's parameters
        assert name in [p for p, _, _ in build_kernel(problem, CUDA, dispatch_choice(problem)).outputs]


def dispatch_choice(problem):
    from tvm_fusion.dispatch import choose

    return choose(problem, CUDA).candidate


@pytest.mark.parametrize("setting, gradient, in_place, batch_norm", [
    (None, True, True, False),  # by default: the fused gradient's calls only
    ("1", True, True, True),  # every op
    ("0", False, False, False),  # none
])
def test_the_switch_overlaps_the_fused_gradient_by_default_every_op_at_1_none_at_0(setting, gradient, in_place,
                                                                                   batch_norm):
    """In a fresh process (the switch is read at import): which builds carry the waits.
    The gradient from the saved lse is not among the defaults, nor is BatchNorm."""
    code = ("import tvm_fusion as tf\nfrom tvm_fusion import targets\n"
            "from tvm_fusion.kernel import build_kernel\n"
            "t = targets.resolve({'kind': 'cuda', 'arch': 'sm_90'})\n"
            "def waits(problem, candidate):\n"
            "    return 'griddepcontrol' in build_kernel(problem, t, candidate).device_source()\n"
            "print(waits(tf.make_problem('cross_entropy_grad', (65536, 1000), 'float16'), "
            "'cross_entropy_grad_warp_per_row_padded'),\n"
            "      waits(tf.make_problem('cross_entropy_grad', (65536, 1000), 'float16', in_place=True), "
            "'cross_entropy_grad_row_in_shared'),\n"
            "      waits(tf.make_problem('bn_backward', (64, 56, 56, 256), 'bfloat16', layout='NHWC'), "
            "'bn_backward_channels_last'))\n")
    env = {k: v for k, v in os.environ.items() if k != "TVM_FUSION_DEPENDENT_LAUNCH"}
    if setting is not None:
        env["TVM_FUSION_DEPENDENT_LAUNCH"] = setting
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-3:] == [str(gradient), str(in_place), str(batch_norm)]


def test_the_gradient_from_the_saved_lse_is_not_overlapped_by_default(monkeypatch):
    monkeypatch.setattr(dependent_launch, "ENABLED", True)
    monkeypatch.setattr(dependent_launch, "EVERY_OP", False)
    fused = tf.make_problem("cross_entropy_grad", (64, 1000), "float16")
    from_lse = tf.make_problem("cross_entropy_grad", (64, 1000), "float16", mode="from_lse")
    bn = tf.make_problem("bn_forward", (8, 4, 16, 16), "float16", training=True)
    assert [dependent_launch.wanted(p) for p in (fused, from_lse, bn)] == [True, False, False]
    monkeypatch.setattr(dependent_launch, "EVERY_OP", True)
    assert [dependent_launch.wanted(p) for p in (fused, from_lse, bn)] == [True, True, True]
    monkeypatch.setattr(dependent_launch, "ENABLED", False)
    assert [dependent_launch.wanted(p) for p in (fused, from_lse, bn)] == [False, False, False]


def gradient_kernels(source):
    """The kernels' bodies (their lines, stripped), in launch order."""
    return [[line.strip() for line in lines] for _, lines in cuda_kernels(source)]


def test_the_row_kernel_reads_its_rows_before_it_waits_for_the_denominator(switched_on):
    problem = tf.make_problem("cross_entropy_grad", (65536, 1000), "float16")
    kernel = build_kernel(problem, CUDA, "cross_entropy_grad_warp_per_row_padded")
    targets_pass, rows, loss = gradient_kernels(kernel.device_source())
    assert kernel.launches() == 3
    assert index(targets_pass, WAIT) < index(targets_pass, TRIGGER) < index(targets_pass, "atomicAdd")
    first_load = index(rows, "logits_ptr +")
    assert index(rows, TRIGGER) < first_load < index(rows, "__shfl") < index(rows, WAIT) < index(rows, "denom_ptr[0]")
    assert index(loss, WAIT) < index(loss, "row_loss_ptr[") and not any(TRIGGER in line for line in loss)


def cuda_kernels(source):
    """(parameters, body lines) of each kernel definition of ``source``, in launch order."""
    found = []
    for head in re.finditer(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?\w+\(([^)]*)\) \{', source):
        depth, end = 1, head.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(source[end], 0)
            end += 1
        found.append((re.findall(r"(\w+)(?:,|$)", head.group(1)), source[head.end():end - 1].splitlines()))
    return found


def names_in(line, params):
    return {p for p in params if re.search(rf"(?<![\w.]){p}(?!\w)", line)}


def written_in(line, params):
    """The parameters ``line`` stores to: an indexed or vector store, or an atomic."""
    return {p for p in params
            if re.search(rf"(?<![\w.]){p}\[[^=]*\]\s*=(?!=)|\*\(\w+\s*\*\)\({p}( \+[^=]*)?\)\s*=(?!=)"
                         rf"|atomic\w+\(\(?&?\(?{p}\b", line)}


def too_early(source):
    """Read from the printed CUDA alone, not from the pass's own walk: each statement
    of a launch before its first ``griddepcontrol.wait`` that names a parameter an
    earlier launch stores to, or stores to one an earlier launch names; a launch with
    no wait; a first launch that names any parameter before its wait."""
    found, written, named = [], set(), set()
    for n, (params, lines) in enumerate(cuda_kernels(source)):
        waits = [i for i, line in enumerate(lines) if WAIT + "();" in line]
        if not waits:
            found.append((n, "no wait"))
        for line in lines[:waits[0] if waits else len(lines)]:
            named_here = names_in(line, params)
            clash = named_here if n == 0 else named_here & written | written_in(line, params) & named
            if clash:
                found.append((n, line.strip()[:120]))
        for line in lines:
            written |= written_in(line, params)
            named |= names_in(line, params)
    return found


# Every fused-gradient candidate in a form of several launches: short rows (warp a
# row), rows in shared memory, granules and windows (odd V), rows cut across a cluster
# and a head in shared memory (long rows), the online and block-per-row fallbacks;
# with a weight and label smoothing, in place, summed, unreduced, float32.
GRADIENT_CASES = [((65536, 1000), "float16", {}), ((4096, 32000), "bfloat16", {}),
                  ((4096, 32000), "float16", {"in_place": True}),
                  ((3000, 50257), "float16", {"weight": True, "label_smoothing": 0.1}),
                  ((8192, 128256), "bfloat16", {}), ((2048, 256000), "bfloat16", {"reduction": "sum"}),
                  ((64, 20000), "float32", {"reduction": "none"})]


def test_no_launch_of_a_default_build_touches_an_earlier_launchs_buffers_before_its_wait(monkeypatch):
    """Every multi-launch build of the fused gradient under the default switch, checked
    by :func:`too_early` on its CUDA; the check itself fails on a build whose row
    kernel lost its wait."""
    monkeypatch.setattr(dependent_launch, "ENABLED", True)
    monkeypatch.setattr(dependent_launch, "EVERY_OP", False)
    checked = set()
    for shape, dtype, options in GRADIENT_CASES:
        problem = tf.make_problem("cross_entropy_grad", shape, dtype, **options)
        for candidate in registry.applicable(problem, CUDA):
            kernel = build_kernel(problem, CUDA, candidate.name)
            if kernel.launches() > 1:
                assert too_early(kernel.device_source()) == [], (candidate.name, shape, dtype, options)
                checked.add(candidate.name)
    fused = {c.name for c in registry.candidates("cross_entropy_grad", "cuda") if "from_lse" not in c.name}
    one_launch = {"cross_entropy_grad_row_targets", "cross_entropy_grad_row_in_shared_targets"}
    assert fused - checked <= one_launch
    source = build_kernel(tf.make_problem("cross_entropy_grad", (65536, 1000), "float16"), CUDA,
                          "cross_entropy_grad_warp_per_row_padded").device_source()
    second_wait = [m.start() for m in re.finditer(re.escape(WAIT + "();"), source)][1]
    without = source[:second_wait] + source[second_wait + len(WAIT) + 3:]
    assert any("denom_ptr" in line for _, line in too_early(without)) and (1, "no wait") in too_early(without)


def test_every_kernel_is_launched_programmatically(switched_on, monkeypatch):
    monkeypatch.setattr(kernel_module, "_CACHE", {})  # built here, not fetched
    found = {}
    tail = launch_order.tail

    def spy():
        passes = tail()

        def run(mod):
            out = passes(mod)
            for gvar, func in out.functions.items():
                if gvar.name_hint.startswith("main_kernel"):
                    found[gvar.name_hint] = list(func.attrs.get(grid_barrier.LAUNCH_PARAMS, []))
            return out
        return run
    monkeypatch.setattr(launch_order, "tail", spy)
    problem = tf.make_problem("cross_entropy_grad", (65536, 1000), "bfloat16")
    build_kernel(problem, CUDA, "cross_entropy_grad_warp_per_row_padded")
    assert len(found) == 3 and all(dependent_launch.TAG in params for params in found.values()), found


def test_nvcc_compiles_the_overlapped_launches(switched_on):
    if nvcc_path() is None:
        pytest.skip("needs nvcc")
    problem = tf.make_problem("cross_entropy_grad", (65536, 1000), "float16")
    report = cuda_report(build_kernel(problem, CUDA, "cross_entropy_grad_warp_per_row_padded"))
    assert report.ptx.count("griddepcontrol.wait") >= 3 and report.ptx.count("griddepcontrol.launch_dependents") == 2
    assert not any(report.spill_bytes.values()), report.spill_bytes


# -- on the GPU ---------------------------------------------------------------------------
def on_two_streams_and_in_a_graph(call, reference, check, inputs):
    """``call(*inputs)`` ten times on each of two streams and replayed in a CUDA graph
    against ``reference(*inputs)``."""
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    data = [inputs(k) for k in range(2)]
    refs = [reference(*d) for d in data]
    torch.cuda.synchronize()
    results = [[], []]
    for _ in range(10):
        for k, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                results[k].append(call(*data[k]))
    torch.cuda.synchronize()
    for k in range(2):
        for got in results[k]:
            check(got, refs[k])
    static = [t.clone() for t in inputs(7)]
    call(*static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(*static)
    for seed in (20, 21):
        for dst, src in zip(static, inputs(seed)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check(captured, reference(*static))


def assert_overlapped(problem):
    """Dispatch's kernel for ``problem`` has several launches, overlapped."""
    from tvm_fusion.dispatch import kernel_for

    kernel = kernel_for(problem, targets.for_device("cuda"))
    source = kernel.device_source()
    assert kernel.launches() > 1 and source.count(WAIT + "();") == kernel.launches(), kernel.candidate


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("shape, dtype", [((65536, 1000), "float16"), ((4096, 32000), "bfloat16"),
                                          ((3000, 50257), "float16")])
def test_overlapped_gradients_equal_float64_on_two_streams_and_in_a_graph(poisoned, switched_on, shape, dtype):
    from tvm_fusion import records

    records.invalidate()  # dispatch's kernels built again, with the switch on
    assert_overlapped(tf.make_problem("cross_entropy_grad", shape, dtype))
    try:
        on_two_streams_and_in_a_graph(*cross_entropy_training_step(shape, dtype))
    finally:
        records.invalidate()


def cross_entropy_training_step(shape, dtype):
    """(call, reference, check, inputs) for :func:`on_two_streams_and_in_a_graph`: the
    mean loss and its gradient through ``tvm_fusion.torch`` (a seventh of the rows
    ignored) against torch autograd in float64."""
    import tvm_fusion.torch as tft

    def inputs(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        logits = (torch.randn(shape, device="cuda", generator=gen) * 3).to(getattr(torch, dtype))
        target = torch.randint(0, shape[1], (shape[0],), device="cuda", generator=gen)
        target[::7] = -100
        return logits, target

    def call(logits, target):
        x = logits.clone().requires_grad_()
        loss = tft.cross_entropy(x, target, check_targets=False)
        (grad,) = torch.autograd.grad(loss, x)
        return loss.detach(), grad

    def reference(logits, target):
        x = logits.double().requires_grad_()
        loss = torch.nn.functional.cross_entropy(x, target)
        return loss.detach(), torch.autograd.grad(loss, x)[0]

    def check(got, want):
        tol = {"bfloat16": 1e-2, "float16": 2e-3}[dtype]
        torch.testing.assert_close(got[0].double(), want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1].double(), want[1], rtol=tol, atol=tol * float(want[1].abs().max()))

    return call, reference, check, inputs


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu() or torch is None, reason="needs a CUDA GPU and torch")
@pytest.mark.parametrize("shape, dtype, layout", [((256, 2048, 7, 7), "float16", "NCHW"),
                                                  ((64, 256, 56, 56), "bfloat16", "NHWC"),
                                                  ((32, 64, 112, 112), "float16", "NCHW")])
def test_overlapped_batch_norm_backward_equals_float64_on_two_streams_and_in_a_graph(poisoned, switched_on, shape,
                                                                                      dtype, layout):
    """Training forward with running statistics (read and written in place) and backward,
    each of three launches overlapped: small_plane, channels_last; split_plane's
    backward (its forward is one launch)."""
    from tvm_fusion import records
    import tvm_fusion.torch as tft

    records.invalidate()
    n, c, h, w = shape
    problem_shape = (n, h, w, c) if layout == "NHWC" else shape
    assert_overlapped(tf.make_problem("bn_backward", problem_shape, dtype, layout=layout))
    if shape != (32, 64, 112, 112):
        assert_overlapped(tf.make_problem("bn_forward", problem_shape, dtype, layout=layout, training=True))
    memory_format = torch.channels_last if layout == "NHWC" else torch.contiguous_format

    def inputs(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = (torch.randn(shape, device="cuda", generator=gen) * 2 + 0.5).to(getattr(torch, dtype))
        dy = torch.randn(shape, device="cuda", generator=gen).to(getattr(torch, dtype))
        return x.contiguous(memory_format=memory_format), dy.contiguous(memory_format=memory_format)

    def call(x, dy):
        leaf = x.clone().requires_grad_()
        running = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")  # updated in place
        y = tft.batch_norm(leaf, *running, training=True, momentum=0.1)
        (dx,) = torch.autograd.grad(y, leaf, dy)
        return y.detach(), dx, *running

    def reference(x, dy):
        leaf = x.double().requires_grad_()
        running = (torch.zeros(c, device="cuda", dtype=torch.float64),
                   torch.ones(c, device="cuda", dtype=torch.float64))
        y = torch.nn.functional.batch_norm(leaf, *running, training=True, momentum=0.1)
        (dx,) = torch.autograd.grad(y, leaf, dy.double())
        return y.detach(), dx, *running

    def check(got, want):
        for g, w in zip(got[:2], want[:2]):
            torch.testing.assert_close(g.double(), w, rtol=2e-3, atol=2e-3 * float(w.abs().max()))
        for g, w in zip(got[2:], want[2:]):
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)

    try:
        on_two_streams_and_in_a_graph(call, reference, check, inputs)
    finally:
        records.invalidate()


def test_a_pointer_handed_to_a_call_counts_as_read_and_written(monkeypatch):
    """A call's pointer argument (cp.async's source prints as ``logits.data``, the key of
    the buffer it points into) counts as both read and written."""
    from tvm_fusion import single_launch

    monkeypatch.setattr(kernel_module, "_CACHE", {})  # built here, not fetched
    lowered = []
    merge = single_launch.merge_launch_pairs
    monkeypatch.setattr(single_launch, "merge_launch_pairs", lambda func: lowered.append(merge(func)) or lowered[-1])
    problem = tf.make_problem("cross_entropy_grad", (4096, 32000), "float16")
    build_kernel(problem, CUDA, "cross_entropy_grad_row_in_shared")
    launches = [s for s in lowered[-1].body.seq if isinstance(s, tirx.AttrStmt)]
    reads, writes = dependent_launch.accesses(launches[1])  # the rows: the row copied by cp.async
    assert "logits.data" in reads and "logits.data" in writes and "dlogits.data" in writes
    ptr = tirx.Var("p", tvm.ir.PointerType(tvm.ir.PrimType("float32")))
    assert dependent_launch.accesses(tirx.Evaluate(tirx.call_extern("void", "touch", ptr))) == ({"p"}, {"p"})
