"""The call a user makes: built once per call signature, then nothing done twice.

What must hold for the hot path to stay thin, checked by what it does rather than
by timing (timings come from ``tvm-fusion bench``'s api rows): no filesystem
access per call, no copy of aligned numpy inputs, a copy (and the right answer)
for misaligned ones, the launchers rebuilt when a log changes, and the 16-byte
parameter alignment changing nothing else in the compiled function."""

import copy
import os
import pathlib

import numpy as np
import pytest

import tvm
import tvm_fusion as tf
from helpers import assert_close, random_floats, rng, torch_or_none
from tvm_fusion import api, arrays, records, registry, targets
from tvm_fusion.contracts import bn_stats as bn_ref
from tvm_fusion.contracts import cross_entropy as ce_ref
from tvm_fusion.kernel import schedule_for, with_param_alignment

torch = torch_or_none()


def ce_inputs(gen, batch=64, classes=1000):
    logits = random_floats(gen, (batch, classes), "float32")
    target = gen.integers(0, classes, batch)
    target[::5] = -100
    return logits, target


def test_a_call_after_the_first_reads_no_file(monkeypatch):
    gen = rng()
    logits, target = ce_inputs(gen)
    x = random_floats(gen, (4, 8, 5, 5), "float32")
    tf.cross_entropy(logits, target)
    tf.bn_stats(x)

    def no_stat(*args, **kwargs):
        raise AssertionError("the hot path touched the filesystem")

    for name in ("stat", "exists", "open"):
        monkeypatch.setattr(pathlib.Path, name, no_stat)
    monkeypatch.setattr(os, "stat", no_stat)
    fresh_logits, fresh_target = ce_inputs(gen)
    assert_close(tf.cross_entropy(fresh_logits, fresh_target), ce_ref.reference(fresh_logits, fresh_target),
                 1e-5, 1e-5, "ce")
    fresh_x = random_floats(gen, (4, 8, 5, 5), "float32")
    mean, var = tf.bn_stats(fresh_x)
    ref_mean, ref_var = bn_ref.reference(fresh_x, "NCHW")
    assert_close(mean, ref_mean, 1e-5, 1e-5, "mean")
    assert_close(var, ref_var, 1e-5, 1e-5, "var")


def test_aligned_numpy_is_not_copied_and_misaligned_numpy_is(monkeypatch):
    gen = rng()
    logits, target = ce_inputs(gen, 32, 256)
    raw = np.empty(logits.size + 32, np.float32)
    offset = next(k for k in range(16) if (raw[k:].ctypes.data % 64) == 16)  # 16-aligned, not 64
    view = raw[offset : offset + logits.size].reshape(logits.shape)
    view[...] = logits
    copies = []
    real_copy = arrays.aligned_numpy_copy
    monkeypatch.setattr(arrays, "aligned_numpy_copy", lambda a: copies.append(a.shape) or real_copy(a))
    expected = ce_ref.reference(logits, target)
    assert_close(tf.cross_entropy(view, target), expected, 1e-5, 1e-5, "16-byte aligned")
    assert copies == []
    misaligned = raw[offset + 1 : offset + 1 + logits.size].reshape(logits.shape)  # 4 bytes off
    misaligned[...] = logits
    assert_close(tf.cross_entropy(misaligned, target), expected, 1e-5, 1e-5, "4 bytes off")
    assert copies == [logits.shape]


def test_array_subclasses_are_keyed_by_their_shape_not_their_id(tmp_path):
    """A launcher keyed by an object's id served a later memmap of another shape that
    reused the id: (6, 4) data reduced as (4, 6). Subclasses are keyed by their type,
    shape, dtype and contiguity, as their base class is."""
    import gc

    gen = rng()
    files = []
    for shape in ((4, 6), (6, 4)):
        files.append(tmp_path / f"{shape[0]}x{shape[1]}.npy")
        np.save(files[-1], random_floats(gen, shape, "float32"))
    for i in range(6):
        x = np.load(files[i % 2], mmap_mode="r+")
        mean, var = tf.bn_stats(x)
        ref_mean, ref_var = bn_ref.reference(np.asarray(x), "NCHW")
        assert_close(mean, ref_mean, 1e-5, 1e-5, f"memmap {x.shape} mean")
        assert_close(var, ref_var, 1e-5, 1e-5, f"memmap {x.shape} var")
        del x
        gc.collect()
    memmap, plain = arrays.signature(np.load(files[0], mmap_mode="r")), arrays.signature(np.ones((4, 6), np.float32))
    assert memmap[0] is np.memmap and memmap[1:] == plain[1:]


def test_read_only_and_byte_swapped_numpy_are_copied_not_refused():
    """DLPack exports neither a read-only array (np.load(mmap_mode="r"),
    np.frombuffer) nor a non-native byte order; the kernels only read their inputs,
    so each is copied once."""
    gen = rng()
    logits, target = ce_inputs(gen, 16, 40)
    expected = ce_ref.reference(logits, target)
    frozen_logits, frozen_target = logits.copy(), target.copy()
    frozen_logits.flags.writeable = frozen_target.flags.writeable = False
    assert_close(tf.cross_entropy(frozen_logits, frozen_target), expected, 1e-5, 1e-5, "read-only")
    assert_close(tf.cross_entropy(logits.astype(">f4"), target.astype(">i8")), expected, 1e-5, 1e-5, "big-endian")
    x = random_floats(gen, (4, 8, 5, 5), "float32")
    buffered = np.frombuffer(x.tobytes(), np.float32).reshape(x.shape)
    assert_close(tf.bn_stats(buffered)[0], bn_ref.reference(x, "NCHW")[0], 1e-5, 1e-5, "frombuffer")


def test_a_masked_array_is_refused_with_the_reason():
    masked = np.ma.masked_array(np.ones((4, 3), np.float32), mask=[[1, 0, 0]] * 4)
    with pytest.raises(TypeError, match="masked array"):
        tf.bn_stats(masked)


def test_tensors_without_dense_data_and_shapes_that_are_not_tuples_are_type_errors():
    """Meta, sparse and nested tensors reached DLPack (or torch's shape) with an
    internal error; a shape given as an int failed iterating it."""
    if torch is None:
        pytest.skip("needs torch")
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(3, 3)])
    for x, what in ((torch.randn(4, 3, device="meta"), "meta tensor"), (torch.randn(4, 3).to_sparse(), "sparse"),
                    (nested, "nested tensor")):
        with pytest.raises(TypeError, match=f"x is a .*{what}"):
            tf.bn_stats(x)
    with pytest.raises(TypeError, match="logits is a nested tensor"):
        tf.cross_entropy(nested, torch.tensor([0, 1]))
    for shape in (4, None):
        with pytest.raises(TypeError, match="shape must be a tuple of sizes"):
            tf.build("cross_entropy", shape)


def test_tune_many_specs_and_the_weight_option_are_checked():
    with pytest.raises(TypeError, match=r"each spec is \(op, shape, dtype, options dict\)"):
        tf.tune_many([("bn_stats", (4, 3), "float32")], target="llvm")
    with pytest.raises(TypeError, match="the weight option is a bool"):
        tf.build("cross_entropy", (4, 8), "float32", "llvm", weight="no")  # was taken as weight=True


def test_a_numpy_float32_label_smoothing_is_a_number():
    gen = rng()
    logits, target = ce_inputs(gen, 8, 20)
    expected = ce_ref.reference(logits, target, None, -100, "mean", 0.25)
    assert_close(tf.cross_entropy(logits, target, label_smoothing=np.float32(0.25)), expected, 1e-5, 1e-6, "np.float32")


def test_merging_a_log_rebuilds_the_launchers(tmp_path):
    gen = rng()
    logits, target = ce_inputs(gen, 8, 40)
    tf.cross_entropy(logits, target)
    assert api._LAUNCHERS
    records.merge([], tmp_path)
    assert not api._LAUNCHERS
    assert_close(tf.cross_entropy(logits, target), ce_ref.reference(logits, target), 1e-5, 1e-5, "after merge")


def test_options_of_another_type_are_checked_not_served_from_the_cache():
    logits, target = ce_inputs(rng(), 4, 10)
    tf.cross_entropy(logits, target, ignore_index=-100)
    tf.cross_entropy(logits, np.where(target == -100, 1, target), ignore_index=1)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        tf.cross_entropy(logits, target, ignore_index=True)  # True == 1, but not an int
    tf.cross_entropy(logits, target, label_smoothing=0.0)
    with pytest.raises(TypeError, match="label_smoothing must be a float"):
        tf.cross_entropy(logits, target, label_smoothing=False)
    tf.cross_entropy(logits, target, check_targets=True)
    with pytest.raises(TypeError, match="check_targets must be True or False"):
        tf.cross_entropy(logits, target, check_targets=1)
    with pytest.raises(ValueError, match="reduction must be one of"):
        tf.cross_entropy(logits, target, reduction=["mean"])  # unhashable: the contract names it


def test_an_unhashable_ignore_index_the_contract_takes_is_served_uncached():
    """A 0-d numpy int ignore_index (torch takes it) cannot key the launcher cache: it was
    a bare 'unhashable type' TypeError, raised on storing the launcher."""
    logits, target = ce_inputs(rng(), 8, 10)
    target[::5] = 3  # ce_inputs' ignored rows, here ignore_index 3
    expected = ce_ref.reference(logits, target, ignore_index=3, reduction="none")
    for _ in range(2):
        got = tf.cross_entropy(logits, target, ignore_index=np.array(3), reduction="none")
        assert_close(got, expected, 1e-5, 1e-6, "numpy")
    if torch is None:
        return
    import tvm_fusion.torch as tft

    x = torch.from_numpy(logits).requires_grad_()
    loss = tft.cross_entropy(x, torch.from_numpy(target), ignore_index=np.array(3))
    ref = torch.from_numpy(logits).double().requires_grad_()
    ref_loss = torch.nn.functional.cross_entropy(ref, torch.from_numpy(target), ignore_index=3)
    loss.backward()
    ref_loss.backward()
    assert_close(loss.detach(), ref_loss.detach(), 1e-5, 1e-6, "torch loss")
    assert_close(x.grad, ref.grad, 1e-5, 1e-6, "torch grad")


def test_a_bad_target_still_raises_on_every_call_of_a_cached_signature():
    logits, target = ce_inputs(rng(), 6, 10)
    tf.cross_entropy(logits, target)
    bad = target.copy()
    bad[3] = 10
    for _ in range(2):
        with pytest.raises(tf.TargetOutOfRangeError, match=r"target\[3\] = 10"):
            tf.cross_entropy(logits, bad)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_mixed_kinds_are_named():
    logits, target = ce_inputs(rng(), 4, 10)
    with pytest.raises(ValueError, match="target must be of the same kind"):
        tf.cross_entropy(torch.from_numpy(logits), target)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_torch_requires_grad_and_sliced_inputs():
    gen = rng()
    logits, target = ce_inputs(gen, 16, 64)
    lt = torch.from_numpy(logits).requires_grad_()
    tt = torch.from_numpy(target)
    assert_close(tf.cross_entropy(lt, tt).detach().numpy(), ce_ref.reference(logits, target), 1e-5, 1e-5, "grad")
    wide = torch.from_numpy(random_floats(gen, (16, 65), "float32"))
    sliced = wide[:, 1:]  # not contiguous
    offset = torch.from_numpy(random_floats(gen, (16 * 64 + 1,), "float32"))[1:].view(16, 64)  # 4 bytes off
    for x in (sliced, offset):
        assert_close(tf.cross_entropy(x, tt).numpy(), ce_ref.reference(x.numpy(), target), 1e-5, 1e-5, "copied")


def cases():
    cpu, cuda = targets.resolve("llvm"), targets.resolve({"kind": "cuda", "arch": "sm_90"})
    problems = [tf.make_problem("bn_stats", (8, 16, 7, 7), "float16"),
                tf.make_problem("bn_stats", (8, 7, 7, 32), "bfloat16", layout="NHWC"),
                tf.make_problem("cross_entropy", (64, 1000), "float32", weight=True, label_smoothing=0.1),
                tf.make_problem("cross_entropy", (64, 50257), "bfloat16", reduction="none")]
    for problem in problems:
        for target in (cpu, cuda):
            for cand in registry.applicable(problem, target):
                yield pytest.param(problem, target, cand.name, id=f"{cand.name}-{problem.key()}")


@pytest.mark.parametrize("problem, target, candidate", list(cases()))
def test_param_alignment_changes_nothing_but_the_alignment(problem, target, candidate):
    mod = schedule_for(problem, target, candidate)[0].mod
    tvm.ir.assert_structural_equal(with_param_alignment(mod, 64), mod)  # 64 is TVM's default
    aligned = with_param_alignment(mod)
    assert [p.data_alignment for p in aligned["main"].params] == [16] * len(mod["main"].params)


def test_a_flag_view_of_raw_memory_receives_the_kernels_flag():
    """The CUDA check hands kernels a view of pinned host memory
    (``target_check.int32_view``); the same view over host memory on the CPU
    shows that the kernel writes through it: the first bad row, then B."""
    from tvm_fusion import target_check

    gen = rng()
    logits, target = ce_inputs(gen, 48, 100)
    kernel = tf.build("cross_entropy", logits.shape, "float32", target="llvm", reduction="none")
    slots = np.full(8, -1, np.int32)  # 32 bytes: a 16-byte aligned slot inside
    slot = next(k for k in range(4) if (slots[k:].ctypes.data % 16) == 0)
    flag = target_check.int32_view(slots[slot:].ctypes.data, 1, 0)  # kDLCPU
    assert tuple(flag.shape) == (1,) and str(flag.dtype) == "int32"
    loss = np.full(48, np.nan, np.float32)
    bad = target.copy()
    bad[17] = 1000
    kernel(logits, bad, loss, flag)
    assert slots[slot] == 17 and (slots[:slot] == -1).all() and (slots[slot + 1 :] == -1).all()
    kernel(logits, target, loss, flag)
    assert slots[slot] == 48
    assert_close(loss, ce_ref.reference(logits, target, reduction="none"), 1e-5, 1e-5, "loss")


def test_a_reduced_loss_is_a_0d_parameter_and_the_kernel_code_is_the_same():
    """A mean's loss param is 0-d (no view per call): the generated CUDA is the same
    as with the (1,) buffer, and a 0-d numpy output receives the loss on the CPU."""
    from tvm_fusion.kernel import compiled_form

    gen = rng()
    problem = tf.make_problem("cross_entropy", (96, 640), "float16", reduction="mean")
    cuda = targets.resolve("cuda")
    sch, _ = schedule_for(problem, cuda, "cross_entropy_warp_per_row")
    compiled = compiled_form(sch.mod, problem)
    assert [tuple(p.shape) for p in compiled["main"].params][-2:] == [(), (1,)]  # loss, first_bad_row
    with cuda:
        plain = tvm.compile(with_param_alignment(sch.mod), target=cuda)
        zero_d = tvm.compile(compiled, target=cuda)
    assert plain.mod.imports[0].inspect_source() == zero_d.mod.imports[0].inspect_source()
    none = tf.make_problem("cross_entropy", (1, 640), "float32", reduction="none")  # a (1,) per-row loss stays
    sch_none, _ = schedule_for(none, targets.resolve("llvm"), "cross_entropy_parallel")
    assert tuple(compiled_form(sch_none.mod, none)["main"].params[2].shape) == (1,)
    logits, target = ce_inputs(gen, 40, 300)
    kernel = tf.build("cross_entropy", logits.shape, "float32", target="llvm", reduction="sum")
    assert kernel.outputs[-2] == ("loss", (), "float32")
    loss = tf.cross_entropy(logits, target, reduction="sum")
    assert loss.shape == () and np.isclose(loss, ce_ref.reference(logits, target, reduction="sum"), rtol=1e-5)


def test_kernels_past_two_to_the_31_elements_get_the_same_signature_edits():
    """int64-indexed kernels print their shapes as T.int64(...): the alignment and the
    0-d loss apply to them too (a (1,) loss there broke the gradient's scaling)."""
    from tvm_fusion.kernel import compiled_form

    problem = tf.make_problem("cross_entropy", (32768, 151936), "bfloat16")
    sch, _ = schedule_for(problem, targets.resolve("cuda"), "cross_entropy_online")
    params = compiled_form(sch.mod, problem)["main"].params
    assert [p.data_alignment for p in params] == [16] * len(params)
    assert [tuple(int(d) for d in p.shape) for p in params][-2:] == [(), (1,)]


def test_a_launcher_does_not_keep_its_first_calls_tensors_alive():
    """The launcher cache outlives every call: a closure over the first call's
    arguments would keep its logits (gigabytes on a large vocabulary) alive."""
    if torch is None:
        pytest.skip("needs torch")
    import gc
    import weakref

    import tvm_fusion.torch as tft

    target = torch.randint(0, 100, (64,))
    for call in (lambda x: tf.cross_entropy(x, target), lambda x: tft.cross_entropy(x, target).backward()):
        logits = torch.randn(64, 100, requires_grad=True)
        alive = weakref.ref(logits)
        call(logits)
        del logits
        gc.collect()
        assert alive() is None


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_a_4d_torch_input_goes_in_as_it_is_and_the_kernel_code_is_the_same(monkeypatch):
    """bn_stats' kernels take (N, C, L) or (M, C); a contiguous 4-d torch tensor is
    passed as it is to a kernel compiled for its shape (a view per call costs more
    host time than the rest of the argument handling): the generated CUDA is the
    same, and a later call makes no view and is right."""
    from tvm_fusion import dispatch
    from tvm_fusion.kernel import with_param_alignment

    cuda = targets.resolve("cuda")
    for shape, layout in (((8, 3, 24, 24), "NCHW"), ((4, 6, 6, 64), "NHWC")):
        problem = tf.make_problem("bn_stats", shape, "float16", layout=layout)
        plain = dispatch.kernel_for(problem, cuda)
        as_called = dispatch.kernel_for(problem, cuda, input_shapes=(("x", shape),))
        assert plain.params[0][1] == problem.shape and as_called.params[0][1] == shape
        assert plain.device_source() == as_called.device_source().replace("x_as_called", "x")
    with pytest.raises(ValueError, match="has 1728 elements, not the 1729"):
        sch, _ = schedule_for(tf.make_problem("bn_stats", (8, 3, 72), "float32"), targets.resolve("llvm"),
                              "bn_stats_parallel")
        with_param_alignment(sch.mod, shapes={"x": (1729,)})

    gen = rng()
    for shape, layout in (((5, 3, 7, 9), "NCHW"), ((4, 3, 5, 16), "NHWC")):
        x = torch.from_numpy(random_floats(gen, shape, "float32"))
        tf.bn_stats(x, layout)
        fresh = torch.from_numpy(random_floats(gen, shape, "float32"))

        def no_view(self, *args, **kwargs):
            raise AssertionError("the hot path made a view")

        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "view", no_view)
            mean, var = tf.bn_stats(fresh, layout)
        ref_mean, ref_var = bn_ref.reference(fresh.numpy(), layout)
        assert_close(mean.numpy(), ref_mean, 1e-5, 1e-5, f"mean {layout}")
        assert_close(var.numpy(), ref_var, 1e-5, 1e-5, f"var {layout}")


@pytest.mark.skipif(torch is None, reason="needs torch")
@pytest.mark.parametrize("shape, memory_format", [
    ((4, 6, 5, 7), "contiguous"),  # NCHW: the kernels take (N, C, H*W), built here for (N, C, H, W)
    ((4, 6, 5, 7), "channels_last"),  # the (N*H*W, C) kernels built for the permuted (N, H, W, C)
    ((3, 6, 2, 3, 4), "contiguous"),  # rank 5, (N, C, D*H*W)
    ((5, 6), "contiguous"),  # rank 2: already the kernel's shape
])
def test_a_batch_norm_training_step_makes_no_view(poisoned, monkeypatch, shape, memory_format):
    """x, y, dy and dx go to the BatchNorm kernels in the input's own shape (its
    permutation to (N, H, W, C) when channels-last): after the first step, a forward
    and backward make no view (1.3-2.7 us of host time each on the CI machine, five a
    step before), and are right against float64 torch."""
    import tvm_fusion.torch as tft

    gen = torch.Generator().manual_seed(int(rng().integers(2**31)))
    fmt = getattr(torch, f"{memory_format}_format" if memory_format == "contiguous" else memory_format)
    module = tft.BatchNorm2d(6) if len(shape) == 4 else (tft.BatchNorm1d(6) if len(shape) < 4 else None)
    if module is None:
        module = type("BatchNorm3d", (tft.batch_norm.__globals__["_BatchNormMixin"], torch.nn.BatchNorm3d), {})(6)
    with torch.no_grad():
        module.weight.copy_(torch.randn(6, generator=gen))
        module.bias.copy_(torch.randn(6, generator=gen))
    reference = copy.deepcopy(module).double()
    module(torch.randn(shape, generator=gen).to(memory_format=fmt).requires_grad_()).sum().backward()
    module.zero_grad(set_to_none=True)

    x = (torch.randn(shape, generator=gen) * 2 + 3).to(memory_format=fmt).requires_grad_()
    dy = torch.randn(shape, generator=gen).to(memory_format=fmt)

    def no_view(self, *args, **kwargs):
        raise AssertionError("the hot path made a view")

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "view", no_view)
        y = module(x)
        y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    y64 = torch.nn.functional.batch_norm(x64, None, None, reference.weight, reference.bias, True)
    y64.backward(dy.double())
    assert y.is_contiguous(memory_format=fmt) and x.grad.is_contiguous(memory_format=fmt)
    assert_close(y.detach().numpy(), y64.detach().numpy(), 1e-5, 1e-5, "y")
    assert_close(x.grad.numpy(), x64.grad.numpy(), 1e-5, 1e-5, "dx")
    assert_close(module.weight.grad.numpy(), reference.weight.grad.numpy(), 1e-4, 1e-4, "dweight")
    assert_close(module.bias.grad.numpy(), reference.bias.grad.numpy(), 1e-4, 1e-4, "dbias")



@pytest.mark.parametrize("op, names", [("bn_forward", ("x", "y")), ("bn_backward", ("x", "dy", "dx")),
                                       ("bn_backward_dx", ("x", "dy", "dx"))])
def test_batch_norm_kernels_taking_the_inputs_shape_generate_the_same_cuda(op, names):
    """The generated CUDA of every BatchNorm candidate is the same when its x, y, dy
    and dx parameters take the input's own shape (what tvm_fusion.torch builds)."""
    from tvm_fusion.kernel import build_kernel

    cuda = targets.resolve({"kind": "cuda", "arch": "sm_90"})
    for shape, layout in (((8, 16, 7, 7), "NCHW"), ((4, 6, 6, 64), "NHWC")):
        problem = tf.make_problem(op, shape, "float16", layout=layout)
        for cand in registry.applicable(problem, cuda):
            plain = build_kernel(problem, cuda, cand.name)
            as_called = build_kernel(problem, cuda, cand.name, input_shapes=tuple((n, shape) for n in names))
            assert {p[0]: p[1] for p in as_called.params if p[0] in names} == dict.fromkeys(names, shape)
            source = as_called.device_source()
            for name in names:
                source = source.replace(f"{name}_as_called", name)
            assert plain.device_source() == source, f"{cand.name} {layout}"


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_cpu_scratch_is_per_thread_and_reused(monkeypatch):
    """A CPU call's scratch (row losses, lse, the flag) is one set per host thread,
    reused by that thread's later calls: threads calling one launcher at once each
    get their own answer, a bad target in one call is not remembered by the next, and
    a thread's second call allocates only what it returns."""
    import threading

    import tvm_fusion.torch as tft

    gen = rng()
    batch, classes = 48, 300
    inputs = [(torch.from_numpy(random_floats(gen, (batch, classes), "float32")).requires_grad_(),
               torch.from_numpy(gen.integers(0, classes, batch))) for _ in range(4)]
    want = [(ce_ref.reference(lg.detach().numpy(), t.numpy()), None) for lg, t in inputs]
    for lg, t in inputs[:1]:
        tft.cross_entropy(lg, t).backward()  # builds the launcher
    got, errors = {}, []

    def worker(k):
        try:
            lg, t = inputs[k]
            for _ in range(25):
                loss = tft.cross_entropy(lg, t)
                got[k] = float(loss.detach())
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for k in range(4):
        assert_close(np.float64(got[k]), want[k][0], 1e-5, 1e-5, f"thread {k}")

    lg, t = inputs[0]
    bad = t.clone()
    bad[7] = classes
    with pytest.raises(tf.TargetOutOfRangeError, match=r"target\[7\]"):
        tft.cross_entropy(lg, bad)
    assert_close(np.float64(float(tft.cross_entropy(lg, t).detach())), want[0][0], 1e-5, 1e-5, "after a bad target")

    made = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(a) or empty(*a, **k))
    tft.cross_entropy(lg, t)
    assert len(made) == 2, f"a call allocated {made}: the loss and the gradient only"
