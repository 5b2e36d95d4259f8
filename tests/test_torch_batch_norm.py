"""tvm_fusion.torch's BatchNorm: the functional form, the modules, patch, compile.

Everything is compared with torch's float64 ``F.batch_norm`` / ``nn.BatchNorm*d`` on
the same (rounded) input: ``y``, the running statistics, and through autograd
``dx``, ``dweight`` and ``dbias``, with fresh random data (the mean away from 0)
and the launchers' outputs poisoned with NaN (the ``poisoned`` fixture), so an
element a kernel does not write fails. Tolerances per dtype: the final store's
rounding of ``y`` and ``dx``, and float32 sums for the per-channel values."""

import copy
import math
import os

import numpy as np
import pytest

from helpers import BN_LAYOUTS, has_gpu, rng, torch_or_none

torch = torch_or_none()
pytestmark = pytest.mark.skipif(torch is None, reason="needs torch")
if torch is not None:
    import torch.nn.functional as F
    from torch import nn

    import tvm_fusion.torch as tft
    from tvm_fusion.torch.batch_norm import output_format

ROUNDING = {"float32": 0.0, "float16": 1e-3, "bfloat16": 8e-3}  # the final store, relative
GPU = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]
# (training, affine parameters, running statistics, momentum): each of F.batch_norm's forms
MODES = {
    "train": (True, "both", True, 0.1),
    "train-momentum-tensor": (True, "both", True, "tensor"),
    "train-no-running": (True, "both", False, 0.1),
    "train-plain": (True, "none", True, 0.3),
    "train-weight-only": (True, "weight", True, 0.1),
    "train-bias-only": (True, "bias", False, 0.1),
    "eval": (False, "both", True, 0.1),
    "eval-plain": (False, "none", True, 0.1),
}
LAYOUTS = BN_LAYOUTS


def seeded():
    torch.manual_seed(int(rng().integers(2**31)))


def make(shape, dtype, device, mode, loc=3.0):
    """x (mean ``loc``), running statistics, parameters and momentum for ``mode``."""
    training, params, running, momentum = MODES[mode]
    c = shape[1]
    x = (torch.randn(shape, device=device) * 2 + loc).to(getattr(torch, dtype))
    weight = torch.randn(c, device=device) if params in ("both", "weight") else None
    bias = torch.randn(c, device=device) if params in ("both", "bias") else None
    rm = torch.randn(c, device=device) + loc if running else None
    rv = torch.rand(c, device=device) + 0.5 if running else None
    if momentum == "tensor":
        momentum = torch.tensor(0.2, device=device)
    return x, rm, rv, weight, bias, training, momentum


def assert_near(got, want, dtype, what, sums_over=1):
    """``got`` within the per-dtype tolerance of the float64 ``want``: the store's
    rounding, plus float32 error growing with the square root of a sum's length."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got = got.double()
    assert not torch.isnan(got).any(), f"{what}: an element is unwritten or NaN"
    scale = float(want.detach().abs().max()) or 1.0
    tol = ROUNDING[dtype] * want.abs() + 3e-5 * scale * math.sqrt(sums_over) + 1e-6
    err = (got - want).abs()
    assert (err <= tol).all(), f"{what}: off by {float(err.max()):.3g} (largest {scale:.3g})"


def check_against_torch(x, rm, rv, weight, bias, training, momentum, eps=1e-5):
    """Forward and backward of ``tft.batch_norm`` against float64 torch."""
    dtype = str(x.dtype).removeprefix("torch.")
    count = x.numel() // x.shape[1]
    leaf = x.detach().clone().requires_grad_()
    params = [p.clone().requires_grad_() if p is not None else None for p in (weight, bias)]
    ours_rm, ours_rv = (None, None) if rm is None else (rm.clone(), rv.clone())
    y = tft.batch_norm(leaf, ours_rm, ours_rv, *params, training, momentum, eps)
    x64 = x.detach().double().requires_grad_()
    p64 = [p.double().requires_grad_() if p is not None else None for p in (weight, bias)]
    if weight is None and bias is not None:  # torch's CUDA backward fails on a bias without a weight
        p64[0] = torch.ones_like(p64[1]).detach()
    ref_rm, ref_rv = (None, None) if rm is None else (rm.double(), rv.double())
    m = float(momentum) if isinstance(momentum, torch.Tensor) else momentum
    y64 = F.batch_norm(x64, ref_rm, ref_rv, *p64, training, m, eps)
    assert y.dtype == x.dtype and y.is_contiguous(memory_format=output_format(x))
    assert_near(y, y64, dtype, "y")
    if rm is not None:
        assert_near(ours_rm, ref_rm, "float32", "running_mean")
        assert_near(ours_rv, ref_rv, "float32", "running_var", count)
    upstream = torch.randn_like(y64).to(x.dtype)
    y.backward(upstream)
    y64.backward(upstream.double())
    assert_near(leaf.grad, x64.grad, dtype, "dx")
    for name, ours, ref in zip(("dweight", "dbias"), params, p64):
        if ours is not None and ref.grad is not None:
            assert_near(ours.grad, ref.grad, "float32", name, count)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["nchw", "channels-last"])
@pytest.mark.parametrize("mode", list(MODES))
def test_functional_equals_float64_torch_in_every_mode(poisoned, device, dtype, layout, mode):
    seeded()
    x, *rest = make((4, 6, 5, 7), dtype, device, mode)
    check_against_torch(LAYOUTS[layout](x), *rest)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_functional_equals_float64_torch_in_every_layout(poisoned, device, layout, mode):
    seeded()
    x, *rest = make((4, 6, 5, 8), "float32", device, mode)
    x = LAYOUTS[layout](x)
    if layout == "nc":
        rest = make(x.shape, "float32", device, mode)[1:]
    check_against_torch(x, *rest)


@pytest.mark.parametrize("device", DEVICES)
def test_a_large_mean_with_a_small_spread_keeps_float32_precision(poisoned, device):
    """|mean| >> std (1000 and 0.02): the shifted statistics, not the sum of squares
    minus the square of the sum (which would lose the variance entirely here). A
    float32 mean of 1000 is off by half an ulp, 3e-5, times ``invstd * weight`` (~50)
    in y, so no float32 kernel meets the usual tolerance: y must be within four such
    roundings per channel (ours rounds the shift and the mean; comparing with torch's
    own float32 error instead failed in CI at seed 1600207735, 1.6e-3 against 2x
    5.6e-4, as that seed's torch mean happened to round closer)."""
    seeded()
    x, rm, rv, weight, bias, _, _ = make((8, 4, 9, 9), "float32", device, "train", loc=0.0)
    x = x * 0.01 + 1000.0
    ours_rv = rv.clone()
    y = tft.batch_norm(x, rm.clone(), ours_rv, weight, bias, True, 0.1)
    ref_rv = rv.double()
    x64 = x.double()
    y64 = F.batch_norm(x64, rm.double(), ref_rv, weight.double(), bias.double(), True, 0.1)
    mean, var = x64.mean(dim=(0, 2, 3)), x64.var(dim=(0, 2, 3), unbiased=False)
    per_channel = 4 * 2.0**-24 * mean.abs() * (weight.double().abs() / (var + 1e-5).sqrt())
    assert not torch.isnan(y).any()
    err = (y.double() - y64).abs().amax(dim=(0, 2, 3))
    assert (err <= per_channel + 1e-5).all(), f"y off by {err.tolist()} against {per_channel.tolist()}"
    assert_near(ours_rv, ref_rv, "float32", "running_var", 8 * 81)


# -- the modules -----------------------------------------------------------------------
MODULE_OPTIONS = [
    {},
    {"momentum": None},  # the cumulative average, 1 / num_batches_tracked on the device
    {"affine": False, "eps": 1e-3},
    {"track_running_stats": False},
    {"momentum": 0.5, "affine": False, "track_running_stats": False},
]
MODULE_INPUTS = {  # (ours, torch's, input shape, memory format)
    "1d-nc": ("BatchNorm1d", (16, 6), torch.contiguous_format if torch else None),
    "1d-ncl": ("BatchNorm1d", (4, 6, 9), torch.contiguous_format if torch else None),
    "2d-nchw": ("BatchNorm2d", (4, 6, 5, 7), torch.contiguous_format if torch else None),
    "2d-channels-last": ("BatchNorm2d", (4, 6, 5, 7), torch.channels_last if torch else None),
}


def module_pair(kind, options, device):
    """Ours (float32) and torch's (float64) from one state dict: every option and
    ``state_dict`` loaded torch -> ours."""
    theirs = getattr(nn, kind)(6, **options).double().to(device)
    if theirs.affine:
        with torch.no_grad():
            theirs.weight.copy_(torch.randn(6) + 1)
            theirs.bias.copy_(torch.randn(6))
    ours = getattr(tft, kind)(6, **options).to(device)
    ours.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in theirs.state_dict().items()})
    assert isinstance(ours, getattr(nn, kind)) and ours.extra_repr() == theirs.extra_repr()
    return ours, theirs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inputs", list(MODULE_INPUTS))
@pytest.mark.parametrize("options", MODULE_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_modules_equal_torchs_over_training_steps_then_eval(poisoned, device, inputs, options):
    kind, shape, memory_format = MODULE_INPUTS[inputs]
    seeded()
    ours, theirs = module_pair(kind, options, device)
    count = math.prod(shape) // 6
    for step in range(4):
        if step == 3:
            ours.eval()
            theirs.eval()
        x = (torch.randn(shape, device=device) * 2 + 1).to(memory_format=memory_format)
        leaf, leaf64 = x.clone().requires_grad_(), x.double().requires_grad_()
        y, y64 = ours(leaf), theirs(leaf64)
        assert_near(y, y64, "float32", f"step {step} y")
        upstream = torch.randn_like(y64)
        y.backward(upstream.float())
        y64.backward(upstream)
        assert_near(leaf.grad, leaf64.grad, "float32", f"step {step} dx")
        if ours.affine:
            assert_near(ours.weight.grad, theirs.weight.grad, "float32", f"step {step} dweight", count)
            assert_near(ours.bias.grad, theirs.bias.grad, "float32", f"step {step} dbias", count)
            ours.zero_grad()
            theirs.zero_grad()
        if ours.track_running_stats:
            assert_near(ours.running_mean, theirs.running_mean, "float32", f"step {step} running_mean")
            assert_near(ours.running_var, theirs.running_var, "float32", f"step {step} running_var", count)
            assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == min(step + 1, 3)
    back = getattr(nn, kind)(6, **options).to(device)  # ours -> torch's
    back.load_state_dict(ours.state_dict())
    assert set(back.state_dict()) == set(ours.state_dict())


def test_a_float64_module_call_is_torchs():
    seeded()
    ours = tft.BatchNorm2d(3).double()
    theirs = copy.deepcopy(ours)
    theirs.__class__ = nn.BatchNorm2d
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    torch.testing.assert_close(ours.running_var, theirs.running_var, rtol=0, atol=0)


@pytest.mark.parametrize("call, error, words", [
    (lambda: tft.batch_norm(torch.randn(5), None, None, training=True), ValueError, "rank 2 to 5"),
    (lambda: tft.batch_norm(torch.randn(4, 3, dtype=torch.float64), None, None, training=True), TypeError,
     "float16, bfloat16 or float32"),
    (lambda: tft.batch_norm(torch.randn(4, 3), None, None), ValueError, "must be given in eval mode"),
    (lambda: tft.batch_norm(torch.randn(4, 3), torch.zeros(3), None), ValueError, "both be given"),
    (lambda: tft.batch_norm(torch.randn(4, 3), None, None, torch.ones(4), training=True), ValueError,
     r"weight must have shape \(3,\)"),
    (lambda: tft.batch_norm(torch.randn(1, 3), torch.zeros(3), torch.ones(3), training=True), ValueError,
     r"more than 1 value per channel when training, got input size \(1, 3\)"),
    (lambda: tft.batch_norm(torch.randn(4, 3), torch.zeros(3), torch.ones(3), training=True,
                            momentum=torch.ones(2)), ValueError, "momentum tensor must be 0-d"),
    (lambda: tft.batch_norm(torch.randn(4, 3), torch.zeros(3), torch.ones(3), training=True, momentum="0.1"),
     TypeError, "momentum must be a number"),
    # an empty batch hands torch a momentum of 0.0: the given one went unchecked
    (lambda: tft.batch_norm(torch.randn(0, 3), torch.zeros(3), torch.ones(3), training=True, momentum="0.1"),
     TypeError, "momentum must be a number"),
    (lambda: tft.batch_norm(torch.randn(0, 3), torch.zeros(3), torch.ones(3), training=True,
                            momentum=torch.ones(2)), ValueError, "momentum tensor must be 0-d"),
    (lambda: tft.batch_norm(torch.randn(4, 3), None, None, training=True, eps=-1.0), ValueError,
     "eps must be a finite number"),
    (lambda: tft.batch_norm(torch.randn(4, 3), None, None, training=True, eps=0.0), ValueError,
     "eps must be positive when training, got 0.0"),  # torch's rule
    (lambda: tft.batch_norm(torch.randn(4, 3), None, None, training=True, eps=None), TypeError,
     "eps must be a number, got None"),
    (lambda: tft.batch_norm(torch.randn(4, 3), None, None, training=1), TypeError, "training must be a bool"),
    (lambda: tft.batch_norm([[1.0, 2.0]], None, None, training=True), TypeError, "input must be a torch tensor"),
])
def test_bad_arguments_are_named(call, error, words):
    with pytest.raises(error, match=words):
        call()


@pytest.mark.parametrize("call, error, words", [
    (lambda x: tft.batch_norm(x, torch.full((3,), 5), torch.full((3,), 5), training=True), TypeError,
     "running_mean must be floating point"),
    (lambda x: tft.batch_norm(x, torch.zeros(4), torch.ones(4), training=True), ValueError,
     r"running_mean must have shape \(3,\)"),
    (lambda x: tft.batch_norm(x, torch.zeros(1, 3), torch.ones(1, 3), training=True), ValueError,
     r"got \(1, 3\)"),
    (lambda x: tft.batch_norm(x, torch.zeros(3), torch.ones(3), torch.ones(3, dtype=torch.long), training=True),
     TypeError, "weight must be floating point"),
    (lambda x: tft.batch_norm(x, torch.zeros(3), torch.ones(3), [1.0, 1.0, 1.0], training=True), TypeError,
     "weight must be a torch tensor"),
    (lambda x: tft.batch_norm(x, torch.zeros(3), torch.ones(3), training=1), TypeError, "training must be a bool"),
])
def test_bad_vectors_are_named_after_a_good_call_of_the_same_input(call, error, words):
    """The launcher is cached per input signature; a later call with vectors of another
    dtype, shape or kind must still be checked (integer buffers were truncated into)."""
    x = torch.randn(4, 3, 5, 5)
    rm, rv = torch.zeros(3), torch.ones(3)
    tft.batch_norm(x, rm, rv, torch.ones(3), torch.zeros(3), training=True)
    with pytest.raises(error, match=words):
        call(x)


@pytest.mark.parametrize("mode", ["train", "train-no-running", "eval", "train-bias-only"])
def test_an_empty_batch_is_torchs(mode):
    """torch's empty batch: an empty output that still depends on weight and bias (zero
    gradients), the running statistics unchanged; the modules count the batch."""
    seeded()
    x, rm, rv, weight, bias, training, momentum = make((0, 3, 4, 4), "float32", "cpu", mode)
    leaf = x.clone().requires_grad_()
    params = [None if p is None else p.clone().requires_grad_() for p in (weight, bias)]
    ours_rm, ours_rv = (None, None) if rm is None else (rm.clone(), rv.clone())
    y = tft.batch_norm(leaf, ours_rm, ours_rv, *params, training, momentum)
    assert y.shape == x.shape and y.dtype == x.dtype
    if rm is not None:
        assert torch.equal(ours_rm, rm) and torch.equal(ours_rv, rv)
    if any(p is not None for p in params):
        y.sum().backward()
        assert leaf.grad.shape == x.shape
        for p in params:
            assert p is None or torch.equal(p.grad, torch.zeros_like(p))
    ours, theirs = tft.BatchNorm2d(3, momentum=None), nn.BatchNorm2d(3, momentum=None)
    batch = torch.randn(6, 3, 4, 4) + 1
    for module in (ours, theirs):
        module(batch)
        module(batch[:0])
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 2
    torch.testing.assert_close(ours.running_mean, theirs.running_mean, rtol=1e-5, atol=1e-6)
    assert ours.eval()(torch.randn(0, 3, 4, 4)).shape == (0, 3, 4, 4)


def test_a_second_derivative_is_a_clear_error_not_a_silent_zero():
    """Under create_graph=True the gradients carry a node that raises: a Hessian-vector
    product through the layer would otherwise drop its terms silently."""
    seeded()
    x, rm, rv, weight, bias, training, momentum = make((4, 3, 5, 5), "float32", "cpu", "train")
    leaf, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = tft.batch_norm(leaf, rm.clone(), rv.clone(), w, bias, training, momentum)
    dx, dw = torch.autograd.grad(y.pow(3).sum(), (leaf, w), create_graph=True)
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    ref = torch.autograd.grad(F.batch_norm(x64, None, None, w64, bias.double(), True).pow(3).sum(), (x64, w64))
    assert_near(dx.detach(), ref[0], "float32", "dx")
    assert_near(dw.detach(), ref[1], "float32", "dweight", 100)
    for grad in (dx, dw):
        with pytest.raises(RuntimeError, match="tvm_fusion.torch.batch_norm has no second derivative"):
            grad.sum().backward(retain_graph=True)


def test_meta_and_fake_tensors_get_the_shapes_without_a_kernel():
    """Shape inference (a model built on the meta device, FakeTensorMode) goes through
    the custom ops' fake functions, as torch's own ops do."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    module = tft.BatchNorm2d(6, device="meta")
    x = torch.randn(4, 6, 5, 5, device="meta").to(memory_format=torch.channels_last).requires_grad_()
    y = module(x)
    assert y.device.type == "meta" and y.shape == x.shape and y.is_contiguous(memory_format=torch.channels_last)
    y.sum().backward()
    assert x.grad.shape == x.shape and module.weight.grad.shape == (6,)
    with FakeTensorMode():
        fake = torch.randn(8, 6, requires_grad=True)
        out = tft.BatchNorm1d(6)(fake)
        out.sum().backward()
        assert out.shape == (8, 6) and fake.grad.shape == (8, 6)


def test_numpy_scalars_are_numbers_as_in_torch():
    """np.float32 momentum and eps (a config read through numpy) are taken, as torch takes them."""
    seeded()
    x = torch.randn(4, 3, 5, 5)
    ours, theirs = (tft.BatchNorm2d(3, eps=np.float32(1e-3), momentum=np.float32(0.3)),
                    nn.BatchNorm2d(3, eps=np.float32(1e-3), momentum=np.float32(0.3)))
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours.running_var, theirs.running_var)


META = {"device": "meta"}


@pytest.mark.parametrize("bad, error, words", [
    (lambda: (torch.randn(5, **META), None, None, {"training": True}), ValueError, "rank 2 to 5"),
    (lambda: (torch.randn(1, 3, **META), None, None, {"training": True}), ValueError,
     r"more than 1 value per channel when training, got input size \(1, 3\)"),
    (lambda: (torch.randn(4, 3, **META), torch.zeros(4, **META), torch.ones(4, **META), {"training": True}),
     ValueError, r"running_mean must have shape \(3,\)"),
    (lambda: (torch.randn(4, 3, **META), torch.zeros(3), torch.ones(3), {"training": True}), ValueError,
     "running_mean is on cpu, the input on meta"),
    (lambda: (torch.randn(4, 3, **META), None, None, {"training": True, "eps": -1.0}), ValueError,
     "eps must be a finite number"),
    (lambda: (torch.nn.Parameter(torch.randn(4, 3)), None, None, {"training": True, "momentum": None}), TypeError,
     "momentum must be a number or a 0-d tensor, got None"),
    (lambda: (torch.nn.Parameter(torch.randn(4, 3)), None, None, {"training": True, "eps": None}), TypeError,
     "eps must be a number, got None"),
])
def test_a_call_without_a_launcher_is_checked_as_one_with(bad, error, words):
    """Meta tensors, fake ones and subclasses reach the custom ops, not a launcher: a bad
    call must raise the launcher's error, not return y's shape (meta), an IndexError
    from the fake function, or a float() error that names no argument."""
    input, running_mean, running_var, options = bad()
    with pytest.raises(error, match=words):
        tft.batch_norm(input, running_mean, running_var, **options)


def test_opcheck_both_custom_ops():
    seeded()
    x = torch.randn(4, 6, 5, 7) + 2
    w, b = torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)
    momentum = torch.tensor(0.1)
    for args in ((x.requires_grad_(), torch.zeros(6), torch.ones(6), w, b, True, momentum, 1e-5),
                 (x.to(memory_format=torch.channels_last), None, None, w, None, True, momentum, 1e-5),
                 (x, torch.zeros(6), torch.ones(6), None, None, False, momentum, 1e-3)):
        torch.library.opcheck(torch.ops.tvm_fusion.batch_norm_forward, args)
    torch.library.opcheck(torch.ops.tvm_fusion.batch_norm_backward,
                          (torch.randn(4, 6, 5, 7), x.detach(), torch.randn(6), torch.rand(6) + 1, w.detach(), True))


def conv_bn_model():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 16), nn.BatchNorm1d(16, momentum=None), nn.ReLU(), nn.Linear(16, 5))


def test_torch_compile_fullgraph_trains_through_the_ops():
    seeded()
    model, reference = conv_bn_model(), conv_bn_model()
    reference.load_state_dict(model.state_dict())
    tft.patch(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    for _ in range(3):
        x, t = torch.randn(8, 3, 6, 6), torch.randint(0, 5, (8,))
        for m, o in ((compiled, opt), (reference, ref_opt)):
            o.zero_grad()
            F.cross_entropy(m(x), t).backward()
            o.step()
    for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=name)


# -- patch and the end-to-end training check ------------------------------------------------
def train_losses(model, steps, device, lr=0.1):
    """Losses of ``steps`` SGD steps of the small ResNet on one batch (so that the
    loss must fall)."""
    from tvm_fusion.relax.model import example_inputs

    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    x, target = (t.to(device) for t in example_inputs(batch=8, image=8))
    for _ in range(steps):
        opt.zero_grad()
        _, loss = model(x, target)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def batch_norm_dx_gaps(model, step) -> tuple:
    """Run ``step`` (a forward and backward of ``model``) and return what it returned
    and, for each BatchNorm submodule, the relative L2 gap of the gradient it passed to its input
    from float64 torch's for the same input, parameters and upstream gradient: each
    layer's backward checked on its own, where a whole model's gradient also carries
    every discontinuity (a ReLU's, a max-pool's) that the BatchNorms' rounding moved."""
    seen, handles = {}, []

    def capture(name, inp, out):
        seen[name] = [inp.detach(), None, None]
        inp.register_hook(lambda g: seen[name].__setitem__(1, g.detach()))
        out.register_hook(lambda g: seen[name].__setitem__(2, g.detach()))

    norms = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    for name, m in norms.items():
        handles.append(m.register_forward_hook(lambda m, args, out, name=name: capture(name, args[0], out)))
    try:
        result = step()
    finally:
        for handle in handles:
            handle.remove()
    gaps = {}
    for name, (inp, dx, dy) in seen.items():
        m = norms[name]
        x64 = inp.double().requires_grad_()
        y = F.batch_norm(x64, None, None, None if m.weight is None else m.weight.detach().double(),
                         None if m.bias is None else m.bias.detach().double(), True, 0.0, m.eps)
        (expected,) = torch.autograd.grad(y, (x64,), dy.double())
        gaps[name] = float((dx.double() - expected).norm() / expected.norm())
    assert set(gaps) == set(norms), "a BatchNorm ran no forward or no backward"
    return result, gaps


# 20 SGD steps (lr 0.1, momentum 0.9) of the small ResNet in float32 on one batch
# (the loss falls from about 2.4 to 0.1-0.6): the patched model's kernels sum in
# another order than torch's, so the two drift apart by rounding. Over 12 initial
# seeds here the largest gaps were 3.8e-6 in the losses (relative) and 2.2e-5 in a
# parameter (relative to the tensor's largest value); the bounds keep a margin.
# (On fresh batches every step, one seed in eight reached 1.3e-2 in a parameter:
# a ReLU or a small-variance channel amplifies the rounding.)
LOSS_RTOL, STATE_RTOL = 1e-4, 1e-3
TRAINING_SEED = 3541275734


@pytest.mark.parametrize("device", DEVICES)
def test_patch_trains_the_small_resnet_as_torch_does(device):
    from tvm_fusion.relax.model import small_resnet

    # One fixed seed (TVM_FUSION_TEST_SEED overrides it): the drift of this chaotic
    # trajectory is heavy-tailed over seeds, and about one random seed in six reached
    # 2.6e-3 in the last loss and 1e-3 in a parameter on the CPU, at e8acefc as now
    # (2026-12-02), where most stay under 4e-6 and 2e-5.
    torch.manual_seed(int(os.environ.get("TVM_FUSION_TEST_SEED", TRAINING_SEED)))
    model, reference = small_resnet().to(device), small_resnet().to(device)
    reference.load_state_dict(model.state_dict())
    norms = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    swaps = tft.patch(model)
    assert {s.name for s in swaps} == set(norms) and tft.patch(model) == []
    for swap in swaps:
        assert type(swap.replacement) is getattr(tft, type(swap.original).__name__)
        assert swap.replacement.weight is swap.original.weight
        assert swap.replacement.running_var is swap.original.running_var
    from tvm_fusion.relax.model import example_inputs

    x, target = (t.to(device) for t in example_inputs(batch=8, image=8))
    probe = copy.deepcopy(model)  # a step of its own would move the model's running statistics
    _, gaps = batch_norm_dx_gaps(probe, lambda: probe(x, target)[1].backward())
    assert max(gaps.values()) <= 1e-5, gaps
    losses, reference_losses = train_losses(model, 20, device), train_losses(reference, 20, device)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=LOSS_RTOL, atol=1e-5)
    assert reference_losses[-1] < 0.5 * reference_losses[0]  # it trained
    for name, value in reference.state_dict().items():
        gap = (model.state_dict()[name].double() - value.double()).abs().max()
        assert gap <= STATE_RTOL * value.double().abs().max() + 1e-6, f"{name}: off by {float(gap):.3g}"
    restored = tft.unpatch(model)
    assert all(model.get_submodule(r.name) is r.original for r in restored)
    assert int(norms["bn"].num_batches_tracked) == 20  # the originals hold the trained state


def test_patch_trains_a_3d_conv_net_as_torch_does(poisoned):
    """nn.BatchNorm3d is swapped too: (N, C, D, H, W) runs the (N, C, D*H*W) kernels."""
    seeded()
    model = nn.Sequential(nn.Conv3d(2, 4, 3), nn.BatchNorm3d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4 * 4, 3))
    reference = copy.deepcopy(model)
    swaps = tft.patch(model)
    assert [type(s.replacement) for s in swaps] == [tft.BatchNorm3d]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for _ in range(3):
        x, y = torch.randn(5, 2, 6, 6, 6), torch.randint(0, 3, (5,))
        for m, opt in zip((model, reference), opts):
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], want, rtol=1e-4, atol=1e-5, msg=name)
    x = torch.randn(2, 2, 6, 6, 6)
    torch.testing.assert_close(model.eval()(x), reference.eval()(x), rtol=1e-4, atol=1e-5)


def test_hooks_run_on_the_stand_ins_and_handles_remove_them():
    """A forward hook on a BatchNorm or a loss (activation statistics, say) stopped
    running after the patch: the stand-ins share the originals' hook tables."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten())
    seen = []
    first = model[1].register_forward_hook(lambda module, args, out: seen.append("before the patch"))
    loss = nn.CrossEntropyLoss()
    loss.register_forward_pre_hook(lambda module, args: seen.append("loss"))
    holder = nn.ModuleDict({"model": model, "loss": loss})
    tft.patch(holder)
    model[1].register_forward_pre_hook(lambda module, args: seen.append("after the patch"))
    holder["loss"](model(torch.randn(2, 3, 6, 6)).view(2, -1)[:, :5], torch.tensor([0, 1]))
    assert seen == ["after the patch", "before the patch", "loss"]
    first.remove()
    model(torch.randn(2, 3, 6, 6))
    assert seen[3:] == ["after the patch"]
    tft.unpatch(holder)
    model(torch.randn(2, 3, 6, 6))
    assert seen[4:] == ["after the patch"], "a hook added to the stand-in stays on the original"


def test_running_statistics_that_require_grad_are_refused_as_torch_refuses_them():
    """In eval y depends on the running statistics, but the kernels give them no gradient:
    running_mean.grad stayed None without a word, where torch refuses them in the forward."""
    x = torch.randn(4, 3, 5, 5, requires_grad=True)
    running_mean, running_var = torch.zeros(3, requires_grad=True), torch.ones(3)
    with pytest.raises(RuntimeError, match="running_mean and running_var must not require grad"):
        tft.batch_norm(x, running_mean, running_var, training=False)
    with torch.no_grad():  # no graph, as torch takes it
        tft.batch_norm(x, running_mean, running_var, training=False)


def test_unpatch_leaves_a_stand_in_the_caller_removed_or_replaced_and_restores_the_rest():
    """A removed stand-in made unpatch raise torch's AttributeError halfway (the later
    originals never put back, the record of them gone); a replaced one had the original
    put over the caller's module."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.BatchNorm2d(4), nn.BatchNorm2d(4))
    originals = list(model)
    assert len(tft.patch(model)) == 3
    model[2] = nn.Identity()
    del model[1]  # Sequential renumbers: the stand-in of "3" is now at "2", none at "3"
    restored = tft.unpatch(model)
    assert restored == [] and isinstance(model[1], nn.Identity) and isinstance(model[2], tft.BatchNorm2d)
    model = nn.Sequential(*originals)
    tft.patch(model)
    model[2] = nn.Identity()
    assert [r.name for r in tft.unpatch(model)] == ["1", "3"]
    assert model[1] is originals[1] and isinstance(model[2], nn.Identity) and model[3] is originals[3]


def test_the_patched_loss_hands_uint8_targets_to_torch():
    """nn.CrossEntropyLoss takes uint8 class indices; the stand-in sent them to the kernels,
    which take int64 and int32 only, so a patched model raised where it had computed."""
    logits, target = torch.randn(6, 10), torch.tensor([0, 3, 9, 1, 2, 5], dtype=torch.uint8)
    holder = nn.ModuleDict({"loss": nn.CrossEntropyLoss(label_smoothing=0.1)})
    tft.patch(holder)
    expected = F.cross_entropy(logits.double(), target, label_smoothing=0.1)
    torch.testing.assert_close(holder["loss"](logits, target).double(), expected, rtol=1e-5, atol=1e-6)


def test_patch_keeps_the_mode_and_refuses_a_lone_batch_norm():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    (swap,) = tft.patch(model)
    assert not swap.replacement.training
    with pytest.raises(TypeError, match="the model itself is an nn.BatchNorm2d"):
        tft.patch(nn.BatchNorm2d(3))


def test_unpatch_carries_the_mode_and_replaced_tensors_back_to_the_originals():
    """After patch: model.eval() and model.double() act on the stand-ins (.double()
    replaces the buffers), then steps train; unpatch hands the originals the mode and
    those tensors, so the unpatched model equals one that never was patched."""
    seeded()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 5),
                          nn.BatchNorm1d(5))
    reference = copy.deepcopy(model)
    tft.patch(model)
    x = torch.randn(6, 3, 8, 8)
    for m in (model, reference):
        m.double().train()
        m(x.double())
        m.eval()
    tft.unpatch(model)
    assert all(type(m) in (nn.Conv2d, nn.BatchNorm2d, nn.Flatten, nn.Linear, nn.BatchNorm1d) for m in model)
    assert not model[1].training and not model[4].training
    for name, want in reference.state_dict().items():
        got = model.state_dict()[name]
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9, msg=name)
    torch.testing.assert_close(model(x.double()), reference(x.double()), rtol=1e-6, atol=1e-9)
    with pytest.raises(TypeError, match="unpatch: model must be a torch.nn.Module"):
        tft.unpatch(3)


# -- the GPU ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape, dtype, layout", [
    ((64, 256, 14, 14), "float16", "nchw"),  # (N, C, L) kernels, many channels
    ((16, 64, 56, 56), "float16", "nchw"),  # few channels, long planes
    ((8, 64, 56, 56), "bfloat16", "channels-last"),  # the (M, C) kernels
    ((256, 2048, 7, 7), "float16", "nchw"),  # a channel fits on chip
    ((3, 5, 37, 41), "float16", "channels-last"),  # odd everything
])
@pytest.mark.parametrize("mode", ["train", "train-no-running", "eval"])
def test_large_shapes_on_gpu(poisoned, shape, dtype, layout, mode):
    seeded()
    x, *rest = make(shape, dtype, "cuda", mode)
    check_against_torch(LAYOUTS[layout](x), *rest)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape, dtype, forward", [
    ((64, 256, 56, 56), "bfloat16", "bn_forward_cluster_half_one_launch"),  # launched in thread-block clusters
    ((64, 256, 56, 56), "float32", "bn_forward_cluster_half_one_launch"),
    ((64, 128, 56, 56), "float16", "bn_forward_cluster_half_one_launch"),  # 3.9 tasks an SM
    ((64, 64, 56, 56), "float16", "bn_forward_grid_persistent"),  # launched cooperatively
])
def test_the_cluster_and_grid_wide_kernels_through_the_op(poisoned, shape, dtype, forward):
    """Where dispatch (no shipped record: the heuristic) picks the forward in clusters or
    the grid-wide one, and the grid-wide backward, the op's forward and backward equal
    float64 torch."""
    from tvm_fusion import targets
    from tvm_fusion.api import make_problem
    from tvm_fusion.dispatch import choose

    cuda = targets.resolve("cuda")
    assert choose(make_problem("bn_forward", shape, dtype, layout="NCHW"), cuda).candidate == forward
    assert choose(make_problem("bn_backward", shape, dtype, layout="NCHW"), cuda).candidate == "bn_backward_grid_persistent"
    seeded()
    check_against_torch(*make(shape, dtype, "cuda", "train"))


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
def test_batch_norm_1d_on_gpu(poisoned):
    seeded()
    x, *rest = make((512, 1000), "float32", "cuda", "train")
    check_against_torch(x, *rest)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
def test_a_patched_training_step_replays_in_a_cuda_graph():
    seeded()
    model, reference = conv_bn_model().cuda(), conv_bn_model().cuda()
    reference.load_state_dict(model.state_dict())
    tft.patch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, t = torch.randn(32, 3, 6, 6, device="cuda"), torch.randint(0, 5, (32,), device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        loss = tft.cross_entropy(model(x), t, check_targets=False)
        loss.backward()
        opt.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # build, compile and allocate outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    reference.load_state_dict(model.state_dict())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_loss = step()
    for _ in range(3):
        x.copy_(torch.randn(32, 3, 6, 6, device="cuda"))
        t.copy_(torch.randint(0, 5, (32,), device="cuda"))
        graph.replay()
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(reference(x), t)
        ref_loss.backward()
        ref_opt.step()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured_loss, ref_loss, rtol=1e-4, atol=1e-5)
        for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_patch_trains_torchvisions_resnet18_as_torch_does(device, monkeypatch):
    """The issue's second model, where torchvision is installed (the H200 host has it,
    the CI machine not), 20 SGD steps on one batch of 8, checked two ways:

    - along torch's trajectory (any seed): before each step the patched model takes the
      reference's parameters and running statistics, so one step's rounding is measured
      without the steps before it. Every loss within rtol 1e-4; the gradients' gap, as a
      fraction of their norm, under 1e-4 in the median step; and in every step each
      BatchNorm's input gradient within 1e-5 of float64 torch's from the same input and
      upstream gradient (``batch_norm_dx_gaps``). A bound on every step's whole-model
      gap failed on the H200 (bdfefa1, seed 2268653145: 2.3e-2 at step 0 in
      conv1.weight, with the BatchNorm partials in TVM's pool as before and as
      workspace parameters alike; torch's model against a copy of itself 3e-7), while
      each of the 20 BatchNorms' input gradients there was within 1.3e-7 of float64
      torch's in four runs: the gap is the rounding moved across some discontinuity
      (not the stem's max-pool, whose choices were the same), not a wrong gradient;
    - free-running, on one fixed seed: the two loss curves within 1e-3 of the first loss.
      The free run is chaotic, its drift heavy-tailed over seeds as the small ResNet's
      on the CPU: on the H200 (float32 convolutions) it was 5.3e-5 of the first loss at
      most on the seeds of earlier runs, then 5e-4 on seed 1742003498 (b771166, at steps
      4 and 6, where the loss falls steepest) and 2.4e-4 on this fixed seed (b57a0fe),
      while the per-step check above passed on both."""
    torchvision = pytest.importorskip("torchvision")
    # TF32 convolutions (torch's CUDA default) round to 10 bits: a 1e-6 gap between two
    # BatchNorms' outputs grew to 2e-2 by layer4 and 30% in conv gradients on the H200;
    # with float32 convolutions the step-0 gradients agreed to 1.7e-5.
    if device == "cuda":
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)

    def loss_and_grads(m, x, target):
        m.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x), target)
        loss.backward()
        return loss.detach(), [p.grad.detach().clone() for p in m.parameters()]

    seeded()
    model = torchvision.models.resnet18(num_classes=10).to(device)
    reference = copy.deepcopy(model)
    swaps = tft.patch(model)
    assert len(swaps) == 20  # every BatchNorm2d of ResNet-18
    for m in model.modules():  # each BatchNorm's output gradient is read before the ReLU's mask
        if isinstance(m, nn.ReLU):
            m.inplace = False
    x, target = torch.randn(8, 3, 32, 32, device=device), torch.randint(0, 10, (8,), device=device)
    opt = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9)
    gaps = []
    for step in range(20):
        model.load_state_dict(reference.state_dict())
        (loss, grads), layers = batch_norm_dx_gaps(model, lambda: loss_and_grads(model, x, target))
        worst = max(layers, key=layers.get)
        assert layers[worst] <= 1e-5, f"step {step}: {worst} {layers[worst]:.2e}"
        ref_loss, ref_grads = loss_and_grads(reference, x, target)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-6, msg=f"step {step}")
        total = math.sqrt(sum(float(g.double().square().sum()) for g in ref_grads))
        gaps.append(math.sqrt(sum(float((a.double() - b.double()).square().sum())
                                  for a, b in zip(grads, ref_grads))) / total)
        opt.step()
    assert sorted(gaps)[len(gaps) // 2] <= 1e-4, [f"{g:.1e}" for g in gaps]

    torch.manual_seed(int(os.environ.get("TVM_FUSION_TEST_SEED", TRAINING_SEED)))
    model = torchvision.models.resnet18(num_classes=10).to(device)
    reference = copy.deepcopy(model)
    tft.patch(model)
    x, target = torch.randn(8, 3, 32, 32, device=device), torch.randint(0, 10, (8,), device=device)
    curves = []
    for m in (model, reference):
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        curve = []
        for _ in range(20):
            loss, _ = loss_and_grads(m, x, target)
            opt.step()
            curve.append(float(loss))
        curves.append(torch.tensor(curve))
    # The 8 images are fitted: the loss falls toward 0, where a relative bound means
    # nothing; the gaps are bounded by a fraction of the first loss.
    torch.testing.assert_close(curves[0], curves[1], rtol=0, atol=1e-3 * float(curves[1][0]))
    assert curves[1][-1] < 0.5 * curves[1][0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("memory_format", ["contiguous_format", "channels_last"])
def test_an_in_place_relu_after_the_batch_norm_trains_as_torchs(device, memory_format):
    """ResNet's ``nn.ReLU(inplace=True)`` modifies the BatchNorm's output: autograd
    forbids that on a view made inside a custom Function (torchvision's ResNet-18
    failed so on the H200), so ``y`` must be a tensor of its own."""
    seeded()
    fmt = getattr(torch, memory_format)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.Conv2d(8, 4, 1)).to(device).to(memory_format=fmt)
    reference = copy.deepcopy(model)
    tft.patch(model)
    x = torch.randn(4, 3, 6, 6, device=device).to(memory_format=fmt)
    for m in (model, reference):
        m(x).square().sum().backward()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        # Two float32 sums in different orders: the gap scales with the largest gradient
        # of the tensor, not with each element (a near-zero element can differ by more
        # than 1e-5 relative when its neighbours are large).
        atol = 1e-4 * float(theirs.grad.abs().max())
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=atol, msg=name)
