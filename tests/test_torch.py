"""tvm_fusion.torch: cross entropy as a differentiable op, eager and compiled.

Every loss and gradient is compared with float64 torch autograd on the same
(rounded) logits, with fresh random data and outputs poisoned with NaN before the
kernel runs (the launcher's allocations are swapped for NaN-filled ones), so an
element the kernel does not write fails."""

import math

import pytest

from helpers import has_gpu, rng, torch_or_none

torch = torch_or_none()
pytestmark = pytest.mark.skipif(torch is None, reason="needs torch")
if torch is not None:
    import torch.nn.functional as F

    import tvm_fusion as tf
    import tvm_fusion.torch as tft

# (loss rtol, gradient tolerance as a fraction of the largest gradient element)
TOL = {"float32": (1e-5, 1e-5), "bfloat16": (1e-5, 1e-2), "float16": (1e-5, 2e-3)}
OPTIONS = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"ignore_index": 3, "label_smoothing": 0.1},
    {"weight": True, "reduction": "mean"},
    {"weight": True, "reduction": "none", "label_smoothing": 0.2},
    {"weight": True, "reduction": "sum", "ignore_index": 0},
]


def make_inputs(gen, batch, classes, dtype, options, device="cpu"):
    seed = int(gen.integers(2**31))
    torch.manual_seed(seed)
    logits = (torch.randn(batch, classes, device=device) * 3).to(getattr(torch, dtype))
    target = torch.randint(0, classes, (batch,), device=device)
    ignore = options.get("ignore_index", -100)
    target[:: 5] = ignore
    weight = torch.rand(classes, device=device) + 0.1 if options.get("weight") else None
    kwargs = {k: v for k, v in options.items() if k != "weight"}
    return logits, target, weight, kwargs


def reference(logits, target, weight, upstream, **kwargs):
    x = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(x, target, None if weight is None else weight.double(), **kwargs)
    (grad,) = torch.autograd.grad(loss, x, upstream.double())
    return loss, grad


def loss_atol(logits):
    """A row's loss is ``lse - logit`` in float32: a small loss keeps the rounding of
    ``lse``, a few ulps of the logits' size (H200: 3e-7 on a loss of 0.018, 7x10 fp16
    logits up to 5), not of the loss's."""
    return max(1e-7, 8 * 2.0**-24 * (float(logits.detach().abs().max()) + math.log(logits.shape[-1])))


def check_loss_and_grad(logits, target, weight, kwargs, dtype):
    x = logits.clone().requires_grad_()
    loss = tft.cross_entropy(x, target, weight, **kwargs)
    upstream = torch.rand(loss.shape, device=loss.device) + 0.5  # not 1: the backward must scale
    (grad,) = torch.autograd.grad(loss, x, upstream)
    ref_loss, ref_grad = reference(logits, target, weight, upstream, **kwargs)
    loss_rtol, grad_tol = TOL[dtype]
    # float32 lse over V classes is off by up to ~log2(V) roundings, and every p with it
    grad_tol = max(grad_tol, 1e-5 * math.log2(logits.shape[1] + 1) / 4)
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
    torch.testing.assert_close(loss.double(), ref_loss, rtol=loss_rtol, atol=loss_atol(logits), equal_nan=True)
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    scale = float(ref_grad.abs().max()) or 1.0
    torch.testing.assert_close(grad.double(), ref_grad, rtol=grad_tol, atol=grad_tol * scale, equal_nan=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_loss_and_grad_equal_torch_float64_autograd(poisoned, dtype, options):
    gen = rng()
    logits, target, weight, kwargs = make_inputs(gen, 37, 1001, dtype, options)
    check_loss_and_grad(logits, target, weight, kwargs, dtype)


@pytest.mark.parametrize("batch, classes", [(1, 1), (3, 50257), (64, 7), (200, 4096)])
def test_odd_and_large_vocabularies(poisoned, batch, classes):
    gen = rng()
    logits, target, weight, kwargs = make_inputs(gen, batch, classes, "float32", {"label_smoothing": 0.05})
    check_loss_and_grad(logits, target, weight, kwargs, "float32")


def test_the_target_class_term_keeps_its_precision_near_p_equal_1(poisoned):
    """p - 1 in float32: a confident bf16 row's gradient at the target is -(1 - p),
    not 0 (Liger's bf16 arithmetic lost it, their PR 1329)."""
    logits = torch.full((8, 512), -4.0).bfloat16()
    target = torch.arange(8) * 7
    logits[torch.arange(8), target] = 12.0  # p ~ 1 - 5e-5
    x = logits.clone().requires_grad_()
    tft.cross_entropy(x, target, reduction="sum").backward()
    ref_loss, ref_grad = reference(logits, target, None, torch.tensor(1.0), reduction="sum")
    at_target = x.grad[torch.arange(8), target].double()
    torch.testing.assert_close(at_target, ref_grad[torch.arange(8), target], rtol=1e-2, atol=0)
    assert (at_target < 0).all()


def test_all_rows_ignored_give_torchs_nan_mean_and_zero_grad(poisoned):
    logits = torch.randn(6, 10, requires_grad=True)
    target = torch.full((6,), -100)
    loss = tft.cross_entropy(logits, target)
    assert torch.isnan(loss)
    loss.backward()
    ref = F.cross_entropy(logits.detach().clone().requires_grad_(), target)
    assert torch.isnan(ref)
    assert torch.isnan(logits.grad).all() or (logits.grad == 0).all()
    ref_x = logits.detach().clone().requires_grad_()
    F.cross_entropy(ref_x, target).backward()
    torch.testing.assert_close(logits.grad, ref_x.grad, equal_nan=True)


def test_no_grad_calls_the_forward_kernel(poisoned):
    gen = rng()
    logits, target, weight, kwargs = make_inputs(gen, 16, 300, "float32", {"weight": True})
    with torch.no_grad():
        loss = tft.cross_entropy(logits.requires_grad_(), target, weight)
    assert not loss.requires_grad
    # float64 torch, not tf.cross_entropy: under no_grad the op *is* tf.cross_entropy
    ref_loss, _ = reference(logits, target, weight, torch.ones(()))
    torch.testing.assert_close(loss.double(), ref_loss, rtol=TOL["float32"][0], atol=loss_atol(logits))


def test_the_eager_graph_node_is_ours_and_a_functorch_transform_gets_torchs_apply():
    """The eager path builds its graph node with the C++ apply
    (``tvm_fusion.torch.function_apply``, without torch's Python layer); under a
    functorch transform it is torch's own ``Function.apply``, which asks for a
    ``setup_context`` as it did before."""
    gen = rng()
    logits, target, _, _ = make_inputs(gen, 8, 50, "float32", {})
    x = logits.clone().requires_grad_()
    loss = tft.cross_entropy(x, target)
    assert type(loss.grad_fn).__name__ == "_CrossEntropyBackward"
    (grad,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(grad.double(), reference(logits, target, None, torch.ones((), dtype=torch.float64))[1])
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda z: tft.cross_entropy(z, target))(logits)


def test_the_module_equals_nn_cross_entropy_loss():
    gen = rng()
    logits, target, weight, kwargs = make_inputs(gen, 24, 513, "float32", {"weight": True})
    for ours, theirs in (
        (tft.CrossEntropyLoss(weight, label_smoothing=0.1), torch.nn.CrossEntropyLoss(weight, label_smoothing=0.1)),
        (tft.CrossEntropyLoss(reduction="none", ignore_index=2), torch.nn.CrossEntropyLoss(reduction="none", ignore_index=2)),
    ):
        x, y = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        labels = target.clamp(min=0) if ours.ignore_index != -100 else target  # class 0 for the -100 rows
        a, b = ours(x, labels), theirs(y, labels)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        a.sum().backward()
        b.sum().backward()
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-7)
    with pytest.warns(UserWarning):
        legacy = tft.CrossEntropyLoss(size_average=False)
    assert legacy.reduction == "sum"
    assert "label_smoothing=0.0" in repr(tft.CrossEntropyLoss())


def test_a_bad_target_raises_the_clear_error():
    logits = torch.randn(12, 40, requires_grad=True)
    target = torch.randint(0, 40, (12,))
    target[5] = 40
    with pytest.raises(tf.TargetOutOfRangeError, match=r"target\[5\] = 40 is outside \[0, 40\)"):
        tft.cross_entropy(logits, target)


@pytest.mark.parametrize("bad, error, words", [
    (lambda: tft.cross_entropy(torch.randn(4, 5, requires_grad=True), torch.randint(0, 5, (3,))), ValueError, ["target"]),
    (lambda: tft.cross_entropy(torch.randn(4, 5, requires_grad=True), torch.randint(0, 5, (4,)), reduction="avg"),
     ValueError, ["reduction"]),
    (lambda: tft.cross_entropy(torch.randn(2, 4, 5, requires_grad=True), torch.randint(0, 5, (2, 5))), ValueError,
     ["logits"]),
    (lambda: tft.cross_entropy(torch.randn(4, 5, requires_grad=True), torch.rand(4, 5)), ValueError, ["target.shape"]),
    (lambda: tft.cross_entropy(torch.randn(4, 5, requires_grad=True), torch.rand(4)), TypeError, ["target"]),
    (lambda: tft.cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long), ignore_index=2**64), ValueError,
     ["ignore_index must fit in int64", str(2**64)]),
    # int() took a float tensor as 3; torch refuses it
    (lambda: tft.cross_entropy(torch.randn(4, 5, requires_grad=True), torch.zeros(4, dtype=torch.long),
                               ignore_index=torch.tensor(3.5)), TypeError, ["ignore_index must be an int", "3.5"]),
])
def test_bad_arguments_are_named(bad, error, words):
    with pytest.raises(error) as info:
        bad()
    for word in words:
        assert word in str(info.value)


def test_a_second_backward_through_the_same_loss_is_a_clear_error():
    logits = torch.randn(8, 30, requires_grad=True)
    loss = tft.cross_entropy(logits, torch.randint(0, 30, (8,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_a_second_derivative_is_a_clear_error_not_a_silent_zero():
    """Under create_graph=True the gradient carries a node that raises: a gradient
    penalty through the loss would otherwise drop its second-order term silently."""
    gen = rng()
    logits, target, weight, kwargs = make_inputs(gen, 6, 11, "float32", {"label_smoothing": 0.1})
    x = logits.clone().requires_grad_()
    (grad,) = torch.autograd.grad(tft.cross_entropy(x, target, **kwargs), x, create_graph=True)
    _, ref_grad = reference(logits, target, None, torch.ones(()), **kwargs)
    torch.testing.assert_close(grad.detach().double(), ref_grad, rtol=1e-5, atol=1e-6)  # the first order holds
    with pytest.raises(RuntimeError, match="tvm_fusion.torch.cross_entropy has no second derivative"):
        (grad.pow(2).sum() + x.sum()).backward()
    x.grad = None
    tft.cross_entropy(x, target, **kwargs).backward()  # a plain backward leaves no such node
    assert x.grad.grad_fn is None and not x.grad.requires_grad


def test_meta_and_fake_tensors_get_the_losss_shape_without_a_kernel():
    """Shape inference (a model built on the meta device, FakeTensorMode) goes through
    the custom ops' fake functions, as torch's own ops do."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    logits = torch.randn(8, 100, device="meta", requires_grad=True)
    target = torch.zeros(8, dtype=torch.long, device="meta")
    loss = tft.cross_entropy(logits, target)
    assert loss.device.type == "meta" and loss.shape == () and loss.dtype == torch.float32
    loss.backward()
    assert logits.grad.shape == (8, 100) and logits.grad.device.type == "meta"
    assert tft.cross_entropy(logits.detach(), target, reduction="none").shape == (8,)
    with FakeTensorMode():
        fake = torch.randn(4, 50, requires_grad=True)
        loss = tft.CrossEntropyLoss()(fake, torch.randint(0, 50, (4,)))
        loss.backward()
        assert loss.shape == () and fake.grad.shape == (4, 50)


META = {"device": "meta"}


@pytest.mark.parametrize("bad, error, words", [
    (lambda: (torch.randn(5, **META), torch.zeros(5, dtype=torch.long, **META)), ValueError, "rank 2 (B, V)"),
    (lambda: (torch.randn(4, 5, **META), torch.zeros(3, dtype=torch.long, **META)), ValueError,
     "target.shape must be (B,) = (4,)"),
    (lambda: (torch.randn(4, 5, **META), torch.zeros(4, **META)), TypeError, "integer class indices"),
    (lambda: (torch.randn(4, 5, **META), torch.zeros(4, dtype=torch.long)), ValueError,
     "target must be on the same device as logits (meta), got cpu"),
    (lambda: (torch.randn(4, 5, **META), torch.zeros(4, dtype=torch.long, **META), {"reduction": "avg"}), ValueError,
     "reduction must be one of"),
    (lambda: (torch.randn(4, 5, **META), torch.zeros(4, dtype=torch.long, **META), {"label_smoothing": 3.0}),
     ValueError, "label_smoothing must be in [0, 1]"),
    (lambda: (torch.randn(4, 5, **META), torch.zeros(4, dtype=torch.long, **META), {"weight": torch.ones(6, **META)}),
     ValueError, "weight.shape must be (V,) = (5,)"),
    # a Parameter goes to the dispatcher, whose own errors named an FX-like schema, not the argument's problem
    (lambda: (torch.nn.Parameter(torch.randn(4, 5)), torch.zeros(4, dtype=torch.long), {"ignore_index": 1.5}),
     TypeError, "ignore_index must be an int, got 1.5"),
    (lambda: (torch.nn.Parameter(torch.randn(4, 5)), torch.zeros(4, dtype=torch.long), {"ignore_index": 2**70}),
     ValueError, "ignore_index must fit in int64"),
    (lambda: (torch.nn.Parameter(torch.randn(4, 5)), [0, 1, 2, 3]), TypeError, "target must be a torch tensor, got list"),
])
def test_a_call_without_a_launcher_is_checked_as_one_with(bad, error, words):
    """Meta tensors, fake ones and subclasses reach the custom ops, not a launcher: a bad
    call must raise the contract's error, not return a loss's shape (meta) or the
    dispatcher's schema error (a Parameter)."""
    logits, target, *options = bad()
    with pytest.raises(error) as info:
        tft.cross_entropy(logits, target, **(options[0] if options else {}))
    assert words in str(info.value), f"{words!r} not in {info.value!s}"


def test_a_parameter_as_logits_equals_torch(poisoned):
    """A tensor subclass goes through the dispatcher, which hands the kernel a plain tensor."""
    gen = rng()
    logits, target, weight, kwargs = make_inputs(gen, 5, 17, "float32", {"weight": True})
    param = torch.nn.Parameter(logits.clone())
    loss = tft.cross_entropy(param, target, weight)
    loss.backward()
    ref_loss, ref_grad = reference(logits, target, weight, torch.ones(()))
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(param.grad.double(), ref_grad, rtol=1e-5, atol=1e-6)


def test_logits_that_are_not_a_tensor_are_a_type_error():
    with pytest.raises(TypeError, match="logits must be a torch tensor, got list"):
        tft.cross_entropy([[1.0, 2.0]], torch.tensor([0]))


def test_opcheck_both_custom_ops():
    gen = rng()
    for options in ({}, {"weight": True, "reduction": "none", "label_smoothing": 0.1}):
        logits, target, weight, kwargs = make_inputs(gen, 9, 33, "float32", options)
        args = (logits.requires_grad_(), target, weight, kwargs.get("ignore_index", -100),
                kwargs.get("reduction", "mean"), kwargs.get("label_smoothing", 0.0), True)
        torch.library.opcheck(torch.ops.tvm_fusion.cross_entropy_fused.default, args)
        torch.library.opcheck(torch.ops.tvm_fusion.cross_entropy.default, (logits.detach(), *args[1:]))


def test_torch_compile_fullgraph_trains_a_model_through_it():
    torch.manual_seed(int(rng().integers(2**31)))
    model = torch.nn.Linear(64, 300)
    reference_model = torch.nn.Linear(64, 300)
    reference_model.load_state_dict(model.state_dict())
    loss_fn = tft.CrossEntropyLoss(label_smoothing=0.1)

    def forward(m, x, y, fn):
        return fn(m(x), y)

    # fullgraph: a graph break at the loss would raise; AOT autograd traces the backward too
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    x, y = torch.randn(32, 64), torch.randint(0, 300, (32,))
    ours = compiled(model, x, y, loss_fn)
    theirs = forward(reference_model, x, y, torch.nn.CrossEntropyLoss(label_smoothing=0.1))
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.weight.grad, reference_model.weight.grad, rtol=1e-4, atol=1e-6)


# -- on the GPU ----------------------------------------------------------------------------
gpu = pytest.mark.skipif(torch is None or not has_gpu(), reason="needs a CUDA GPU and torch")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("batch, classes", [(37, 1001), (512, 32000), (5, 50257)])
def test_loss_and_grad_on_gpu(poisoned, dtype, options, batch, classes):
    gen = rng()
    logits, target, weight, kwargs = make_inputs(gen, batch, classes, dtype, options, device="cuda")
    check_loss_and_grad(logits, target, weight, kwargs, dtype)
    tf.check_targets()


@pytest.mark.gpu
@gpu
def test_past_two_to_the_31_elements_on_gpu():
    """32768 x 151936 bf16 (5e9 elements): loss and gradient against float64 torch on
    row blocks (the whole float64 reference would not fit)."""
    batch, classes = 32768, 151936
    torch.manual_seed(int(rng().integers(2**31)))
    logits = (torch.randn(batch, classes, device="cuda", dtype=torch.bfloat16) * 2)
    target = torch.randint(0, classes, (batch,), device="cuda")
    target[::11] = -100
    x = logits.requires_grad_()
    loss = tft.cross_entropy(x, target, check_targets=False)
    loss.backward()
    valid = int((target != -100).sum())
    total = 0.0
    rows = [0, 1, batch // 2, batch - 2, batch - 1] + list(range(20000, 20000 + 256))
    for start in range(0, batch, 4096):
        block = logits[start : start + 4096].detach().double()
        total += float(F.cross_entropy(block, target[start : start + 4096], reduction="sum"))
    torch.testing.assert_close(loss.double(), torch.tensor(total / valid, device="cuda", dtype=torch.float64),
                               rtol=1e-5, atol=0)
    pick = torch.tensor(rows, device="cuda")
    block = logits.detach()[pick].double().requires_grad_()
    (F.cross_entropy(block, target[pick], reduction="sum") / valid).backward()
    torch.testing.assert_close(x.grad[pick].double(), block.grad, rtol=1e-2, atol=1e-2 * float(block.grad.abs().max()))


@pytest.mark.gpu
@gpu
def test_batch_norm_past_two_to_the_31_elements_on_gpu():
    """512 x 256 x 130 x 130 fp16 (2.2e9 elements; dispatch picks split_plane_runs, whose
    grid walks back on 64-bit indices): the forward in training, the backward, and the
    running statistics, against float64 torch on four channels (a whole float64
    reference would not fit)."""
    shape, channels = (512, 256, 130, 130), [0, 1, 127, 255]
    torch.manual_seed(int(rng().integers(2**31)))
    x = (torch.randn(shape, device="cuda", dtype=torch.float16) * 2 + 0.5).requires_grad_()
    weight = (torch.rand(shape[1], device="cuda") + 0.5).requires_grad_()
    bias = torch.randn(shape[1], device="cuda").requires_grad_()
    running_mean, running_var = torch.zeros(shape[1], device="cuda"), torch.ones(shape[1], device="cuda")
    y = tft.batch_norm(x, running_mean, running_var, weight, bias, True, 0.1, 1e-5)
    dy = torch.randn(shape, device="cuda", dtype=torch.float16)
    y.backward(dy)
    pick = torch.tensor(channels, device="cuda")
    xs = x.detach()[:, pick].double().requires_grad_()
    ws, bs = weight.detach()[pick].double().requires_grad_(), bias.detach()[pick].double().requires_grad_()
    rm, rv = torch.zeros(len(channels), device="cuda", dtype=torch.float64), torch.ones(len(channels), device="cuda",
                                                                                       dtype=torch.float64)
    ys = F.batch_norm(xs, rm, rv, ws, bs, True, 0.1, 1e-5)
    ys.backward(dy[:, pick].double())
    torch.testing.assert_close(y[:, pick].double(), ys, rtol=2e-3, atol=2e-3 * float(ys.abs().max()))
    torch.testing.assert_close(x.grad[:, pick].double(), xs.grad, rtol=2e-3, atol=2e-3 * float(xs.grad.abs().max()))
    torch.testing.assert_close(weight.grad[pick].double(), ws.grad, rtol=1e-3, atol=1e-3 * float(ws.grad.abs().max()))
    torch.testing.assert_close(bias.grad[pick].double(), bs.grad, rtol=1e-3, atol=1e-3 * float(bs.grad.abs().max()))
    # float32 sums of 8.7e6 values a channel: about 1e-7 x sqrt(n) of the spread
    torch.testing.assert_close(running_mean[pick].double(), rm, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(running_var[pick].double(), rv, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@gpu
def test_a_training_step_replays_in_a_cuda_graph():
    torch.manual_seed(int(rng().integers(2**31)))
    model = torch.nn.Linear(256, 8192).cuda()
    reference_model = torch.nn.Linear(256, 8192).cuda()
    reference_model.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference_model.parameters(), lr=0.1)
    x = torch.randn(512, 256, device="cuda")
    y = torch.randint(0, 8192, (512,), device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        loss = tft.cross_entropy(model(x), y, check_targets=False)
        loss.backward()
        opt.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up: build, compile and allocate outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    reference_model.load_state_dict(model.state_dict())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_loss = step()
    for _ in range(3):
        x.copy_(torch.randn(512, 256, device="cuda"))
        y.copy_(torch.randint(0, 8192, (512,), device="cuda"))
        graph.replay()
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(reference_model(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured_loss, ref_loss, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model.weight, reference_model.weight, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@gpu
def test_a_bad_target_on_gpu_is_raised_later_and_the_context_lives():
    logits = torch.randn(256, 1000, device="cuda", requires_grad=True)
    target = torch.randint(0, 1000, (256,), device="cuda")
    bad = target.clone()
    bad[9] = 1000
    tf.check_targets()
    tft.cross_entropy(logits, bad).backward()
    with pytest.raises(tf.TargetOutOfRangeError, match=r"target\[9\] = 1000"):
        tf.check_targets()
    loss = tft.cross_entropy(logits, target)
    torch.testing.assert_close(loss, F.cross_entropy(logits, target), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_in_place_scaling_skips_a_scale_of_one_and_scales_otherwise(dtype):
    from tvm_fusion.torch.scale import scale_in_place

    torch.manual_seed(int(rng().integers(2**31)))
    x = torch.randn(1003).to(getattr(torch, dtype))
    before = x.clone()
    scale_in_place(x, torch.tensor(1.0))
    assert torch.equal(x, before)
    scale_in_place(x, torch.tensor(-2.75))
    torch.testing.assert_close(x, (before.float() * -2.75).to(x.dtype), rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_nan_upstream_gradient_gives_torchs_nan_gradient(reduction):
    """The in-place scaling skips an upstream gradient of exactly 1; a NaN one is not 1
    (on the CPU the skip's float compare was ordered, false for NaN, and the gradient
    came back as for an upstream of 1)."""
    torch.manual_seed(int(rng().integers(2**31)))
    logits, target = torch.randn(6, 10), torch.randint(0, 10, (6,))
    x = logits.clone().requires_grad_()
    (tft.cross_entropy(x, target, reduction=reduction) * float("nan")).backward()
    ref = logits.double().requires_grad_()
    (F.cross_entropy(ref, target, reduction=reduction) * float("nan")).backward()
    assert ref.grad.isnan().all()
    torch.testing.assert_close(x.grad.double(), ref.grad, equal_nan=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype, numel", [("float32", 4096 * 1001), ("bfloat16", 4096 * 32000), ("float16", 1001 * 7)])
def test_the_in_place_scaling_on_gpu(dtype, numel):
    from tvm_fusion.torch.scale import scale_in_place

    torch.manual_seed(int(rng().integers(2**31)))
    x = torch.randn(numel, device="cuda").to(getattr(torch, dtype))
    before = x.clone()
    scale_in_place(x, torch.tensor(1.0, device="cuda"))
    assert torch.equal(x, before)
    scale_in_place(x, torch.tensor(0.37, device="cuda"))
    torch.testing.assert_close(x, (before.float() * 0.37).to(x.dtype), rtol=0, atol=0)


# -- inplace_backward: the gradient written over the logits ---------------------------------
def check_in_place(logits, target, weight, kwargs, dtype, contiguous=True):
    """``inplace_backward=True``: the loss and gradient equal float64 torch's, the
    gradient autograd hands back is the logits' own storage (every element
    overwritten: one left holding its logit fails the comparison), and the version
    counter moved."""
    leaf = (logits.clone() if contiguous else logits.t().contiguous().t()).requires_grad_()
    x = leaf * 1.0  # not a leaf: inplace_backward refuses to overwrite one, as torch does
    assert x.is_contiguous() == contiguous
    version = x._version
    loss = tft.cross_entropy(x, target, weight, inplace_backward=True, **kwargs)
    assert x._version > version
    upstream = torch.rand(loss.shape, device=loss.device) + 0.5
    (grad,) = torch.autograd.grad(loss, x, upstream)
    assert grad.data_ptr() == x.data_ptr()
    # A gradient, not the logits themselves: outside the graph (no grad_fn leading back
    # into the layers that made the logits), as any backward's result.
    assert grad is not x and grad.grad_fn is None and not grad.requires_grad
    ref_loss, ref_grad = reference(logits, target, weight, upstream, **kwargs)
    loss_rtol, grad_tol = TOL[dtype]
    grad_tol = max(grad_tol, 1e-5 * math.log2(logits.shape[1] + 1) / 4)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=loss_rtol, atol=loss_atol(logits), equal_nan=True)
    scale = float(ref_grad.abs().max()) or 1.0
    torch.testing.assert_close(x.detach().double(), ref_grad, rtol=grad_tol, atol=grad_tol * scale, equal_nan=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_inplace_backward_writes_the_gradient_over_the_logits(dtype, options):
    logits, target, weight, kwargs = make_inputs(rng(), 37, 1001, dtype, options)
    check_in_place(logits, target, weight, kwargs, dtype)


def test_inplace_backward_on_non_contiguous_logits_copies_the_gradient_over_them():
    logits, target, weight, kwargs = make_inputs(rng(), 19, 300, "float32", {"label_smoothing": 0.1})
    check_in_place(logits, target, weight, kwargs, "float32", contiguous=False)


def test_inplace_backward_makes_a_stale_saved_use_of_the_logits_an_error():
    h = (torch.randn(8, 100) * 1.0).requires_grad_()
    logits = h * 2.0
    square = (logits * logits).sum()  # saves logits for its backward
    loss = tft.cross_entropy(logits, torch.randint(0, 100, (8,)), inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (square + loss).backward()


def test_a_weight_that_requires_grad_is_refused_as_torch_refuses_it():
    """The kernels give no gradient for the class weights: the backward left weight.grad
    None without a word, where torch refuses such a weight in the forward."""
    logits, target = torch.randn(6, 10, requires_grad=True), torch.randint(0, 10, (6,))
    weight = torch.rand(10, requires_grad=True)
    with pytest.raises(RuntimeError, match="weight requires grad"):
        tft.cross_entropy(logits, target, weight)
    with torch.no_grad():  # no graph, as torch takes it
        tft.cross_entropy(logits, target, weight)


def test_inplace_backward_module_and_bad_flag():
    logits, target, _, _ = make_inputs(rng(), 9, 64, "float32", {})
    ref = F.cross_entropy(logits.double(), target)
    x = logits.clone().requires_grad_()
    module = tft.CrossEntropyLoss(inplace_backward=True)
    assert "inplace_backward=True" in repr(module)
    torch.testing.assert_close(module(x * 1.0, target).double(), ref, rtol=1e-5, atol=1e-7)
    with pytest.raises(TypeError, match="inplace_backward must be a bool"):
        tft.cross_entropy(x, target, inplace_backward="yes")


def test_inplace_backward_refuses_to_overwrite_a_leaf_or_a_view_of_one():
    """torch forbids in-place writes to a leaf that requires grad (a parameter) and to
    its views: the gradient written over it would replace the parameter's values."""
    logits, target, _, _ = make_inputs(rng(), 6, 10, "float32", {})
    leaf = logits.clone().requires_grad_()
    for x in (leaf, leaf[:, :]):
        with pytest.raises(RuntimeError, match="would overwrite logits that are \\(a view of\\) a leaf"):
            tft.cross_entropy(x, target, inplace_backward=True)
    assert torch.equal(leaf.detach(), logits)
    # A Parameter goes through the custom ops (a tensor subclass), where the option has no effect.
    param = torch.nn.Parameter(logits.clone())
    tft.cross_entropy(param, target, inplace_backward=True).backward()
    assert torch.equal(param.detach(), logits)
    torch.testing.assert_close(param.grad.double(), reference(logits, target, None, torch.ones(()))[1],
                               rtol=1e-5, atol=1e-6)


def test_in_place_problem_is_its_own_kernel_without_no_alias():
    from tvm_fusion.contracts.cross_entropy_grad import cross_entropy_grad_problem

    problem = tf.make_problem("cross_entropy_grad", (16, 1000), "float32", in_place=True)
    assert problem.in_place and "inplace" in problem.key()
    assert problem.key() != tf.make_problem("cross_entropy_grad", (16, 1000), "float32").key()
    with pytest.raises(ValueError, match="only mode='fused'"):
        cross_entropy_grad_problem((16, 1000), "float32", mode="from_lse", in_place=True)
    kernel = tf.build("cross_entropy_grad", (16, 1000), "float32", target="llvm", in_place=True)
    assert "target_logit" in kernel.mod.script()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("options", OPTIONS[:4], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
# (160, 151936): rows past 256 KiB and a row an SM, cross_entropy_grad_row_in_cluster in place
@pytest.mark.parametrize("batch, classes", [(300, 1001), (512, 32000), (5, 50257), (3, 128256), (7, 10), (160, 151936)])
def test_inplace_backward_on_gpu(dtype, options, batch, classes):
    logits, target, weight, kwargs = make_inputs(rng(), batch, classes, dtype, options, device="cuda")
    check_in_place(logits, target, weight, kwargs, dtype)
    tf.check_targets()


def in_place_kernel_cases():
    from helpers import candidate_params
    from tvm_fusion import targets

    problems = [tf.make_problem("cross_entropy_grad", shape, dtype, in_place=True, **options)
                for shape, dtype, options in [((300, 1000), "float16", {}), ((64, 50257), "bfloat16", {"label_smoothing": 0.1}),
                                              ((33, 4096), "float32", {"reduction": "none", "weight": True}),
                                              # rows past shared memory: cross_entropy_grad_head_in_shared in place
                                              ((7, 128256), "bfloat16", {}),
                                              ((5, 73736), "float16", {"label_smoothing": 0.1, "weight": True,
                                                                       "reduction": "none"})]]
    yield from candidate_params(problems, targets.resolve({"kind": "cuda", "arch": "sm_90"}), 3)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("problem, candidate, configs", list(in_place_kernel_cases()))
def test_every_in_place_kernel_on_gpu(problem, candidate, configs):
    """Each in-place candidate, default and sampled knobs, with the logits passed as
    ``dlogits`` too: the loss and every element of the gradient right."""
    from tvm_fusion import targets
    from tvm_fusion.kernel import build_kernel

    options = {"reduction": problem.reduction, "label_smoothing": problem.label_smoothing}
    opts = dict(options, weight=True) if problem.has_weight else options
    for knobs in configs:
        logits, target, weight, kwargs = make_inputs(rng(), problem.batch, problem.classes, problem.dtype, opts,
                                                     device="cuda")
        kernel = build_kernel(problem, targets.resolve("cuda"), candidate, knobs)
        x = logits.clone()
        outs = {name: (x if name == "dlogits" else torch.full(shape, float("nan") if dtype.startswith("float") else -7777,
                                                             dtype=getattr(torch, dtype), device="cuda"))
                for name, shape, dtype in kernel.outputs}
        kernel.func(x, target, *([weight] if weight is not None else []), *outs.values())
        torch.cuda.synchronize()
        upstream = torch.ones((problem.batch,) if problem.reduction == "none" else (), device="cuda")
        ref_loss, ref_grad = reference(logits, target, weight, upstream, **kwargs)
        grad_tol = max(TOL[problem.dtype][1], 1e-5 * math.log2(problem.classes + 1) / 4)
        scale = float(ref_grad.abs().max()) or 1.0
        torch.testing.assert_close(x.double(), ref_grad, rtol=grad_tol, atol=grad_tol * scale, equal_nan=True,
                                   msg=lambda m: f"{candidate} {knobs}: {m}")
        torch.testing.assert_close(outs["loss"].double().reshape(ref_loss.shape), ref_loss, rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{candidate} {knobs}: {m}")
