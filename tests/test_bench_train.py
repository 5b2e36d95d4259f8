"""The training bench's correctness gate (CPU): ``check`` against float64 torch, and the
status a peer's row gets when its result is wrong (timed anyway)."""

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from tvm_fusion.bench import Case  # noqa: E402
from tvm_fusion.bench_train import OP, check, peer_status  # noqa: E402


def _step(x: "torch.Tensor", t: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    x = x.detach().requires_grad_()
    loss = F.cross_entropy(x, t)
    return loss, torch.autograd.grad(loss, x)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_check_passes_torch_in_full_precision(dtype: "torch.dtype") -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(300, 97, generator=gen) * 3).to(dtype)
    target = torch.randint(0, 97, (300,), generator=gen)
    loss, grad = _step(logits, target)
    assert check(Case(OP, (300, 97), "float32"), loss, grad, logits, target) is None


def test_check_names_a_wrong_gradient_and_a_wrong_loss() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 50, generator=gen)
    target = torch.randint(0, 50, (64,), generator=gen)
    loss, grad = _step(logits, target)
    case = Case(OP, (64, 50), "float32")
    off = grad.clone()
    off[5, int(target[5])] = 0.0  # one target entry lost, as torch's float16 mean over 65536 rows loses them all
    assert check(case, loss, off, logits, target).startswith("wrong: gradient off by")
    assert check(case, loss * 1.01, grad, logits, target).startswith("wrong: loss")


def test_torch_float16_mean_over_65536_rows_is_flagged_and_the_peer_still_timed() -> None:
    # The mean's total weight (65536 rows) overflows float16: torch's gradient loses its
    # target entries. A peer's wrong result keeps its time, its row says what is off.
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(65536, 8, generator=gen).half()
    target = torch.randint(0, 8, (65536,), generator=gen)
    loss, grad = _step(logits, target)
    wrong = check(Case(OP, (65536, 8), "float16"), loss, grad, logits, target)
    assert wrong is not None and wrong.startswith("wrong:")
    assert peer_status(wrong) == f"{wrong}; timed anyway (a peer)"
    assert peer_status(None) == "ok"


def test_the_in_place_step_overwrites_non_leaf_logits_and_gives_the_gradient() -> None:
    # tvm_fusion.torch refuses to overwrite a leaf that requires grad (torch's rule); the
    # bench's in-place steps take their logits from a stand-in layer, as training does.
    from tvm_fusion.bench_train import providers

    case = Case(OP, (64, 100), "float32")
    steps = {step.name: step for step in providers(case)}
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 100, generator=gen)
    target = torch.randint(0, 100, (64,), generator=gen)
    for name in ("tvm_fusion.torch", "tvm_fusion.torch (inplace_backward)"):
        given = logits.clone()
        loss, grad = steps[name].run(given, target)
        assert check(case, loss.detach(), grad.detach(), logits, target) is None, name
        assert steps[name].in_place == (not torch.equal(given, logits)), name
