"""tvm_fusion.torch.fold: eval BatchNorm folded into the conv or linear before it.

Each folded model's outputs equal the unfolded one's on fresh random inputs (float64
models, so the tolerance is tight), no BatchNorm is left where folding was possible,
every kept BatchNorm comes with its reason, and the given model is left as it was."""

import pytest

from helpers import rng, torch_or_none

torch = torch_or_none()
pytestmark = pytest.mark.skipif(torch is None, reason="needs torch")
if torch is not None:
    from torch import nn

    from tvm_fusion.relax.model import example_inputs, small_resnet
    from tvm_fusion.torch import fold


def randomized(bn):
    """BatchNorm statistics and affine parameters away from their defaults."""
    with torch.no_grad():
        n = bn.num_features
        if bn.weight is not None:
            bn.weight.copy_(1 + 0.5 * torch.randn(n, dtype=bn.weight.dtype))
            bn.bias.copy_(0.5 * torch.randn(n, dtype=bn.bias.dtype))
        bn.running_mean.copy_(0.5 * torch.randn(n, dtype=bn.running_mean.dtype))
        bn.running_var.copy_(0.5 + torch.rand(n, dtype=bn.running_var.dtype))
    return bn


def seeded():
    torch.manual_seed(int(rng().integers(2**31)))


def batch_norms(model):
    return [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@pytest.mark.parametrize("layer, bn, shape", [
    (lambda: nn.Conv2d(4, 6, 3, padding=1), lambda: nn.BatchNorm2d(6), (3, 4, 7, 5)),
    (lambda: nn.Conv2d(4, 6, 3, groups=2, bias=False), lambda: nn.BatchNorm2d(6), (2, 4, 6, 6)),
    (lambda: nn.Conv2d(6, 6, 3, groups=6), lambda: nn.BatchNorm2d(6, affine=False), (2, 6, 5, 5)),
    (lambda: nn.Conv1d(3, 5, 4, bias=False), lambda: nn.BatchNorm1d(5, eps=1e-3), (4, 3, 9)),
    (lambda: nn.Linear(7, 5), lambda: nn.BatchNorm1d(5), (6, 7)),
    (lambda: nn.Linear(7, 5, bias=False), lambda: nn.BatchNorm1d(5, momentum=None), (6, 7)),
    (lambda: nn.Conv3d(4, 6, 3, groups=2), lambda: nn.BatchNorm3d(6), (2, 4, 5, 6, 5)),  # 3-D convolutions
])
def test_a_layer_and_its_batch_norm_fold_to_the_same_outputs(layer, bn, shape):
    seeded()
    model = nn.Sequential(layer(), randomized(bn()), nn.ReLU()).double().eval()
    x = torch.randn(*shape, dtype=torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    folded, kept = fold(model, x)
    assert kept == {} and batch_norms(folded) == []
    torch.testing.assert_close(folded(x), model(x), rtol=1e-12, atol=1e-12)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "fold changed its input"
    fresh = torch.randn(*shape, dtype=torch.float64)
    torch.testing.assert_close(folded(fresh), model(fresh), rtol=1e-12, atol=1e-12)


def test_the_small_resnet_folds_every_batch_norm_and_keeps_its_outputs():
    model = small_resnet().double().eval()
    x, target = example_inputs()
    x = x.double()
    folded, kept = fold(model, x, target)
    assert kept == {} and batch_norms(folded) == []
    logits, loss = folded(x, target)
    ref_logits, ref_loss = model(x, target)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-10)


def test_float32_fold_within_float_tolerance():
    seeded()
    model = nn.Sequential(nn.Conv2d(3, 8, 3), randomized(nn.BatchNorm2d(8))).eval()
    x = torch.randn(2, 3, 9, 9)
    folded, kept = fold(model)
    assert kept == {} and folded[0].weight.dtype == torch.float32
    torch.testing.assert_close(folded(x), model(x), rtol=1e-5, atol=1e-5)


class Shared(nn.Module):
    """A conv whose output two layers read, a conv called twice, a BN after a relu."""

    def __init__(self):
        super().__init__()
        self.conv_read_twice = nn.Conv2d(2, 2, 1)
        self.bn_a = nn.BatchNorm2d(2)
        self.conv_called_twice = nn.Conv2d(2, 2, 1)
        self.bn_b = nn.BatchNorm2d(2)
        self.bn_after_relu = nn.BatchNorm2d(2)

    def forward(self, x):
        y = self.conv_read_twice(x)
        a = self.bn_a(y) + y
        b = self.bn_b(self.conv_called_twice(a)) + self.conv_called_twice(x)
        return self.bn_after_relu(torch.relu(b))


@pytest.mark.parametrize("model, words", [
    (lambda: nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2)).train(), {"1": "training mode"}),
    (lambda: nn.Sequential(nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2, track_running_stats=False)).eval(),
     {"1": "no running statistics"}),
    (lambda: nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).eval(), {"1": "pass example inputs"}),
    (lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.Flatten(), nn.BatchNorm1d(3)).eval(), {"2": "'1'"}),
    (lambda: Shared().eval(), {"bn_a": "also read elsewhere", "bn_b": "called 2 times",
                               "bn_after_relu": "not a Conv1d, Conv2d, Conv3d or Linear"}),
])
def test_a_batch_norm_that_cannot_fold_stays_with_its_reason(model, words):
    seeded()
    model = model()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
            randomized(module)
    folded, kept = fold(model)
    assert set(kept) == set(words)
    for name, word in words.items():
        assert word in kept[name], kept[name]
    assert batch_norms(folded) == batch_norms(model)


class Tied(nn.Module):
    """Two convs sharing one weight; the BatchNorm follows only the first."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.bn = nn.Conv2d(2, 3, 3), nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.bn(self.first(x)) + self.second(x)


class ReadsTheWeight(nn.Module):
    """A forward that also uses the conv's weight itself."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn(self.conv(x)) + torch.nn.functional.conv2d(x, self.conv.weight)


def hooked(index):
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3))
    model[index].register_forward_hook(lambda module, args, out: out * 2)
    return model


def old_weight_norm():
    with torch.no_grad():  # made under no_grad, its computed weight deep-copies
        return nn.Sequential(torch.nn.utils.weight_norm(nn.Conv2d(2, 3, 3)), nn.BatchNorm2d(3))


# Folding scales the layer's stored weight in place: each of these would change
# something else (the helper's audit measured errors of 0.4 to 2.4 on such models).
@pytest.mark.parametrize("model, bn, words", [
    (Tied, "bn", "first.weight is shared (first.weight, second.weight)"),
    (ReadsTheWeight, "bn", "the forward reads conv.weight directly"),
    (lambda: nn.Sequential(torch.nn.utils.parametrizations.weight_norm(nn.Conv2d(2, 3, 3)), nn.BatchNorm2d(3)),
     "1", "is parametrized"),
    (lambda: nn.Sequential(torch.nn.utils.parametrizations.spectral_norm(nn.Conv2d(2, 3, 3)), nn.BatchNorm2d(3)),
     "1", "is parametrized"),
    (old_weight_norm, "1", "has hooks (forward_pre_hooks)"),
    (lambda: hooked(0), "1", "'0' has hooks (forward_hooks)"),
    (lambda: hooked(1), "1", "'1' has hooks (forward_hooks)"),
], ids=["tied", "reads-weight", "weight-norm", "spectral-norm", "old-weight-norm", "conv-hook", "bn-hook"])
def test_a_batch_norm_whose_fold_would_change_more_stays(model, bn, words):
    seeded()
    model = model().eval()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            randomized(module)
    x = torch.randn(2, 2, 8, 8)
    folded, kept = fold(model)
    assert list(kept) == [bn] and words in kept[bn], kept
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), rtol=0, atol=0)


def test_example_inputs_leave_a_training_batch_norms_statistics_alone():
    seeded()
    model = nn.Sequential(nn.Conv2d(2, 3, 3), randomized(nn.BatchNorm2d(3)), nn.Flatten(), nn.Linear(3 * 6 * 6, 4),
                          randomized(nn.BatchNorm1d(4))).eval()
    model[4].train()
    folded, kept = fold(model, torch.randn(5, 2, 8, 8))
    assert list(kept) == ["4"] and "training mode" in kept["4"] and folded[4].training
    assert int(folded[4].num_batches_tracked) == 0
    torch.testing.assert_close(folded[4].running_mean, model[4].running_mean, rtol=0, atol=0)


def test_a_torchscript_model_is_refused_not_passed_through_unfolded():
    """A scripted model's submodules are not nn.BatchNorm instances: fold found none,
    kept none and folded nothing, with no word."""
    model = torch.jit.script(nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3)).eval())
    with pytest.raises(TypeError, match="TorchScript module"):
        fold(model)


def test_a_model_that_cannot_be_deep_copied_is_a_clear_error():
    model = nn.Sequential(torch.nn.utils.weight_norm(nn.Conv2d(2, 3, 3)), nn.BatchNorm2d(3)).eval()
    with pytest.raises(ValueError, match="fold: the model cannot be deep-copied"):
        fold(model)


@pytest.mark.parametrize("example, words", [
    (lambda: "not a tensor", "TypeError: conv1d()"),
    (lambda: torch.randn(2, 5, 7), "RuntimeError: Given groups=1"),  # 5 channels into Conv1d(3, ...)
])
def test_example_inputs_the_model_fails_on_are_a_clear_error(example, words):
    """torch.fx's ShapeProp wraps the model's error in one naming an FX node; fold names
    example_inputs and the model's own error."""
    model = nn.Sequential(nn.Conv1d(3, 4, 1), nn.BatchNorm1d(4)).eval()
    with pytest.raises(ValueError, match=r"fold: the model fails on example_inputs") as info:
        fold(model, example())
    assert words in str(info.value)


def test_a_linear_over_three_dims_is_not_folded_into_batch_norm1d():
    seeded()
    model = nn.Sequential(nn.Linear(4, 5), randomized(nn.BatchNorm1d(3))).eval()  # BN over dim 1 (L = 3)
    x = torch.randn(2, 3, 4)
    folded, kept = fold(model, x)
    assert "output channels" in kept["1"] or "not 2-D" in kept["1"]
    torch.testing.assert_close(folded(x), model(x))


def test_an_untraceable_model_keeps_every_batch_norm_and_says_why():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1)

        def forward(self, x):
            return self.bn(self.conv(x)) if x.sum() > 0 else x

    folded, kept = fold(Branchy().eval())
    assert "torch.fx cannot trace" in kept["bn"]
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        fold("not a model")


# -- patch / unpatch ---------------------------------------------------------------------
class WithLosses(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.loss = nn.CrossEntropyLoss(weight, label_smoothing=0.1)
        self.heads = nn.ModuleDict({"aux": nn.CrossEntropyLoss(ignore_index=2, reduction="sum")})

    def forward(self, x, target):
        logits = self.fc(x)
        return self.loss(logits, target) + self.heads["aux"](logits, target)


def test_patch_swaps_cross_entropy_losses_and_training_matches_torch():
    from tvm_fusion.torch import PatchedCrossEntropyLoss, patch, unpatch

    seeded()
    weight = torch.rand(5) + 0.1
    model, reference = WithLosses(weight), WithLosses(weight)
    reference.load_state_dict(model.state_dict())
    originals = {"loss": model.loss, "heads.aux": model.heads["aux"]}
    swaps = patch(model)
    assert {s.name for s in swaps} == set(originals) and patch(model) == []
    assert all(isinstance(s.replacement, PatchedCrossEntropyLoss) for s in swaps)
    assert model.heads["aux"].ignore_index == 2 and model.loss.label_smoothing == 0.1
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference))
    start = model.fc.weight.detach().clone()
    for _ in range(5):
        x, t = torch.randn(12, 6), torch.randint(0, 5, (12,))
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(x, t).backward()
            o.step()
        torch.testing.assert_close(model.fc.weight, reference.fc.weight, rtol=1e-5, atol=1e-6)
    assert (model.fc.weight - start).abs().max() > 1e-3  # it trained
    x64 = torch.randn(3, 6, dtype=torch.float64)  # float64: torch's path, same answer
    # the weights trained in float32 agree to about 1e-6, so the float64 losses do too
    torch.testing.assert_close(model.double()(x64, t[:3]), reference.double()(x64, t[:3]), rtol=1e-5, atol=1e-6)
    restored = unpatch(model)
    assert {r.name for r in restored} == set(originals)
    assert model.loss is originals["loss"] and model.heads["aux"] is originals["heads.aux"]


def test_a_patched_loss_hands_forms_it_does_not_cover_to_torch():
    from tvm_fusion.torch import patch

    holder = nn.Module()
    holder.loss = nn.CrossEntropyLoss(label_smoothing=0.05)
    patch(holder)
    seeded()
    images, pixels = torch.randn(2, 4, 3, 3), torch.randint(0, 4, (2, 3, 3))
    probabilities = torch.softmax(torch.randn(5, 4), dim=1)
    logits = torch.randn(5, 4)
    import torch.nn.functional as F
    torch.testing.assert_close(holder.loss(images, pixels), F.cross_entropy(images, pixels, label_smoothing=0.05))
    torch.testing.assert_close(holder.loss(logits, probabilities),
                               F.cross_entropy(logits, probabilities, label_smoothing=0.05))
    torch.testing.assert_close(holder.loss(logits, torch.tensor([0, 1, 2, 3, 0])),
                               F.cross_entropy(logits, torch.tensor([0, 1, 2, 3, 0]), label_smoothing=0.05),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="the model itself"):
        patch(nn.CrossEntropyLoss())
